"""The one policy contract (contract.py): what the rollout engine fed the model, recorded per turn as digests
(Trajectory.digests), is what rollout.collate builds for the trainer, on the embedded tiny model and real mp4s.

The tiny model does not write tool calls by itself, so most rollouts here are scripted (tests/test_rollout.py's
`Scripted` stands in for the sampler; the engine still runs every forward); the fuzzer adds sampled ones.

    python -m pytest tests/test_contract.py -q
"""
import dataclasses
import random
import re
import time
from collections import Counter

import pytest
import torch

import contract
import kvcache
import rollout
from conftest import TEST_ROLLOUT
from tests.test_rollout import Scripted, call, split, tiny, turn  # noqa: F401 (split, tiny: fixtures, one thread)

SEED = 0
TWO_TURNS = [turn("two marks", call(28.0, 36.0) + "\n" + call(50.0, 58.0)), turn("again", call(30.0, 33.0)),
             turn("done", "<answer>B</answer>")]


def config(**kw) -> rollout.RolloutConfig:
    return rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96, **kw})


def checked(model, processor, trajs: list) -> list:
    """collate(check=True) over trajectories and their sub-agents (raises on a broken contract); returns them."""
    every = trajs + [s for t in trajs for s in t.subagents]
    rollout.collate(every, model, processor.tokenizer.pad_token_id, check=True)
    return every


def scripted_rollout(model, processor, split, monkeypatch, scripts: dict, **kw) -> list:
    root, recs = split
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, scripts, seed=SEED))
    n = 1 + max(i for i, _ in scripts)
    return rollout.run_agent(model, processor, recs[1:1 + n], root, config(**kw), seed=SEED)


def turn_of(t, index: int) -> int:
    """The turn (segment) whose digest covers token `index` of t (contract.segments)."""
    segs = contract.segments(torch.tensor(t.roles) == rollout.POLICY)
    return next(k for k, (s, _, e) in enumerate(segs) if s <= index < max(e, s + 1))


# ----------------------------------------------------------------------------- a real rollout's digests

@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_a_rollouts_digests_hold_in_collate(tiny, split, monkeypatch, mode):
    """Each row (sub-agents too) records one digest per turn; collate recomputes and checks them; two samples
    of a group, sharing the prompt, differ in their first digest by what they decoded only."""
    model, processor = tiny
    trajs = scripted_rollout(model, processor, split, monkeypatch,
                             {(0, 0): TWO_TURNS, (0, 1): [turn("done", "<answer>A</answer>")]},
                             tool_mode=mode, group_size=2)
    every = checked(model, processor, trajs)
    assert [len(t.digests) for t in trajs] == [len(t.turns) for t in trajs] == [3, 1]
    subs = [s for t in trajs for s in t.subagents]
    assert len(subs) == (3 if mode == "subagent" else 0) and all(len(s.digests) == 1 for s in subs)
    a, b = (t.digests[0].split(":") for t in trajs)
    assert a[2:] == b[2:] and a[:2] != b[:2]           # same prompt grid and pixels, other decoded ids and positions
    assert all(re.fullmatch(r"([0-9a-f]{16}:){3}[0-9a-f]{16}", d) for t in every for d in t.digests)
    assert len({d for t in every for d in t.digests}) == sum(len(t.digests) for t in every)


def test_recording_off_leaves_the_rollout_and_skips_the_check(tiny, split, monkeypatch):
    model, processor = tiny
    on = scripted_rollout(model, processor, split, monkeypatch, {(0, 0): TWO_TURNS})
    monkeypatch.setattr(contract, "RECORD", False)
    off = scripted_rollout(model, processor, split, monkeypatch, {(0, 0): TWO_TURNS})
    assert on[0].token_ids == off[0].token_ids and on[0].digests and not off[0].digests
    off[0].token_ids[-2] += 1                           # not checked: nothing recorded
    checked(model, processor, off)


# ----------------------------------------------------------------------------- tampering raises

@pytest.fixture
def two_turns(tiny, split, monkeypatch):
    """A scripted rollout whose first two turns crop (clips in its context), then answers; checked once."""
    model, processor = tiny
    [t] = scripted_rollout(model, processor, split, monkeypatch, {(0, 0): TWO_TURNS})
    assert len(t.digests) == 3 and len(t.videos) == 3
    checked(model, processor, [t])
    return t


def raises(model, processor, t, turn: int, part: str) -> None:
    with pytest.raises(contract.ContractError, match=rf"record '{t.record_id}' sample 0: turn {turn} .*differs in "
                                                     rf"{part}"):
        checked(model, processor, [t])


def test_a_changed_digest_raises(tiny, two_turns):
    t = two_turns
    d = t.digests[1]
    t.digests[1] = d[:20] + ("0" if d[20] != "0" else "1") + d[21:]
    raises(*tiny, t, 1, "positions")
    t.digests.pop()
    with pytest.raises(contract.ContractError, match="fed 2 segments, the trainer's row has 3 turns"):
        checked(*tiny, [t])


def test_a_changed_pixel_raises(tiny, two_turns):
    t = two_turns
    pixels, grid = t.videos[2]                         # the second tool response's clip: turn 2's chunk
    pixels = pixels.clone()
    pixels[3, 5] += 1e-3
    t.videos[2] = (pixels, grid)
    raises(*tiny, t, 2, "pixels")


@pytest.mark.parametrize("where", ["chunk", "decoded"])
def test_a_changed_token_raises(tiny, two_turns, where):
    t = two_turns
    s, c, e = contract.segments(torch.tensor(t.roles) == rollout.POLICY)[1]
    j = s + 3 if where == "chunk" else c + 2           # inside turn 1's tool response, or a token it decoded
    vision = rollout.vision_ids(rollout.special_token_ids(tiny[1]))
    assert t.token_ids[j] not in vision
    t.token_ids[j] = next(x for x in range(100) if x != t.token_ids[j] and x not in vision)
    raises(*tiny, t, 1, "ids")


def test_a_shifted_trainer_position_raises(tiny, two_turns, monkeypatch):
    model, processor = tiny
    t = two_turns
    at = len(t.token_ids) - 5                          # a token of the last turn
    rope = model.model.get_rope_index

    def shifted(*a, **kw):
        pos, delta = rope(*a, **kw)
        pos = pos.clone()
        pos[1, 0, at] += 1
        return pos, delta
    monkeypatch.setattr(model.model, "get_rope_index", shifted)
    raises(model, processor, t, turn_of(t, at), "positions")


def test_a_shifted_engine_position_raises(tiny, split, monkeypatch):
    """The engine feeding one chunk (turn 1's tool response) a wrong position: the row's own digests say so."""
    model, processor = tiny
    positions, chunks = kvcache.chunk_positions, []

    def shifted(model, c):
        pos = positions(model, c)
        chunks.append(c)
        return pos + (torch.arange(pos.shape[1]) == 4) if len(chunks) == 2 else pos
    monkeypatch.setattr(kvcache, "chunk_positions", shifted)
    [t] = scripted_rollout(model, processor, split, monkeypatch, {(0, 0): TWO_TURNS})
    assert len(chunks) == 3 and len(t.digests) == 3
    raises(model, processor, t, 1, "positions")


# ----------------------------------------------------------------------------- the fuzzer

def fuzz_call(rng: random.Random) -> str:
    """A crop_video call: a valid window, or a degenerate one (empty, reversed, outside the video, shorter than
    min_window), sometimes with a resolution level."""
    a = round(rng.uniform(0.0, 60.0), 1)
    b = rng.choice([a + round(rng.uniform(1.0, 12.0), 1)] * 4 + [a, a - 5.0, -3.0, 90.0, a + 0.3])
    extra = {"resolution": rng.choice(["coarse", "medium", "fine"])} if rng.random() < 0.3 else {}
    return call(a, b, **extra)


def fuzz_script(rng: random.Random) -> list[str]:
    """0-2 tool turns of 1-5 parallel calls each, then an answer (or more calls: past the turn budget)."""
    calls = lambda n: "\n".join(fuzz_call(rng) for _ in range(n))
    turns = [turn("m", calls(rng.choices([1, 2, 3, 4, 5], [35, 25, 15, 15, 10])[0]))
             for _ in range(rng.choices([0, 1, 2], [5, 4, 1])[0])]
    last = calls(rng.randint(1, 2)) if rng.random() < 0.2 else rng.choice(["<answer>B</answer>", "B"])
    return turns + [turn("so", last)]


def fuzz_config(rng: random.Random) -> rollout.RolloutConfig:
    """A rollout config: tool mode, turn budget (0: the forced answer at once), call cap, group size, greedy or
    not, and cuts (max_new_tokens, the sub-agents') or none."""
    return config(tool_mode=rng.choice(["interleaved", "interleaved", "subagent"]), max_turns=rng.randint(0, 3),
                  max_calls_per_turn=rng.randint(2, 5), group_size=rng.choice([2, 4]),
                  max_new_tokens=rng.choice([256, 256, rng.randint(1, 120)]),
                  subagent_max_new_tokens=rng.choice([48, rng.randint(1, 12)]), temperature=rng.choice([1.0, 0.0]))


def cut_point(rng: random.Random, t, vision: set) -> int:
    """A max_context that cuts trajectory t after its prompt: mostly inside a tool response's vision span (between
    two vision tokens), if it has one; else anywhere."""
    first = t.roles.index(rollout.POLICY)
    inside = [j for j in range(first + 1, len(t.token_ids)) if {t.token_ids[j - 1], t.token_ids[j]} <= vision]
    return rng.choice(inside) if inside and rng.random() < 0.7 else rng.randint(first, len(t.token_ids))


def features(t, cfg, vision: set) -> set[str]:
    """What a rolled-out trajectory covers (the fuzzer's counters)."""
    out = {f"turns={min(len(t.turns), 4)}", f"tool_mode={cfg.tool_mode}"}
    out |= {f"calls={min(x.count('<tool_call>'), 5)}" for x in t.turns}
    if t.truncated:
        if t.roles[-1] == rollout.ENV:
            out.add("cut at max_context before a chunk is fed")
            if len(t.token_ids) > cfg.max_context and {t.token_ids[cfg.max_context - 1],
                                                       t.token_ids[cfg.max_context]} <= vision:
                out.add("cut at max_context inside a vision span")
        elif len(t.token_ids) >= cfg.max_context:
            out.add("cut at max_context while decoding")
        else:
            out.add("cut at max_new_tokens")
    if rollout.FORCED_ANSWER in t.text:
        out.add("forced answer")
    for flag, name in [(t.hit_turn_limit, "hit turn limit"), (t.tool_failures, "error observation"),
                       (len(t.videos) > 1, "clips in context")]:
        if flag:
            out.add(name)
    return out


NEEDED = ["turns=1", "turns=2", "turns=3", *[f"calls={k}" for k in range(6)], "cut at max_new_tokens",
          "cut at max_context while decoding", "cut at max_context before a chunk is fed",
          "cut at max_context inside a vision span", "forced answer", "hit turn limit", "error observation",
          "clips in context", "tool_mode=subagent", "sub-agent", "sub-agent cut", "sampled"]


@pytest.mark.slow
def test_contract_holds_over_fuzzed_rollouts(tiny, split, monkeypatch):
    """At least 1,000 rollouts over random configs and scripts (plus sampled ones, and scripted ones rerun with
    max_context cutting them at a chosen token): every digest the engine recorded is what collate builds. The
    counters make sure the generator keeps covering each feature."""
    torch.set_num_threads(1)
    model, processor = tiny
    root, recs = split
    vision = set(rollout.vision_ids(rollout.special_token_ids(processor)))
    rng, seen, count, subs, n_checked, check = random.Random(0), Counter(), 0, 0, [0], contract.check_row
    monkeypatch.setattr(contract, "check_row", lambda *a: (n_checked.__setitem__(0, n_checked[0] + 1), check(*a)))

    def roll(cfg, records, scripts, seed, tags=()) -> list:
        nonlocal count, subs
        with monkeypatch.context() as m:
            if scripts is not None:
                m.setattr(rollout, "sample_tokens", Scripted(processor, scripts, seed=seed))
            trajs = rollout.run_agent(model, processor, records, root, cfg, seed=seed)
        every = checked(model, processor, trajs)
        for t in every:
            assert t.error is None and len(t.digests) == int(torch.diff(torch.tensor([0] + t.roles)).eq(1).sum())
            if t.parent is None:
                assert len(t.digests) == len(t.turns)
                seen.update(features(t, cfg, vision) | set(tags))
            else:
                seen.update({"sub-agent"} | ({"sub-agent cut"} if t.truncated else set()))
        count, subs = count + len(trajs), subs + len(every) - len(trajs)
        return trajs

    t0 = time.time()
    while count < 1000:
        cfg, records, seed = fuzz_config(rng), [rng.choice(recs) for _ in range(8)], count
        if rng.random() < 0.1:                         # the random tiny model rarely stops: short turns
            roll(dataclasses.replace(cfg, max_new_tokens=rng.randint(1, 48)), records, None, seed, ["sampled"])
            continue
        scripts = {(i, s): fuzz_script(rng) for i in range(len(records)) for s in range(cfg.group_size)}
        trajs = roll(cfg, records, scripts, seed)
        if rng.random() < 0.5:                         # the same rollouts, cut at a token of one of them
            cut = cut_point(rng, rng.choice([t for t in trajs if len(t.videos) > 1] or trajs), vision)
            roll(dataclasses.replace(cfg, max_context=cut), records, scripts, seed)
    elapsed = time.time() - t0
    print(f"\n{count} rollouts + {subs} sub-agents checked in {elapsed:.1f} s: {dict(sorted(seen.items()))}")
    assert n_checked[0] == count + subs
    assert all(seen[k] >= 3 for k in NEEDED), {k: seen[k] for k in NEEDED}
