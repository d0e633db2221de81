"""The rules of a turn's end (rollout.turn_outcome): each rule on plain values, then the rollout engine and the SFT
encoder (sft.encode_messages) both following them on the embedded tiny model.

    python -m pytest tests/test_turns.py -q
"""
import types

import pytest
import torch

import data
import kvcache
import rollout
import sft
from rewards import ToolCall, parse_tool_calls
from rollout import turn_outcome
from tests.test_rollout import Scripted, call, tiny, turn, user_messages  # noqa: F401 (tiny: a fixture, one thread)
from conftest import TEST_ROLLOUT


def crops(n: int) -> list[ToolCall]:
    """n distinct crop_video calls (their order is their start time)."""
    return [ToolCall("crop_video", {"start_time": float(k), "end_time": k + 4.0}) for k in range(n)]


# (calls written, tool turns before, forced message sent, truncated, max_turns, max_calls_per_turn) ->
# (calls kept, dropped, executes, forced, done, hit_turn_limit)
@pytest.mark.parametrize("n, tool_turns, sent, truncated, max_turns, cap, expected", [
    (0, 0, False, False, 3, 5, (0, 0, False, False, True, False)),   # no calls: the turn answers, the end
    (0, 3, True, False, 3, 5, (0, 0, False, False, True, False)),    # an answer after the forced message: not the limit
    (2, 0, False, False, 3, 5, (2, 0, True, False, False, False)),   # within the budget: the calls run
    (7, 0, False, False, 3, 5, (5, 2, True, False, False, False)),   # past the cap: the first 5 run, 2 dropped
    (5, 0, False, False, 3, 5, (5, 0, True, False, False, False)),   # exactly the cap: nothing dropped
    (1, 2, False, False, 3, 5, (1, 0, True, True, False, False)),    # the last budgeted turn: its responses + forced
    (1, 0, False, False, 1, 5, (1, 0, True, True, False, False)),    # a budget of 1: the first turn is the last
    (2, 0, False, False, 0, 5, (2, 0, False, True, False, False)),   # budget 0: not run, the forced message alone
    (7, 0, False, False, 0, 5, (5, 0, False, True, False, False)),   # ... and none dropped: none ran
    (1, 3, True, False, 3, 5, (1, 0, False, False, True, True)),     # calls after the forced message: the limit
    (1, 0, True, False, 0, 5, (1, 0, False, False, True, True)),     # budget 0, still calling after the message
    (2, 0, False, True, 3, 5, (2, 0, False, False, True, False)),    # a cut turn ends it; its calls do not run
    (2, 3, True, True, 3, 5, (2, 0, False, False, True, False)),     # cut, past the limit: truncated, not the limit
])
def test_turn_outcome_rules(n, tool_turns, sent, truncated, max_turns, cap, expected):
    calls = crops(n)
    out = turn_outcome(calls, tool_turns, sent, truncated, max_turns, cap)
    assert (len(out.calls), out.dropped, out.executes, out.forced, out.done, out.hit_turn_limit) == expected
    assert out.calls == calls[:cap]                  # the first ones, in call order


@pytest.mark.parametrize("max_turns", [0, 1, 2, 5])
def test_a_policy_that_always_calls(max_turns):
    """Calling every turn: max_turns turns run, the forced-answer message comes once, the next turn hits the limit;
    the turns written are the scheduler's worst case (kvcache.assistant_turns, which sizes a row's K/V)."""
    outs, tool_turns, sent = [], 0, False
    while not (outs and outs[-1].done):
        outs.append(turn_outcome(crops(1), tool_turns, sent, False, max_turns, 5))
        tool_turns += outs[-1].executes
        sent = sent or outs[-1].forced
        assert len(outs) <= max_turns + 2, outs
    assert tool_turns == max_turns and sum(o.forced for o in outs) == 1 and outs[-1].hit_turn_limit
    assert outs[-2].forced and not any(o.forced for o in outs[:-2])
    assert len(outs) == kvcache.assistant_turns(types.SimpleNamespace(max_turns=max_turns))


# ----------------------------------------------------------------------------- the engine and the SFT encoder

def replay(turns: list[str], cfg: rollout.RolloutConfig) -> list:
    """turn_outcome over a finished trajectory's turn texts, as a rollout meets them (no turn cut)."""
    outs, tool_turns, sent = [], 0, False
    for text in turns:
        outs.append(turn_outcome(parse_tool_calls(text), tool_turns, sent, False, cfg.max_turns, cfg.max_calls_per_turn))
        tool_turns += outs[-1].executes
        sent = sent or outs[-1].forced
    return outs


def recorded(t: rollout.Trajectory, outs: list, record: dict) -> list[dict]:
    """A rollout's trajectory as a recording (docs/data.md's messages): its turns, and a tool result (the video
    cropped again by the encoder) for each call of a turn whose calls ran."""
    msgs = []
    for text, out in zip(t.turns, outs):
        msgs.append({"role": "assistant", "content": text})
        msgs += [{"role": "tool", "content": [{"type": "video", "video": record["video"]}]}
                 for _ in out.calls if out.executes]
    return msgs


@pytest.mark.parametrize("max_turns, script", [
    (2, [turn("look", call(28.0, 36.0)), turn("closer", call(2.0, 6.0) + "\n" + call(40.0, 44.0)),
         turn("done", "<answer>B</answer>")]),                                   # 2 turns, forced with the 2nd
    (1, [turn("look", call(28.0, 36.0)), turn("again", call(2.0, 6.0))]),       # calls after it: the limit
    (0, [turn("look", call(28.0, 36.0)), turn("done", "<answer>C</answer>")]),  # budget 0: the message alone
    (3, [turn("done", "<answer>A</answer>")]),                                  # no tool at all
])
def test_engine_and_sft_encoder_follow_turn_outcome(tiny, tmp_path, monkeypatch, max_turns, script):
    """A scripted rollout's counters, calls, flags and forced-answer messages are turn_outcome's over its turns; the
    SFT encoder, given the same turns as a recording, writes the same tokens and roles (the forced-answer message
    at the same place)."""
    model, processor = tiny
    root = str(tmp_path)
    rec = data.make_split(root, 2, seed=0, duration=64.0)[1]
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96, "max_turns": max_turns})
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, {(0, 0): script}))
    [t] = rollout.run_agent(model, processor, [rec], root, cfg, seed=0)
    outs = replay(t.turns, cfg)
    assert t.error is None and not t.truncated and len(t.turns) == len(script) and outs[-1].done
    assert t.calls == [o.calls for o in outs] and t.hit_turn_limit == outs[-1].hit_turn_limit
    assert t.n_tool_turns == sum(o.executes for o in outs) == min(max_turns, len(script) - 1)
    assert t.n_calls == sum(len(o.calls) for o in outs if o.executes) == len(t.windows)
    users = user_messages(t.text)                     # one per turn that did not end the trajectory
    assert [rollout.FORCED_ANSWER in u for u in users] == [o.forced for o in outs if not o.done]
    s = sft.encode_messages(processor, rec, recorded(t, outs, rec), root, cfg)
    assert s.token_ids == t.token_ids and s.roles == t.roles and s.n_tool_turns == t.n_tool_turns
    assert len(s.videos) == len(t.videos) and all(torch.equal(a[0], b[0]) for a, b in zip(s.videos, t.videos))
