"""bench/headroom.py: held-out MCQs binned by greedy result and sampled accuracy; the sampled mode's accuracy."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import headroom  # noqa: E402


@pytest.mark.parametrize("p, label", [(0.0, "p = 0"), (1 / 16, "0 < p < 1/4"), (0.25, "1/4 <= p < 1/2"),
                                      (0.5, "1/2 <= p < 3/4"), (0.9375, "3/4 <= p < 1"), (1.0, "p = 1")])
def test_p_bins_edges(p, label):
    assert headroom.p_bin(p) == label


def test_counts_and_the_accuracy_of_the_sampled_mode():
    greedy = {"a": True, "b": True, "c": False, "d": False, "e": False}
    sampled = {"a": 1.0, "b": 0.25, "c": 0.75, "d": 0.0, "e": 0.5, "unused": 1.0}
    out = headroom.headroom(greedy, sampled)
    assert out["questions"] == 5 and out["greedy_accuracy"] == pytest.approx(0.4)
    assert out["sampled_accuracy"] == pytest.approx((1.0 + 0.25 + 0.75 + 0.0 + 0.5) / 5)
    assert out["mode_accuracy"] == pytest.approx(2 / 5)          # a and c: p = 1/2 is not a majority
    assert (out["wrong_with_p_above_half"], out["right_with_p_below_half"], out["wrong_with_p_below_quarter"]) == (1, 1, 1)
    assert out["counts"] == {"right, p = 1": 1, "right, 1/4 <= p < 1/2": 1, "wrong, 3/4 <= p < 1": 1,
                             "wrong, 1/2 <= p < 3/4": 1, "wrong, p = 0": 1}


def test_a_question_without_a_sampled_accuracy_is_an_error_naming_it():
    with pytest.raises(ValueError, match="e.g. b"):
        headroom.headroom({"a": True, "b": False}, {"a": 1.0})
