"""The tool-turn budget: the search question kind (evidence found in two rounds), the oracle's budget-limited
recordings, the rollout's forced answer at every budget (0 included) and `eval.py --max-turns`.

    python -m pytest tests/test_turn_budget.py -q
"""
import os

import numpy as np
import pytest
import torch

import data
import eval as evaluation
import rewards
import rollout
import sft
import video
from tests.test_rollout import Scripted, call, responses, tiny, turn, user_messages  # noqa: F401 (tiny: a fixture)
from conftest import SFT_MIX, TEST_ROLLOUT, bench_module, oracle_turns

CROP = dict(level="medium", fps=1.0, max_frames=16, max_pixels=64 * 64)   # the tiny rollout's crops


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("search"))
    return root, data.make_split(root, 24, seed=5, mix={"search": 1.0}, duration=64.0)


def has_colour(frames: torch.Tensor, colour: str) -> bool:
    """Whether some frame of (T, 3, 64, 64) uint8 frames shows `colour` in its bottom-right quadrant (where both
    a needle and a direct glyph are drawn)."""
    px = frames[:, :, 56, 56].float()                                        # (T, 3)
    return bool(((px - torch.tensor(data.PALETTE[colour]).float()).abs().max(1).values < 40).any())


def shows_glyph(root: str, rec: dict, start: float, end: float) -> bool:
    """Whether a real crop of the record's video (the tiny rollout's sampling) shows the glyph colour."""
    clip = video.crop(os.path.join(root, rec["video"]), start, end, **CROP)
    return has_colour(clip.frames, rec["meta"]["colours"][0])


def crops(msgs: list[dict]) -> list[tuple[float, float]]:
    return [(m["content"][0]["video_start"], m["content"][0]["video_end"]) for m in msgs if m["role"] == "tool"]


def test_search_oracle_acts_on_what_its_crops_show(search):
    """Every crop but the last of a recording misses the glyph, the last shows it: the oracle's view of which
    frames a crop holds (data.crop_patch_times) agrees with the decoder's. Some questions need two rounds."""
    root, recs = search
    rounds = []
    for rec in recs:
        msgs = oracle_turns(rec, np.random.default_rng(0))
        windows = crops(msgs)
        rounds.append(data.oracle_rounds(msgs))
        assert rounds[-1] == len(windows) and 1 <= len(windows) <= 2
        assert [shows_glyph(root, rec, *w) for w in windows] == [False] * (len(windows) - 1) + [True], rec["id"]
        assert msgs[-1]["content"].endswith(f"<answer>{rec['answer']}</answer>")
        if len(windows) == 2:
            assert windows[0] == (0.0, 64.0)                                  # search wide, then crop close
            assert windows[1][1] - windows[1][0] <= 12.0
    assert rounds.count(2) >= 3 and rounds.count(1) >= 3


def test_a_whole_video_crop_prints_every_search_mark_near_its_time():
    """Whatever the 8-frame overview shows, a whole-video crop (16 frames, the tiny rollout's sampling) holds a frame
    inside a search question's mark, printed at a patch time within 4 s of it (data.seen_at over
    data.crop_patch_times): the time the policy can name for its second, close crop."""
    needed = []
    for seed in range(20):
        rec = data._make_one("q", "search", np.random.default_rng(seed), 64.0)[0]
        (s, e), = rec["clues"]
        t = data.seen_at([s, e], data.crop_patch_times(0.0, 64.0, 64.0, 1.0, 16))
        assert t is not None and s - 4 <= t < e + 4, (seed, s, t)
        needed.append(data.tool_needed(rec, 8))
    assert True in needed and False in needed           # the overview alone misses some marks, shows others


def test_budget_limited_recordings_answer_from_what_was_seen(search, tiny):
    root, recs = search
    _, processor = tiny
    rec = next(r for r in recs if data.oracle_rounds(oracle_turns(r, np.random.default_rng(0))) == 2)
    full = oracle_turns(rec, np.random.default_rng(0))
    assert oracle_turns(rec, np.random.default_rng(0), budget=2) == full
    assert oracle_turns(rec, np.random.default_rng(0), budget=4) == full
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96})
    for budget in (0, 1):
        msgs = oracle_turns(rec, np.random.default_rng(0), budget=budget)
        assert data.oracle_rounds(msgs) == budget
        assert "guess" in msgs[-1]["content"]          # the glyph was in no frame seen: a guessed letter
        t = sft.encode_messages(processor, rec, msgs, root, rollout.RolloutConfig(**{**vars(cfg), "max_turns": budget}))
        users = user_messages(t.text)
        assert len(users) == 1 and users[0].endswith(rollout.FORCED_ANSWER)   # the forced answer, once
        assert len(responses(t.text)) == budget and t.n_tool_turns == budget
        assert t.answer == rewards.extract_answer(msgs[-1]["content"]) and t.answer in "ABCD"
    # a question the wide crop answers: at budget 1 nothing is guessed
    rec1 = next(r for r in recs if data.oracle_rounds(oracle_turns(r, np.random.default_rng(0))) == 1
                and crops(oracle_turns(r, np.random.default_rng(0)))[0] == (0.0, 64.0))
    assert oracle_turns(rec1, np.random.default_rng(0), budget=1) == oracle_turns(rec1, np.random.default_rng(0))
    msgs = oracle_turns(rec1, np.random.default_rng(0), budget=0)
    assert len(msgs) == 2 and "<tool_call>" in msgs[0]["content"] and "<tool_call>" not in msgs[1]["content"]


def test_sft_examples_add_budget_limited_copies(search, tiny):
    root, recs = search
    model, processor = tiny
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96})
    plain, _ = sft.sft_examples(recs[:6], processor, root, cfg, sft_data=None, seed=0, gated_choices=[], **SFT_MIX)
    more, _ = sft.sft_examples(recs[:6], processor, root, cfg, sft_data=None, seed=0, gated_choices=[],
                                 **dict(SFT_MIX, budget_fraction=1.0))
    assert len(plain) == 6 and len(more) == 12                     # every search question calls the tool
    assert sum(rollout.FORCED_ANSWER in t.text for t in plain) == 0
    assert sum(rollout.FORCED_ANSWER in t.text for t in more) == 6


@pytest.mark.parametrize("keeps_calling", [False, True])
def test_budget_zero_answers_from_the_overview(search, tiny, monkeypatch, keeps_calling):
    """Budget 0: the first turn's calls are not executed, the forced-answer message comes alone, and the
    next turn is the last (an answer, or calls that end the trajectory at the limit)."""
    model, processor = tiny
    root, recs = search
    turns = [turn("look", call(0.0, 64.0))] + ([] if keeps_calling else [turn("no turns left", "<answer>C</answer>")])
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, {(0, 0): turns}))
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96, "temperature": 1.0, "max_turns": 0})
    [t] = rollout.run_agent(model, processor, recs[:1], root, cfg, seed=0)
    assert t.n_tool_turns == 0 and t.windows == [] and len(t.turns) == 2 and len(t.videos) == 1
    assert user_messages(t.text) == [rollout.FORCED_ANSWER] and not responses(t.text)
    assert t.hit_turn_limit == keeps_calling
    if not keeps_calling:
        assert t.answer == "C"


def test_budget_one_executes_one_round(search, tiny, monkeypatch):
    model, processor = tiny
    root, recs = search
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, {(0, 0): [
        turn("look", call(0.0, 64.0)), turn("closer", call(10.0, 20.0)), turn("ok", "<answer>A</answer>")]}))
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96, "temperature": 1.0, "max_turns": 1})
    [t] = rollout.run_agent(model, processor, recs[:1], root, cfg, seed=0)
    assert t.n_tool_turns == 1 and t.windows == [(0.0, 64.0)] and t.hit_turn_limit and len(t.turns) == 2
    assert len(user_messages(t.text)) == 1 and user_messages(t.text)[0].endswith(rollout.FORCED_ANSWER)


def test_eval_max_turns_flag(tmp_path):
    with pytest.raises(SystemExit):
        evaluation.parse_args(["--max-turns", "-1"])
    args = evaluation.parse_args(["--max-turns", "0", "--synthetic-n", "2", "--synthetic-mix", "search=1",
                                  "--out", str(tmp_path / "p.jsonl")])
    assert args.max_turns == 0 and args.synthetic_mix == "search=1"
    cfg = evaluation.preset_rollout_config("paravt", "interleaved", tiny=True, max_turns=0)
    assert cfg.max_turns == 0 and cfg.crop_max_frames == 16


@pytest.mark.parametrize("nframes", [4, 8, 32])
def test_tool_needed_agrees_with_the_decoded_overview(tmp_path, nframes):
    """data.tool_needed says a question needs the tool exactly when some glyph its answer reads is in no frame
    of the real K-frame overview (decoded by video.py, as the rollout samples it)."""
    root = str(tmp_path)
    recs = data.make_split(root, 24, seed=9, duration=64.0)
    seen = []
    for rec in recs:
        need = data.tool_needed(rec, nframes)
        if rec["task"] != "mcq":
            assert need is None
            continue
        clip = video.sample_overview(os.path.join(root, rec["video"]), nframes=nframes, max_pixels=64 * 64)
        shown = [has_colour(clip.frames, c) for c in rec["meta"]["colours"]]
        assert need == (not all(shown)), (rec["id"], nframes)
        seen.append(need)
    if nframes <= 8:
        assert True in seen and False in seen
    else:
        assert not any(seen)                 # 32 frames, 2 s apart: every glyph is in some frame


@pytest.mark.bench
@pytest.mark.slow
def test_turn_budget_bench_names_a_path_without_a_checkpoint(tmp_path):
    """`bench/turn_budget.py --model DIR` on a folder that is neither a checkpoint nor a run dir exits at once,
    naming the script and the path (bench/common.checkpoint_or_exit)."""
    import subprocess
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "turn_budget.py")
    r = subprocess.run([sys.executable, bench, "--model", str(tmp_path / "empty")], capture_output=True, text=True,
                       env={**os.environ, "PARAVT_CACHE": str(tmp_path)}, timeout=120)
    assert r.returncode == 1 and "turn_budget.py: " in r.stderr and "neither a checkpoint dir" in r.stderr


@pytest.mark.bench
def test_turn_budget_bench_scores_as_eval_py(search):
    """bench/turn_budget.py's accuracy is eval.py's: a letter inside a wordy answer span ("... I guess I D") is right,
    as benchmarks.judge reads it; an errored row and a wrong letter are wrong."""
    import benchmarks
    mod = bench_module("turn_budget")
    mcq = [r for r in search[1] if r["task"] == "mcq"]
    wrong = lambda r: "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]
    span = lambda r, i: (f"No the shape, not read I guess I {r['answer']}" if i % 3 == 0 else r["answer"] if i % 3 == 1
                         else wrong(r))
    rows = [{"id": r["id"], "response": f"<answer>{span(r, i)}</answer>", "answer": span(r, i), "tool_turns": 1,
             **({"error": "decode failed"} if i == 1 else {})} for i, r in enumerate(mcq)]
    out = mod.by_kind(search[1], rows)
    right = sum(benchmarks.judge(r, row, "answer_tag_then_mcq")["score"] for r, row in zip(mcq, rows))
    assert right == sum(i % 3 in (0, 1) for i in range(len(mcq))) - 1
    assert out["all"] == pytest.approx(100 * right / len(mcq)) and out["n"]["all"] == len(mcq)
