"""bench/paired.py: two checkpoints' predictions on one split, question by question (fixed / broken, sign test)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import data  # noqa: E402
import paired  # noqa: E402


@pytest.mark.parametrize("fixed, broken, p", [(12, 1, 14 / 4096), (13, 4, 2 * 3214 / 2 ** 17), (0, 0, 1.0), (3, 3, 1.0),
                                              (5, 0, 2 / 32)])
def test_sign_test_by_hand(fixed, broken, p):
    assert paired.sign_test(fixed, broken) == pytest.approx(p)
    assert paired.sign_test(broken, fixed) == pytest.approx(p)        # two-sided


def records() -> list[dict]:
    """Synthetic records without videos (data._make_one): 4 MCQs of each kind and one grounding question."""
    kinds = [k for k in ("single_clue", "multi_clue", "search", "direct") for _ in range(4)] + ["grounding"]
    return [data._make_one(f"q{i}", k, np.random.default_rng(i), 64.0)[0] for i, k in enumerate(kinds)]


def test_fixed_broken_and_splits_counted_question_by_question():
    recs = records()
    mcq = [r for r in recs if r["task"] == "mcq"]
    wrong = lambda r: "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]
    # A: right on all but the first two; B: right on all but the last one -> B fixed 2, broke 1
    rows_a = [{"id": r["id"], "answer": wrong(r) if i < 2 else r["answer"], "calls": 1} for i, r in enumerate(mcq)]
    rows_b = [{"id": r["id"], "answer": wrong(r) if i == len(mcq) - 1 else r["answer"], "calls": 0}
              for i, r in enumerate(mcq)]
    out = paired.compare(recs, rows_a, rows_b, nframes=8)
    assert (out["right_a"], out["right_b"], out["mcq"], out["fixed"], out["broken"]) == (14, 15, 16, 2, 1)
    assert out["sign_test_p"] == pytest.approx(1.0)
    assert out["a"]["single_clue"] == 50.0 and out["b"]["direct"] == 75.0 and out["a"]["all"] == 100 * 14 / 16
    need = [r for r in mcq if data.tool_needed(r, 8)]
    assert out["a"]["n"]["tool_needed"] == len(need) and 0 < len(need) < len(mcq)
    assert out["a"]["tool_call_ratio_needed"] == 1.0 and out["b"]["tool_call_ratio_not_needed"] == 0.0


def test_a_missing_question_is_an_error_naming_the_file():
    recs = records()
    rows = [{"id": r["id"], "answer": r["answer"]} for r in recs if r["task"] == "mcq"][1:]
    with pytest.raises(ValueError, match=r"rl\.jsonl: no prediction for 1 question"):
        paired.compare(recs, rows + [{"id": "q0", "answer": "A"}], rows, where=("sft.jsonl", "rl.jsonl"))


def test_glyphs_seen_counts_the_frames_a_crop_samples_not_its_span():
    recs = [r for r in records() if r["task"] == "mcq" and data.tool_needed(r, 8)]
    rec = next(r for r in recs if len(r["meta"]["glyph_windows"]) == 1)
    (g0, g1), duration = rec["meta"]["glyph_windows"][0], rec["duration"]
    assert data.glyphs_seen(rec, 8, None) is False                  # the overview alone misses it (tool needed)
    assert data.glyphs_seen(rec, 8, [(max(0.0, g0 - 2), min(duration, g1 + 2))]) is True   # a tight crop shows it
    far = (0.0, 8.0) if g0 > 20 else (duration - 8.0, duration)
    assert data.glyphs_seen(rec, 8, [far]) is False
    # a wide crop covers the slot and may still miss it between frames: decided by the frames it samples
    wide = (0.0, duration)
    frames = [f for _, f0, f1 in data.crop_patch_times(*wide, duration, 1.0, 16) for f in (f0, f1)]
    assert data.glyphs_seen(rec, 8, [wide], 1.0, 16) == any(g0 <= f < g1 for f in frames)
    assert data.glyphs_seen({"task": "grounding", "meta": {}}, 8, None) is None


def test_changed_answers_split_by_what_was_seen():
    recs = [r for r in records() if r["task"] == "mcq" and data.tool_needed(r, 8)
            and len(r["meta"]["glyph_windows"]) == 1][:3]
    wrong = lambda r: "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]
    tight = lambda r: [[max(0.0, r["meta"]["glyph_windows"][0][0] - 2), r["meta"]["glyph_windows"][0][1] + 2]]
    # q0: A misses the glyph and guesses wrong, B crops it and is right (look); q1: both see it, B misreads (read);
    # q2: neither sees it, B's guess is right (guess)
    rows_a = [{"id": recs[0]["id"], "answer": wrong(recs[0]), "windows": []},
              {"id": recs[1]["id"], "answer": recs[1]["answer"], "windows": tight(recs[1])},
              {"id": recs[2]["id"], "answer": wrong(recs[2]), "windows": []}]
    rows_b = [{"id": recs[0]["id"], "answer": recs[0]["answer"], "windows": tight(recs[0])},
              {"id": recs[1]["id"], "answer": wrong(recs[1]), "windows": tight(recs[1])},
              {"id": recs[2]["id"], "answer": recs[2]["answer"], "windows": []}]
    out = paired.compare(recs, rows_a, rows_b, nframes=8)
    assert out["fixed_by"] == {"look": 1, "read": 0, "guess": 1} and out["broken_by"] == {"look": 0, "read": 1, "guess": 0}
    assert out["a"]["n"]["seen"] == 1 and out["b"]["n"]["seen"] == 2
    assert out["a"]["seen"] == 100.0 and out["b"]["seen"] == 50.0 and out["b"]["unseen"] == 100.0
