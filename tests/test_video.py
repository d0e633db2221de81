"""
Tests for video.py: decoding real and synthetic files, exact frame times, windowed crops, bad input.

    python -m pytest tests/test_video.py -q

Synthetic videos carry their frame index in the pixels (`synthetic_frames`), so a decoded frame's
identity can be checked against its reported time. Real files (../shared/real_videos) come with
every frame's true pts_time from FFmpeg.
"""
import io
import json
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

import video
from video import VideoError

REAL = Path(__file__).resolve().parents[2] / "shared" / "real_videos"
NASA = REAL / "nasa_13013.mp4"
CLIP = dict(fps=2.0, max_frames=128)          # Video-o3's crops (recipes.COMMON's crop_fps, crop_max_frames)
OVERVIEW = dict(fps=2.0, max_frames=768)      # ... and its overview's fps rule (overview_fps, overview_max_frames)
FPS, SECONDS, GOP = 10, 60, 20


def truth_times(stream: int) -> np.ndarray:
    """Every frame's pts_time from the FFmpeg dump beside the real file, presentation order."""
    info = json.loads((REAL / f"nasa_13013.mp4.stream{stream}.all_frames_info.json").read_text())
    return np.array([float(d["pts_time"]) for d in info])


def indices(clip) -> list[int]:
    return [video.read_frame_index(f) for f in clip.frames]


@pytest.fixture(scope="module")
def long_video(tmp_path_factory) -> Path:
    """60 s at 10 fps (600 frames), keyframe at least every 20 frames."""
    path = tmp_path_factory.mktemp("vid") / "long.mp4"
    video.write_video(path, video.synthetic_frames(FPS * SECONDS, 64, 96, seed=1), FPS, gop=GOP)
    return path


def write_short(tmp_path, num_frames: int, name: str = "short.mp4") -> Path:
    path = tmp_path / name
    video.write_video(path, video.synthetic_frames(num_frames, 64, 64), FPS)
    return path


# ----------------------------------------------------------------------------- synthetic round trip

def test_synthetic_round_trip_every_frame(long_video):
    """Each decoded frame reads back as its own index, at time index / fps exactly."""
    with av.open(str(long_video)) as c:
        vs = c.streams.video[0]
        got = [(video.read_frame_index(torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1)),
                float(f.pts * vs.time_base)) for f in c.decode(vs)]
    assert [i for i, _ in got] == list(range(FPS * SECONDS))
    np.testing.assert_allclose([t for _, t in got], np.arange(FPS * SECONDS) / FPS, atol=1e-9)


def test_write_video_to_buffer(tmp_path):
    """A file-like target gets a playable mp4."""
    buf = io.BytesIO()
    video.write_video(buf, video.synthetic_frames(6, 64, 64), FPS)
    (tmp_path / "b.mp4").write_bytes(buf.getvalue())
    info = video.probe(tmp_path / "b.mp4")
    assert (info.num_frames, info.width, info.height, info.fps) == (6, 64, 64, FPS)


def test_read_frame_index_survives_resize(long_video):
    """The index code is proportional, so it still reads after a downscale to 32x64."""
    clip = video.sample_overview(long_video, nframes=8, max_pixels=64 * 64)
    assert tuple(clip.frames.shape[2:]) == (32, 64)
    assert indices(clip) == [round(t * FPS) for t in clip.times]


# ----------------------------------------------------------------------------- overview

@pytest.mark.parametrize("fps, max_frames, expected", [
    (2.0, 768, 120),    # 60 s * 2 fps
    (2.0, 50, 50),      # capped by max_frames
    (2.0, 51, 50),      # odd cap: rounded down to even
    (0.05, 768, 4),     # round(3) is odd: rounded up to 4
    (0.01, 768, 2),     # round(0.6) = 1: at least 2
])
def test_overview_fps_mode(long_video, fps, max_frames, expected):
    clip = video.sample_overview(long_video, fps=fps, max_frames=max_frames)
    assert clip.frames.shape == (expected, 3, 64, 96) and clip.frames.dtype == torch.uint8
    assert clip.times.dtype == np.float64 and clip.times.shape == (expected,)
    all_times = np.arange(FPS * SECONDS) / FPS
    want = all_times[video.sample_frame_indices(all_times, video.uniform_targets(0, SECONDS, expected))]
    np.testing.assert_allclose(clip.times, want, atol=1e-9)
    assert indices(clip) == [round(t * FPS) for t in clip.times]


@pytest.mark.parametrize("k", [4, 8, 16, 64])  # the nFrames-gating choices
def test_overview_nframes_exact_and_uniform(long_video, k):
    clip = video.sample_overview(long_video, nframes=k)
    assert len(clip.frames) == len(clip.times) == k
    gaps = np.diff(clip.times)
    assert np.all(np.abs(gaps - SECONDS / k) <= 1 / FPS + 1e-9), gaps  # uniform up to one frame
    assert len(set(indices(clip))) == k and indices(clip) == [round(t * FPS) for t in clip.times]


@pytest.mark.parametrize("nframes", [0, 3, -2])  # zero, odd, negative
def test_overview_rejects_bad_nframes(long_video, nframes):
    with pytest.raises(ValueError, match="even"):
        video.sample_overview(long_video, nframes=nframes)


@pytest.mark.parametrize("kwargs", [{}, dict(fps=2.0), dict(max_frames=768), dict(fps=0.0, max_frames=768)])
def test_overview_needs_a_frame_rule(long_video, kwargs):
    """No default rule: K frames, or the caller's fps and max_frames (recipes.py's overview_fps, ...)."""
    with pytest.raises(ValueError, match="fps rule"):
        video.sample_overview(long_video, **kwargs)
    with pytest.raises(ValueError, match="fps rule"):
        video.FrameCache().overview(long_video, **kwargs)


@pytest.mark.parametrize("num_frames, kwargs, expected", [
    (5, dict(nframes=8), [0, 1, 2, 3, 4, 4, 4, 4]),   # K > real frames: all frames, last one repeated
    (3, dict(fps=10.0, max_frames=768), [0, 1, 2, 2]),   # 3 frames at 10 fps: odd, last repeated to 4
    (2, dict(fps=2.0, max_frames=768), [0, 1]),          # round(0.2 s * 2) = 0 -> the minimum of 2
])
def test_overview_short_video_repeats_last(tmp_path, num_frames, kwargs, expected):
    clip = video.sample_overview(write_short(tmp_path, num_frames), **kwargs)
    assert indices(clip) == expected
    np.testing.assert_allclose(clip.times, np.array(expected) / FPS, atol=1e-9)


# ----------------------------------------------------------------------------- crop

def test_crop_decodes_only_the_window(long_video):
    clip = video.crop(long_video, 20.0, 24.0, **CLIP)
    window = 4 * FPS
    assert clip.decoded <= window + GOP + 2, clip.decoded  # pre-roll from a keyframe + the frame past the end
    assert clip.decoded < FPS * SECONDS // 5
    assert np.all((clip.times >= 20.0) & (clip.times <= 24.0)), clip.times
    assert indices(clip) == [round(t * FPS) for t in clip.times]
    all_times = np.arange(FPS * SECONDS) / FPS
    n, _ = video.crop_budget(4.0, "medium", **CLIP)
    want = all_times[video.sample_frame_indices(all_times, video.uniform_targets(20.0, 24.0, n))]
    np.testing.assert_allclose(clip.times, want, atol=1e-9)


def test_crop_paravt_subagent_settings(long_video):
    """ParaVT sub-agent: 1 fps, at most 16 frames, at most 224x224 pixels."""
    clip = video.crop(long_video, 10.0, 50.0, level=None, fps=1, max_frames=16, max_pixels=224 * 224)
    assert len(clip.frames) == 16 and np.all((clip.times >= 10) & (clip.times <= 50))
    assert clip.frames.shape[2] * clip.frames.shape[3] <= 224 * 224
    assert indices(clip) == [round(t * FPS) for t in clip.times]


def test_crop_window_shorter_than_a_frame(long_video):
    """No frame inside [20.01, 20.05]: the frame nearest the centre (20.0 s), twice (T even)."""
    clip = video.crop(long_video, 20.01, 20.05, **CLIP)
    assert indices(clip) == [200, 200] and clip.decoded <= GOP + 2


class LateSeekContainer:
    """A demuxer whose seeks land at 5 s whatever the target; seeking to the start works."""

    def __init__(self):
        self.seeks, self.pos = [], 0

    def seek(self, offset, stream=None, backward=True):
        self.seeks.append(offset)
        self.pos = 50 if offset > 0 else 0

    def decode(self, vs):
        return iter([SimpleNamespace(pts=p) for p in range(self.pos, 100)])


def test_inexact_seek_falls_back_to_the_start():
    """If the first frame after a seek is already past the target, frames before it would be lost:
    decoding restarts from the stream start, once, and nothing before the target is skipped."""
    container, count = LateSeekContainer(), [0]
    vs = SimpleNamespace(start_time=0, time_base=Fraction(1, 10), average_rate=10)
    times = [t for t, _ in video._frames(container, vs, "late.mp4", 3.0, count)]
    assert container.seeks == [30, 0] and times == [p / 10 for p in range(100)]
    assert count[0] == 1 + 100  # the one late frame that revealed the problem counts as decoded too


@pytest.mark.parametrize("level", ["coarse", "medium", "fine"])
def test_crop_levels_respect_pixel_budget(level):
    """nasa stream 1 is 480x270; a 10 s window at 2 fps = 20 frames, budget per level from crop_budget."""
    clip = video.crop(NASA, 2.0, 12.0, level=level, stream=1, **CLIP)
    n, max_pixels = video.crop_budget(10.0, level, **CLIP)
    h, w = clip.frames.shape[2:]
    assert len(clip.frames) == n and h * w <= max_pixels and h % 32 == 0 and w % 32 == 0
    assert abs(w / h - 480 / 270) < 0.25  # aspect ratio kept (up to rounding to 32)


@pytest.mark.parametrize("window, level, kw, expected", [
    (4.0, "medium", {}, (8, 512 * 1024)),             # 4 pairs: 2048 // 4 = 512 tokens
    (60.0, "coarse", {}, (120, 17 * 1024)),           # 60 pairs: 1024 // 60 = 17 tokens
    (100.0, "fine", {}, (128, 48 * 1024)),            # 200 frames capped at 128: 3072 // 64 = 48
    (1.0, "fine", {}, (2, 768 * 1024)),               # 3072 tokens for one pair: capped at 768
    (0.2, "coarse", {}, (2, 768 * 1024)),             # under one frame at 2 fps: still 2 frames
    (4.0, None, {}, (8, None)),                       # no level: no pixel budget
    (4.0, "medium", dict(tokens_per_pixel_area=28 * 28), (8, 512 * 784)),  # Qwen2.5-VL patch area
    (40.0, "medium", dict(fps=1.0, max_frames=16), (16, 256 * 1024)),      # explicit fps and cap
])
def test_crop_budget(window, level, kw, expected):
    assert video.crop_budget(window, level, **{**CLIP, **kw}) == expected


def test_crop_budget_unknown_level():
    with pytest.raises(ValueError, match="coarse, medium, fine"):
        video.crop_budget(4.0, "ultra", **CLIP)


# ----------------------------------------------------------------------------- real files

@pytest.mark.parametrize("stream, json_stream, fps, num_frames", [
    (None, 0, 25.0, 325),            # default = first video stream in container order (stream 0)
    (1, 3, 30000 / 1001, 390),       # second video stream = container stream 3, 29.97 fps
])
def test_nasa_streams_match_ffmpeg_times(stream, json_stream, fps, num_frames):
    truth = truth_times(json_stream)
    info = video.probe(NASA, stream=stream)
    assert (info.stream, info.num_frames) == (json_stream, num_frames) and math.isclose(info.fps, fps)
    clip = video.sample_overview(NASA, nframes=16, stream=stream)
    want = truth[video.sample_frame_indices(truth, video.uniform_targets(0, info.duration, 16))]
    np.testing.assert_allclose(clip.times, want, atol=1e-6)
    crop = video.crop(NASA, 5.0, 7.0, stream=stream, **CLIP)
    assert np.all(np.abs(crop.times[:, None] - truth[None]).min(1) < 1e-6)  # every time is a real frame time
    assert np.all((crop.times >= 5.0) & (crop.times <= 7.0)) and crop.decoded < num_frames


def test_h265():
    info = video.probe(REAL / "h265_video.mp4")
    assert (info.num_frames, info.fps, info.width, info.height) == (10, 10.0, 128, 128)
    clip = video.sample_overview(REAL / "h265_video.mp4", nframes=10)
    np.testing.assert_allclose(clip.times, np.arange(10) / 10, atol=1e-9)  # every frame once


def test_av1_mkv_without_frame_count():
    path = REAL / "av1_video.mkv"
    with av.open(str(path)) as c:
        assert c.streams.video[0].frames == 0  # the premise: no count in the header
        decoded = sum(1 for _ in c.decode(video=0))
    info = video.probe(path)
    assert not info.frames_from_header and info.num_frames == decoded
    assert math.isclose(info.duration, decoded / info.fps)
    clip = video.sample_overview(path, nframes=8)
    assert clip.frames.shape == (8, 3, 360, 640) and np.all(np.diff(clip.times) > 0)


def test_10bit_h264_comes_out_as_uint8_rgb():
    """Compare with FFmpeg's 16-bit RGB of the same frames: our uint8 must be its top byte, not garbage."""
    path = REAL / "h264_10bits.mp4"
    clip = video.sample_overview(path, nframes=4)
    assert clip.frames.dtype == torch.uint8 and clip.frames.shape == (4, 3, 200, 200)
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        assert vs.codec_context.pix_fmt == "yuv420p10le"  # the premise: 10-bit pixels
        ref = {round(float(f.pts * vs.time_base), 6): f.to_ndarray(format="rgb48le") / 257 for f in c.decode(vs)}
    for frame, t in zip(clip.frames, clip.times):
        ours = frame.permute(1, 2, 0).numpy().astype(np.float64)  # (H, W, 3)
        diff = np.abs(ours - ref[round(t, 6)])  # swscale rounds/dithers the two paths differently
        assert diff.mean() < 1.0 and diff.max() < 8 and ours.std() > 10


def test_reused_converter_gives_pyav_pixels():
    """`to_rgb` (one swscale context per thread, reconfigured when the input changes) returns exactly what
    PyAV's per-frame `to_ndarray(format="rgb24")` does, on every frame of four codecs, sizes and bit depths
    read in turn by the same thread, two files interleaved frame by frame."""
    files = ["av1_video.mkv", "h264_10bits.mp4", "h265_video.mp4", "nasa_13013.mp4"]
    containers = [av.open(str(REAL / f)) for f in files]
    try:
        streams = [c.decode(c.streams.video[0]) for c in containers]
        checked = {f: 0 for f in files}
        for i in range(0, len(files), 2):            # pairs: av1 with 10-bit h264, h265 with the NASA clip
            for a, b in zip(streams[i], streams[i + 1]):
                for name, frame in ((files[i], a), (files[i + 1], b)):
                    ours, ref = video.to_rgb(frame), frame.to_ndarray(format="rgb24")
                    assert ours.dtype == np.uint8 and ours.shape == ref.shape and np.array_equal(ours, ref), name
                    checked[name] += 1
    finally:
        for c in containers:
            c.close()
    assert min(checked.values()) >= 10, checked


def write_per_frame(target, frames, fps: float) -> None:
    """The reference encoder: write_video's settings, each frame converted to yuv420p by PyAV's `frame.reformat`
    (a new converter per frame, what write_video did before it kept one)."""
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(target, mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=rate)
        vs.width, vs.height, vs.pix_fmt = frames.shape[3], frames.shape[2], "yuv420p"
        vs.options = {"crf": "18", "preset": "ultrafast", "threads": "1"}
        for i, x in enumerate(frames.permute(0, 2, 3, 1).numpy()):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(x), format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = i, 1 / rate
            out.mux(vs.encode(frame))
        out.mux(vs.encode(None))


def test_write_video_bytes_as_with_a_converter_per_frame():
    """write_video converts through one reused converter: the file is byte for byte the one that converting each
    frame with its own (`write_per_frame`) gives, so synthetic-task caches written before stay valid."""
    frames = video.synthetic_frames(24, 64, 96, seed=5)
    ours, ref = io.BytesIO(), io.BytesIO()
    video.write_video(ours, frames, FPS)
    write_per_frame(ref, frames, FPS)
    assert len(ours.getvalue()) > 1000 and ours.getvalue() == ref.getvalue()


# ----------------------------------------------------------------------------- bad input

def make_bad(kind: str, tmp_path) -> Path:
    path = tmp_path / {"audio": "audio.wav"}.get(kind, f"{kind}.mp4")
    if kind == "text":
        path.write_text("this is not a video\n")
    elif kind == "truncated":
        data = NASA.read_bytes()
        path.write_bytes(data[: len(data) * 3 // 10])
    elif kind == "truncated_faststart":
        video.write_video(path, video.synthetic_frames(100, 64, 64), FPS, faststart=True)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 3 // 10])
    elif kind == "zero":
        path.write_bytes(b"")
    elif kind == "audio":
        with av.open(str(path), "w") as out:
            s = out.add_stream("pcm_s16le", rate=8000)
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 8000, 0
            out.mux(s.encode(frame))
            out.mux(s.encode(None))
    elif kind == "directory":
        path.mkdir()
    return path  # "missing": never created


@pytest.mark.parametrize("kind, reason", [
    ("missing", "no such file"),
    ("text", "not a readable video"),                  # text renamed .mp4
    ("truncated", "not a readable video"),             # 30% of a real mp4: its index is at the end, cut off
    ("truncated_faststart", "truncated"),              # index first: it opens, the frames stop early
    ("zero", "empty file"),
    ("audio", "no video stream"),                      # audio-only file
    ("directory", "not a regular file"),
])
@pytest.mark.parametrize("call", ["overview", "crop"])
def test_bad_files_raise_video_error(tmp_path, kind, reason, call):
    path = make_bad(kind, tmp_path)
    with pytest.raises(VideoError, match=reason) as e:
        if call == "overview":
            video.sample_overview(path, **OVERVIEW)
        else:
            video.crop(path, 3.0, 9.0, **CLIP)
    assert str(path) in str(e.value) and e.value.path == str(path)


def test_truncated_faststart_still_probes(tmp_path):
    """The header survives, so probe reports it; only decoding finds the cut."""
    assert video.probe(make_bad("truncated_faststart", tmp_path)).num_frames == 100


def test_missing_video_stream_index():
    with pytest.raises(VideoError, match="no video stream 2 .it has 2."):
        video.probe(NASA, stream=2)


@pytest.mark.parametrize("start, end, reason", [
    (95.0, 100.0, "past the end of the video .60.0 s."),  # window after the end
    (60.0, 61.0, "past the end"),                          # start exactly at the end
    (5.0, 5.0, "must be smaller"),                         # empty window
    (9.0, 2.0, "must be smaller"),                         # reversed
    (float("nan"), 3.0, "finite"),                         # NaN from a parsed model output
    (1.0, float("inf"), "finite"),                         # infinity
])
def test_crop_bad_window_names_file(long_video, start, end, reason):
    with pytest.raises(VideoError, match=reason) as e:
        video.crop(long_video, start, end, **CLIP)
    assert str(long_video) in str(e.value) and str(long_video) not in e.value.reason


# ----------------------------------------------------------------------------- pure helpers

@pytest.mark.parametrize("start, end, min_length, expected", [
    (10.0, 20.0, 0.0, (10.0, 20.0)),     # inside: unchanged
    (-5.0, 20.0, 0.0, (0.0, 20.0)),      # negative start clamps to 0
    (50.0, 80.0, 0.0, (50.0, 60.0)),     # end clamps to the duration
    ("12", 13, 0.0, (12.0, 13.0)),       # numeric strings from JSON are accepted
    (59.0, 70.0, 1.0, (59.0, 60.0)),     # exactly the minimum after clamping
])
def test_check_window_ok(start, end, min_length, expected):
    assert video.check_window(start, end, 60.0, min_length) == expected


@pytest.mark.parametrize("start, end, min_length, reason", [
    (95.0, 100.0, 0.0, r"start_time 95.0 is past the end of the video \(60.0 s\)"),
    (20.0, 10.0, 0.0, "start_time 20.0 must be smaller than end_time 10.0"),
    (-5.0, -1.0, 0.0, "must be smaller"),            # both negative: start clamps to 0 > end
    (float("nan"), 10.0, 0.0, "finite"),
    (float("-inf"), 10.0, 0.0, "finite"),            # -inf is not clamped to 0: it is an error
    ("abc", 10.0, 0.0, "must be numbers"),           # garbage argument from the model
    (None, 10.0, 0.0, "must be numbers"),
    (10.0, 10.5, 1.0, "minimum is 1.0 s"),           # interleaved mode needs >= 1 s
    (59.5, 70.0, 1.0, "minimum is 1.0 s"),           # long enough before clamping, too short after
])
def test_check_window_errors(start, end, min_length, reason):
    with pytest.raises(ValueError, match=reason):
        video.check_window(start, end, 60.0, min_length)


@pytest.mark.parametrize("n, cap, expected", [
    (10, 768, 10),   # even: unchanged
    (11, 768, 12),   # odd: up
    (11, 11, 10),    # odd at an odd cap: down
    (900, 768, 768), # capped
    (0, 768, 2),     # at least 2
])
def test_even_count(n, cap, expected):
    assert video.even_count(n, cap) == expected


@pytest.mark.parametrize("times, targets, expected", [
    ([0.0, 1.0, 2.0], [0.4, 0.6, 1.9], [0, 1, 2]),   # plain nearest
    ([0.0, 1.0, 2.0], [0.5, 1.5], [0, 1]),           # ties go to the earlier frame
    ([1.0, 2.0], [-3.0, 9.0], [0, 1]),               # outside the range: first / last frame
    ([0.0, 0.1, 5.0], [2.0, 3.0], [1, 2]),           # uneven spacing (variable frame rate)
    ([7.0], [0.0, 100.0], [0, 0]),                   # a single frame
    ([0.6, 0.7], [0.65], [0]),                       # float midpoint is 0.64999..: still a tie -> earlier
])
def test_sample_frame_indices(times, targets, expected):
    assert video.sample_frame_indices(np.array(times), np.array(targets)).tolist() == expected


@pytest.mark.parametrize("hw, max_pixels, factor, expected", [
    ((64, 96), 10**6, 32, (64, 96)),            # multiples and within bounds: identity
    ((180, 320), 10**6, 32, (192, 320)),        # rounded to multiples of 32
    ((360, 640), 224 * 224, 32, (160, 288)),    # ParaVT cap: beta = sqrt(360*640/50176)
    ((360, 640), 224 * 224, 28, (168, 280)),    # the same with Qwen2.5-VL's 28
    ((32, 4096), 4 * 32 * 32, 32, (32, 128)),   # extreme aspect: short side stays 32, long side trimmed
    ((10, 10), 10**6, 32, (32, 32)),            # tiny frame: at least one patch
])
def test_resize_frames(hw, max_pixels, factor, expected):
    frames = torch.full((2, 3, *hw), 77, dtype=torch.uint8)
    out = video.resize_frames(frames, max_pixels, factor)
    assert tuple(out.shape) == (2, 3, *expected) and out.dtype == torch.uint8
    assert out.shape[2] * out.shape[3] <= max_pixels
    assert torch.all(out == 77)  # a flat image stays flat (antialiased bilinear keeps constants)


def test_resize_identity_returns_input():
    frames = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    assert video.resize_frames(frames, 64 * 96) is frames


def test_resize_rejects_budget_below_one_patch():
    with pytest.raises(ValueError, match="below one 32x32 patch"):
        video.resize_frames(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), 1000)
