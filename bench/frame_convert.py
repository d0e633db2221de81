"""
Decoded frames to RGB (and RGB to the encoder's YUV) through one reused converter, against PyAV's own call.

PyAV's `frame.to_ndarray(format="rgb24")` and `frame.reformat(...)` build a new swscale context, with its
worker threads, for every frame. At the synthetic task's 64x64 that set-up is nearly all of the cost of
decoding a clip. `video.to_rgb` keeps one context per thread; `video.write_video` one per file. Side by side in
one run, interleaved, each against the per-frame way (the same pixels and bytes checked, not assumed):

  - decoding and converting every frame of a synthetic-task-sized video (64 s at 2 fps, 64x64: 128 frames);
  - the same for the first 100 frames of a real H.264 clip (../shared/real_videos/nasa_13013.mp4, if present);
  - one crop of that synthetic video (`video.crop`, an 8 s window near the end: decode + convert + resize),
    with video.to_rgb swapped for the per-frame call;
  - writing the synthetic video (`video.write_video` against the same loop with a converter per frame);

each on an idle machine and with every core busy (a child process multiplying matrices, as the model does
while the decode pool works during RL and evaluation).

    python bench/frame_convert.py               # ~ a minute
    python bench/frame_convert.py --repeats 5

Targets (cores busy): synthetic decode + convert >= 3x, the crop >= 2x; nowhere slower (>= 0.9x).
The last line printed is one JSON object with the figures and ratios.
"""
import argparse
import contextlib
import io
import itertools
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, ab_times, median, print_json, set_threads, table  # noqa: E402

import video  # noqa: E402

REAL = ROOT.parent / "shared" / "real_videos" / "nasa_13013.mp4"


def per_frame_rgb(frame) -> np.ndarray:
    return frame.to_ndarray(format="rgb24")                  # PyAV: a new converter each call


def decoded(path, n: int | None = None) -> list:
    with av.open(str(path)) as c:
        return list(itertools.islice(c.decode(c.streams.video[0]), n))


@contextlib.contextmanager
def busy_cores(on: bool):
    """While inside, (if on) a child process multiplies matrices on every core, as the model does during a run."""
    if not on:
        yield
        return
    burn = ("import torch, time; torch.set_num_threads(%d); a = torch.randn(1024, 1024)\n"
            "while True: a @ a" % (os.cpu_count() or 1))
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        time.sleep(2.0)          # torch imported and spinning
        yield
    finally:
        child.kill()
        child.wait()


def write_per_frame(target, frames, fps: float) -> None:
    """write_video's encoding with a converter made for every frame (what write_video did before)."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the crop's resize)")
    args = p.parse_args()
    set_threads(args.threads)
    frames = video.synthetic_frames(128, 64, 64, seed=0)                  # (128, 3, 64, 64)
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "task.mp4")
    video.write_video(path, frames, 2.0)

    rows, result, same = [], {}, {}

    def compare(name: str, old, new, check, load: bool) -> None:
        with busy_cores(load):
            wall, _ = ab_times({"per_frame": old, "reused": new}, args.repeats)
        a, b = median(wall["per_frame"]), median(wall["reused"])
        key = f"{name}, {'cores busy' if load else 'idle'}"
        same[key] = bool(check())
        rows.append([key, a * 1e3, b * 1e3, a / b, same[key]])
        result[key] = {"per_frame_ms": a * 1e3, "reused_ms": b * 1e3, "speedup": a / b, "same": same[key]}

    def crop_with(convert):
        saved, video.to_rgb = video.to_rgb, convert
        try:
            return video.crop(path, 52.0, 60.0, level="medium")
        finally:
            video.to_rgb = saved

    def bytes_of(write):
        buf = io.BytesIO()
        write(buf, frames, 2.0)
        return buf.getvalue()

    for load in (False, True):
        # frames decoded afresh in every call: PyAV keeps a converter on a frame once it has converted it
        compare("decode + convert 128 frames 64x64", lambda: [per_frame_rgb(f) for f in decoded(path)],
                lambda: [video.to_rgb(f) for f in decoded(path)],
                lambda: all(np.array_equal(per_frame_rgb(f), video.to_rgb(f)) for f in decoded(path)), load)
        if REAL.exists():
            compare("decode + convert 100 frames 320x180", lambda: [per_frame_rgb(f) for f in decoded(REAL, 100)],
                    lambda: [video.to_rgb(f) for f in decoded(REAL, 100)],
                    lambda: all(np.array_equal(per_frame_rgb(f), video.to_rgb(f)) for f in decoded(REAL, 100)), load)
        compare("crop 8 s of 64 s", lambda: crop_with(per_frame_rgb), lambda: crop_with(video.to_rgb),
                lambda: np.array_equal(crop_with(per_frame_rgb).frames.numpy(), crop_with(video.to_rgb).frames.numpy()),
                load)
        compare("write 128 frames 64x64", lambda: bytes_of(write_per_frame), lambda: bytes_of(video.write_video),
                lambda: bytes_of(write_per_frame) == bytes_of(video.write_video), load)

    print(table(rows, ["work", "per-frame converter ms", "reused converter ms", "speedup", "same output"]))
    speed = {k: v["speedup"] for k, v in result.items()}
    targets = {"synthetic_3x_cores_busy": speed["decode + convert 128 frames 64x64, cores busy"] >= 3,
               "crop_2x_cores_busy": speed["crop 8 s of 64 s, cores busy"] >= 2,
               "no_slower_anywhere": min(speed.values()) >= 0.9,
               "same_output": all(same.values())}
    tmp.cleanup()
    print_json({"bench": "frame_convert", "repeats": args.repeats, "results": result, "targets_met": targets})


if __name__ == "__main__":
    main()
