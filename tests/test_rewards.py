"""Reward math: parsers, ParaVT and Video-o3 rewards, gating, group advantages.

    python -m pytest tests/test_rewards.py -q

Expected values are worked by hand from the formulas in docs/method.md §4 (each case says how).
"""
import math
import random

import pytest
import torch

from recipes import GATING_CHOICES
from rewards import (
    ANCHOR_WEIGHT,
    accuracy_reward,
    call_window,
    clue_terms,
    extract_answer,
    extract_letter,
    extract_time_range,
    format_anchor,
    format_compliant,
    format_reward,
    gate_nframes,
    grounding_format_reward,
    group_advantages,
    hybrid_clue_score,
    infer_data_type,
    merge_windows,
    paravt_reward,
    parse_tool_calls,
    shape_reward,
    temporal_iou,
    tool_reward,
    turn_decay,
    vtgr_reward,
    vtgr_tool_term,
    zero_variance_groups,
)

# ---- building blocks of trajectory texts (docs/method.md §2) ---------------------------------
THINK = "<think>\nI should look closer at the clock on the wall.\n</think>\n"
CALL = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 12.0, "end_time": 20.0}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 30, "end_time": 35, "resolution": "fine"}}\n</tool_call>'
GROUND = '<grounding>{"temporal_segment": [12.0, 20.0], "sampling_strategy": "medium"}</grounding>'
RESP = ("<|im_end|>\n<|im_start|>user\n<tool_response>\nA clock shows noon.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
FINAL = "<think>\nThe clock shows noon, so the answer is B.\n</think>\n<answer>B</answer><|im_end|>"
PERFECT = THINK + CALL + RESP + FINAL                      # whole trajectory as the model saw it
GENERATED = PERFECT.replace("<think>\n", "").replace(RESP, "")  # released view: policy tokens only


# ---- parse_tool_calls ----------------------------------------------------------------------------
def test_parallel_calls_in_order_both_syntaxes():
    calls = parse_tool_calls(THINK + CALL + "\n" + GROUND + "\n" + CALL2)
    assert [c.syntax for c in calls] == ["tool_call", "grounding", "tool_call"]
    assert [call_window(c) for c in calls] == [(12.0, 20.0), (12.0, 20.0), (30.0, 35.0)]
    assert [c.arguments["resolution"] for c in calls] == ["medium", "medium", "fine"]  # default medium
    assert all(c.error is None and c.name == "crop_video" for c in calls)


def _tc(args: str) -> str:
    return '<tool_call>{"name": "crop_video", "arguments": %s}</tool_call>' % args


@pytest.mark.parametrize("text, error_part", [
    ("<tool_call>{bad json</tool_call>", "invalid JSON"),                     # not JSON at all
    ("<tool_call>[1, 2]</tool_call>", "JSON object"),                         # JSON, but not an object
    ('<tool_call>{"arguments": {}}</tool_call>', "name"),                     # missing name
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "name"),          # non-string name
    ('<tool_call>{"name": "crop_video", "arguments": "{}"}</tool_call>', "arguments"),  # arguments as a string
    (_tc('{"end_time": 5}'), "start_time is missing"),                        # missing start
    (_tc('{"start_time": 1}'), "end_time is missing"),                        # missing end
    (_tc('{"start_time": "1", "end_time": 5}'), "start_time is not a finite"),  # a string is not a number
    (_tc('{"start_time": true, "end_time": 5}'), "start_time is not a finite"),  # bool is not a number
    (_tc('{"start_time": 1e400, "end_time": 5}'), "start_time is not a finite"),  # overflows to inf
    (_tc('{"start_time": 1, "end_time": NaN}'), "end_time is not a finite"),   # json.loads accepts NaN
    (_tc('{"start_time": 1, "end_time": -Infinity}'), "end_time is not a finite"),  # and Infinity
    (_tc('{"start_time": %s, "end_time": 5}' % ("9" * 400)), "start_time is not a finite"),  # int too big for float
    (_tc('{"start_time": 1, "end_time": 5, "resolution": "ultra"}'), "resolution"),  # unknown level
    ('<grounding>{"temporal_segment": [1, 2, 3], "sampling_strategy": "fine"}</grounding>', "pair"),  # not a pair
    ('<grounding>{"temporal_segment": [1, 2]}</grounding>', "sampling_strategy"),  # Video-o3 needs a level
    ('<grounding>{"temporal_segment": [1, 2], "sampling_strategy": "huge"}</grounding>', "resolution"),  # bad level
    (_tc('{"start_time": 1, "end_time": 5}').replace("</tool_call>", ""), "unclosed"),  # final block unclosed
])
def test_parse_errors_are_error_calls(text, error_part):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].error is not None and error_part in calls[0].error
    assert call_window(calls[0]) is None


def test_unknown_tool_parses_without_error():
    # the parser is syntactic: deciding that "search" is not a tool is the executor's job
    (call,) = parse_tool_calls('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert (call.name, call.arguments, call.error, call_window(call)) == ("search", {"q": "x"}, None, None)


@pytest.mark.parametrize("max_calls, expected", [(None, 3), (2, 2), (0, 0)])  # extra calls dropped silently
def test_max_calls(max_calls, expected):
    assert len(parse_tool_calls(CALL + CALL2 + GROUND, max_calls=max_calls)) == expected


def test_unclosed_block_ends_the_scan_and_nested_opener_is_one_bad_call():
    # a call left open swallows everything after it: one error call, nothing parsed from inside it
    calls = parse_tool_calls("<tool_call>{" + CALL)
    assert len(calls) == 1 and "invalid JSON" in calls[0].error
    calls = parse_tool_calls(CALL + "<tool_call>{\"name\": ")
    assert [c.error is None for c in calls] == [True, False] and "unclosed" in calls[1].error


# ---- answers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<think>x</think><answer> B </answer>", "B"),                         # (1) the answer block, stripped
    ("<answer>A</answer> then <answer>B</answer>", "A"),                   # (1) the first block wins
    ("<answer><answer>C</answer></answer>", "C"),                          # nested tags: innermost body
    ("<think>\nhmm\n</think>\nThe answer is B<|im_end|>", "The answer is B"),  # (2) after </think>, markers gone
    ("<think>a</think>" + CALL + "\nB", "B"),                              # (2) tool blocks stripped
    ("<think>a</think>\n<answer>C", "C"),                                  # (2) a stray unclosed tag dropped
    ("<think>\nreasoning about C\n", "reasoning about C"),                 # (3) last non-tag line
    ("<answer>\n", None),                                                  # only tag lines: nothing
    ("", None),                                                            # empty output
    ("<answer>é 答案 🎬</answer>", "é 答案 🎬"),                            # unicode survives
    (THINK + CALL + RESP.replace("A clock", "<answer>C</answer>") + FINAL, "B"),  # a tool response's answer is ignored
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("B", "B"),                    # a lone letter
    ("b", "B"),                    # a lone lowercase letter
    ("(B)", "B"),                  # parenthesised
    ("B.", "B"), ("B)", "B"), ("B:", "B"),  # letter with trailing punctuation
    ("(B) a red car", "B"),        # option echoed with its text
    ("B. a red car", "B"),         # same, dotted
    ("The answer is B", "B"),      # sentence form
    ("The answer is B.", "B"),     # sentence with a full stop
    ("Option C", "C"),             # option keyword
    ("Answer: (D)", "D"),          # colon and parentheses
    ("Option A is wrong; the answer is C", "C"),  # "answer" outranks "option"
    ("the answer is a cat", None), # lowercase article, not option A
    ("A cat", None),               # leading article with no punctuation
    ("K", None),                   # beyond n_options=10
    ("", None),                    # empty
])
def test_extract_letter(text, expected):
    assert extract_letter(text) == expected


def test_extract_letter_respects_n_options():
    assert (extract_letter("D", n_options=4), extract_letter("E", n_options=4)) == ("D", None)


@pytest.mark.parametrize("text, expected", [
    ("[12.5, 20.0]", (12.5, 20.0)),                                        # bracketed pair
    ("(3, 7)", (3.0, 7.0)),                                                # parenthesised pair
    ("12.5 - 20.0", (12.5, 20.0)),                                         # dash
    ("from 12.5s to 20s", (12.5, 20.0)),                                   # "to" with units
    ("1:05 - 1:30", (65.0, 90.0)),                                         # m:ss
    ("The event happens in the 12.5 - 20.0 seconds", (12.5, 20.0)),        # Charades-STA answer sentence
    ("The event happens in the 20.0 - 12.5 seconds", (12.5, 20.0)),        # reversed pair swapped
    ("1, 2", None),                                                        # a bare comma is not a range
    ("2 to " + "9" * 400 + " then 3 - 4", (3.0, 4.0)),                     # non-finite pair skipped
    ("no numbers here", None),                                             # nothing
])
def test_extract_time_range(text, expected):
    assert extract_time_range(text) == expected


@pytest.mark.parametrize("text, target, task, expected", [
    ("<answer>B</answer>", "B", "mcq", 1.0),                               # right letter
    ("<answer>(C) a dog</answer>", "B", "mcq", 0.0),                       # wrong letter
    ("<think>\nno answer", "B", "mcq", 0.0),                               # nothing extractable as a letter
    ("<answer>The red car</answer>", "red car", "oe", 1.0),                # articles and case normalised away
    ("<answer>Red, car!</answer>", "a red car", "oe", 1.0),                # punctuation dropped
    ("<answer>red truck</answer>", "red car", "oe", 0.5),                  # F1: P = R = 1/2
    ("<answer>[10, 20]</answer>", [15, 25], "tvg", 5 / 15),                # IoU 5 / 15
    ("<answer>The event happens in the 15 - 25 seconds</answer>", [15, 25], "tvg", 1.0),  # sentence form
    ("<answer>soon</answer>", [15, 25], "tvg", 0.0),                       # no window
])
def test_accuracy_reward(text, target, task, expected):
    assert accuracy_reward(text, target, task) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("target, task", [("B", "essay"), ([1, 2, 3], "tvg"), ("maybe", "mcq")])  # bad data raises
def test_accuracy_reward_rejects_bad_targets(target, task):
    with pytest.raises(ValueError):
        accuracy_reward("<answer>B</answer>", target, task)


# ---- ParaVT format reward ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, anchor_weight, expected", [
    (PERFECT, 0.5, 1.0),             # 0.2 + 0.5 + 0.5*0.7 + 0.3 + 0.1 = 1.45, capped at 1
    (FINAL, 0.5, 1.0),               # no tool: 0.2 + 0.5 + 0.35 + 0.1 = 1.15, capped
    (FINAL, 0.0, 0.8),               # anchor off: 0.2 + 0.5 + 0.1
    # no </think>: 0.2 + 0.3 + 0.2 (the release's answer body anywhere) - 0.5*0.3
    ("<think>\nThe clock shows noon, so B.\n<answer>B</answer>", 0.5, 0.55),
    (THINK + "<answer>B", 0.5, 0.7),  # no </answer>: 0.2 + 0.3 + 0.5*0.4, tags unbalanced
    (FINAL.replace("</think>", "</think></think>"), 0.0, 0.7),  # unbalanced think: loses the 0.1
    ("<think>\nshort\n</think>\n<answer>B</answer>", 0.5, 0.75),  # think < 10 chars: 0.5 + 0.5*0.3 + 0.1
    (CALL + THINK + "<answer>B", 0.5, 0.7),   # tool before think: no +0.3 (compare the next case)
    (THINK + CALL + "<answer>B", 0.5, 1.0),   # think first: 0.2 + 0.3 + 0.2 + 0.3
    ("<think>\nab", 0.5, -0.15),     # short think never closed: no lower clamp
    ("", 0.5, 0.0),                  # empty output
    ("<think>\nThe clock shows noon.\n</think>\n<answer> </answer>", 0.5, 0.2 + 0.2 + 0.1),  # empty body
])
def test_format_reward(text, anchor_weight, expected):
    assert format_reward(text, anchor_weight) == pytest.approx(expected, abs=1e-12)


def test_released_quirk_generated_tokens_only():
    """Regression for the ParaVT release, which scored only generated tokens.

    The environment writes the forced `<think>\\n` prefix, so the policy's own text of a perfect
    trajectory has no `<think>`: has_think fails (-0.2), the anchor's `</think> closed` term never
    fires (0), the think-before-tool bonus is lost and the think tags look unbalanced. Scoring the
    trajectory as seen (our default) gives the full 1.0; the released view gives 0.5.
    """
    assert (format_reward(PERFECT, ANCHOR_WEIGHT), format_anchor(PERFECT)) == (1.0, pytest.approx(0.7))
    assert (format_reward(GENERATED, ANCHOR_WEIGHT), format_anchor(GENERATED)) == (0.5, 0.0)
    assert format_compliant(PERFECT) and not format_compliant(GENERATED)


@pytest.mark.parametrize("text, expected", [
    (PERFECT, 0.7),                                     # 0.4 (think closed) + 0.3 (answer closed)
    (THINK + "<answer>B", 0.4),                         # answer never closed
    ("<think>\nab", -0.3),                              # opened, never closed
    (THINK + "<think>\nstill thinking", 0.4 - 0.3),     # first think closed, last one open
])
def test_format_anchor(text, expected):
    assert format_anchor(text) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("text, expected", [
    (PERFECT, True),                                    # the reference trajectory
    (FINAL, True),                                      # no tool call needed
    (THINK + GROUND + RESP + FINAL, True),              # Video-o3 syntax
    (THINK + "<answer>B", False),                       # answer unclosed
    ("<think>\nok\n<answer>B</answer>", False),         # think unclosed
    (THINK + "<tool_call>{oops}</tool_call>" + RESP + FINAL, False),  # a call that does not parse
    (FINAL + "<answer>C</answer>", False),              # two answers
    ("<answer>B</answer>", False),                      # no think at all
    ("<think>\n<answer>B</answer>\n</think>", False),   # answer nested in think
])
def test_format_compliant(text, expected):
    assert format_compliant(text) is expected


@pytest.mark.parametrize("text, acc, expected", [
    (FINAL, 1.0, 0.0),                                  # no tool call: 0 even when right
    (THINK + CALL + FINAL, 0.0, 0.1),                   # a call, no response
    (PERFECT, 0.0, 0.3),                                # a call and its response
    (PERFECT, 1.0, 0.8),                                # + 0.5 for a right answer
    (THINK + "<tool_call>{oops}</tool_call>" + RESP + FINAL, 1.0, 0.0),  # unparseable call earns nothing
])
def test_tool_reward(text, acc, expected):
    assert tool_reward(text, acc) == pytest.approx(expected)


def test_paravt_reward_composes_and_degenerate_rule():
    total, parts = paravt_reward(PERFECT, "B", "mcq", ANCHOR_WEIGHT)
    assert set(parts) == {"acc", "format", "anchor", "tool", "degenerate"}
    assert total == pytest.approx(parts["acc"] + parts["format"] + parts["tool"]) == pytest.approx(2.8)
    total, parts = paravt_reward(PERFECT, "B", "mcq", ANCHOR_WEIGHT, w_fmt=0.5)   # weight applies to R_fmt only
    assert total == pytest.approx(2.3)
    degenerate = "<|im_start|>" * 5 + "<answer>B</answer>"                 # 5 markers in < 300 chars
    assert paravt_reward(degenerate, "B", "mcq", ANCHOR_WEIGHT) == (0.0, {"acc": 0.0, "format": 0.0, "anchor": 0.0,
                                                           "tool": 0.0, "degenerate": 1.0})
    long_enough = degenerate + " " * 300                                   # same markers, >= 300 chars
    assert paravt_reward(long_enough, "B", "mcq", ANCHOR_WEIGHT)[1]["acc"] == 1.0


# ---- Video-o3 VTGR ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pred, gt, expected", [
    ((0, 10), (0, 10), 1.0),          # identical
    ((0, 10), (5, 15), 5 / 15),       # half overlap
    ((0, 1), (2, 3), 0.0),            # disjoint
    ((5, 5), (0, 10), 0.0),           # zero-length prediction
    ((8, 2), (0, 10), 0.0),           # reversed window is degenerate
    ((0, math.nan), (0, 10), 0.0),    # NaN end point
    ((0, math.inf), (0, 10), 0.0),    # infinite end point
])
def test_temporal_iou(pred, gt, expected):
    assert temporal_iou(pred, gt) == pytest.approx(expected)


@pytest.mark.parametrize("windows, expected", [
    ([(5, 15), (0, 10)], [(0, 15)]),                   # overlap, unsorted input
    ([(0, 5), (5, 8)], [(0, 8)]),                      # touching windows merge (start <= last end)
    ([(0, 1), (2, 3)], [(0, 1), (2, 3)]),              # disjoint stay apart
    ([(3, 3), (4, 2), (0, math.inf)], []),             # degenerate windows dropped
    ([], []),                                          # nothing
])
def test_merge_windows(windows, expected):
    assert merge_windows(windows) == expected


def test_hybrid_clue_score_spec_worked_example():
    """docs/method.md §4.3 example, P = [0,10],[5,15] -> [0,15]; G = [0,5],[10,20]. By the formula: I = 10,
    |P| = 15, |G| = 15, IoU = 10/20, IoP = IoG = 10/15; hulls [0,15], [0,20]: d = 2.5, C = 20.
    (the method's first draft writes IoU = 10/15 and IoG = 1, which hold for G = [0,5],[10,15] - next test.)"""
    t = clue_terms([(0, 10), (5, 15)], [(0, 5), (10, 20)])
    assert t == pytest.approx({"iou": 10 / 20, "iop": 10 / 15, "iog": 10 / 15, "diou": 10 / 20 - 2.5 ** 2 / 20 ** 2})
    h = (10 / 20 + 10 / 15 + 10 / 15 + (10 / 20 - 6.25 / 400 + 1) / 2) / 4
    assert abs(hybrid_clue_score([(0, 10), (5, 15)], [(0, 5), (10, 20)]) - h) < 1e-9


def test_hybrid_clue_score_spec_numbers_with_consistent_gt():
    # G = [0,5],[10,15]: I = 10, IoU = IoP = 10/15, IoG = 1, both hulls [0,15] so d = 0 and DIoU = IoU
    h = hybrid_clue_score([(0, 10), (5, 15)], [(0, 5), (10, 15)])
    assert abs(h - (10 / 15 + 10 / 15 + 1 + (10 / 15 + 1) / 2) / 4) < 1e-9
    h_multi = hybrid_clue_score([(0, 10), (5, 15)], [(0, 5), (10, 15)], multi_clue=True)
    assert abs(h_multi - (2 * 10 / 15 + 10 / 15 + 1) / 4) < 1e-9


@pytest.mark.parametrize("pred, gt, multi, expected", [
    ([(0, 10)], [(0, 10)], False, 1.0),                 # identical: every term 1
    ([(0, 10)], [(0, 10)], True, 1.0),                  # identical, multi-clue H'
    ([(0, 1)], [(9, 10)], False, (-0.81 + 1) / 8),      # disjoint: IoU = 0, DIoU = -(9/10)^2
    ([], [(0, 10)], False, 0.0),                        # no crops
    ([(0, 10)], [], False, 0.0),                        # no clues
    ([(0, 10)], [(5, 5)], False, 0.0),                  # only a degenerate clue (dropped)
])
def test_hybrid_clue_score_cases(pred, gt, multi, expected):
    assert hybrid_clue_score(pred, gt, multi_clue=multi) == pytest.approx(expected)


def test_disjoint_windows_have_negative_diou():
    assert clue_terms([(0, 1)], [(9, 10)])["diou"] == pytest.approx(-0.81)


def test_overlapping_crops_score_as_their_merge():
    # parallel crops that overlap (or repeat) must not count twice: H uses the union of all windows
    gt = [(0, 5), (10, 20)]
    merged = hybrid_clue_score([(0, 15)], gt)
    assert hybrid_clue_score([(0, 10), (5, 15)], gt) == merged
    assert hybrid_clue_score([(0, 15), (0, 15), (2, 3)], gt) == merged


@pytest.mark.parametrize("n, expected", [
    (1, 1.0),     # first turn is free
    (2, 0.95),    # 1 - 0.05
    (3, 0.90),    # 1 - 0.10
    (8, 0.65),    # Video-o3's eval budget of 8 turns
    (0, 1.0),     # no tool turn: clamped, a decay never amplifies
    (30, 0.0),    # beyond 21 turns the clamp keeps it >= 0
])
def test_turn_decay(n, expected):
    assert turn_decay(n) == pytest.approx(expected)


HIT = [(0, 10)]  # a crop identical to the clue: H = H' = 1


@pytest.mark.parametrize("data_type, n, correct, fmt_ok, expected", [
    ("single_clue", 1, True, True, 1.0),          # (H + 1) / 2 = 1, no decay at n = 1
    ("single_clue", 3, True, True, 0.9),          # decay 0.9
    ("single_clue", 0, True, True, 0.0),          # right without looking: no clue term
    ("multi_clue", 5, True, True, 1.0),           # (H' + 1) / 2, no decay
    ("direct", 0, True, True, 0.75),              # answered directly
    ("direct", 2, True, True, 0.6),               # 0.75 (1 - 0.2)
    ("free_form", 2, True, True, 0.5),            # constant
    ("grounding", 2, True, True, 0.0),            # no tool term for grounding
    ("single_clue", 1, False, True, 0.0),         # wrong answer: 0
    ("multi_clue", 1, True, False, 0.0),          # format below 1: 0
    ("free_form", 1, False, False, 0.0),          # both: 0
])
def test_vtgr_tool_term(data_type, n, correct, fmt_ok, expected):
    clue = hybrid_clue_score(HIT, HIT, multi_clue=data_type == "multi_clue")     # 1: the clue itself
    assert clue == pytest.approx(1.0)
    assert vtgr_tool_term(data_type, clue, turn_decay(n), n, correct, fmt_ok) == pytest.approx(expected)


def test_vtgr_tool_term_rejects_unknown_data_type():
    with pytest.raises(ValueError, match="data_type"):
        vtgr_tool_term("mystery", 1.0, 1.0, 1, True, True)


TURN_CALL = "<think>\nCrop the clock.\n</think>\n" + CALL + "<|im_end|>"
TURN_PAR = "<think>\nCrop both.\n</think>\n" + CALL + "\n" + GROUND + "<|im_end|>"
TURN_BAD = "<think>\nCrop.\n</think>\n" + _tc('{"start_time": 1}') + "<|im_end|>"
TURN_ANS = "<think>\nIt is noon.\n</think>\n<answer>B</answer><|im_end|>"


@pytest.mark.parametrize("turns, expected", [
    ([TURN_CALL, TURN_ANS], 1.0),                                   # reference two-turn trajectory
    ([TURN_PAR, TURN_ANS], 1.0),                                    # parallel calls, both syntaxes
    ([TURN_ANS], 1.0),                                              # direct answer
    ([TURN_BAD, TURN_ANS], 0.5),                                    # e = 1, K = 2
    ([TURN_BAD, TURN_BAD, TURN_ANS], 1 - 2 / 3),                    # e = 2, K = 3
    ([TURN_BAD.replace(_tc('{"start_time": 1}'), _tc('{}') * 3), TURN_ANS], 0.0),  # e = 3 > K: clamped
    ([TURN_CALL.replace("crop_video", "search"), TURN_ANS], 0.5),   # unknown tool counts as an error
    ([CALL, TURN_ANS], 0.0),                                        # call without think
    ([TURN_CALL.replace("</think>\n", "</think>\nLet me see.\n"), TURN_ANS], 0.0),  # text between blocks
    ([TURN_CALL, TURN_CALL], 0.0),                                  # final turn calls a tool
    ([TURN_CALL, "<think>\nIt is noon.\n</think>\nB"], 0.0),        # final turn without answer tags
    ([TURN_ANS, TURN_ANS], 0.0),                                    # answer in a non-final turn
    (["<think>\nx\n</think><answer>B"], 0.0),                       # unclosed answer
    ([], 0.0),                                                      # no turns at all
])
def test_grounding_format_reward(turns, expected):
    assert grounding_format_reward(turns) == pytest.approx(expected)


def test_vtgr_reward_mcq_and_grounding():
    total, parts = vtgr_reward([TURN_CALL, TURN_ANS], "", "B", "mcq", None, [(12, 20)], [[12, 20]], 1)
    assert set(parts) == {"acc", "format", "tool", "clue"}
    assert (total, parts["clue"]) == (3.0, 1.0)                     # 1 + 1 + (1 + 1) / 2, single clue inferred
    wrong, _ = vtgr_reward([TURN_CALL, TURN_ANS], "", "C", "mcq", None, [(12, 20)], [[12, 20]], 1)
    assert wrong == 1.0                                             # format only: tool term needs a right answer
    tvg_turn = "<think>\nThe clock moves.\n</think>\n<answer>[10, 20]</answer>"
    total, parts = vtgr_reward([tvg_turn], "", [15, 25], "tvg", None, [], None, 0)
    assert (total, parts["tool"]) == (pytest.approx(1 + 5 / 15), 0.0)  # IoU + R_fmt, no tool term


@pytest.mark.parametrize("task, clues, data_type, expected", [
    ("tvg", None, None, "grounding"),              # grounding task
    ("mcq", [[1, 2]], None, "single_clue"),        # one clue
    ("mcq", [[1, 2], [5, 6]], None, "multi_clue"), # several
    ("oe", None, None, "free_form"),               # none
    ("mcq", [], None, "free_form"),                # empty list = none
    ("mcq", [[1, 2]], "direct", "direct"),         # given type wins
])
def test_infer_data_type(task, clues, data_type, expected):
    assert infer_data_type(task, clues, data_type) == expected


def test_infer_data_type_rejects_unknown():
    with pytest.raises(ValueError, match="data_type"):
        infer_data_type("mcq", None, "clueless")


# ---- token masks, gating, advantages --------------------------------------------------------------
def test_gate_same_k_within_group_and_deterministic():
    ks = [gate_nframes("video_17.mp4#q3", 5, GATING_CHOICES) for _ in range(8)]  # one group's 8 samples
    assert len(set(ks)) == 1 and ks[0] in (4, 8, 16, 32, 64)
    per_step = {gate_nframes("video_17.mp4#q3", s, GATING_CHOICES) for s in range(50)}
    assert len(per_step) > 1                                        # redrawn across steps
    assert gate_nframes("p", 1, GATING_CHOICES, seed=0) == gate_nframes("p", 1, GATING_CHOICES, seed=0)


def test_gate_uniform_over_prompts():
    choices, n = (4, 8, 16, 32, 64), 5000
    counts = {c: 0 for c in choices}
    for i in range(n):
        counts[gate_nframes(f"prompt-{i}", step=3, choices=choices)] += 1
    expected = n / len(choices)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert min(counts.values()) > 0 and chi2 < 25.0                # 4 dof: p(chi2 > 25) ~ 5e-5


def test_gate_needs_a_choice():
    with pytest.raises(ValueError):
        gate_nframes("p", 0, choices=())


def test_gate_does_not_use_python_hash(monkeypatch):
    """Python's str hash() is salted per process, so a gate built on it would give each rank a
    different K. Replacing builtins.hash must leave every K unchanged."""
    import builtins
    keys = [f"clip-{i}" for i in range(40)]
    before = [gate_nframes(k, 2, GATING_CHOICES) for k in keys]
    monkeypatch.setattr(builtins, "hash", lambda obj: 0)
    assert [gate_nframes(k, 2, GATING_CHOICES) for k in keys] == before and len(set(before)) > 1


def test_group_advantages_properties():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=g)
    adv = group_advantages(rewards, 8)
    assert adv.shape == rewards.shape and torch.isfinite(adv).all()
    assert adv.view(6, 8).sum(1).abs().max() < 1e-5                  # sums ~ 0 per group
    assert adv.view(6, 8).std(1).sub(1).abs().max() < 1e-4           # unit (unbiased) std per group
    perm = torch.randperm(8, generator=g)                            # order preserved: permute within a group
    assert torch.allclose(group_advantages(rewards[:8][perm], 8), adv[:8][perm])


def test_group_advantages_hand_values_and_constant_group():
    # group [0, 1]: mean 0.5, unbiased std sqrt(0.5) -> A = -+0.5 / 0.7071; group [0.3, 0.3]: exactly 0
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.3, 0.3]), 2, eps=0.0)
    assert adv[:2].tolist() == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5)])
    assert adv[2:].tolist() == [0.0, 0.0] and not torch.isnan(adv).any()
    assert zero_variance_groups(torch.tensor([0.0, 1.0, 0.3, 0.3]), 2).tolist() == [False, True]
    assert group_advantages(torch.tensor([1, 0, 1, 0]), 2).dtype == torch.float32  # integer rewards accepted


def test_group_advantages_shaping():
    # inside the clip, 10 (R - 0.2) is affine, and normalisation removes it: same advantages
    r = torch.tensor([0.0, 0.5, 1.0, 1.5])
    assert torch.allclose(group_advantages(shape_reward(r), 4), group_advantages(r, 4), atol=1e-5)
    # the clip at +20 ties rewards 3 and 5 (both shape to 20), so they share one advantage
    adv = group_advantages(shape_reward(torch.tensor([0.0, 3.0, 5.0, 1.0])), 4)
    assert adv[1] == adv[2] and adv[0] < adv[3] < adv[1]


# ---- robustness and ranges ---------------------------------------------------------------------
ADVERSARIAL = [
    "",                                                          # empty
    "<answer><answer><think></answer></think>",                  # nested, crossed tags
    "<tool_call>" * 50 + "</tool_call>" * 3,                     # repeated openers
    "<answer>" + "é答🎬\u202e" * 100 + "</answer>",              # unicode
    (THINK + CALL + RESP) * 30 + FINAL,                          # long multi-turn
    PERFECT * 400,                                               # ~100 kB output
    "x" * 100_000,                                               # 100 kB of filler
    "<|im_start|>" * 6,                                          # degenerate output
]


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_never_raises_and_stays_in_range(text):
    assert isinstance(parse_tool_calls(text), list)
    assert extract_answer(text) is None or isinstance(extract_answer(text), str)
    assert extract_letter(extract_answer(text)) in (None, *"ABCDEFGHIJ")
    assert extract_time_range(text) is None or len(extract_time_range(text)) == 2
    assert -0.15 <= format_reward(text, ANCHOR_WEIGHT) <= 1.0 and -0.3 <= format_anchor(text) <= 0.7
    assert isinstance(format_compliant(text), bool)
    assert 0.0 <= grounding_format_reward(text.split("<|im_start|>assistant\n")) <= 1.0
    for task, target in (("mcq", "B"), ("oe", "red car"), ("tvg", [1, 2])):
        assert -0.15 <= paravt_reward(text, target, task, ANCHOR_WEIGHT)[0] <= 2.8


def test_rewards_in_range_seeded_loop():
    rng = random.Random(0)
    pieces = [THINK, CALL, CALL2, GROUND, RESP, FINAL, "<think>\n", "</think>", "<answer>", "</answer>",
              "<answer>C</answer>", "[3, 9]", "\n", "<tool_call>{", "B"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        turns = text.split("<|im_start|>assistant\n")
        windows = [(rng.uniform(0, 50), rng.uniform(0, 50)) for _ in range(rng.randint(0, 4))]  # some reversed
        clues = [[10.0, 20.0]] * rng.randint(0, 2)
        assert -0.15 <= format_reward(text, ANCHOR_WEIGHT) <= 1.0
        assert -0.3 <= format_anchor(text) <= 0.7
        assert 0.0 <= tool_reward(text, rng.random()) <= 1.0
        assert 0.0 <= grounding_format_reward(turns) <= 1.0
        assert 0.0 <= hybrid_clue_score(windows, clues, multi_clue=rng.random() < 0.5) <= 1.0
        assert -0.15 <= paravt_reward(text, "B", "mcq", ANCHOR_WEIGHT)[0] <= 2.8
        total, parts = vtgr_reward(turns, text, "B", "mcq", None, windows, clues, len(turns) - 1)
        assert 0.0 <= total <= 3.0 and all(0.0 <= v <= 1.0 for v in parts.values())
