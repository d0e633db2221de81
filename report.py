"""
Trajectory report: one self-contained HTML page that shows what the agent did on each question, so a
person can see where it looked and why it answered what it did (docs/report.md has a screenshot).

    write_report(out_dir, records, rows, metrics=None, video_root=None, title=None, max_questions=None)
        -> out_dir/index.html

Inputs are what evaluation already has; the model is never re-run:
  records  prompt records (data.py schema: id, video relative to video_root, question, options, answer,
           task mcq|oe|tvg, clues [[s, e], ...], data_type, duration); answer None: a question asked with
           no gold answer (eval.py --video), shown as asked, never scored
  rows     prediction rows as eval.py writes them: id, response, answer, turns, calls, windows [[s, e], ...],
           tool_failures, latency, error; and, each optional (the page falls back without them):
           text (the trajectory after the prompt as the model saw it), segments [[role, text], ...] with
           role "policy" | "env", tool_turns, nframes (the overview's K), format_compliant, calls_by_turn
           (the crop windows of each assistant turn), rewards {acc, format, anchor, tool, clue, turn_decay},
           score (eval.judge's score), truncated, hit_turn_limit
  metrics  eval.score()'s dict (its scalar entries are printed as the benchmark's scores)

The page has a summary (scores, format compliance, tool-call ratio, mean turns / calls, filter links to
wrong answers, tool failures and truncated rows: CSS :target rules, no JavaScript) and, per question:
the overview as a strip of JPEG thumbnails with their times, an SVG timeline of the whole video with the
ground-truth clue windows and every crop window coloured by turn (the parallel calls of one turn stacked
in lanes), a few frames of each crop, the turns with environment text (forced prefixes, tool responses,
sub-agent summaries) set apart from the policy's own text, the reward components and K.

Frames come from video.py (sample_overview / crop) as uint8 (T, 3, H, W) tensors, are shrunk to
thumbnails and embedded as base64 JPEG (torchvision.io.encode_jpeg): nothing is loaded from elsewhere.
A missing or undecodable video leaves a note in that question's section.

Reward components missing from a row are recomputed from the trajectory text with rewards.py and marked
"recomputed": acc = accuracy_reward(response), the ParaVT format reward, Exploration
Anchoring term and R_tool (docs/method.md §4.1), the Video-o3 hybrid clue score and turn decay
(docs/method.md §4.3). A run that used other weights logs its own `rewards`, and those are shown as given.
"""
import base64
import html
import math
import os
import re

import torch
from torchvision.io import encode_jpeg

import rewards
import video
from data import resolve_video

TURN_COLOURS = ("#1f77b4", "#ff7f0e", "#9467bd", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
UNKNOWN_TURN_COLOUR = "#7f7f7f"     # windows whose turn the row does not record
THUMB_PIXELS = 112 * 64             # per thumbnail (a 16:9 frame becomes about 112x63, aspect kept)
MAX_OVERVIEW_THUMBS = 32            # a K = 64 overview shows every other frame
DEFAULT_K = 16                      # overview frames shown when the row does not record K
CROP_THUMBS = 4                     # frames shown per crop window
THUMB_FPS = 2.0                     # ... sampled at this rate, then CROP_THUMBS at most (a short window shows fewer)
REWARD_KEYS = ("acc", "format", "anchor", "tool", "clue", "turn_decay")
REWARD_NAMES = {"acc": "R_acc", "format": "R_fmt", "anchor": "anchor", "tool": "R_tool", "clue": "clue score",
                "turn_decay": "turn decay"}


# ----------------------------------------------------------------------------- reading rows

def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _pairs(x) -> list[tuple[float, float]]:
    """[[s, e], ...] -> [(s, e), ...], skipping anything that is not a pair of finite numbers."""
    out = []
    for w in x if isinstance(x, (list, tuple)) else []:
        if isinstance(w, (list, tuple)) and len(w) == 2 and _num(w[0]) is not None and _num(w[1]) is not None:
            out.append((float(w[0]), float(w[1])))
    return out


def window_turns(row: dict) -> list[int | None]:
    """Turn number (1-based) of each of row["windows"], read off row["calls_by_turn"]; None where unknown.

    Each window is matched, in order, to the next equal window of calls_by_turn (which may also hold
    calls that failed). If some window finds no match but both lists are as long, they are paired by
    position instead (calls_by_turn may hold the windows as called, before clamping to the video)."""
    windows, by_turn = _pairs(row.get("windows")), row.get("calls_by_turn")
    if not isinstance(by_turn, list):
        return [None] * len(windows)
    flat = [(t + 1, w) for t, calls in enumerate(by_turn) for w in _pairs(calls)]
    out, j = [], 0
    for w in windows:
        k = next((k for k in range(j, len(flat)) if all(abs(a - b) < 1e-6 for a, b in zip(flat[k][1], w))), None)
        out.append(None if k is None else flat[k][0])
        j = j if k is None else k + 1
    if None in out and len(flat) == len(windows):
        return [t for t, _ in flat]
    return out


def tool_turn_count(row: dict) -> int:
    """Tool turns of a row: row["tool_turns"], else the turns of calls_by_turn with a call, else 1 if it
    called at all (the best a row without turn records allows)."""
    if _num(row.get("tool_turns")) is not None:
        return int(row["tool_turns"])
    if isinstance(row.get("calls_by_turn"), list):
        return sum(bool(_pairs(c)) for c in row["calls_by_turn"])
    return int(bool(row.get("calls") or row.get("windows")))


def _trajectory_text(row: dict) -> str:
    """The text the rewards score: row["text"], else the segments joined, else the final response."""
    if isinstance(row.get("text"), str) and row["text"]:
        return row["text"]
    segs = _segments(row)[0]
    return "".join(t for _, t in segs) if segs else str(row.get("response") or "")


def data_type(record: dict) -> str | None:
    """The record's data_type, inferred from its task and clues when absent (rewards.infer_data_type);
    None for a value rewards.py does not know."""
    try:
        return rewards.infer_data_type(record.get("task"), _pairs(record.get("clues")), record.get("data_type"))
    except ValueError:
        return None


def reward_components(record: dict, row: dict) -> dict[str, tuple[float | None, str]]:
    """{component: (value, "logged" | "recomputed" | why it is missing)} for REWARD_KEYS (+ any extra logged key)."""
    logged = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
    out = {k: (_num(v), "logged") for k, v in logged.items() if _num(v) is not None}
    if row.get("error"):
        return {k: out.get(k, (None, "error row")) for k in (*REWARD_KEYS, *out)}
    text, response = _trajectory_text(row), str(row.get("response") or "")
    acc = out.get("acc", (None, ""))[0]
    if acc is None and record.get("answer") is None:    # a question asked (eval.py --video): nothing to score
        out["acc"] = (None, "no gold answer")
    elif acc is None:
        try:
            acc = rewards.accuracy_reward(response, record["answer"], record["task"])
            out["acc"] = (acc, "recomputed")
        except ValueError as e:                       # a target score_answer cannot read: say so on the page
            out["acc"] = (None, f"cannot score: {e}")
    out.setdefault("format", (rewards.format_reward(text, rewards.ANCHOR_WEIGHT), "recomputed"))
    out.setdefault("anchor", (rewards.format_anchor(text), "recomputed"))
    if acc is not None:
        out.setdefault("tool", (rewards.tool_reward(text, acc), "recomputed"))
    clues, dtype = _pairs(record.get("clues")), data_type(record)
    if clues:
        out.setdefault("clue", (rewards.hybrid_clue_score(_pairs(row.get("windows")), clues,
                                                          multi_clue=dtype == "multi_clue"), "recomputed"))
    else:
        out.setdefault("clue", (None, "no clue windows"))
    out.setdefault("turn_decay", (rewards.turn_decay(tool_turn_count(row)), "recomputed"))
    return {k: out.get(k, (None, "not computable")) for k in (*REWARD_KEYS, *out)}


def row_flags(record: dict, row: dict) -> dict[str, bool]:
    """wrong / fail (tool failures) / trunc (truncated, hit the turn limit, or no closed <answer>) / error.

    Correct: row["score"] (eval.judge) if given, else the recomputed R_acc; mcq and oe need 1.0, tvg IoU >= 0.5."""
    score = _num(row.get("score"))
    if score is None:
        score = reward_components(record, row)["acc"][0] or 0.0
    need = 0.5 if record.get("task") == "tvg" else 1.0
    error = bool(row.get("error"))
    if "truncated" in row or "hit_turn_limit" in row:
        trunc = bool(row.get("truncated") or row.get("hit_turn_limit"))
    else:
        trunc = not error and "</answer>" not in str(row.get("response") or "")
    return {"wrong": error or (record.get("answer") is not None and score < need), "fail": bool(row.get("tool_failures")), "trunc": trunc, "error": error}


def _segments(row: dict) -> tuple[list[tuple[str, str]], str]:
    """([(role, text)], how the roles were found): row["segments"], else split off row["text"], else the response."""
    segs = row.get("segments")
    if isinstance(segs, list) and segs:
        out = [(str(s[0]), str(s[1])) for s in segs if isinstance(s, (list, tuple)) and len(s) == 2]
        return [(r if r in ("policy", "env") else "env", t) for r, t in out], "logged"
    if isinstance(row.get("text"), str) and row["text"]:
        return split_roles(row["text"]), "inferred from the text"
    resp = str(row.get("response") or "")
    return ([("policy", resp)] if resp else []), "final response only"


# The environment's text in a trajectory: the forced "<think>\n" that opens each assistant turn, and each
# user message of tool responses up to the next assistant's forced prefix (rollout.response_chunk_text);
# the <|im_end|> before it is the policy's (its sampled stop token).
_ENV_RE = re.compile(r"(\n?<\|im_start\|>user.*?<\|im_start\|>assistant\n(?:<think>\n)?|\A<think>\n)", re.S)


def split_roles(text: str) -> list[tuple[str, str]]:
    """Policy / env segments of a trajectory text without recorded roles (a fallback; roles come from the
    chat markers the rollout writes, so text that imitates them is misread)."""
    out, pos = [], 0
    for m in _ENV_RE.finditer(text):
        if m.start() > pos:
            out.append(("policy", text[pos:m.start()]))
        out.append(("env", m.group(0)))
        pos = m.end()
    if pos < len(text):
        out.append(("policy", text[pos:]))
    return out


# ----------------------------------------------------------------------------- frames

def _jpeg_uri(frame: torch.Tensor) -> str:
    """data: URI of a (3, H, W) uint8 frame as JPEG."""
    return "data:image/jpeg;base64," + base64.b64encode(encode_jpeg(frame.contiguous(), quality=85).numpy().tobytes()).decode()


def _even_pick(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (all of them if n <= k)."""
    return list(range(n)) if n <= k else [round(i * (n - 1) / (k - 1)) for i in range(k)]


def _frames_html(clip: video.Clip, indices: list[int], cls: str) -> str:
    cells = [f'<figure class="{cls}"><img alt="frame at {clip.times[i]:.1f} s" src="{_jpeg_uri(clip.frames[i])}">'
             f"<figcaption>{clip.times[i]:.1f} s</figcaption></figure>" for i in indices]
    return "".join(cells)


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


# ----------------------------------------------------------------------------- timeline

def _ticks(duration: float) -> list[float]:
    step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600) if duration / s <= 10), 7200)
    return [i * step for i in range(int(duration // step) + 1)]


def timeline_svg(duration: float, clues: list, windows: list, turns: list[int | None], width: int = 640) -> str:
    """SVG of [0, duration]: a lane of clue windows (also shaded behind every lane), then one lane per crop,
    lanes grouped by turn (a turn's parallel calls stacked). Rects carry data-start / data-end / data-turn."""
    left, lane, gap, top0 = 52, 14, 3, 4
    x = lambda t: left + (width - left - 10) * min(max(t, 0.0), duration) / duration
    order = sorted(range(len(windows)), key=lambda i: (turns[i] is None, turns[i] or 0, i))
    height = top0 + (lane + gap) * (1 + len(windows)) + 18
    out = [f'<svg class="timeline" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">']
    top = top0 + lane + gap
    for s, e in clues:   # clue bands behind the crop lanes: over- and under-cropping visible at a glance
        out.append(f'<rect class="clueband" x="{x(s):.1f}" y="{top}" width="{max(x(e) - x(s), 1):.1f}" '
                   f'height="{(lane + gap) * len(windows)}"/>')
    out.append(f'<text class="lbl" x="4" y="{top0 + lane - 3}">clues</text>')
    for s, e in clues:
        out.append(f'<rect class="clue" data-start="{s!r}" data-end="{e!r}" x="{x(s):.1f}" y="{top0}" '
                   f'width="{max(x(e) - x(s), 1):.1f}" height="{lane}"><title>clue [{s:g}, {e:g}] s</title></rect>')
    prev = object()
    for lane_i, i in enumerate(order):
        (s, e), t = windows[i], turns[i]
        y = top + (lane + gap) * lane_i
        colour = UNKNOWN_TURN_COLOUR if t is None else TURN_COLOURS[(t - 1) % len(TURN_COLOURS)]
        if t != prev:
            out.append(f'<text class="lbl" x="4" y="{y + lane - 3}">{"turn ?" if t is None else f"turn {t}"}</text>')
            prev = t
        out.append(f'<rect class="crop" data-start="{s!r}" data-end="{e!r}" data-turn="{"" if t is None else t}" '
                   f'data-index="{i}" x="{x(s):.1f}" y="{y}" width="{max(x(e) - x(s), 2):.1f}" height="{lane}" '
                   f'fill="{colour}"><title>crop {i + 1}, {"turn unknown" if t is None else f"turn {t}"}: '
                   f'[{s:g}, {e:g}] s</title></rect>')
    axis = height - 16
    out.append(f'<line class="axis" x1="{left}" y1="{axis}" x2="{x(duration):.1f}" y2="{axis}"/>')
    for t in _ticks(duration):
        out.append(f'<line class="axis" x1="{x(t):.1f}" y1="{axis}" x2="{x(t):.1f}" y2="{axis + 4}"/>'
                   f'<text class="tick" x="{x(t):.1f}" y="{axis + 14}">{t:g}s</text>')
    return "".join(out) + "</svg>"


# ----------------------------------------------------------------------------- one question

def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}" if isinstance(x, float) else html.escape(str(x))


def _question_html(record: dict, row: dict, video_root: str | None, anchor: str) -> str:
    flags = row_flags(record, row)
    classes = " ".join(["q", *(k for k, v in flags.items() if v)])
    windows, turns = _pairs(row.get("windows")), window_turns(row)
    clues = _pairs(record.get("clues"))
    k = int(row["nframes"]) if _num(row.get("nframes")) else None
    notes, path, duration = [], None, _num(record.get("duration"))
    if video_root is None:
        notes.append("no video root given: frames not shown")
    else:
        try:
            path = resolve_video(video_root, record["video"])
            duration = video.probe(path).duration
        except (ValueError, OSError) as e:        # video.VideoError is a ValueError; the message names the file
            notes.append(f"video not shown: {e}")
            path = None
    if duration is None:
        duration = max([e for _, e in windows + clues] + [1.0])
    pred = row.get("answer") if "answer" in row and row.get("error") is None else None
    pred = pred if pred is not None else rewards.extract_answer(str(row.get("response") or ""))
    verdict = "error" if flags["error"] else "wrong" if flags["wrong"] else \
        "asked" if record.get("answer") is None else "right"
    h = [f'<section class="{classes}" id="{anchor}" data-id="{html.escape(str(record["id"]))}">',
         f'<h2><span class="verdict v-{verdict}">{verdict}</span> {html.escape(str(record["id"]))} '
         f'<small>{html.escape(str(record.get("task")))} · {html.escape(str(data_type(record) or record.get("data_type")))} · '
         f'{duration:.1f} s · K = {k if k is not None else "not recorded"}</small></h2>',
         f'<p class="question">{html.escape(str(record.get("question", "")))}</p>']
    if record.get("options"):
        h.append('<p class="options">' + " · ".join(f"{chr(65 + i)}. {html.escape(str(o))}"
                                                     for i, o in enumerate(record["options"])) + "</p>")
    gold = "no gold answer" if record.get("answer") is None else f'gold <b>{html.escape(str(record["answer"]))}</b>'
    h.append(f'<p class="answers">{gold} · predicted '
             f'<b>{html.escape(str(pred))}</b> · turns {_fmt(row.get("turns"))} · calls {_fmt(row.get("calls"))} '
             f'· tool failures {_fmt(row.get("tool_failures"))}'
             + (f' · <span class="err">error: {html.escape(str(row["error"]))}</span>' if row.get("error") else "") + "</p>")
    h += [_note(n) for n in notes]
    h.append('<div class="cols"><div class="pics">')
    # overview strip
    if path is not None:
        n = k if k is not None else DEFAULT_K
        try:
            clip = video.sample_overview(path, nframes=n, max_pixels=THUMB_PIXELS, factor=8)
            shown = _even_pick(len(clip.times), MAX_OVERVIEW_THUMBS)
            what = f"overview: {len(clip.times)} frames" + ("" if k is not None else " (K not recorded)") + \
                   ("" if len(shown) == len(clip.times) else f", {len(shown)} shown")
            h.append(f'<h3>{what}</h3><div class="strip">{_frames_html(clip, shown, "ov")}</div>')
        except (ValueError, OSError) as e:
            h.append(_note(f"overview not shown: {e}"))
    # timeline
    h.append('<h3>timeline: clue windows and crops by turn</h3>')
    h.append(timeline_svg(duration, clues, windows, turns))
    if windows and all(t is None for t in turns):
        h.append(_note("turn of each crop not recorded (no calls_by_turn): crops drawn in grey, one lane each"))
    # crops' frames
    if path is not None and windows:
        cells = []
        for i, ((s, e), t) in enumerate(zip(windows, turns)):
            colour = UNKNOWN_TURN_COLOUR if t is None else TURN_COLOURS[(t - 1) % len(TURN_COLOURS)]
            head = f'crop {i + 1} · {"turn ?" if t is None else f"turn {t}"} · [{s:g}, {e:g}] s'
            try:
                clip = video.crop(path, s, e, level=None, fps=THUMB_FPS, max_frames=CROP_THUMBS,
                                  max_pixels=THUMB_PIXELS, tokens_per_pixel_area=64)
                body = _frames_html(clip, _even_pick(len(clip.times), CROP_THUMBS), "cf")
            except (ValueError, OSError) as err:
                body = _note(f"not shown: {err}")
            cells.append(f'<div class="cropbox" style="border-color:{colour}"><div class="ch" '
                         f'style="background:{colour}">{head}</div>{body}</div>')
        h.append('<h3>crops</h3><div class="crops">' + "".join(cells) + "</div>")
    # rewards
    comps = reward_components(record, row)
    h.append('<h3>rewards</h3><table class="rewards"><tr>' +
             "".join(f"<th>{html.escape(REWARD_NAMES.get(c, c))}</th>" for c in comps) + "<th>K</th></tr><tr>" +
             "".join(f'<td title="{html.escape(src)}" class="{"rec" if src == "recomputed" else "log" if src == "logged" else "na"}">'
                     f"{_fmt(v)}</td>" for c, (v, src) in comps.items()) +
             f"<td>{k if k is not None else '–'}</td></tr></table>")
    # turns
    segs, how = _segments(row)
    h.append('</div><div class="turns">')
    h.append(f'<h3>trajectory <small>(roles {html.escape(how)}; <span class="legend env">environment</span> '
             f'<span class="legend policy">policy</span>)</small></h3><div class="traj">')
    for role, text in segs:
        text = re.sub(r"(?:<\|video_pad\|>){2,}", lambda m: f"<|video_pad|>×{len(m.group(0)) // 13}", text)
        h.append(f'<pre class="seg {role}" data-role="{role}">{html.escape(text)}</pre>')
    h.append("</div></div></div>")
    h.append("</section>")
    return "\n".join(h)


# ----------------------------------------------------------------------------- the page

CSS = """
body{font:14px/1.35 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:12px 20px;background:#fff;border-bottom:1px solid #ddd}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:0 0 4px} h3{font-size:13px;margin:10px 0 4px;color:#555}
small{color:#666;font-weight:normal}
main{padding:0 20px 40px}
section.q{background:#fff;border:1px solid #ddd;border-radius:6px;margin:14px 0;padding:10px 14px}
.filter{display:none}
#wrong:target~main section.q:not(.wrong),#failures:target~main section.q:not(.fail),
#truncated:target~main section.q:not(.trunc){display:none}
#wrong:target~header a[href="#wrong"],#failures:target~header a[href="#failures"],
#truncated:target~header a[href="#truncated"]{background:#222;color:#fff}
nav a{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #999;border-radius:4px;
text-decoration:none;color:#222}
table{border-collapse:collapse} td,th{border:1px solid #ddd;padding:2px 8px;text-align:right;font-size:13px}
th{background:#f0f0f0;font-weight:600}
.summary{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.verdict{font-size:12px;padding:1px 6px;border-radius:3px;color:#fff}
.v-right{background:#2ca02c}.v-wrong{background:#d62728}.v-error{background:#555}.v-asked{background:#1f77b4}
.question{margin:4px 0} .options{margin:2px 0;color:#333} .answers{margin:4px 0}
.cols{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:18px}
.err{color:#b00} .note{color:#8a5a00;background:#fff7e0;padding:2px 6px;margin:4px 0}
.strip{display:flex;gap:3px;overflow-x:auto;padding-bottom:4px}
figure{margin:0;text-align:center} figure img{height:56px;display:block;image-rendering:pixelated}
figcaption{font-size:10px;color:#555}
.crops{display:flex;gap:8px;flex-wrap:wrap}
.cropbox{border:2px solid;border-radius:4px;padding:0 4px 4px;display:flex;gap:3px;flex-wrap:wrap;width:212px}
.cf img{height:44px}
.key{font-size:12px;color:#555;margin:6px 0 0}
.ch{width:100%;color:#fff;font-size:11px;padding:1px 4px;margin:0 -4px 2px}
svg.timeline{max-width:100%;height:auto;background:#fff}
.clue{fill:#2ca02c} .clueband{fill:#2ca02c;opacity:.13} .axis{stroke:#888}
.lbl{font-size:11px;fill:#444} .tick{font-size:10px;fill:#666;text-anchor:middle}
.traj{border-left:3px solid #ddd;padding-left:6px}
pre.seg{white-space:pre-wrap;word-break:break-word;margin:0;padding:3px 6px;font:12px/1.3 ui-monospace,monospace}
pre.env{background:#eef2f7;color:#456;border-left:3px solid #8aa;font-style:italic}
pre.policy{background:#fff;color:#111;border-left:3px solid #1f77b4}
.legend{padding:0 4px} .legend.env{background:#eef2f7;color:#456;font-style:italic}
.legend.policy{border-left:3px solid #1f77b4;background:#fff}
td.rec{font-style:italic} td.na{color:#999}
"""


def _summary_html(pairs: list[tuple[dict, dict]], metrics: dict | None, shown: int, unmatched: int) -> str:
    """The page's summary: the agent table (rewards.py's agent figures over the non-error rows), the benchmark
    scores and notes, the filter links and the key."""
    n = len(pairs)
    ok = [(rec, row) for rec, row in pairs if not row.get("error")]
    flags = [row_flags(rec, row) for rec, row in pairs]
    comp = [bool(row["format_compliant"]) if "format_compliant" in row else rewards.format_compliant(_trajectory_text(row))
            for _, row in ok]
    agent = {
        "questions": n, "error rows": n - len(ok),
        "format compliance": rewards.mean_or_none(comp),          # the logged flags, else rewards.format_compliant
        "tool-call ratio": rewards.tool_call_ratio(bool(row.get("calls") or row.get("windows")) for _, row in ok),
        "mean turns": rewards.mean_turns(_num(row.get("turns")) or 0 for _, row in ok),
        "mean calls": rewards.mean_or_none(_num(row.get("calls")) or 0 for _, row in ok),
        "mean tool turns": rewards.mean_turns(tool_turn_count(row) for _, row in ok),
        "tool failures": sum(int(_num(row.get("tool_failures")) or 0) for _, row in ok),
    }
    h = ['<div class="summary"><table><tr><th colspan="2" style="text-align:left">agent</th></tr>']
    h += [f'<tr><td style="text-align:left">{k}</td><td>{_fmt(v)}</td></tr>' for k, v in agent.items()]
    h.append("</table>")
    if metrics:
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        h.append('<table><tr><th colspan="2" style="text-align:left">benchmark scores</th></tr>')
        h += [f'<tr><td style="text-align:left">{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>' for k, v in scalars.items()]
        h.append("</table>")
        notes = metrics.get("notes")
        if isinstance(notes, list) and notes:
            h.append('<ul class="notes">' + "".join(f"<li>{html.escape(str(x))}</li>" for x in notes) + "</ul>")
    h.append("</div>")
    count = lambda key: sum(f[key] for f in flags[:shown])
    h.append(f'<nav>show: <a href="#all">all ({shown})</a><a href="#wrong">wrong answers ({count("wrong")})</a>'
             f'<a href="#failures">tool failures ({count("fail")})</a>'
             f'<a href="#truncated">truncated / no final answer ({count("trunc")})</a></nav>')
    extra = []
    if shown < n:
        extra.append(f"showing the first {shown} of {n} questions (the summary covers all {n})")
    if unmatched:
        extra.append(f"{unmatched} prediction row(s) match no record and are left out")
    h += [_note(x) for x in extra]
    h.append('<p class="key">rewards in <i>italics</i> are recomputed from the trajectory with rewards.py (ParaVT '
             'R_fmt, anchor and R_tool; Video-o3 hybrid clue score and turn decay); upright ones were logged by the '
             'run. Timeline: green = ground-truth clue windows (shaded behind the crop lanes), one lane per crop, '
             'coloured by turn.</p>')
    return "\n".join(h)


def _check_inputs(records, rows) -> None:
    if not isinstance(records, list) or not isinstance(rows, list):
        raise ValueError(f"write_report: records and rows must be lists, got {type(records).__name__} "
                         f"and {type(rows).__name__}")
    for name, items, need in (("records", records, ("id", "video", "question", "task")), ("rows", rows, ("id",))):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"write_report: {name}[{i}] must be a dict, got {type(item).__name__}")
            missing = [k for k in need if item.get(k) is None]
            if missing:
                raise ValueError(f"write_report: {name}[{i}] lacks {', '.join(missing)}: {str(item)[:120]}")


def write_report(out_dir: str, records: list[dict], rows: list[dict], metrics: dict | None = None,
                 video_root: str | None = None, title: str | None = None, max_questions: int | None = None) -> str:
    """Write out_dir/index.html for the questions of `records` that have a row in `rows` (records' order);
    returns its path. max_questions limits the per-question sections (the first N), not the summary.
    Raises ValueError for inputs that are not records / rows; a bad video only gives a note on the page."""
    _check_inputs(records, rows)
    by_id = {}
    for i, row in enumerate(rows):
        if str(row["id"]) in by_id:
            raise ValueError(f"write_report: rows[{i}] repeats id {row['id']!r}")
        by_id[str(row["id"])] = row
    pairs = [(rec, by_id[str(rec["id"])]) for rec in records if str(rec["id"]) in by_id]
    unmatched = len(by_id) - len(pairs)
    shown = len(pairs) if max_questions is None else max(0, min(max_questions, len(pairs)))
    title = title or "agent trajectories"
    anchors = [f"q{i}" for i in range(shown)]
    sections = [_question_html(rec, row, video_root, a) for (rec, row), a in zip(pairs[:shown], anchors)]
    page = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
            '<div id="wrong" class="filter"></div><div id="failures" class="filter"></div>'
            '<div id="truncated" class="filter"></div><div id="all" class="filter"></div>',
            f"<header><h1>{html.escape(title)}</h1>", _summary_html(pairs, metrics, shown, unmatched), "</header>",
            "<main>", *sections, "</main></body></html>"]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "index.html")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(page))
    os.replace(tmp, path)                         # a reader never sees half a page
    return path
