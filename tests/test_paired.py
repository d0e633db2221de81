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
