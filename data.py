"""
Data records (JSONL) and the synthetic "needle in a long video" task.

Prompt record (docs/method.md §9), one JSON object per line, as `read_valid_records` yields it:
  id: str; video: str (relative to video_root, no `..`; links inside the root are followed); question: str;
  options: [str] | None (letters A, B, ... implied by order); answer: "B" (mcq) | str (oe) | [s, e] (tvg);
  task: "mcq" | "oe" | "tvg"; clues: [[s, e], ...] | None (evidence windows, seconds);
  data_type: single_clue | multi_clue | direct | free_form | grounding (inferred when absent: tvg ->
  grounding, one clue -> single_clue, several -> multi_clue, none -> free_form);
  duration: float | None; subtitles: str | None; meta: dict (free-form). Unknown keys are kept.
SFT record (`write_sft_records`): {"id", "video", "prompt": <prompt record>, "messages": [...]} where
  messages are the Hugging Face chat messages AFTER the prompt (the system prompt and the user turn
  with the overview are built by the rollout code from "prompt"): assistant contents are strings in
  the text format of docs/method.md §2 (forced "<think>\n" prefix included, no <|im_end|>: the chat template adds
  it) and each tool result is {"role": "tool", "content": [{"type": "video", "video": path,
  "video_start": s, "video_end": e}]}, one per call, which the rollout turns into real clips.

The synthetic task. A video of D seconds (default 64) at 2 fps, 64x64 RGB: a dim background whose
colour drifts slowly (sinusoid per channel) over a fixed seeded texture (never near white, never
near a glyph colour). A clue is a MARK window [s, s+8) (s integer, marks >= 4 s apart) during which a
white 32x32 block fills the top-left quadrant. A coloured GLYPH (colour from PALETTE) is shown: for a
"needle" clue in the three quadrants around the mark and during the middle 4 s [s+2, s+6) (NEEDLE) only;
for a "direct" clue over the whole frame, mark included, for the whole window. Kinds: single_clue
(mcq, glyph colour), multi_clue (mcq, which of two named colours came first), direct (mcq, glyph visible
in the overview), grounding (tvg, when is the mark shown), search (mcq, glyph colour, evidence found in two
rounds: a 4 s mark [s, s+4) with its glyph for the middle 2 s [s+1, s+3), which an 8-frame overview misses half
the time; a whole-video crop, 16 frames 4 s apart on the tiny rollout, always shows the mark and half the time
the glyph; otherwise a close crop around where it showed the mark reads it; its data_type is single_clue).
Every mcq lists the palette as its options,
so a colour has one letter everywhere: what is learned is reading colours, not matching option texts.
What the overview can show: where the marks are (any overview frame inside a mark window shows the
block, even at 32x32), and the colour of a direct glyph (a uniform overview of >= 8 frames over 64 s
has a frame in every 8 s window). What it cannot: a needle's colour, unless an
overview frame happens to fall in the 4 s glyph slot (8 frames over 64 s: about half the time; 4
frames: a quarter; 16 or more: always, which is ParaVT's tool necessity gap); a crop always shows it.
A direct glyph (no white mark left) never looks like a needle (mark and glyph side by side), so whether
the tool is needed can be read off the overview. A needle covers three of a frame's four visual tokens:
with two (the bottom half, render version 5) reading colours out of crops came late and at a step that
varied with the seed (held-out accuracy after 500 SFT steps, seeds 1 and 2: 0.48 and 0.45 with two tokens,
0.76 and 0.70 with three).
"""
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import video
from rewards import infer_data_type, parse_tool_calls

TASKS = ("mcq", "oe", "tvg")
PALETTE = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 70, 230), "yellow": (230, 210, 30)}
KINDS = ("single_clue", "multi_clue", "direct", "grounding", "search")
DEFAULT_MIX = {"single_clue": 0.3, "multi_clue": 0.2, "direct": 0.2, "grounding": 0.1, "search": 0.2}
FPS, SIZE = 2.0, 64              # synthetic videos: native frame rate, frame side (pixels)
MARK_LEN, MARK_GAP = 8, 4        # mark window length and minimum gap between marks (seconds)
NEEDLE = (2.0, 6.0)              # glyph slot of a needle clue, relative to the mark start (seconds)
SEARCH_LEN, SEARCH_GLYPH = 4, (1.0, 3.0)   # a search clue: a 4 s mark, its glyph for the middle 2 s
RENDER_VERSION = 7               # bump when render_frames changes: cached videos are then re-rendered
MARK_PX, GLYPH_PX = 32, 32       # white block (top-left quadrant, one Qwen3-VL visual token at 64x64: a
                                 # token covers 32x32 pixels); needle glyph = the bottom half (rows >= 32) and
                                 # the top-right quadrant (three tokens), direct glyph = the whole frame (four)
INSTRUCTIONS = {
    "mcq": "Answer with the option letter inside <answer></answer>.",
    "oe": "Answer briefly inside <answer></answer>.",
    "tvg": "Answer with the time window as <answer>[start, end]</answer> in seconds.",
}
SINGLE_Q = "What colour is the shape shown in the video?"


class RecordError(ValueError):
    """An invalid data record; the message starts with where it came from ("train.jsonl:17: ...")."""


# ----------------------------------------------------------------------------- records I/O

def resolve_video(video_root: str, rel: str) -> str:
    """Path of a record's video under video_root. The path is checked AS WRITTEN in the record: relative,
    with no `..` component, so it names something inside the root. Symlinks inside the root are then
    followed like any path (datasets are usually laid out as links; that layout is the user's own), so
    no realpath is compared. Only records choose paths: a tool call always crops its record's video."""
    if not isinstance(rel, str) or not rel:
        raise ValueError(f"video path must be a non-empty string, got {rel!r}")
    if os.path.isabs(rel) or rel[:1] in "/\\" or re.match(r"[A-Za-z]:", rel):
        raise ValueError(f"video path {rel!r} is absolute; write it relative to the video root {video_root}")
    if ".." in re.split(r"[/\\]", rel):
        raise ValueError(f"video path {rel!r} has a '..' component: a record's path must not lead outside "
                         f"the video root {video_root}")
    return os.path.normpath(os.path.join(video_root, rel))


def _pair(x, what: str) -> list[float]:
    """[s, e] floats with 0 <= s < e, both finite; ValueError saying what is wrong otherwise."""
    if not isinstance(x, (list, tuple)) or len(x) != 2 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in x):
        raise ValueError(f"{what} must be a [start, end] pair of numbers, got {x!r}")
    s, e = float(x[0]), float(x[1])
    if not 0 <= s < e:
        raise ValueError(f"{what} {x!r} needs 0 <= start < end")
    return [s, e]


def _check(rec, video_root: str | None) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, got {type(rec).__name__}")
    missing = [k for k in ("id", "video", "question", "answer", "task") if rec.get(k) is None]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    out = dict(rec)  # keep unknown keys: never lose data
    if not isinstance(rec["id"], (str, int)) or isinstance(rec["id"], bool) or str(rec["id"]) == "":
        raise ValueError(f"id must be a non-empty string, got {rec['id']!r}")
    out["id"] = str(rec["id"])
    for k in ("video", "question"):
        if not isinstance(rec[k], str) or not rec[k].strip():
            raise ValueError(f"{k} must be a non-empty string, got {rec[k]!r}")
    if rec["task"] not in TASKS:
        raise ValueError(f"unknown task {rec['task']!r}; expected one of {', '.join(TASKS)}")
    options = rec.get("options")
    if options is not None and (not isinstance(options, list) or not all(isinstance(o, str) for o in options)):
        raise ValueError(f"options must be a list of strings, got {options!r}")
    out["options"] = list(options) if options else None
    duration = rec.get("duration")
    if duration is not None:
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not 0 < duration < math.inf:
            raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")
        out["duration"] = duration = float(duration)
    answer, task = rec["answer"], rec["task"]
    if task == "mcq":
        if not out["options"] or not 2 <= len(out["options"]) <= 26:
            raise ValueError("an mcq record needs 2 to 26 options")
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(out["options"])]
        if not isinstance(answer, str) or len(answer.strip()) != 1 or answer.strip().upper() not in letters:
            raise ValueError(f"mcq answer {answer!r} is not a letter among the options (A-{letters[-1]})")
        out["answer"] = answer.strip().upper()
    elif task == "tvg":
        out["answer"] = _pair(answer, "tvg answer")
    else:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ValueError(f"oe answer must be a non-empty string, got {answer!r}")
        out["answer"] = str(answer)
    clues = rec.get("clues")
    if clues is not None:
        if not isinstance(clues, list):
            raise ValueError(f"clues must be a list of [start, end] windows, got {clues!r}")
        out["clues"] = [_pair(c, f"clue {i}") for i, c in enumerate(clues)]
        for i, (s, e) in enumerate(out["clues"]):
            if duration is not None and e > duration + 1e-6:
                raise ValueError(f"clue {i} [{s}, {e}] ends after the video's duration {duration}")
    out["data_type"] = infer_data_type(task, out.get("clues"), rec.get("data_type"))
    subtitles = rec.get("subtitles")
    if subtitles is not None and not isinstance(subtitles, str):
        raise ValueError(f"subtitles must be a string, got {type(subtitles).__name__}")
    if not isinstance(out.setdefault("meta", {}), dict):
        raise ValueError(f"meta must be an object, got {out['meta']!r}")
    if video_root is not None:
        path = resolve_video(video_root, rec["video"])
        if not os.path.isfile(path):
            raise ValueError(f"video {rec['video']!r} not found under {video_root} ({path})")
    return out


def validate_record(rec: dict, video_root: str | None, where: str) -> dict:
    """Normalised copy of a prompt record (types, upper-case letter, float windows, data_type filled in).

    Raises RecordError "{where}: {what is wrong}"; checks the video file exists when video_root is given."""
    try:
        return _check(rec, video_root)
    except ValueError as e:
        raise RecordError(f"{where.rstrip(': ')}: {e}") from None


def read_valid_records(path: str, video_root: str | None = None, *, max_bad_fraction: float
                       ) -> tuple[list[dict], list[str]]:
    """(good records, errors "file:line: reason") of a JSONL file; blank lines are skipped.

    Raises ValueError only if the file cannot be read or more than max_bad_fraction of its lines are bad."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read records ({e})") from None
    records, errors, seen, n = [], [], {}, 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        n += 1
        where = f"{path}:{lineno}"
        try:
            rec = validate_record(json.loads(line), video_root, where)
        except json.JSONDecodeError as e:
            errors.append(f"{where}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        except RecordError as e:
            errors.append(str(e))
            continue
        if rec["id"] in seen:
            errors.append(f"{where}: duplicate id {rec['id']!r} (first on line {seen[rec['id']]})")
            continue
        seen[rec["id"]] = lineno
        records.append(rec)
    if n and len(errors) / n > max_bad_fraction:
        raise ValueError(f"{path}: {len(errors)} of {n} lines are bad (more than {max_bad_fraction:.0%}); first: "
                         + "; ".join(errors[:5]))
    return records, errors


def atomic_write(path: str, data: bytes) -> None:
    """Write to a temp file in the same folder, then os.replace: readers never see a partial file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_records(path: str, records: list[dict]) -> None:
    """Write records as JSONL, atomically (temp file + os.replace)."""
    atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))


def format_question(record: dict) -> str:
    """User text after the video: [Subtitles], Question, lettered Options, one instruction line by task."""
    text = f"Subtitles:\n{record['subtitles']}\n" if record.get("subtitles") else ""
    text += f"Question: {record['question']}\n"
    if record.get("options"):
        text += "Options:\n"
        for letter, opt in zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", record["options"]):
            prefixed = re.match(rf"\(?{letter}[.)]\s", opt)  # already "A. x", "A) x" or "(A) x"
            text += f"{opt}\n" if prefixed else f"{letter}. {opt}\n"
    return text + INSTRUCTIONS[record["task"]]


# ----------------------------------------------------------------------------- the synthetic task

def render_frames(duration: float, marks: list[tuple[int, str, tuple[float, float], bool, int]], seed: int
                  ) -> torch.Tensor:
    """(T, 3, 64, 64) uint8 frames at 2 fps, T = round(duration * 2).
    marks: (start s, colour, glyph window, big (direct) glyph?, mark length in seconds)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(duration * FPS)) / FPS                                  # (T,) seconds
    base, amp = rng.uniform(60, 110, 3), rng.uniform(8, 20, 3)                 # per channel
    period, phase = rng.uniform(duration / 2, 2 * duration, 3), rng.uniform(0, 2 * np.pi, 3)
    drift = base + amp * np.sin(2 * np.pi * t[:, None] / period + phase)       # (T, 3) in [40, 130]
    texture = rng.integers(-5, 6, (1, 3, SIZE, SIZE))                          # fixed: cheap to encode
    x = (drift[:, :, None, None] + texture).astype(np.uint8)                   # (T, 3, H, W)
    g0 = SIZE - GLYPH_PX                                                        # the bottom half
    for s, colour, (g_start, g_end), big, length in marks:
        x[(t >= s) & (t < s + length), :, :MARK_PX, :MARK_PX] = 255
        on, rgb = (t >= g_start) & (t < g_end), np.array(PALETTE[colour], dtype=np.uint8)[:, None, None]
        x[on, :, g0:, :] = rgb                       # bottom half
        x[on, :, :g0, MARK_PX:] = rgb                # and top-right quadrant
        if big:
            x[on, :, :MARK_PX, :MARK_PX] = rgb       # and over the mark: the whole frame
    return torch.from_numpy(x)


def _mark_starts(rng: np.random.Generator, k: int, duration: float, length: int = MARK_LEN) -> list[int]:
    """k integer mark starts, sorted, each window [s, s + length) inside [0, duration], >= MARK_GAP s apart."""
    slack = int(duration) - k * length - (k - 1) * MARK_GAP
    if slack < 0:
        raise ValueError(f"a {duration} s video cannot hold {k} mark(s) of {length} s")
    offsets = np.sort(rng.integers(0, slack + 1, k))
    return [int(o) + i * (length + MARK_GAP) for i, o in enumerate(offsets)]


def _kind_counts(n: int, mix: dict) -> dict:
    """Largest-remainder split of n records over the mix weights (exact proportions as n grows)."""
    bad = set(mix) - set(KINDS)
    if bad or not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"mix must map some of {KINDS} to weights >= 0 with a positive sum, got {mix}")
    total = sum(mix.values())
    exact = {k: n * w / total for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def _make_one(rid: str, kind: str, rng: np.random.Generator, duration: float) -> tuple[dict, list]:
    """(prompt record without video path, marks for render_frames) for one synthetic question."""
    names = list(PALETTE)
    length, slot = (SEARCH_LEN, SEARCH_GLYPH) if kind == "search" else (MARK_LEN, NEEDLE)
    starts = _mark_starts(rng, 2 if kind == "multi_clue" else 1, duration, length)
    colours = [names[i] for i in rng.permutation(len(names))[: len(starts)]]   # distinct colours
    glyphs = [(s, s + length) if kind == "direct" else (s + slot[0], s + slot[1]) for s in starts]
    clues = [[float(s), float(s + length)] for s in starts]
    rec = {"id": rid, "task": "mcq", "options": names, "clues": clues,
           "data_type": "single_clue" if kind == "search" else kind, "duration": float(duration), "subtitles": None}
    if kind in ("single_clue", "direct", "search"):
        rec.update(question=SINGLE_Q, answer="ABCD"[names.index(colours[0])])
    elif kind == "multi_clue":
        c1, c2 = colours if rng.random() < 0.5 else colours[::-1]      # named in either order
        rec.update(question=f"Which came first, the {c1} shape or the {c2} shape?",
                   answer="ABCD"[names.index(colours[0])])
    else:  # grounding
        rec.update(task="tvg", question="When is the white mark shown?", options=None, answer=list(clues[0]))
    rec["meta"] = {"kind": kind, "colours": colours, "glyph_windows": [[float(a), float(b)] for a, b in glyphs]}
    return rec, [(s, c, g, kind == "direct", length) for s, c, g in zip(starts, colours, glyphs)]


def parse_mix(text: str | None) -> dict | None:
    """Parse a task mix: "single_clue=2,direct=1" -> {"single_clue": 2.0, "direct": 1.0};
    None or "" -> None (DEFAULT_MIX). Raises ValueError on a malformed text or an unknown kind."""
    if not text:
        return None
    try:
        mix = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise ValueError(f"task mix: expected kind=weight[,kind=weight...], got {text!r}") from None
    _kind_counts(1, mix)                 # validates the kinds and weights, with its own message
    return mix


def make_split(root: str, n: int, seed: int, mix: dict | None = None, *, duration: float) -> list[dict]:
    """n synthetic prompt records (video paths relative to root, so video_root=root), videos cached in
    <root>/videos/<id>-<spec hash>.mp4. Deterministic in (n, seed, mix, duration): same ids, answers and
    video bytes. Another n, mix or duration can give an id other content: the hash of the generation spec
    in the file name keeps such videos apart, so runs with different splits can share a cache, even at the
    same time. A sidecar <id>-<hash>.json holds the spec and byte size; a video is (re-)encoded when the
    sidecar is missing or disagrees (a half-written or damaged cache entry)."""
    counts = _kind_counts(n, DEFAULT_MIX if mix is None else mix)
    kinds = np.random.default_rng([seed, n]).permutation([k for k in KINDS for _ in range(counts.get(k, 0))])
    records, todo = [], []
    for i, kind in enumerate(kinds):
        rid = f"syn-{seed}-{i:05d}"
        rng = np.random.default_rng([seed, i])
        rec, marks = _make_one(rid, str(kind), rng, duration)
        spec = {"duration": duration, "marks": [[s, c, list(g), big, length] for s, c, g, big, length in marks],
                "seed": [seed, i], "size": SIZE, "fps": FPS, "layout": [MARK_PX, GLYPH_PX, RENDER_VERSION]}
        name = f"videos/{rid}-{hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:12]}"
        rec["video"] = f"{name}.mp4"
        path, side = os.path.join(root, rec["video"]), os.path.join(root, f"{name}.json")
        if not _cached(path, side, spec):
            todo.append((path, side, spec, marks, int(rng.integers(2 ** 31))))
        records.append(rec)
    # each video is encoded on its own (one x264 thread, so byte-for-byte the same in any order): a thread per core
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda job: _render(*job, duration=duration), todo))
    return records


def _render(path: str, side: str, spec: dict, marks: list, seed: int, duration: float) -> None:
    """Encode one synthetic video to `path` (through a temporary file), then its sidecar."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(side)  # video first, sidecar last: a sidecar always vouches for a whole video
    frames = render_frames(duration, marks, seed=seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp.mp4"  # per process and thread: no collisions
    try:
        video.write_video(tmp, frames, FPS)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    atomic_write(side, json.dumps({"spec": spec, "bytes": os.path.getsize(path)}).encode())


def _cached(path: str, side: str, spec: dict) -> bool:
    """True when the video exists with the size and spec its sidecar recorded."""
    if not (os.path.isfile(path) and os.path.isfile(side)):
        return False
    try:
        with open(side, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):  # unreadable or half-written sidecar: regenerate
        return False
    return saved.get("spec") == spec and saved.get("bytes") == os.path.getsize(path)


# ----------------------------------------------------------------------------- SFT trajectories

def _t(x: float) -> str:
    return f"{float(x):.1f}"  # 12.0, 12.5


def _noisy_window(rng: np.random.Generator, s: float, e: float, noise: float, duration: float) -> tuple:
    """Clue window with U(-noise, noise) on each end, rounded to 0.5 s, clamped to [0, duration]."""
    a = min(max(round((s + rng.uniform(-noise, noise)) * 2) / 2, 0.0), duration)
    b = min(max(round((e + rng.uniform(-noise, noise)) * 2) / 2, 0.0), duration)
    return (a, b) if a < b else (s, e)


def _call(a: float, b: float) -> str:
    args = {"start_time": float(a), "end_time": float(b)}
    return f"<tool_call>\n{json.dumps({'name': 'crop_video', 'arguments': args})}\n</tool_call>"


def overview_patch_times(duration: float, nframes: int) -> list[tuple[float, float, float]]:
    """(t, f0, f1) per temporal patch of a K-frame overview of a synthetic video: the two frame times
    (nearest 2 fps frames to video.uniform_targets) and t, their mean, which the processor prints."""
    grid = np.arange(round(duration * FPS)) / FPS
    times = grid[video.sample_frame_indices(grid, video.uniform_targets(0.0, duration, nframes))]
    return [(float((a + b) / 2), float(a), float(b)) for a, b in zip(times[0::2], times[1::2])]


def seen_at(clue: list[float], patches: list[tuple[float, float, float]]) -> float | None:
    """The printed time t of the first overview patch that shows the mark [s, s+8), or None (missed)."""
    s, e = clue
    return next((t for t, f0, f1 in patches if s <= f0 < e or s <= f1 < e), None)


def crop_patch_times(start: float, end: float, duration: float, fps: float, max_frames: int
                     ) -> list[tuple[float, float, float]]:
    """(t, f0, f1) per temporal patch of a crop [start, end] of a synthetic video, as `video.crop` samples it
    (n = even(window x fps) <= max_frames targets, the nearest 2 fps frames inside the window)."""
    grid = np.arange(round(duration * FPS)) / FPS
    inside = grid[(grid >= start - 1e-6) & (grid <= end + 1e-6)]
    n = min(video.crop_budget(end - start, None, fps, max_frames)[0], max(1, round((end - start) * FPS)))
    times = inside[video.sample_frame_indices(inside, video.uniform_targets(start, end, n))]
    times = np.append(times, times[-1]) if len(times) % 2 else times
    return [(float((a + b) / 2), float(a), float(b)) for a, b in zip(times[0::2], times[1::2])]


def _shows(window: list[float], patches: list[tuple[float, float, float]]) -> bool:
    """Whether a frame of these patches falls in the half-open window [a, b) (a glyph's slot)."""
    return any(window[0] <= f < window[1] for _, f0, f1 in patches for f in (f0, f1))


def glyphs_seen(record: dict, nframes: int, windows, crop_fps: float | None = None,
                crop_max_frames: int | None = None) -> bool | None:
    """Whether every glyph a synthetic colour question's answer reads fell in a frame the policy was shown: the
    K-frame overview's or one of its executed crops' (`windows`, sampled as the rollout samples them: `crop_fps`,
    `crop_max_frames`, RolloutConfig's, given with windows). A crop can cover a glyph's slot and still miss it
    between its frames. None where this cannot tell (as `tool_needed`)."""
    if windows and (crop_fps is None or crop_max_frames is None):
        raise ValueError("glyphs_seen: a crop's frames need crop_fps and crop_max_frames (the rollout's)")
    glyphs = (record.get("meta") or {}).get("glyph_windows")
    if record.get("task") != "mcq" or not glyphs or not nframes:
        return None
    duration = float(record.get("duration") or record["clues"][-1][1])
    patches = overview_patch_times(duration, nframes)
    for a, b in windows or []:
        patches += crop_patch_times(a, b, duration, crop_fps, crop_max_frames)
    return all(_shows(g, patches) for g in glyphs)


def tool_needed(record: dict, nframes: int) -> bool | None:
    """Whether a synthetic colour question needs the tool under a K-frame overview (a glyph its answer reads is in no
    overview frame); None where it cannot tell (grounding, real data)."""
    seen = glyphs_seen(record, nframes, None)
    return None if seen is None else not seen


def oracle_turns(record: dict, rng: np.random.Generator, *, nframes: int, crop_fps: float, crop_max_frames: int,
                 always_call: bool, direct_crop: float, window_noise: float = 1.0, budget: int | None = None,
                 call_prior: float = 1.0) -> list[dict]:
    """The SFT target after the prompt: assistant strings (docs/method.md §2 format) and one tool message per call.

    The oracle acts only on what it has seen: the K-frame overview (`nframes` = the overview the rollout uses),
    then its own crops (sampled as the rollout samples them: `crop_fps`, `crop_max_frames`).
    A mark is seen in a temporal patch printed as "<t seconds>" whose two frames lie d apart (d = the frame
    spacing); the mark window [s, s+L) holds one of them, so the glyph slot [s+a, s+b) lies inside
    (t - d/2 - (L-a), t + d/2 + b), which it crops (+-window_noise, <= 1 s, on each end; a needle seen in a
    K = 8 overview of 64 s: [t - 10, t + 10]). A big (direct) glyph the overview shows is read off the overview,
    or cropped with probability `direct_crop` (both are right: RL then weighs them, VTGR pricing the crop 0.675
    vs 0.75). A mark no overview frame shows is searched by cropping the whole video; when that sparse crop shows
    the mark but not the glyph (a search clue: a 4 s mark, a 2 s glyph, a whole-video crop of 16 frames 4 s
    apart), a second round crops close around where it showed the mark: two tool rounds.
    Grounding is answered from the overview alone, with the 8 s window centred on the overview frames
    that show the mark (K = 8: one frame f, s in (f - 8, f], answer [f - 4, f + 4], expected IoU 0.62
    against a uniform s); the exact window would be an answer the model cannot see its way to.
    `budget` (tool rounds allowed, for teaching the forced answer): when the oracle needs more rounds, the
    recording stops after `budget` of them (at 0: after the first turn, whose calls are then not executed) and
    the last turn answers from what was seen: right if every glyph the answer needs was in a frame seen, else a
    guessed letter. The rollout sends its forced-answer message at that point (rollout.response_chunk_text).
    `call_prior` (a teacher that knows the tool, not when it pays): where the answer needs a crop (every kind but
    a big glyph the overview shows), the oracle calls with this probability and otherwise says what it sees and
    "I will guess." (a letter, right 1 time in 4, which is context and not a target: `target_chars`; random
    targets would teach the answer token noise). The coin ignores the question, so the SFT policy calls at
    that rate everywhere and learning when to call is left to RL; at 1 (the oracle) nothing is drawn."""
    kind, clues, colours = record["meta"].get("kind", record["data_type"]), record["clues"], record["meta"]["colours"]
    if kind not in KINDS:
        raise ValueError(f"{record['id']}: oracle trajectories exist for {KINDS} only, not {kind!r}")
    duration = float(record.get("duration") or clues[-1][1])
    answer = f"<answer>{record['answer']}</answer>"
    patches = overview_patch_times(duration, nframes)
    glyphs = record["meta"]["glyph_windows"]

    def turn(think: str, body: str) -> dict:
        return {"role": "assistant", "content": f"<think>\n{think}\n</think>\n{body}"}

    if kind == "grounding":   # the estimate the overview allows: 8 s centred on the frames that show the mark
        s, e = clues[0]
        inside = [f for _, f0, f1 in patches for f in (f0, f1) if s <= f < e]
        if not inside:
            return [turn("I see no mark in the overview; it could be anywhere.", f"<answer>[0.0, {_t(duration)}]</answer>")]
        c = (min(inside) + max(inside)) / 2
        a, b = max(0.0, c - MARK_LEN / 2), min(duration, c + MARK_LEN / 2)
        t = seen_at(clues[0], patches)
        return [turn(f"The mark is visible in the overview near {_t(t)} seconds.", f"<answer>[{_t(a)}, {_t(b)}]</answer>")]
    seen = [seen_at(c, patches) for c in clues]
    if kind == "direct" and seen[0] is not None and not always_call and rng.random() >= direct_crop:
        return [turn(f"A big shape is visible in the overview near {_t(seen[0])} seconds: it is {colours[0]}.", answer)]

    def close(t: float, d: float, clue: list[float], glyph: list[float]) -> tuple[float, float]:
        half = d / 2 + max(clue[1] - glyph[0], glyph[1] - clue[0])        # (L - a) and b of the docstring
        return _noisy_window(rng, max(0.0, t - half), min(duration, t + half), window_noise, duration)

    d_overview = duration / nframes
    windows = [(0.0, duration) if t is None else close(t, d_overview, c, g) for t, c, g in zip(seen, clues, glyphs)]
    near = [f"near {_t(t)} seconds" for t in seen if t is not None]
    if kind == "multi_clue":
        think = (f"I see marks {near[0]} and {near[1]} but the shapes are too small to read. I will crop both."
                 if len(near) == 2 else
                 f"I see one mark {near[0]}; the overview misses the other. The shapes are too small to read. "
                 "I will crop it and the whole video." if near else
                 "I see no mark in the overview. I will crop the whole video twice.")
        final = (f"The first clip shows a {colours[0]} shape and the second a {colours[1]} shape, "
                 f"so the {colours[0]} shape came first.")
    elif kind == "direct" and near:
        think = f"A big shape is visible in the overview {near[0]}. I will crop it to be sure."
        final = f"The clip shows a {colours[0]} shape."
    else:  # single_clue, search, or a direct glyph the overview missed
        think = (f"I see a mark {near[0]} but the shape is too small to read. I will crop it." if near
                 else "I see no mark in the overview. I will crop the whole video.")
        final = f"The clip shows a {colours[0]} shape."
    if call_prior < 1.0 and not always_call and not (kind == "direct" and near) and rng.random() >= call_prior:
        letter = "ABCD"[int(rng.integers(4))]
        guess = turn(think.rsplit(" I will ", 1)[0] + " I will guess.", f"<answer>{letter}</answer>")
        return [{**guess, "target_chars": guess["content"].index("<answer>") + len("<answer>")}]   # letter: context
    frames = lambda w: crop_patch_times(*w, duration, crop_fps, crop_max_frames)
    rounds = [(turn(think, "\n".join(_call(a, b) for a, b in windows)), list(enumerate(windows)))]
    # a whole-video crop that showed a mark but not its glyph: crop close around where it showed the mark
    wide = {i: frames(w) for i, w in enumerate(windows) if seen[i] is None}          # the whole-video crops' patches
    spots = {i: seen_at(clues[i], p) for i, p in wide.items() if not _shows(glyphs[i], patches + p)}
    spots = {i: t for i, t in spots.items() if t is not None}
    if spots:
        second = [(i, close(t, (windows[i][1] - windows[i][0]) / (2 * len(wide[i])), clues[i], glyphs[i]))
                  for i, t in spots.items()]                 # d: the wide crop's frame spacing
        marks = " and ".join(f"near {_t(t)} seconds" for t in spots.values())
        rounds.append((turn(f"The whole-video clip shows a mark {marks} but no shape beside it. I will crop closer.",
                            "\n".join(_call(a, b) for _, (a, b) in second)), second))

    def tools(calls):
        return [{"role": "tool", "content": [{"type": "video", "video": record["video"], "video_start": a,
                                               "video_end": b}]} for _, (a, b) in calls]
    if budget is None or budget >= len(rounds):
        return [m for call_turn, calls in rounds for m in (call_turn, *tools(calls))] + [turn(final, answer)]
    # out of tool rounds: answer from what was seen (the overview, the executed crops' frames)
    seen_by_clue = [list(patches) for _ in clues]
    for _, calls in rounds[:budget]:
        for i, w in calls:
            seen_by_clue[i] += frames(w)
    if all(_shows(g, f) for g, f in zip(glyphs, seen_by_clue)):
        last = turn(f"No tool turns are left. {final}", answer)
    else:
        last = turn("No tool turns are left and I could not read the shape, so I guess.",
                    f"<answer>{'ABCD'[int(rng.integers(4))]}</answer>")
    kept = [m for call_turn, calls in rounds[:budget] for m in (call_turn, *tools(calls))]
    return kept + ([rounds[0][0]] if budget == 0 else []) + [last]


def oracle_rounds(messages: list[dict]) -> int:
    """Tool rounds of an oracle recording: assistant turns followed by tool messages."""
    return sum(m["role"] == "assistant" and k + 1 < len(messages) and messages[k + 1]["role"] == "tool"
               for k, m in enumerate(messages))


def write_sft_records(path: str, records: list[dict], seed: int, **oracle) -> None:
    """JSONL of {"id", "video", "prompt": record, "messages": oracle_turns(record, **oracle)} (see module
    docstring); `oracle`: oracle_turns' keywords (the overview, the crops' sampling, always_call, direct_crop)."""
    rng = np.random.default_rng(seed)
    write_records(path, [{"id": r["id"], "video": r["video"], "prompt": r,
                          "messages": oracle_turns(r, rng, **oracle)} for r in records])


# -----------------------------------------------------------------------------
# training data: a run's records (held-out split, the synthetic task) and recorded SFT trajectories

SPLIT_SEEDS = {"sft": 1000, "held_out": 2000, "rl": 4000}   # a synthetic split's seed: this + the run's --seed


def synthetic_data(seed: int, n_train: int, n_eval: int, duration: float, mix: str | None,
                   cache: str) -> tuple[list, list, str]:
    """The synthetic needle task: a training split (seed 1000 + s) and a held-out one (2000 + s), disjoint."""
    root = os.path.join(cache, "synthetic")
    mix = parse_mix(mix)
    train = make_split(root, n_train, seed=SPLIT_SEEDS["sft"] + seed, mix=mix, duration=duration)
    held = make_split(root, n_eval, seed=SPLIT_SEEDS["held_out"] + seed, mix=mix, duration=duration)
    return train, held, root


def synthetic_rl(seed: int, n: int, duration: float, mix: str | None, cache: str) -> list:
    """The synthetic task's RL prompts (seed 4000 + s): disjoint from the SFT split (1000 + s), so RL samples
    questions the warm start never saw, and from the held-out one (2000 + s). `train.py --n-rl N`."""
    return make_split(os.path.join(cache, "synthetic"), n, seed=SPLIT_SEEDS["rl"] + seed, mix=parse_mix(mix),
                      duration=duration)


def split_held_out(records: list, n: int, seed: int) -> tuple[list, list]:
    """(train, held-out): `n` records drawn with `seed` are held out, and training never draws them."""
    if len(records) < 2:
        raise ValueError(f"--data has {len(records)} usable record(s): nothing to hold out; pass --eval-data")
    n = max(1, min(n, len(records) // 5 or 1))
    order = list(range(len(records)))
    random.Random(f"held-out:{seed}").shuffle(order)
    held = set(order[:n])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def load_data(data_path: str | None, eval_path: str | None, video_root: str | None, held_out: int, seed: int,
              max_bad_fraction: float, log=print) -> tuple[list, list, str, str]:
    """(training records, held-out records, video root, where the held-out set came from): the prompt records
    of `data_path` with `eval_path` held out, or `held_out` of them split off (never drawn for training)."""
    train, errors = read_valid_records(data_path, video_root, max_bad_fraction=max_bad_fraction)
    for e in errors[:5]:
        log(f"skipped record: {e}")
    if eval_path:
        return train, read_valid_records(eval_path, video_root, max_bad_fraction=max_bad_fraction)[0], video_root, \
            eval_path
    train, held = split_held_out(train, held_out, seed)
    note = f"split: {len(held)} of --data's records (seed {seed}), never drawn for training"
    log(f"held-out set: {note}")
    return train, held, video_root, note


def sft_pairs(path: str) -> tuple[list, list[str]]:
    """(record, messages, where) of each trajectory record in a JSONL file, and the bad lines' reasons."""
    pairs, errors = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                pairs.append((r.get("prompt") or r, r["messages"], f"{path}:{n}"))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
                errors.append(f"{path}:{n}: not a trajectory record ({type(e).__name__}: {e})")
    return pairs, errors


def content_text(content) -> str:
    if content is None:                    # an assistant turn that only calls tools (content: null)
        return ""
    if isinstance(content, str):
        return content
    return "".join(item.get("text", "") for item in content if isinstance(item, dict))


def message_text(message: dict) -> str:
    """A message's text, an assistant's `tool_calls` field (OpenAI / Hugging Face style: {"function": {"name",
    "arguments": dict or JSON string}}) written as the Hermes <tool_call> blocks the model emits."""
    text = content_text(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass                       # kept as written: the call parser reports it as a bad call
        text += f"\n<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': arguments})}\n</tool_call>"
    return text


def bad_calls(messages: list[dict], duration: float | None, min_window: float) -> list[str]:
    """Why the assistant turns of a recorded trajectory hold tool calls the environment would refuse (an unknown
    tool, bad arguments, a window past the end of the video): training on them teaches such calls."""
    problems = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        text = message_text(m)
        for c in parse_tool_calls(text):
            if c.error is not None:
                problems.append(f"turn {k}: {c.error}")
            elif c.name != "crop_video":
                problems.append(f"turn {k}: unknown tool {c.name!r}")
            elif duration is not None:
                try:
                    video.check_window(c.arguments.get("start_time"), c.arguments.get("end_time"), duration, min_window)
                except ValueError as e:
                    problems.append(f"turn {k}: {e}")
    return problems


def oracle_sft_pairs(records: list[dict], cfg, seed: int, gated_choices: list[int], *, always_call: bool,
                     direct_crop: float, budget_fraction: float, tool_free: float) -> tuple[list, list[str]]:
    """The synthetic task's SFT trajectories, (record, messages, where, K, rollout config) each, and the records
    the oracle could not answer: each record with the evaluation overview (cfg.overview_nframes, else 8 frames),
    and once more with a K drawn from `gated_choices` when given; with probability `budget_fraction` a trajectory
    that calls the tool is also recorded at a smaller tool-turn budget (the forced-answer message, then an answer
    from what was seen; its config's max_turns cut to match), so the model learns to answer when its budget runs
    out; with probability `tool_free` a trajectory that calls the tool is also recorded as a tool-free teacher
    would answer (what it saw, then a guess where the answer needs a crop; `oracle_turns` with call_prior 0), so
    the SFT policy calls the tool on about 1 / (1 + tool_free) of those questions whatever they show and when to
    call is left to RL (not with `always_call`, a teacher that always calls). `cfg` is the rollout's RolloutConfig
    (crop fps and frame cap: the oracle sees what a crop shows)."""
    rng = np.random.default_rng(seed)
    pairs, errors = [], []
    for r in records:
        for k in [cfg.overview_nframes or 8] + ([int(rng.choice(gated_choices))] if gated_choices else []):
            oracle = functools.partial(oracle_turns, r, rng, always_call=always_call, nframes=k,
                                       direct_crop=direct_crop, crop_fps=cfg.crop_fps, crop_max_frames=cfg.crop_max_frames)
            try:
                msgs = oracle()
                pairs.append((r, msgs, r["id"], k, cfg))
                rounds = oracle_rounds(msgs)
                if rounds and tool_free and not always_call and rng.random() < tool_free:
                    pairs.append((r, oracle(call_prior=0.0), f"{r['id']} (tool-free)", k, cfg))
                if rounds and rng.random() < budget_fraction:
                    b = int(rng.integers(rounds))
                    pairs.append((r, oracle(budget=b), f"{r['id']} (budget {b})", k, dataclasses.replace(cfg, max_turns=b)))
            except (ValueError, KeyError) as e:
                errors.append(f"{r.get('id')}: no oracle trajectory ({e}); pass --sft-data for real data")
    return pairs, errors
