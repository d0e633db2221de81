"""
Video decoding and frame sampling for the agent: the overview the model skims and the clips its
`crop_video` calls return, plus a synthetic video whose frames can be identified after compression.

Conventions (every function here):
- frames are uint8 RGB tensors of shape (T, 3, H, W); 10-bit or other pixel formats are converted
  to 8-bit RGB by FFmpeg's swscale (`to_rgb`).
- times are float64 numpy arrays (T,) holding each frame's real presentation time in seconds,
  pts * time_base, counted from the video stream's start_time. They are absolute in the original
  video, for the overview and for every crop, so the model can name windows it has seen (docs/method.md §3).
- T is always even: Qwen-VL's temporal patch is 2 frames. When a video has fewer real frames than
  asked for, the last frame is repeated (with its time) to reach the count.
- stream=None means the FIRST video stream in container order, stream=k the k-th video stream
  (0-based, counting video streams only). We do not use FFmpeg's "best stream" heuristic: it depends
  on bitrate/resolution and picks stream 3 (480x270) in a file whose first video is stream 0, so the
  first-in-order rule is the reproducible one and matches what a player shows by default.

Sampling: a target time list is made (uniform bin centres over the video or the window) and each
target gets the decoded frame nearest to it (`sample_frame_indices` is the pure form of that rule;
decoding applies it on the fly so only chosen frames are converted to RGB). Sparse targets (a K = 8
overview of an hour) seek: `_pick_sparse` jumps to the keyframe before a far target instead of decoding
the gap, and keeps exactly the sequential rule's frames (method="sequential" is the plain decode). The
keyframe list of a file is learned once (`keyframe_times`), as decord / torchcodec index a file.

Reuse and overlap: `FrameCache` keeps decoded overviews (memory LRU, optional disk copy) keyed by the
file version and the sampling rule; `DecodePool` decodes overviews and crops in threads with a deadline
per task, so a bad or stuck video is an error naming the file, never a hang.
Crop budgets follow Video-o3 (arXiv 2601.23224), ported to Qwen3-VL: clip at 2 fps, level quotas
coarse/medium/fine = 1024/2048/3072 visual tokens, per-frame tokens = min(quota // (T // 2), 768).
ParaVT (arXiv 2605.20342) sub-agent crops use fps=1, max_frames=16, max_pixels=224*224, level=None.
The sampling rates and frame caps are the caller's (recipes.py: overview_fps, crop_fps, crop_max_frames, ...):
nothing here defaults them.
"""
import contextlib
import hashlib
import itertools
import math
import os
import pickle
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from fractions import Fraction

import av
from av.video.reformatter import VideoReformatter
import numpy as np
import torch
import torch.nn.functional as F

LEVEL_TOKENS = {"coarse": 1024, "medium": 2048, "fine": 3072}  # visual-token quota per clip (Qwen3-VL)
MAX_TOKENS_PER_FRAME = 768       # per temporal patch of 2 frames, docs/method.md §3
OPEN_TIMEOUT_S = 10.0            # av.open timeout (matters for network-backed paths), so nothing hangs
TIME_TOL = 1e-6                  # seconds; times closer than this count as equal (window edges, ties)
SEEK_COST_FRAMES = 12            # a seek (demuxer seek + decoder flush and refill) costs about this many decoded frames

# Hermes-style schema of the tool the agent calls (rendered into the system prompt's <tools> block).
CROP_VIDEO_TOOL = {"type": "function", "function": {
    "name": "crop_video", "description": "Watch a temporal window of the video more closely.",
    "parameters": {"type": "object", "required": ["start_time", "end_time"], "properties": {
        "start_time": {"type": "number", "description": "window start, seconds from the video start"},
        "end_time": {"type": "number", "description": "window end, seconds from the video start"},
        "resolution": {"type": "string", "enum": list(LEVEL_TOKENS), "description": "detail level, default medium"},
    }}}}


class VideoError(ValueError):
    """A video that cannot be used; the message names the file and the problem (`.reason` has the problem alone)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


@dataclass
class VideoInfo:
    path: str
    stream: int             # container stream index of the chosen video stream
    duration: float         # seconds
    fps: float              # average frame rate
    num_frames: int         # from the header, else round(duration * fps) (see frames_from_header)
    frames_from_header: bool
    width: int
    height: int


@dataclass
class Clip:
    frames: torch.Tensor    # (T, 3, H, W) uint8 RGB
    times: np.ndarray       # (T,) float64 presentation times, seconds
    path: str
    decoded: int            # frames the decoder produced to make this clip


# ----------------------------------------------------------------------------- pure helpers

def check_window(start, end, duration: float, min_length: float = 0.0) -> tuple[float, float]:
    """Validate a crop window as the released tools do (docs/method.md §2); errors read as observations for the model."""
    try:
        start, end = float(start), float(end)
    except (TypeError, ValueError):
        raise ValueError(f"start_time and end_time must be numbers, got {start!r} and {end!r}") from None
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"start_time and end_time must be finite numbers, got {start} and {end}")
    start = max(start, 0.0)
    if start >= end:
        raise ValueError(f"start_time {round(start, 3)} must be smaller than end_time {round(end, 3)}")
    if start >= duration:
        raise ValueError(f"start_time {round(start, 3)} is past the end of the video ({round(duration, 3)} s)")
    end = min(end, duration)
    if end - start < min_length:
        raise ValueError(f"window [{round(start, 3)}, {round(end, 3)}] is {round(end - start, 3)} s long; "
                         f"the minimum is {min_length} s")
    return start, end


def even_count(n: int, cap: int) -> int:
    """n capped at cap, then made even (up if that stays <= cap, else down), at least 2."""
    n = min(n, cap)
    if n % 2:
        n = n + 1 if n + 1 <= cap else n - 1
    return max(n, 2)


def uniform_targets(start: float, end: float, n: int) -> np.ndarray:
    """n target times at the centres of n equal bins of [start, end): start + (i + 1/2) (end - start) / n."""
    return start + (np.arange(n) + 0.5) * (end - start) / n  # (n,)


def sample_frame_indices(frame_times: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Index of the frame nearest each target; frame_times sorted (N,).

    Ties (within TIME_TOL) go to the earlier frame, i.e. the one on screen. They are common, not rare:
    bin centres sit exactly between frames whenever the frame rate is an odd multiple of the sampling
    rate (10 fps sampled at 2 fps, or every frame of a video), and float rounding must not decide them."""
    frame_times = np.asarray(frame_times, dtype=np.float64)
    mid = (frame_times[:-1] + frame_times[1:]) / 2 + TIME_TOL  # (N-1,) right ends of frames' nearest regions
    return np.searchsorted(mid, np.asarray(targets, dtype=np.float64), side="left")


def crop_budget(window: float, level: str | None, fps: float, max_frames: int,
                tokens_per_pixel_area: int = 32 * 32) -> tuple[int, int | None]:
    """(n_frames, per-frame max pixels) for a window: n = even(window * fps) <= max_frames,
    tokens = min(LEVEL_TOKENS[level] // (n // 2), 768) (at least 1), pixels = tokens * tokens_per_pixel_area.
    level=None gives no pixel budget. Source: Video-o3 (arXiv 2601.23224), docs/method.md §3."""
    n = even_count(max(1, round(window * fps)), max_frames)
    if level is None:
        return n, None
    if level not in LEVEL_TOKENS:
        raise ValueError(f"unknown resolution {level!r}; choose one of {', '.join(LEVEL_TOKENS)}")
    tokens = max(1, min(LEVEL_TOKENS[level] // (n // 2), MAX_TOKENS_PER_FRAME))
    return n, tokens * tokens_per_pixel_area


def resize_frames(frames: torch.Tensor, max_pixels: int, factor: int = 32) -> torch.Tensor:
    """Resize (T, 3, H, W) uint8 so H'*W' <= max_pixels, H', W' multiples of factor, aspect kept (Qwen smart_resize)."""
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels {max_pixels} is below one {factor}x{factor} patch")
    h, w = frames.shape[-2:]
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
        if hb * wb > max_pixels:  # an extreme aspect ratio clamped one side at `factor`: trim the other
            if hb > wb:
                hb = max_pixels // wb // factor * factor
            else:
                wb = max_pixels // hb // factor * factor
    if (hb, wb) == (h, w):
        return frames
    out = F.interpolate(frames.float(), size=(hb, wb), mode="bilinear", align_corners=False, antialias=True)
    return out.round_().clamp_(0, 255).to(torch.uint8)  # (T, 3, H', W')


# ----------------------------------------------------------------------------- decoding (I/O)

def _open(path, stream: int | None):
    """Open a file and pick its video stream; returns (container, video stream)."""
    path = str(path)
    if not os.path.exists(path):
        raise VideoError(path, "no such file")
    if not os.path.isfile(path):
        raise VideoError(path, "not a regular file")
    if os.path.getsize(path) == 0:
        raise VideoError(path, "empty file (0 bytes)")
    try:
        container = av.open(path, timeout=OPEN_TIMEOUT_S)
    except av.FFmpegError as e:
        raise VideoError(path, f"not a readable video (not a video, corrupt or truncated): {e.strerror or e}") from None
    videos = list(container.streams.video)
    k = 0 if stream is None else stream
    if not videos or not 0 <= k < len(videos):
        kinds = ", ".join(s.type for s in container.streams) or "none"
        container.close()
        what = "no video stream" if not videos else f"no video stream {k} (it has {len(videos)})"
        raise VideoError(path, f"{what}; streams: {kinds}")
    vs = videos[k]
    vs.thread_type = "AUTO"
    return container, vs


def _frames(container, vs, path: str, seek_time: float = 0.0, count: list | None = None):
    """Yield (time, av.VideoFrame) in presentation order from the keyframe at or before seek_time.

    count[0] is increased for every frame the decoder outputs (the cost of a clip)."""
    start_pts, tb = vs.start_time or 0, vs.time_base
    count = [0] if count is None else count
    if seek_time > 0:
        container.seek(start_pts + int(seek_time / tb), stream=vs, backward=True)
    prev_t, retried = None, seek_time <= 0
    try:
        for frame in container.decode(vs):
            count[0] += 1
            _check_deadline(path)
            if frame.pts is None:  # no timestamp (rare containers): one nominal frame after the previous
                t = (prev_t or 0.0) + 1 / float(vs.average_rate or 25)
            else:
                t = float((frame.pts - start_pts) * tb)
            if prev_t is None and not retried and t > seek_time + TIME_TOL:
                # the demuxer landed after the target (inexact seek): restart from the stream start, once
                retried = True
                container.seek(start_pts, stream=vs, backward=True)
                yield from _frames(container, vs, path, 0.0, count)
                return
            prev_t = t
            yield t, frame
    except av.FFmpegError as e:
        raise VideoError(path, f"decoding failed (corrupt or truncated): {e.strerror or e}") from None


def _frames_in_window(frames, start: float, end: float, edge: dict):
    """Pass on frames with start <= time <= end; keep the last one before and first one after in `edge`."""
    for t, frame in frames:
        if t < start - TIME_TOL:
            edge["before"] = (t, frame)
        elif t > end + TIME_TOL:
            edge["after"] = (t, frame)
            return
        else:
            yield t, frame


_LOCAL = threading.local()  # per thread: .deadline (DecodePool), .rgb (the reused pixel-format converter)


def to_rgb(frame: av.VideoFrame) -> np.ndarray:
    """(H, W, 3) uint8 rgb24 pixels through this thread's one single-threaded converter: PyAV's own call makes a
    swscale context (and its threads) per frame, 20-500x slower here (docs/experiments.md)."""
    conv = getattr(_LOCAL, "rgb", None)
    if conv is None:
        conv = _LOCAL.rgb = VideoReformatter()
    return conv.reformat(frame, format="rgb24", threads=1).to_ndarray()


def _to_tensor(frame, max_pixels: int | None, factor: int) -> torch.Tensor:
    x = torch.from_numpy(to_rgb(frame)).permute(2, 0, 1)[None]  # (1, 3, H, W)
    return x if max_pixels is None else resize_frames(x, max_pixels, factor)


def _give_nearest(prev: list, t_next: float, targets: np.ndarray, j: int, chosen: list, max_pixels: int | None,
                  factor: int) -> int:
    """The nearest-frame rule, one decoded frame at a time: targets from j on that lie nearer to the frame
    prev = [time, frame, tensor or None] than to the next frame (at t_next) get it, appended to `chosen`.
    Returns the next unserved target's index."""
    while j < len(targets) and targets[j] <= (prev[0] + t_next) / 2 + TIME_TOL:
        if prev[2] is None:  # convert a frame once, and only when a target picks it
            prev[2] = _to_tensor(prev[1], max_pixels, factor)
        chosen.append((prev[0], prev[2]))
        j += 1
    return j


def _pick(frames, targets: np.ndarray, max_pixels: int | None, factor: int) -> list:
    """Streaming form of `sample_frame_indices`: one (time, (1, 3, H, W) tensor) per target, in order."""
    chosen, j, prev = [], 0, None
    for t, frame in frames:
        if prev is not None:
            j = _give_nearest(prev, t, targets, j, chosen, max_pixels, factor)
        if j == len(targets):
            break  # every target has its frame: stop decoding
        prev = [t, frame, None]
    if prev is not None and j < len(targets):  # targets after the last decoded frame get that frame
        x = prev[2] if prev[2] is not None else _to_tensor(prev[1], max_pixels, factor)
        chosen += [(prev[0], x)] * (len(targets) - j)
    return chosen


def _check_deadline(path: str) -> None:
    deadline = getattr(_LOCAL, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise VideoError(path, f"decoding timed out after {_LOCAL.timeout:g} s")


def file_key(path) -> tuple:
    """(real path, size, mtime_ns): one version of a file. Caches key on it, so an edited file is a new entry."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


_KEYFRAMES: OrderedDict = OrderedDict()   # (file_key, stream) -> keyframe times; bounded, shared by threads
_KEYFRAMES_LOCK = threading.Lock()


def keyframe_times(path, stream: int | None = None) -> np.ndarray:
    """Sorted times (s, from the stream start) of the stream's keyframes, learned once per file version.

    From the demuxer's index when it lists every sample (mp4/mov: free), else from one demux pass over the
    packets (no decoding; Matroska cues list only a few keyframes). mp4 index times are decode times (dts),
    shifted by the first packet's pts - dts (the B-frame delay) to presentation times. They only steer the
    seek-or-decode choice, never which frame is returned (see `_pick_sparse`)."""
    key = (file_key(path), stream)
    with _KEYFRAMES_LOCK:
        if key in _KEYFRAMES:
            _KEYFRAMES.move_to_end(key)
            return _KEYFRAMES[key]
    container, vs = _open(path, stream)
    with container:
        start, tb = vs.start_time or 0, vs.time_base
        entries = vs.index_entries
        if len(entries) >= 0.5 * (vs.frames or float("inf")):
            first = next((p for p in container.demux(vs) if p.pts is not None and p.dts is not None), None)
            shift = 0 if first is None else first.pts - first.dts  # B-frame reorder delay: dts -> pts
            pts = [e.timestamp + shift for e in entries if e.is_keyframe and not e.is_discard]
        else:
            pts = [p.pts for p in container.demux(vs) if p.is_keyframe and p.pts is not None and not p.is_discard]
    times = np.sort(np.array([float((p - start) * tb) for p in pts], dtype=np.float64))  # (n_keyframes,)
    with _KEYFRAMES_LOCK:
        _KEYFRAMES[key] = times
        while len(_KEYFRAMES) > 4096:
            _KEYFRAMES.popitem(last=False)
    return times


def _pick_sparse(container, vs, path: str, targets: np.ndarray, keyframes: np.ndarray, fps: float,
                 max_pixels: int | None, factor: int, count: list, lo: float = -math.inf, hi: float = math.inf):
    """`_pick` (the nearest-frame rule over the frames with lo <= time <= hi) that seeks over long gaps.

    Frames are decoded in runs. The first run starts at the stream start, as `_pick` does. Once a run has
    served a target, if the last keyframe at or before the next target lies more than SEEK_COST_FRAMES past
    the last decoded frame, the run ends and the next starts with a seek to the target (the demuxer lands on
    the keyframe before). A run after a seek is trusted from its first keyframe t0 on (leading frames of an
    open GOP are dropped), and only if t0 <= max(target, lo) + TIME_TOL: then no frame before t0 is the
    nearest, and the frames from t0 on are all the stream's frames, so every choice equals the sequential
    one. Otherwise it seeks one keyframe earlier (2 more tries, then from the start). Returns None (the caller then decodes sequentially) where the
    rule's premise fails: a frame without a timestamp, times not increasing, or a run with no frame in [lo, hi]."""
    start_pts, tb = vs.start_time or 0, vs.time_base
    gap = SEEK_COST_FRAMES / fps

    def last_key(tau: float) -> int:  # index of the last keyframe at or before tau, -1 if none
        return int(np.searchsorted(keyframes, max(tau, lo) + TIME_TOL, side="right")) - 1

    def timed(frames):  # (time or None, frame), counting each decoded frame
        for frame in frames:
            count[0] += 1
            _check_deadline(path)
            yield (None if frame.pts is None else float((frame.pts - start_pts) * tb)), frame

    chosen, j, first_run = [], 0, True
    while j < len(targets):  # one run per pass; each run serves at least one target
        tau, kf, j0 = max(targets[j], lo), last_key(targets[j]), j
        run, head = None, None
        for attempt in range(4):
            from_start = attempt == 3 or kf < 0 or keyframes[kf] <= gap
            if not (first_run and from_start):  # a fresh container is at the stream start already
                # the demuxer lands on the keyframe at or before the time asked: the target itself first
                to = 0.0 if from_start else tau if attempt == 0 else keyframes[kf]
                container.seek(start_pts + int(to / tb), stream=vs, backward=True)
            first_run, run = False, timed(container.decode(vs))
            for t, frame in run:
                if t is None:
                    return None
                if from_start or (frame.key_frame and t <= tau + TIME_TOL):
                    head = (t, frame)
                    break
                if t > tau + TIME_TOL:
                    break  # landed after the target: try the keyframe before
                # else a leading frame of an open GOP (shown before its keyframe): skip it
            if head is not None:
                break
            kf -= 1
        if head is None:
            return None
        cur, ended = None, True
        for t, frame in itertools.chain([head], run):
            if t is None:
                return None
            if t < lo - TIME_TOL:
                continue
            if t > hi + TIME_TOL:
                break
            if cur is not None:
                if t <= cur[0]:
                    return None
                j = _give_nearest(cur, t, targets, j, chosen, max_pixels, factor)
                if j == len(targets):
                    return chosen
            cur = [t, frame, None]
            if j > j0 and (k := last_key(targets[j])) >= 0 and keyframes[k] > t + gap:
                ended = False  # the next target's keyframe is far ahead: seek there
                break
        if ended:  # the stream (or the window) ended: the remaining targets get its last frame
            if cur is None:
                return None
            x = cur[2] if cur[2] is not None else _to_tensor(cur[1], max_pixels, factor)
            return chosen + [(cur[0], x)] * (len(targets) - j)
    return chosen


def _clip(path: str, chosen: list, targets: np.ndarray, fps: float, n_out: int, decoded: int) -> Clip:
    """Check the frames reach the targets (else the file is truncated), stack them, repeat the last to n_out."""
    if not chosen:
        raise VideoError(path, "no decodable video frame")
    if targets[-1] - chosen[-1][0] > max(1.0, 2 / fps):
        raise VideoError(path, f"truncated: decodable frames stop at {chosen[-1][0]:.2f} s, "
                               f"before {targets[-1]:.2f} s")
    chosen = chosen + [chosen[-1]] * (n_out - len(chosen))
    sizes = {tuple(x.shape) for _, x in chosen}
    if len(sizes) > 1:
        raise VideoError(path, f"frame size changes inside the video {sorted(sizes)}; pass max_pixels")
    frames = torch.cat([x for _, x in chosen])  # (T, 3, H, W)
    return Clip(frames, np.array([t for t, _ in chosen], dtype=np.float64), path, decoded)


def probe(path, stream: int | None = None) -> VideoInfo:
    """Duration, frame rate, frame count and size of a video stream (decodes only if no duration is stored)."""
    container, vs = _open(path, stream)
    with container:
        fps = float(vs.average_rate or vs.guessed_rate or 0) or 25.0
        if vs.duration:
            duration = float(vs.duration * vs.time_base)
        elif container.duration:  # e.g. Matroska keeps the duration on the container only
            duration = container.duration / av.time_base
        else:  # nothing stored: decode to the end
            last = max((t for t, _ in _frames(container, vs, str(path))), default=None)
            duration = 0.0 if last is None else last + 1 / fps
        if duration <= 0:
            raise VideoError(path, "zero-length video (no duration and no decodable frame)")
        n = vs.frames or max(1, round(duration * fps))  # AV1-in-mkv headers hold no frame count
        return VideoInfo(str(path), vs.index, duration, fps, n, bool(vs.frames), vs.codec_context.width,
                         vs.codec_context.height)


METHODS = ("auto", "seek", "sequential")


def _seeks(method: str, n_targets: int, span_frames: float) -> bool:
    """Whether to use `_pick_sparse`: always for "seek", never for "sequential"; for "auto" when the targets
    are sparse enough that a seek could pay (more than 2 * SEEK_COST_FRAMES frames apart on average)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return method == "seek" or method == "auto" and span_frames > 2 * SEEK_COST_FRAMES * n_targets


def _check_rule(fps: float | None, max_frames: int | None, nframes: int | None) -> None:
    """An overview's frame rule: exactly nframes = K (even, >= 2), or the fps rule (fps > 0, max_frames >= 2)."""
    if nframes is not None and (nframes < 2 or nframes % 2):
        raise ValueError(f"nframes must be an even number >= 2, got {nframes}")
    if nframes is None and not (fps is not None and max_frames is not None and fps > 0 and max_frames >= 2):
        raise ValueError(f"an overview needs nframes, or fps > 0 and max_frames >= 2 (the fps rule), got fps={fps}, "
                         f"max_frames={max_frames}")


def sample_overview(path, fps: float | None = None, max_frames: int | None = None, nframes: int | None = None,
                    max_pixels: int | None = None, stream: int | None = None, factor: int = 32,
                    method: str = "auto", cache: "FrameCache | None" = None) -> Clip:
    """Uniform overview of the whole video: exactly nframes=K frames, or (the fps rule, fps and max_frames given)
    min(max_frames, round(duration * fps)) made even. Targets are bin centres (`uniform_targets`), at most one per
    real frame; each gets its nearest frame.

    method: "sequential" decodes from the start until the last target is served; "seek" seeks to the keyframe
    before far-apart targets (`_pick_sparse`, same frames); "auto" seeks when the targets are sparse.
    cache: a `FrameCache` to read the overview from and store it in (the returned tensors are shared: do
    not modify them in place)."""
    path = str(path)
    _check_rule(fps, max_frames, nframes)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if cache is not None:
        return cache.overview(path, fps=fps, max_frames=max_frames, nframes=nframes, max_pixels=max_pixels,
                              stream=stream, factor=factor, method=method)
    info = probe(path, stream)
    n_out = nframes if nframes is not None else even_count(max(1, round(info.duration * fps)), max_frames)
    targets = uniform_targets(0.0, info.duration, min(n_out, info.num_frames))
    count, chosen = [0], None
    if _seeks(method, len(targets), info.num_frames):
        keys = keyframe_times(path, stream)
        container, vs = _open(path, stream)
        with container:
            chosen = _pick_sparse(container, vs, path, targets, keys, info.fps, max_pixels, factor, count)
    if chosen is None:
        container, vs = _open(path, stream)
        with container:
            chosen = _pick(_frames(container, vs, path, 0.0, count), targets, max_pixels, factor)
    return _clip(path, chosen, targets, info.fps, n_out, count[0])


def crop(path, start: float, end: float, level: str | None = "medium", *, fps: float, max_frames: int,
         max_pixels: int | None = None, min_length: float = 0.0, stream: int | None = None,
         tokens_per_pixel_area: int = 32 * 32, method: str = "auto") -> Clip:
    """Frames of [start, end] only: seek to the keyframe before start, decode until the window is covered
    (or, when the targets are sparse, seek between them as `sample_overview` does; same frames).

    Frame count and pixel budget come from `crop_budget` (the caller's fps and max_frames, e.g. RolloutConfig's
    crop_fps and crop_max_frames); an explicit max_pixels overrides the level's budget.
    Only frames with start <= time <= end are used; a window holding no frame gets the frame nearest its centre.
    """
    path = str(path)
    info = probe(path, stream)
    try:
        start, end = check_window(start, end, info.duration, min_length)
    except ValueError as e:
        raise VideoError(path, str(e)) from None
    factor = round(math.sqrt(tokens_per_pixel_area))  # 32 for Qwen3-VL, 28 for Qwen2.5-VL
    n_out, budget = crop_budget(end - start, level, fps, max_frames, tokens_per_pixel_area)
    max_pixels = max_pixels or budget
    n_real = max(1, round((end - start) * info.fps))  # about how many real frames the window holds
    targets = uniform_targets(start, end, min(n_out, n_real))
    count, edge, chosen = [0], {}, None
    if _seeks(method, len(targets), (end - start) * info.fps):
        keys = keyframe_times(path, stream)
        container, vs = _open(path, stream)
        with container:
            chosen = _pick_sparse(container, vs, path, targets, keys, info.fps, max_pixels, factor, count, start, end)
        if chosen is not None:
            return _clip(path, chosen, targets, info.fps, n_out, count[0])
    container, vs = _open(path, stream)
    with container:
        chosen = _pick(_frames_in_window(_frames(container, vs, path, start, count), start, end, edge), targets,
                       max_pixels, factor)
        if not chosen and edge:  # window shorter than the frame spacing: the frame nearest its centre
            t, frame = min(edge.values(), key=lambda f: abs(f[0] - (start + end) / 2))
            chosen = [(t, _to_tensor(frame, max_pixels, factor))]
    return _clip(path, chosen, targets, info.fps, n_out, count[0])


# ----------------------------------------------------------------------------- cache and pool

class FrameCache:
    """Decoded overviews, reused: RL draws the same prompts again in later epochs, with K from a few values.

    A bounded in-memory LRU (max_bytes of frame data) keyed by (real path, size, mtime_ns, stream, frame rule
    (K, or fps and max_frames), max_pixels, factor), optionally backed by disk_dir: one torch.save file per
    entry, written atomically (temporary file + os.replace), oldest-used files deleted past disk_max_bytes.
    Ranks may share disk_dir: a file another process prunes mid-operation is a miss, never an error.
    Thread-safe; a key being decoded by one thread is waited for, not decoded twice. Hits return the cached
    tensors themselves (one copy per overview, whoever asks): never modify them in place.
    `stats()`: hits (memory), disk_hits, misses, hit_rate, decode_seconds (spent on misses), seconds_saved
    (the decode time of each hit's entry, summed), entries, bytes."""

    def __init__(self, max_bytes: int = 2 << 30, disk_dir: str | None = None, disk_max_bytes: int = 20 << 30):
        self.max_bytes, self.disk_dir, self.disk_max_bytes = max_bytes, disk_dir, disk_max_bytes
        if disk_dir:
            os.makedirs(disk_dir, exist_ok=True)
        self._mem: OrderedDict = OrderedDict()   # key -> (Clip, decode seconds)
        self._bytes, self._pending = 0, {}       # key -> threading.Event while one thread decodes it
        self._lock = threading.Lock()
        self._stats = dict(hits=0, disk_hits=0, misses=0, decode_seconds=0.0, seconds_saved=0.0)

    @staticmethod
    def key(path, fps: float | None = None, max_frames: int | None = None, nframes: int | None = None,
            max_pixels: int | None = None, stream: int | None = None, factor: int = 32) -> tuple:
        _check_rule(fps, max_frames, nframes)
        rule = ("K", nframes) if nframes is not None else ("fps", float(fps), max_frames)
        return (*file_key(path), stream, rule, max_pixels, factor)

    def stats(self, reset: bool = False) -> dict:
        with self._lock:
            out = dict(self._stats, entries=len(self._mem), bytes=self._bytes)
            if reset:
                self._stats = dict.fromkeys(self._stats, 0) | dict(decode_seconds=0.0, seconds_saved=0.0)
        asked = out["hits"] + out["disk_hits"] + out["misses"]
        return out | dict(hit_rate=(out["hits"] + out["disk_hits"]) / asked if asked else 0.0)

    def overview(self, path, fps: float | None = None, max_frames: int | None = None, nframes: int | None = None,
                 max_pixels: int | None = None, stream: int | None = None, factor: int = 32,
                 method: str = "auto") -> Clip:
        """`sample_overview` through the cache (a hit's Clip has decoded=0)."""
        path = str(path)
        try:
            key = self.key(path, fps, max_frames, nframes, max_pixels, stream, factor)
        except OSError:  # missing or unreadable: let sample_overview name the problem
            return sample_overview(path, fps, max_frames, nframes, max_pixels, stream, factor, method)
        while True:
            with self._lock:
                clip = self._lookup(key, path)
                if clip is not None:
                    return clip
                event = self._pending.get(key)
                if event is None:
                    self._pending[key] = threading.Event()
                    break
            while not event.wait(0.05):  # another thread decodes it: wait (within this thread's deadline)
                _check_deadline(path)
        try:
            clip = self._load(key, path)
            if clip is None:
                t0 = time.perf_counter()
                clip = sample_overview(path, fps, max_frames, nframes, max_pixels, stream, factor, method)
                seconds = time.perf_counter() - t0
                with self._lock:
                    self._stats["misses"] += 1
                    self._stats["decode_seconds"] += seconds
                self._store(key, clip, seconds)
            return clip
        finally:
            with self._lock:
                self._pending.pop(key).set()

    def _lookup(self, key: tuple, path: str) -> Clip | None:  # under the lock
        if key not in self._mem:
            return None
        self._mem.move_to_end(key)
        clip, seconds = self._mem[key]
        self._stats["hits"] += 1
        self._stats["seconds_saved"] += seconds
        return Clip(clip.frames, clip.times, path, 0)

    def _put_mem(self, key: tuple, clip: Clip, seconds: float) -> None:
        size = clip.frames.numel()
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._mem:
                return
            self._mem[key], self._bytes = (clip, seconds), self._bytes + size
            while self._bytes > self.max_bytes:
                old, _ = self._mem.popitem(last=False)[1]
                self._bytes -= old.frames.numel()

    def _file(self, key: tuple) -> str:
        return os.path.join(self.disk_dir, hashlib.sha1(repr(key).encode()).hexdigest() + ".pt")

    def _load(self, key: tuple, path: str) -> Clip | None:
        """The disk copy of key, or None; an unreadable or foreign file is deleted and counts as absent.
        Ranks may share disk_dir: a file another one prunes before the read is a miss, after it a hit."""
        if not self.disk_dir or not os.path.exists(file := self._file(key)):
            return None
        try:
            d = torch.load(file, weights_only=True)
            ok = isinstance(d, dict) and d.get("key") == repr(key)
        except FileNotFoundError:  # pruned since the exists(): a miss (and nothing of ours to delete)
            return None
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError):  # torn or foreign file
            ok = False
        if not ok:  # a cache miss, not an error: drop the file, decode again
            with contextlib.suppress(FileNotFoundError):
                os.remove(file)
            return None
        with contextlib.suppress(FileNotFoundError):  # most recently used (pruned since the read: still a hit)
            os.utime(file)
        clip = Clip(d["frames"], d["times"].numpy(), path, 0)
        with self._lock:
            self._stats["disk_hits"] += 1
            self._stats["seconds_saved"] += d["seconds"]
        self._put_mem(key, clip, d["seconds"])
        return clip

    def _store(self, key: tuple, clip: Clip, seconds: float) -> None:
        self._put_mem(key, clip, seconds)
        if not self.disk_dir:
            return
        fd, tmp = tempfile.mkstemp(dir=self.disk_dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"key": repr(key), "frames": clip.frames, "times": torch.from_numpy(clip.times),
                            "seconds": seconds}, f)
            os.replace(tmp, self._file(key))
        except BaseException:
            os.remove(tmp)
            raise
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest-used files of disk_dir until it holds at most disk_max_bytes. Other ranks prune
        the same folder at the same time: a file gone between the listing and its stat or remove is skipped."""
        files = []
        for e in os.scandir(self.disk_dir):
            if e.name.endswith(".pt"):
                try:
                    st = e.stat()
                except FileNotFoundError:  # another process deleted it after the listing
                    continue
                files.append((st.st_mtime, st.st_size, e.path))
        total = sum(s for _, s, _ in files)
        for _, size, file in sorted(files):  # oldest-used first, until under the cap
            if total <= self.disk_max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):  # another process deleted it first
                os.remove(file)
            total -= size


class DecodePool:
    """Overviews and crops decoded in worker threads (PyAV releases the GIL while decoding), so decoding
    overlaps the model and other decodes. Every task has a deadline of `timeout` seconds from its start,
    checked between decoded frames; `result` also gives up on a task that runs past it (stuck inside FFmpeg:
    the thread cannot be killed, it is abandoned) or waits in a queue that made no progress for that long.
    Errors come back from `result` as VideoError naming the file, never a hang.

        pool = DecodePool(workers=2, timeout=120, cache=FrameCache())
        futs = [pool.submit_overview(p, nframes=64, max_pixels=...) for p in paths]
        clips = [pool.result(f) for f in futs]          # raises VideoError(path, ...) on a bad video
        pool.prefetch_overviews([(p, dict(nframes=64, max_pixels=...)) for p in next_paths])

    `stats(reset)`: tasks, errors, timeouts, decode_seconds (worker seconds), wait_seconds (caller seconds
    blocked in `result`)."""

    GRACE_S = 5.0   # extra seconds `result` allows past a task's own deadline before giving up on it

    def __init__(self, workers: int, timeout: float, cache: FrameCache | None = None):
        if workers < 1 or not timeout > 0:
            raise ValueError(f"need workers >= 1 and timeout > 0, got workers={workers}, timeout={timeout}")
        self.workers, self.timeout, self.cache = workers, timeout, cache
        self._ex = ThreadPoolExecutor(workers, thread_name_prefix="decode")
        self._lock = threading.Lock()
        self._progress = time.monotonic()  # last time a task started or ended
        self._stats = dict(tasks=0, errors=0, timeouts=0, decode_seconds=0.0, wait_seconds=0.0)

    def _submit(self, path, fn, *args, **kwargs) -> Future:
        started = []

        def work():
            t0 = time.monotonic()
            started.append(t0)
            self._progress = t0
            _LOCAL.deadline, _LOCAL.timeout = t0 + self.timeout, self.timeout
            try:
                return fn(*args, **kwargs)
            except Exception:
                with self._lock:
                    self._stats["errors"] += 1
                raise
            finally:
                _LOCAL.deadline = None
                self._progress = time.monotonic()
                with self._lock:
                    self._stats["decode_seconds"] += self._progress - t0

        with self._lock:
            self._stats["tasks"] += 1
        future = self._ex.submit(work)
        future.path, future.started = str(path), started
        return future

    def submit_overview(self, path, **kwargs) -> Future:
        """`sample_overview(path, **kwargs)` in a worker, through the pool's cache if it has one."""
        return self._submit(path, sample_overview, path, **kwargs, cache=self.cache)

    def submit_crop(self, path, start, end, **kwargs) -> Future:
        """`crop(path, start, end, **kwargs)` in a worker."""
        return self._submit(path, crop, path, start, end, **kwargs)

    def prefetch_overviews(self, jobs: list[tuple[str, dict]]) -> list[Future]:
        """Decode (path, sample_overview kwargs) jobs into the cache in the background (e.g. the next
        step's prompts while this step trains). Errors stay in the returned futures, unraised."""
        if self.cache is None:
            raise ValueError("prefetch_overviews needs a DecodePool with a cache")
        return [self.submit_overview(path, **kwargs) for path, kwargs in jobs]

    def result(self, future: Future) -> Clip:
        """The task's Clip; raises its VideoError/ValueError, or VideoError(path, ...) on a timeout, a stalled
        queue or any other failure."""
        t0 = time.monotonic()
        try:
            while True:
                try:
                    return future.result(timeout=0.05)
                except FuturesTimeout:
                    pass
                now, limit = time.monotonic(), self.timeout + self.GRACE_S
                if future.started and now - future.started[0] > limit:
                    with self._lock:
                        self._stats["timeouts"] += 1
                    raise VideoError(future.path, f"decoding timed out after {self.timeout:g} s (worker abandoned)")
                if not future.started and now - self._progress > limit:
                    raise VideoError(future.path, f"decode pool stalled: no worker free for {limit:g} s")
        except (VideoError, ValueError):
            raise
        except Exception as e:  # anything else a worker raised (OSError, av errors): name the file
            raise VideoError(future.path, f"{type(e).__name__}: {e}") from e
        finally:
            with self._lock:
                self._stats["wait_seconds"] += time.monotonic() - t0

    def stats(self, reset: bool = False) -> dict:
        with self._lock:
            out = dict(self._stats)
            if reset:
                self._stats = dict(tasks=0, errors=0, timeouts=0, decode_seconds=0.0, wait_seconds=0.0)
        return out

    def close(self) -> None:
        """Stop taking tasks; queued ones are cancelled, running ones finish (or hang) on their own."""
        self._ex.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- synthetic video

NUM_DIGITS, BASE = 8, 4                  # frame index written as 8 base-4 digits: up to 65536 frames
LEVELS = (40, 98, 156, 214)              # grey level of each digit; 58 apart survives H.264 easily


def synthetic_frames(num_frames: int, height: int, width: int, seed: int = 0, first: int = 0) -> torch.Tensor:
    """(T, 3, H, W) uint8 frames: the top half holds 8 flat grey cells giving the frame index (first, first + 1,
    ...) in base 4, the bottom half seeded blocky colour noise. Proportional layout, so the code survives resizing."""
    assert first + num_frames <= BASE ** NUM_DIGITS, f"at most {BASE ** NUM_DIGITS} frames, got {first + num_frames}"
    assert height >= 16 and width >= 8 * NUM_DIGITS, f"frames must be >= 16x{8 * NUM_DIGITS}, got {height}x{width}"
    g = torch.Generator().manual_seed(seed)
    top = height // 2
    noise = torch.randint(0, 256, (num_frames, 3, (height - top + 7) // 8, (width + 7) // 8), generator=g,
                          dtype=torch.uint8)
    noise = noise.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)[:, :, : height - top, :width]
    frames = torch.empty(num_frames, 3, height, width, dtype=torch.uint8)
    frames[:, :, top:] = noise
    idx = torch.arange(first, first + num_frames)
    for k in range(NUM_DIGITS):  # most significant digit first, left to right
        digit = idx // BASE ** (NUM_DIGITS - 1 - k) % BASE
        x0, x1 = k * width // NUM_DIGITS, (k + 1) * width // NUM_DIGITS
        frames[:, :, :top, x0:x1] = torch.tensor(LEVELS, dtype=torch.uint8)[digit].view(-1, 1, 1, 1)
    return frames


def read_frame_index(frame: torch.Tensor) -> int:
    """Read back the index written by `synthetic_frames` from one (3, H, W) frame (the centre of each cell)."""
    h, w = frame.shape[-2:]
    band = frame[:, h // 8: 3 * h // 8].float()  # middle rows of the code band, away from its edges
    index = 0
    for k in range(NUM_DIGITS):
        x0, x1 = k * w // NUM_DIGITS, (k + 1) * w // NUM_DIGITS
        q = (x1 - x0) // 4
        level = band[:, :, x0 + q: x1 - q].mean().item()
        digit = int(np.abs(np.array(LEVELS) - level).argmin())
        index = index * BASE + digit
    return index


def write_video(path, frames, fps: float, codec: str = "libx264", crf: int = 18,
                gop: int | None = None, container_format: str | None = None, faststart: bool = False,
                encoder_options: dict | None = None) -> None:
    """Encode (T, 3, H, W) uint8 RGB frames (a tensor, or an iterable of such chunks for long videos) to a
    file (or a file-like object, mp4 by default) as yuv420p.

    gop sets the keyframe interval (frames), so tests can check that a crop seeks instead of decoding from 0;
    faststart puts the mp4 index before the data (then a cut file still opens, and reads as truncated);
    encoder_options are added to the encoder's (e.g. {"bframes": "3"} with libx264's "x264-params").
    """
    chunks = [frames] if isinstance(frames, torch.Tensor) else frames
    if container_format is None and not isinstance(path, (str, os.PathLike)):
        container_format = "mp4"
    rate = Fraction(fps).limit_denominator(1001)
    options = {"movflags": "faststart"} if faststart else {}
    to_yuv = VideoReformatter()  # one converter for the whole file (a new one per frame costs ~0.2-5 ms: to_rgb)
    with av.open(path, mode="w", format=container_format, options=options) as out:
        vs, i = None, 0
        for frames in chunks:
            assert frames.dtype == torch.uint8 and frames.ndim == 4 and frames.shape[1] == 3, "need (T, 3, H, W) uint8"
            assert frames.shape[2] % 2 == 0 and frames.shape[3] % 2 == 0, f"yuv420p needs even sizes, got {tuple(frames.shape)}"
            if vs is None:
                vs = out.add_stream(codec, rate=rate)
                vs.width, vs.height, vs.pix_fmt = frames.shape[3], frames.shape[2], "yuv420p"
                if codec in ("libx264", "libx265"):
                    # ultrafast + one thread: fast and byte-for-byte reproducible (frame threads reorder work)
                    vs.options = {"crf": str(crf), "preset": "ultrafast", "threads": "1", **(encoder_options or {})}
                if gop is not None:
                    vs.codec_context.gop_size = gop
            for x in frames.permute(0, 2, 3, 1).numpy():  # (H, W, 3) each
                # convert to yuv420p ourselves: PyAV's implicit conversion inside encode() is not deterministic
                rgb = av.VideoFrame.from_ndarray(np.ascontiguousarray(x), format="rgb24")
                frame = to_yuv.reformat(rgb, format="yuv420p", threads=1)
                frame.pts, frame.time_base = i, 1 / rate
                out.mux(vs.encode(frame))
                i += 1
        out.mux(vs.encode(None))  # flush the encoder
