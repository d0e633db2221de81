"""bench/search_signal.py: the time a sample names for a search question's mark, checked against the patch time
its whole-video crop printed, and the advantage the group gives right and wrong localisations."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import data  # noqa: E402
import search_signal  # noqa: E402


def search_record(seed: int = 3) -> dict:
    """A search question without its video (data._make_one)."""
    return data._make_one("q", "search", np.random.default_rng(seed), 64.0)[0]


def sample(said: float | None, letter: str, windows=()) -> SimpleNamespace:
    think = f"The whole-video clip shows a mark near {said:.1f} seconds but no shape beside it." if said is not None \
        else "I see a mark."
    return SimpleNamespace(text=f"<think>\n{think}\n</think>\n<answer>{letter}</answer>", windows=windows)


def test_named_time_checked_against_the_printed_patch_time():
    rec = search_record()
    true = data.seen_at(rec["clues"][0], data.crop_patch_times(0.0, 64.0, 64.0, 1.0, 16))
    assert true is not None and rec["clues"][0][0] - 4 <= true < rec["clues"][0][1] + 4
    wrong_letter = "ABCD"[("ABCD".index(rec["answer"]) + 1) % 4]
    other = (true + 16.0) % 64.0
    glyph = rec["meta"]["glyph_windows"][0]
    trajs = [sample(true, rec["answer"], [(glyph[0] - 3, glyph[1] + 3)]), sample(true, wrong_letter), sample(other, rec["answer"]),
             sample(other, wrong_letter), sample(None, rec["answer"])]
    adv = torch.tensor([1.0, -0.5, 0.5, -1.0, 0.0])
    stats = search_signal.sample_stats(rec, trajs, adv, 1.0, 16)
    assert [s["stated"] for s in stats] == [true, true, other, other, None]
    assert [s["right"] for s in stats] == [True, False, True, False, True]
    assert [s["seen"] for s in stats] == [True, False, False, False, False]     # a crop around the glyph; none
    assert data.tool_needed(rec, 8)                                             # (the overview alone misses it)
    out = search_signal.summary(stats, 8)
    assert (out["samples"], out["named"], out["named_right"], out["chance"]) == (5, 4, 2, 0.125)
    assert out["glyph_seen_given_right_time"] == 0.5 and out["glyph_seen_given_wrong_time"] == 0.0
    assert out["answer_right_given_right_time"] == 0.5 and out["answer_right_given_wrong_time"] == 0.5
    assert out["advantage_right_time"] == pytest.approx(0.25) and out["advantage_wrong_time"] == pytest.approx(-0.25)


def test_a_time_named_where_the_crop_showed_no_mark_is_a_wrong_time():
    out = search_signal.summary([{"stated": 20.0, "true": None, "right": False, "seen": False, "advantage": -1.0}], 8)
    assert (out["named"], out["named_right"], out["advantage_wrong_time"]) == (1, 0, -1.0)


def test_nothing_named_gives_none_not_a_division_by_zero():
    out = search_signal.summary([{"stated": None, "true": 12.0, "right": True, "seen": True, "advantage": 0.0}], 8)
    assert out["named"] == 0 and out["answer_right_given_right_time"] is None and out["advantage_wrong_time"] is None
