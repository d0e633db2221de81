"""Pure reward math for agentic long-video RL: parsers, ParaVT and Video-o3 rewards, GRPO advantages.

Strings and tensors in, floats and tensors out: no model, tokenizer, video, file or global state.
Malformed model output is data, never an exception: parsers return None or error calls, and the
rewards score it 0. Bad *targets or settings* (the caller's data) raise ValueError.

Sources
  ParaVT    arXiv 2605.20342  format reward with Exploration Anchoring, R_tool, nFrames Gating
  Video-o3  arXiv 2601.23224  VTGR: strict per-turn format, Hybrid Clue Score, Turn Decay
  GRPO      arXiv 2402.03300  (DeepSeekMath) group-normalised advantages

Departures from the releases (each noted again where it happens)
  1. Rewards score the trajectory text as the model saw it (forced `<think>\n` prefix, tool
     responses); ParaVT scored generated tokens only. Pass that text instead for the released run.
  2. Format checks and answer extraction read the policy's view of the text: `<tool_response>` blocks
     and every user/system/tool message (the forced-answer request, whatever it says) are environment
     text, never the policy's answer or format.
  3. `<grounding>` (Video-o3 syntax) counts as a tool-call block wherever `<tool_call>` does.

Shapes: group_advantages (B,) -> (B,) with B = n_groups * group_size, groups contiguous;
zero_variance_groups (B,) -> (n_groups,).
"""
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

LEVELS = ("coarse", "medium", "fine")
DATA_TYPES = ("single_clue", "multi_clue", "direct", "free_form", "grounding")
_BLOCKS = (("<tool_call>", "</tool_call>", "tool_call"), ("<grounding>", "</grounding>", "grounding"))
_TAG_RE = re.compile(r"<(/?)(think|tool_call|grounding|answer)>")        # structural tags
_MARKER_RE = re.compile(r"<\|im_start\|>[A-Za-z]{0,16}|<\|[A-Za-z_]{1,32}\|>")  # chat markers (+ role)
_ENV_MSG_RE = re.compile(r"<\|im_start\|>(?:user|system|tool)\b.*?(?:<\|im_end\|>|\Z)", re.S)  # env messages
ANCHOR_WEIGHT = 0.5   # lambda of ParaVT's exploration anchoring (docs/method.md §4.1)

# ----------------------------------------------------------------------------- parsing

@dataclass
class ToolCall:
    """One parsed call. A valid crop_video call has arguments {start_time, end_time, resolution}."""
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None          # what was wrong, sent back to the model as the observation
    syntax: str = "tool_call"         # "tool_call" (Hermes) | "grounding" (Video-o3)


def _number(x) -> float | None:
    """A finite float from a JSON number; None for bool, non-numbers, inf/nan and ints too big for a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        x = float(x)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _parse_call(body: str, syntax: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:                    # JSONDecodeError is a ValueError
        return ToolCall(None, {}, f"invalid JSON: {str(e)[:120]}", syntax)
    if not isinstance(obj, dict):
        return ToolCall(None, {}, "the call must be a JSON object", syntax)
    if syntax == "grounding":                                     # Video-o3: both fields required
        seg, level = obj.get("temporal_segment"), obj.get("sampling_strategy")
        if not (isinstance(seg, list) and len(seg) == 2):
            return ToolCall("crop_video", {}, "temporal_segment must be a pair [start, end]", syntax)
        if level is None:
            return ToolCall("crop_video", {}, "missing sampling_strategy", syntax)
        name, args = "crop_video", {"start_time": seg[0], "end_time": seg[1], "resolution": level}
    else:
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str):
            return ToolCall(None, {}, "missing or non-string 'name'", syntax)
        if not isinstance(args, dict):
            return ToolCall(name, {}, "'arguments' must be a JSON object", syntax)
        if name != "crop_video":
            return ToolCall(name, args, None, syntax)             # unknown tools: the executor decides
        args = {"resolution": "medium", **args}
    start, end = _number(args.get("start_time")), _number(args.get("end_time"))
    for key, val in (("start_time", start), ("end_time", end)):
        if val is None:
            what = "missing" if key not in args else "not a finite number"
            return ToolCall(name, args, f"{key} is {what}", syntax)
    if args["resolution"] not in LEVELS:
        return ToolCall(name, args, f"resolution must be one of {', '.join(LEVELS)}", syntax)
    return ToolCall(name, {"start_time": start, "end_time": end, "resolution": args["resolution"]}, None, syntax)


def iter_tool_calls(text: str) -> Iterator[ToolCall]:
    """Lazy parse_tool_calls (no limit): lets `any(...)` / `all(...)` stop at the first decisive call."""
    if not isinstance(text, str):
        return
    nxt = [text.find(opener) for opener, _, _ in _BLOCKS]       # cached next opener of each syntax
    pos = 0
    while True:
        for k, (opener, _, _) in enumerate(_BLOCKS):
            if 0 <= nxt[k] < pos:                                 # passed inside an earlier block
                nxt[k] = text.find(opener, pos)
        found = [(p, k) for k, p in enumerate(nxt) if p >= 0]
        if not found:
            return
        start, k = min(found)
        opener, closer, syntax = _BLOCKS[k]
        end = text.find(closer, start + len(opener))
        if end < 0:
            yield ToolCall(None, {}, f"unclosed <{syntax}> block", syntax)
            return
        yield _parse_call(text[start + len(opener):end], syntax)
        pos = end + len(closer)


def parse_tool_calls(text: str, max_calls: int | None = None) -> list[ToolCall]:
    """Every `<tool_call>` / `<grounding>` block in order (iter_tool_calls: JSON only, never raises, linear time);
    an unclosed block is an error call and ends the scan; calls past `max_calls` dropped (None: all)."""
    return list(itertools.islice(iter_tool_calls(text), max_calls))


def call_window(call: ToolCall) -> tuple[float, float] | None:
    """(start_time, end_time) of a valid crop_video call, else None."""
    if call.error is None and call.name == "crop_video":
        return call.arguments["start_time"], call.arguments["end_time"]
    return None


def _strip_block(text: str, name: str) -> str:
    """Remove every `<name>...</name>` block (an unclosed one runs to the end). Linear."""
    opener, closer, out, pos = f"<{name}>", f"</{name}>", [], 0
    while (i := text.find(opener, pos)) >= 0:
        out.append(text[pos:i])
        j = text.find(closer, i + len(opener))
        pos = len(text) if j < 0 else j + len(closer)
    out.append(text[pos:])
    return "".join(out)


def policy_view(text: str) -> str:
    """The text the policy wrote itself (departure 6): user, system and tool messages (tool responses, the
    forced-answer request) and `<tool_response>` blocks removed. Environment text is never read as the
    policy's answer or format, whatever it says (e.g. the forced-answer message names `<answer></answer>`)."""
    return _strip_block(_ENV_MSG_RE.sub("", text), "tool_response")


def extract_answer(text: str) -> str | None:
    """The answer, docs/method.md §4.1 order (ParaVT release): (1) the first `<answer>...</answer>` (innermost if
    nested); else (2) the text after the first `</think>` without tool blocks, later think blocks,
    chat markers and stray tags; else (3) the last non-empty line, outside tool blocks, that is not a tag
    line. None if none.
    Environment messages and tool responses are removed first (departure 6, `policy_view`): a
    sub-agent's summary or the forced-answer request is not the policy's answer."""
    if not isinstance(text, str):
        return None
    text = policy_view(text)
    a = text.find("<answer>")
    b = text.find("</answer>", a + 8) if a >= 0 else -1
    if b >= 0:
        body = text[a + 8:b]
        return body[body.rfind("<answer>") + 8:].strip() if "<answer>" in body else body.strip()
    t = text.find("</think>")
    if t >= 0:
        rest = text[t + 8:]
        for name in ("tool_call", "grounding", "think"):
            rest = _strip_block(rest, name)
        rest = _TAG_RE.sub("", _MARKER_RE.sub("", rest)).strip()
        if rest:
            return rest
    for name in ("tool_call", "grounding"):        # a call's JSON line is never the answer
        text = _strip_block(text, name)
    for line in reversed(_MARKER_RE.sub("", text).splitlines()):
        line = line.strip()
        if line and not (line.startswith("<") and line.endswith(">")):
            return line
    return None


_LETTER_ONLY = re.compile(r"\(?([A-Za-z])\)?[.):]?")                  # B (B) B. B) B: b
_LETTER_LEAD = re.compile(r"\(([A-Z])\)|([A-Z])[.):](?:\s|$)")        # (B) text, B. text
_LETTER_SAID = [re.compile(rf"\b(?i:{word})(?:\s+is)?\s{{0,8}}:?\s{{0,8}}\(?([A-Z])\)?(?![A-Za-z0-9])")
                for word in ("answer", "option|choice")]               # "answer ..." wins over "option ..."


def extract_letter(text: str | None, n_options: int = 10) -> str | None:
    """The option letter (A.. the n_options-th letter) named by an answer, else None.

    Accepts `B`, `(B)`, `B.`, `B)`, `B:`, a lone lowercase `b`, `(B) text`, `B. text`,
    `The answer is B`, `Option B`, `answer: (B)`. Free text is read case-sensitively so that
    "the answer is a cat" is not option A.
    """
    if not isinstance(text, str):
        return None
    s = text.strip()
    m = _LETTER_ONLY.fullmatch(s) or _LETTER_LEAD.match(s) or _LETTER_SAID[0].search(s) or _LETTER_SAID[1].search(s)
    if m is None:
        return None
    letter = next(g for g in m.groups() if g).upper()
    return letter if ord(letter) - ord("A") < n_options else None


_NUM = r"(\d+(?::\d+){0,2}(?:\.\d+)?)"                                  # 12, 12.5, 1:05, 1:02:03.5
_RANGE_RE = re.compile(                                                  # [s, e] | (s, e) | s - e | s to e
    rf"[\[(]\s*{_NUM}\s*,\s*{_NUM}\s*[\])]"
    rf"|(?<![\d.:]){_NUM}\s*(?:(?:s|secs?|seconds?)\s*)?(?:-|–|—|to)\s*{_NUM}")  # no two \s* side by side


def _seconds(token: str) -> float:
    value = 0.0
    for part in token.split(":"):                                  # m:ss and h:mm:ss
        value = value * 60.0 + float(part)                         # 400 digits -> inf, never raises
    return value


def extract_time_range(text: str | None) -> tuple[float, float] | None:
    """The first time window (start, end) in seconds, as ParaVT parses Charades-STA answers.

    Accepts `[s, e]`, `(s, e)`, `s - e`, `s to e`, `m:ss - m:ss`, "happens in the 12.5 - 20.0 seconds".
    A reversed pair is swapped; a pair with a non-finite number is skipped. None if there is none.
    Linear time: a number never starts inside another (lookbehind), and a rejected pair resumes
    the search at its second number.
    """
    if not isinstance(text, str):
        return None
    pos = 0
    while (m := _RANGE_RE.search(text, pos)) is not None:
        k = 1 if m.group(1) is not None else 3                     # which alternative matched
        s, e = _seconds(m.group(k)), _seconds(m.group(k + 1))
        if math.isfinite(s) and math.isfinite(e):
            return (min(s, e), max(s, e))
        pos = m.start(k + 1)
    return None

# ----------------------------------------------------------------------------- accuracy

def temporal_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """IoU of two windows [s, e]: |pred ∩ gt| / |pred ∪ gt| in [0, 1]; 0 if either is degenerate
    (end <= start or a non-finite end point)."""
    (ps, pe), (gs, ge) = pred, gt
    if not all(math.isfinite(x) for x in (ps, pe, gs, ge)) or pe <= ps or ge <= gs:
        return 0.0
    inter = max(0.0, min(pe, ge) - max(ps, gs))
    return inter / ((pe - ps) + (ge - gs) - inter)


def _tokens(s: str) -> list[str]:
    """SQuAD-style normalisation: lowercase, drop punctuation, drop a/an/the, split on whitespace."""
    return [w for w in re.sub(r"[^\w\s]", "", s.lower()).split() if w not in ("a", "an", "the")]


def token_f1(pred: str, gold: str) -> float:
    """F1 between the sets of normalised tokens; an exact normalised match scores 1."""
    p, g = _tokens(pred), _tokens(gold)
    if p == g:
        return 1.0
    common = len(set(p) & set(g))
    if common == 0:
        return 0.0
    precision, recall = common / len(set(p)), common / len(set(g))
    return 2 * precision * recall / (precision + recall)


def _tvg_target(target) -> tuple[float, float]:
    """(start, end) of a tvg target [start, end] in seconds; ValueError for anything else."""
    if not (isinstance(target, (list, tuple)) and len(target) == 2 and all(_number(x) is not None for x in target)):
        raise ValueError(f"tvg target must be [start, end] in seconds, got {target!r}")
    return float(target[0]), float(target[1])


def score_answer(answer: str | None, target, task: str) -> float:
    """R_acc of an extracted answer (ParaVT, docs/method.md §4.1), in [0, 1]. None scores 0.
    mcq: letter equality; oe: token F1; tvg: IoU of the first window in the answer with the target."""
    if task == "mcq":
        gold = extract_letter(str(target), 26)
        if gold is None:
            raise ValueError(f"mcq target must be an option letter, got {target!r}")
        return float(extract_letter(answer, 26) == gold)
    if task == "oe":
        return token_f1(answer, str(target)) if answer is not None else 0.0
    if task == "tvg":
        gt, pred = _tvg_target(target), extract_time_range(answer)
        return temporal_iou(pred, gt) if pred is not None else 0.0
    raise ValueError(f"unknown task {task!r}; expected 'mcq', 'oe' or 'tvg'")


def accuracy_reward(text: str, target, task: str) -> float:
    """R_acc in [0, 1] = score_answer(extract_answer(text), target, task)."""
    return score_answer(extract_answer(text), target, task)

# ----------------------------------------------------------------------------- format (ParaVT)

@dataclass
class _Format:
    """The predicates of ParaVT's format reward, read off the text outside <tool_response> blocks."""
    has_think: bool       # some <think> block (to its </think> or the end) holds >= 10 non-space chars
    think_closed: bool    # the first <think> is followed by a </think>
    never_closed: bool    # the last <think> has no </think> after it
    has_body: bool        # some <answer> anywhere is followed by non-space text before </answer> or the end
    answer_open: bool     # <answer> in the answer suffix: the text after the last </think> (all if none)
    answer_close: bool    # ... followed by </answer>
    has_tool: bool        # some call block parses to a JSON object with a name
    think_first: bool     # the first <think> comes before the first call block
    balanced: bool        # as many openers as closers of think, tool_call, grounding, answer


def _format_parts(text: str) -> _Format:
    t = policy_view(text)                                         # departure 6
    has_think, pos = False, 0
    while not has_think and (o := t.find("<think>", pos)) >= 0:   # any think with >= 10 non-space chars
        c = t.find("</think>", o + 7)
        has_think = len("".join(t[o + 7:c if c >= 0 else len(t)].split())) >= 10
        pos = len(t) if c < 0 else c + 8
    first, last_open, last_close = t.find("<think>"), t.rfind("<think>"), t.rfind("</think>")
    never_closed = last_open > last_close                          # the last <think> has no </think>
    suffix = t[last_close + 8:] if last_close >= 0 else t
    a = suffix.find("<answer>")
    b = suffix.find("</answer>", a + 8) if a >= 0 else -1
    has_body, pos = False, 0             # release: a body anywhere in the completion, to its </answer> or the end
    while not has_body and (o := t.find("<answer>", pos)) >= 0:
        c = t.find("</answer>", o + 8)
        pos = len(t) if c < 0 else c                                # linear: each stretch read once
        has_body = bool(t[o + 8:pos].strip())
    tool_at = [p for p in (t.find("<tool_call>"), t.find("<grounding>")) if p >= 0]
    return _Format(
        has_think=has_think, think_closed=first >= 0 and t.find("</think>", first) >= 0,
        never_closed=never_closed, has_body=has_body, answer_open=a >= 0, answer_close=b >= 0,
        has_tool=any(c.name is not None for c in iter_tool_calls(t)),
        think_first=first >= 0 and (not tool_at or first < min(tool_at)),
        balanced=all(t.count(f"<{n}>") == t.count(f"</{n}>") for n in ("think", "tool_call", "grounding", "answer")))


def _anchor(f: _Format) -> float:
    return 0.4 * (f.think_closed and f.has_think) + 0.3 * (f.think_closed and f.has_body and f.answer_close) \
        - 0.3 * f.never_closed


def format_anchor(text: str) -> float:
    """Exploration Anchoring term alone (ParaVT), in [-0.3, 0.7]:
    anchor = 0.4 [</think> closed and has_think] + 0.3 [think closed, answer body, </answer>]
             - 0.3 [a <think> opened and never closed]
    Training's token-level anchoring adds it to the closing-tag tokens' advantage."""
    return _anchor(_format_parts(text))


def format_reward(text: str, anchor_weight: float) -> float:
    """ParaVT R_fmt, answer-suffix recipe with Exploration Anchoring (docs/method.md §4.1), in [-0.3 anchor_weight, 1]
    (anchor_weight: ANCHOR_WEIGHT under sequence anchoring, 0 without the anchor):
      0.2 [has_think] + [has_answer_body] (0.3 [<answer>] + 0.2 [</answer>]) + anchor_weight * anchor
      + 0.3 [has_think and has_tool and the first <think> precedes the first tool call]
      + 0.1 [score so far > 0 and think, tool_call, grounding, answer tags balanced]
    capped at 1.0 above, no lower clamp; the predicates are defined on _Format. Scores exactly the
    text given (departure 1): text without the forced `<think>\n` fails has_think and the anchor
    even on a perfect trajectory (the released quirk).
    """
    return _format_score(_format_parts(text), anchor_weight)


def _format_score(f: _Format, anchor_weight: float) -> float:
    score = 0.2 * f.has_think + f.has_body * (0.3 * f.answer_open + 0.2 * f.answer_close) + anchor_weight * _anchor(f)
    score += 0.3 * (f.has_think and f.has_tool and f.think_first)
    score += 0.1 * (score > 0 and f.balanced)
    return min(score, 1.0)


def _block_shape(text: str, strict: bool) -> list[str] | None:
    """Names of the flat, closed tag blocks of `text` in order; None if a tag is nested or unclosed,
    or (strict) if anything but whitespace and chat markers lies between blocks."""
    text = _MARKER_RE.sub("", text)
    names, pos, open_name = [], 0, None
    for m in _TAG_RE.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if open_name is None:
            if closing or (strict and text[pos:m.start()].strip()):
                return None
            open_name = name
        elif not closing or name != open_name:
            return None
        else:
            names.append(name)
            open_name = None
        pos = m.end()
    return None if open_name is not None or (strict and text[pos:].strip()) else names


def format_compliant(text: str) -> bool:
    """The "format compliance" metric: tags flat and closed, >= 1 think block, every tool call parses,
    exactly one answer block. Tool responses are ignored; pass text with the forced prefix."""
    t = policy_view(text)
    names = _block_shape(t, strict=False)
    return (names is not None and "think" in names and names.count("answer") == 1
            and all(c.error is None for c in iter_tool_calls(t)))


def tool_reward(text: str, acc: float) -> float:
    """ParaVT R_tool in [0, 1]: 0 without a call that parses to an object with a name; else 0.1,
    0.3 if a <tool_response> is present, +0.5 if R_acc > 0; capped at 1."""
    has_tool = any(c.name is not None for c in iter_tool_calls(policy_view(text)))
    return _tool_score(has_tool, "<tool_response>" in text, acc)


def _tool_score(has_tool: bool, has_response: bool, acc: float) -> float:
    return min(1.0, (0.3 if has_response else 0.1) + 0.5 * (acc > 0)) if has_tool else 0.0


def paravt_reward(text: str, target, task: str, anchor_weight: float,
                  w_fmt: float = 1.0) -> tuple[float, dict[str, float]]:
    """ParaVT R = R_acc + w_fmt R_fmt + R_tool (docs/method.md §4.1), in [-0.3 anchor_weight w_fmt, 1.8 + w_fmt].
    Degenerate output (>= 5 `<|im_start|>` in fewer than 300 characters) scores 0 overall.
    For token-level anchoring pass anchor_weight=0 and use components["anchor"] on the closing tags."""
    if text.count("<|im_start|>") >= 5 and len(text) < 300:
        return 0.0, {"acc": 0.0, "format": 0.0, "anchor": 0.0, "tool": 0.0, "degenerate": 1.0}
    acc, f = accuracy_reward(text, target, task), _format_parts(text)   # parse the format once
    fmt, tool = _format_score(f, anchor_weight), _tool_score(f.has_tool, "<tool_response>" in text, acc)
    parts = {"acc": acc, "format": fmt, "anchor": _anchor(f), "tool": tool, "degenerate": 0.0}
    return acc + w_fmt * fmt + tool, parts

# ----------------------------------------------------------------------------- VTGR (Video-o3)

def merge_windows(windows) -> list[tuple[float, float]]:
    """Union of windows as sorted disjoint intervals; degenerate ones (end <= start, non-finite) dropped.
    Sort by start, merge when start <= last end (touching windows merge)."""
    good = sorted((float(s), float(e)) for s, e in windows if math.isfinite(s) and math.isfinite(e) and e > s)
    merged: list[tuple[float, float]] = []
    for s, e in good:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def clue_terms(pred_windows, gt_windows) -> dict[str, float] | None:
    """Overlap terms of the Hybrid Clue Score (Video-o3, docs/method.md §4.3); None when P or G is empty.
    P, G = merged crop and clue windows; I = |P ∩ G|; IoU = I / (|P| + |G| - I); IoP = I / |P|;
    IoG = I / |G|; DIoU = IoU - d^2 / C^2, d = distance between the centres of the hulls of P and G,
    C = length of the hull of both (DIoU = IoU when C = 0). DIoU lies in (-1, 1]."""
    P, G = merge_windows(pred_windows or []), merge_windows(gt_windows or [])
    if not P or not G:
        return None
    inter, i, j = 0.0, 0, 0
    while i < len(P) and j < len(G):                               # two pointers over sorted intervals
        inter += max(0.0, min(P[i][1], G[j][1]) - max(P[i][0], G[j][0]))
        i, j = (i + 1, j) if P[i][1] < G[j][1] else (i, j + 1)
    len_p, len_g = sum(e - s for s, e in P), sum(e - s for s, e in G)
    iou = inter / (len_p + len_g - inter)
    d = abs((P[0][0] + P[-1][1]) / 2 - (G[0][0] + G[-1][1]) / 2)    # merged lists are sorted, disjoint
    c = max(P[-1][1], G[-1][1]) - min(P[0][0], G[0][0])
    return {"iou": iou, "iop": inter / len_p, "iog": inter / len_g, "diou": iou - d * d / (c * c) if c > 0 else iou}


def hybrid_clue_score(pred_windows, gt_windows, multi_clue: bool = False) -> float:
    """Video-o3 Hybrid Clue Score in [0, 1] (docs/method.md §4.3), terms from clue_terms; 0 if P or G is empty.
      single clue: H  = (IoU + IoP + IoG + (DIoU + 1) / 2) / 4
      multi clue:  H' = (2 IoU + IoP + IoG) / 4"""
    t = clue_terms(pred_windows, gt_windows)
    if t is None:
        return 0.0
    if multi_clue:
        return (2 * t["iou"] + t["iop"] + t["iog"]) / 4
    return (t["iou"] + t["iop"] + t["iog"] + (t["diou"] + 1) / 2) / 4


def turn_decay(n_tool_turns: int, delta: float = 0.05) -> float:
    """Video-o3 Turn Decay 1 - delta (n - 1), clamped to [0, 1].
    The upper clamp defines n = 0 as 1.0 (a decay never amplifies; the formula would give 1.05);
    the single-clue term is 0 for n = 0 anyway (vtgr_tool_term). The lower clamp only acts for
    n > 1 + 1/delta (21 turns), beyond any turn budget of the papers."""
    return min(1.0, max(0.0, 1.0 - delta * (n_tool_turns - 1)))


def infer_data_type(task: str, clues, data_type: str | None = None) -> str:
    """data_type of a record (docs/method.md §9): given as is, else tvg -> grounding, one clue -> single_clue,
    several -> multi_clue, none -> free_form."""
    if data_type is not None:
        if data_type not in DATA_TYPES:
            raise ValueError(f"data_type must be one of {DATA_TYPES}, got {data_type!r}")
        return data_type
    if task == "tvg":
        return "grounding"
    return {0: "free_form", 1: "single_clue"}.get(len(clues or []), "multi_clue")


def vtgr_tool_term(data_type: str, clue: float, decay: float, n_tool_turns: int, correct: bool,
                   format_ok: bool) -> float:
    """Video-o3 R_tool (docs/method.md §4.3), in [0, 1]; 0 unless the answer is right and R_fmt = 1.
      single_clue: decay (H + 1) / 2 if n > 0 else 0     multi_clue: (H' + 1) / 2 (no decay)
      direct: max(0, 0.75 (1 - 0.1 n))   free_form: 0.5   grounding: 0 (no tool term)
    clue = H or H' (`hybrid_clue_score` of *all* crop windows, multi_clue=True for H'), decay = turn_decay(n); n
    counts tool *turns* (with parallel calls the windows and the turns differ). The caller computes both factors
    (vtgr_reward, combined_score), so each equation is one call from the reward. The max(0, .) on `direct` only
    acts beyond 10 turns. As docs/method.md §4.3 states, only single_clue asks n > 0: a right multi_clue answer
    with no crop still gets (0 + 1) / 2."""
    if data_type not in DATA_TYPES:
        raise ValueError(f"data_type must be one of {DATA_TYPES}, got {data_type!r}")
    if not (correct and format_ok) or data_type == "grounding":
        return 0.0
    if data_type == "single_clue":
        return decay * (clue + 1) / 2 if n_tool_turns > 0 else 0.0
    if data_type == "multi_clue":
        return (clue + 1) / 2
    if data_type == "direct":
        return max(0.0, 0.75 * (1 - 0.1 * n_tool_turns))
    return 0.5


def grounding_format_reward(turns: list[str]) -> float:
    """Video-o3 strict per-turn R_fmt in [0, 1] (docs/method.md §4.3). Each non-final turn must be exactly
    `<think>...</think>` then one or more call blocks (`<tool_call>` or `<grounding>`; more than one
    = our parallel calls), the final turn `<think>...</think><answer>...</answer>`; only whitespace and
    chat markers between blocks. Any mismatch -> 0, else max(0, 1 - e / K) with K = len(turns),
    e = calls with a parse error or another tool name. `resolution` is optional in `<tool_call>`
    syntax (Hermes schema default), so a missing level is an error only in `<grounding>` syntax."""
    errors = 0
    for i, turn in enumerate(turns):
        names, final = _block_shape(turn, strict=True), i == len(turns) - 1
        ok = names == ["think", "answer"] if final else (names is not None and len(names) >= 2 and
             names[0] == "think" and all(n in ("tool_call", "grounding") for n in names[1:]))
        if not ok:
            return 0.0
        if not final:
            errors += sum(c.error is not None or c.name != "crop_video" for c in parse_tool_calls(turn))
    return max(0.0, 1.0 - errors / len(turns)) if turns else 0.0


def _last_answer(text: str) -> str | None:
    b = text.rfind("</answer>")
    a = text.rfind("<answer>", 0, max(b, 0))
    return text[a + 8:b].strip() if a >= 0 and b >= 0 else None


def vtgr_reward(turns: list[str], text: str, target, task: str, data_type: str | None,
                windows, clues, n_tool_turns: int) -> tuple[float, dict[str, float]]:
    """Video-o3 VTGR R = R_acc + R_fmt + R_tool (docs/method.md §4.3), in [0, 3]; grounding: IoU + R_fmt.
    R_acc scores the last `<answer>` of the final turn (of `text` when `turns` is empty).
    R_tool needs a right answer (R_acc = 1: letter match, exact oe match) and R_fmt = 1."""
    data_type = infer_data_type(task, clues, data_type)
    acc = score_answer(_last_answer(turns[-1] if turns else text), target, task)
    fmt = grounding_format_reward(turns)
    clue = 0.0 if data_type not in ("single_clue", "multi_clue") else \
        hybrid_clue_score(windows, clues, multi_clue=data_type == "multi_clue")         # H (or H')
    tool = vtgr_tool_term(data_type, clue, turn_decay(n_tool_turns), n_tool_turns, acc == 1.0, fmt == 1.0)
    return acc + fmt + tool, {"acc": acc, "format": fmt, "tool": tool, "clue": clue}

# ----------------------------------------------------------------------------- a trajectory's reward, per recipe
# One signature, score(traj, record, anchoring, released_scoring) -> (total, components), held by recipes.Recipe
# (vanilla: para_grpo_score, its anchoring "none"). `traj` needs text, policy_text, turns, windows, n_tool_turns (a
# rollout.Trajectory); `record` answer, task, clues, data_type. anchoring "sequence": ANCHOR_WEIGHT * anchor inside
# R_fmt (the release); "token": the anchor leaves the sequence reward and the trainer adds it to the closing-tag
# tokens' advantage (components["anchor"]); "none": no anchor. released_scoring: score the sampled tokens only, as
# the ParaVT release did (departure 1). components["clue"]: the crops' hybrid clue score against the record's clue
# windows (0 without clues), logged under every recipe.

def _scored(traj, record: dict, released_scoring: bool) -> tuple[str, list, str]:
    """(the text scored, the record's clue windows, its data_type)."""
    clues = record.get("clues") or []
    text = traj.policy_text if released_scoring else traj.text
    return text, clues, infer_data_type(record["task"], clues, record.get("data_type"))


def _logged(total: float, parts: dict, traj, clues: list, data_type: str) -> tuple[float, dict[str, float]]:
    parts["clue"] = hybrid_clue_score(traj.windows, clues, multi_clue=data_type == "multi_clue") if clues else 0.0
    return float(total), {k: float(v) for k, v in parts.items()}


def para_grpo_score(traj, record: dict, anchoring: str, released_scoring: bool) -> tuple[float, dict[str, float]]:
    """ParaVT's PARA-GRPO reward (arXiv 2605.20342; docs/method.md §4.1): R = R_acc + R_fmt + R_tool (paravt_reward),
    R_fmt weighting the exploration anchor by ANCHOR_WEIGHT under sequence anchoring, else by 0. The trainer adds
    nFrames gating and the k1 KL. The vanilla ablation is this reward with anchoring "none" (and no gating)."""
    text, clues, data_type = _scored(traj, record, released_scoring)
    anchor_weight = ANCHOR_WEIGHT if anchoring == "sequence" else 0.0
    total, parts = paravt_reward(text, record["answer"], record["task"], anchor_weight)
    return _logged(total, parts, traj, clues, data_type)


def vtgr_score(traj, record: dict, anchoring: str, released_scoring: bool) -> tuple[float, dict[str, float]]:
    """Video-o3's VTGR (arXiv 2601.23224; docs/method.md §4.3): R = R_acc + strict R_fmt + R_tool, the tool term the
    hybrid clue score x turn decay (vtgr_reward). The strict format reward is all or nothing, with no anchor term
    to weight: anchoring "sequence" is refused; components["anchor"] feeds token-level anchoring."""
    if anchoring == "sequence":
        raise ValueError("recipe vtgr has no sequence-level anchor (its strict format reward is all or nothing); "
                         "use anchoring 'token' or 'none'")
    text, clues, data_type = _scored(traj, record, released_scoring)
    total, parts = vtgr_reward(traj.turns, text, record["answer"], record["task"], data_type, traj.windows, clues,
                               traj.n_tool_turns)
    parts["anchor"] = format_anchor(text)
    return _logged(total, parts, traj, clues, data_type)


def combined_score(traj, record: dict, anchoring: str, released_scoring: bool) -> tuple[float, dict[str, float]]:
    """PARA-GRPO with VTGR's tool term (docs/method.md §4): para_grpo_score, with Video-o3's R_tool (vtgr_tool_term:
    clue score x turn decay, given a right answer and the strict format) in place of ParaVT's wherever the record
    has clue windows: R = R_acc + R_fmt (anchored) + R_tool^VTGR; ParaVT's R_tool elsewhere."""
    total, parts = para_grpo_score(traj, record, anchoring, released_scoring)
    _, clues, data_type = _scored(traj, record, released_scoring)
    if clues:
        fmt_ok = grounding_format_reward(traj.turns) == 1.0
        tool = vtgr_tool_term(data_type, parts["clue"], turn_decay(traj.n_tool_turns), traj.n_tool_turns,
                              parts["acc"] == 1.0, fmt_ok)
        total, parts["tool"] = total + tool - parts["tool"], tool
    return total, parts

# ----------------------------------------------------------------------------- agent figures
# The figures of an agent's trajectories, computed here once for train.py's step rows (rollout_metrics),
# eval.py's table (agent_figures), benchmarks.score's agent line (agent_stats) and report.py's summary. The
# callers choose the trajectories (e.g. the non-error ones) and what a turn is (tool turns or all turns);
# each figure is None where it is undefined (no trajectory, no turn, no call).

def mean_or_none(values) -> float | None:
    """The mean of the values (as floats); None for no value."""
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def format_compliance(texts) -> float | None:
    """Fraction of trajectory texts that pass format_compliant."""
    return mean_or_none(format_compliant(t) for t in texts)


def tool_call_ratio(calls) -> float | None:
    """Fraction of trajectories with at least one tool call, from each one's call count (or called flag)."""
    return mean_or_none(c > 0 for c in calls)


def mean_turns(turns) -> float | None:
    """Mean turns per trajectory, from each one's turn count."""
    return mean_or_none(turns)


def calls_per_turn(calls: int, turns: int) -> float | None:
    """Parallel calls: all trajectories' tool calls / their turns; None with no turn."""
    return calls / turns if turns else None


def tool_failure_rate(failures: int, calls: int) -> float | None:
    """Failed tool calls (error observations) / tool calls; None with no call."""
    return failures / calls if calls else None

# ----------------------------------------------------------------------------- gating, advantages

def gate_nframes(prompt_key: str, step: int, choices: Sequence[int], seed: int = 0) -> int:
    """ParaVT nFrames Gating: K ~ Uniform(choices) per (prompt, step), the same K for every sample of
    the prompt's group. K = choices[sha256(f"{seed}:{step}:{prompt_key}") mod len(choices)]; stable
    across processes (Python's hash() is salted). `choices`: the recipe's gating_choices (recipes.py)."""
    if len(choices) == 0:
        raise ValueError(f"gate_nframes needs at least one frame count, got {choices!r} at step {step}")
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_key}".encode()).digest()
    return int(choices[int.from_bytes(digest[:8], "big") % len(choices)])


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    assert rewards.dim() == 1 and group_size >= 1 and rewards.numel() % group_size == 0, \
        f"rewards {tuple(rewards.shape)} must be (n_groups * group_size,) with group_size={group_size}"
    return rewards.view(-1, group_size)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(n_groups,) bool: groups whose rewards are all equal (no learning signal; Video-o3 drops them)."""
    r = _groups(rewards, group_size)
    return (r == r[:, :1]).all(dim=1)


def shape_reward(rewards: torch.Tensor) -> torch.Tensor:
    """ParaVT's reward shaping, elementwise: R <- clip(10 (R - 0.2), -20, 20) (docs/method.md §5). Applied to the
    task reward only; a KL folded into the reward is subtracted after it (grpo.collect_groups)."""
    r = rewards.float() if not rewards.is_floating_point() else rewards
    return (10 * (r - 0.2)).clamp(-20.0, 20.0)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage (DeepSeekMath, arXiv 2402.03300): A_i = (R_i - mean_g) / (std_g + eps).

    rewards: (B,), groups contiguous. Returns (B,) float, same order. std is the unbiased (sample) std,
    so group_size >= 2. A group of identical rewards gets exactly 0 (never NaN). ParaVT's shaping
    (`shape_reward`) comes before, in the caller (grpo.collect_groups: shape, subtract the KL, then this).
    """
    assert group_size >= 2, f"group_size must be >= 2 for an unbiased std, got {group_size}"
    r = _groups(rewards.float() if not rewards.is_floating_point() else rewards, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return torch.where((r == r[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(adv), adv).view(-1)
