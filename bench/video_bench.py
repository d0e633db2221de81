"""
Long videos, fast: the overview seeks instead of decoding everything, decoded frames are reused, decoding
runs in a pool. Side by side in one run, each figure against plain sequential decoding (method="sequential",
the nearest-frame rule decoding from the stream start, as video.py did before):

  - overviews of a generated long video (default 10 min, 30 fps, 640x360 H.264, a keyframe every 250
    frames as x264 writes by default) at K = 8, K = 64 and the 2 fps / 768-frame rule: seconds, frames decoded;
  - crops of a 4 s and a 60 s window (Video-o3 medium) and a ParaVT sub-agent crop (1 fps, <= 16 frames,
    224x224) of a 10 min window, against today's crop (seek to the window start, decode through it);
  - 8 overviews serial vs in a DecodePool;
  - the real files of ../shared/real_videos at K = 8 and 64 (same frames checked, frames decoded);
  - the frame cache over a default-length RL run (20 steps x 4 prompts drawn from 256 synthetic-task videos,
    K = 8, and with nFrames gating K in {4, 8, 16, 32, 64}): hit rate and decode seconds saved.

Every fast result is checked to equal the sequential one (times and pixels). The long video is written once
into --cache-dir and reused. Targets: K = 8 >= 10x, K = 64 >= 2x, the 768 rule no slower,
pooled >= 1.5x on 2 cores.

    python bench/video_bench.py                  # ~ a few minutes (+ ~1-2 min to write the video once)
    python bench/video_bench.py --minutes 2      # smaller and quicker

The last line printed is one JSON object with the figures and ratios.
"""
import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, set_threads, table  # noqa: E402

import video  # noqa: E402

REAL = ROOT.parent / "shared" / "real_videos"


def long_video(cache_dir: str, minutes: float, fps: int, gop: int, height: int, width: int) -> str:
    """The generated long video (written once): frame index in the top half (video.synthetic_frames), a
    fixed noise texture scrolling one pixel a frame in the bottom half (motion the encoder can predict)."""
    n = round(minutes * 60 * fps)
    path = os.path.join(cache_dir, f"long_{n}f_{fps}fps_gop{gop}_{width}x{height}.mp4")
    if os.path.exists(path):
        return path
    texture = torch.randint(0, 256, (3, (height + 7) // 8, (width + 7) // 8), generator=torch.Generator().manual_seed(0),
                            dtype=torch.uint8).repeat_interleave(8, 1).repeat_interleave(8, 2)[:, : height - height // 2, :]

    def chunks(size: int = 300):
        for first in range(0, n, size):
            x = video.synthetic_frames(min(size, n - first), height, width, first=first)  # (t, 3, H, W)
            for i in range(len(x)):
                x[i, :, height // 2:] = torch.roll(texture, shifts=first + i, dims=2)
            yield x

    tmp = f"{path}.{os.getpid()}.tmp.mp4"
    t0 = time.perf_counter()
    video.write_video(tmp, chunks(), fps, gop=gop, crf=23)
    os.replace(tmp, path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def same(a: video.Clip, b: video.Clip) -> bool:
    return np.array_equal(a.times, b.times) and a.frames.shape == b.frames.shape and torch.equal(a.frames, b.frames)


def side_by_side(name: str, fast, slow, rows: list, out: dict) -> None:
    """Run slow then fast once each, check the frames agree, record seconds and frames decoded."""
    ts, s = timed(slow)
    tf, f = timed(fast)
    ok = same(f, s)
    rows.append([name, ts, s.decoded, tf, f.decoded, ts / tf, ok])
    out[name] = dict(seq_s=round(ts, 3), seq_frames=s.decoded, fast_s=round(tf, 3), fast_frames=f.decoded,
                     speedup=round(ts / tf, 2), same_frames=ok)
    print(table([rows[-1]], ["case", "seq s", "seq frames", "fast s", "fast frames", "speedup", "same"]), flush=True)


def cache_run(cache_dir: str, n_train: int, steps: int, prompts: int, choices: list[int], seed: int) -> dict:
    """A default-length RL run's overview requests through one FrameCache: records drawn with replacement
    (as train.py draws them), K fixed or drawn per prompt. The videos are the synthetic task's kind
    (64 s, 2 fps, 64x64), written once; the in-memory cache starts empty."""
    vdir = os.path.join(cache_dir, "task_like")
    os.makedirs(vdir, exist_ok=True)
    paths = []
    for i in range(n_train):
        p = os.path.join(vdir, f"v{i:04d}.mp4")
        if not os.path.exists(p):
            video.write_video(p + ".tmp.mp4", video.synthetic_frames(128, 64, 64, seed=i), 2.0)
            os.replace(p + ".tmp.mp4", p)
        paths.append(p)
    rng, cache = random.Random(seed), video.FrameCache()
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(prompts):
            cache.overview(paths[rng.randrange(n_train)], nframes=rng.choice(choices), max_pixels=64 * 64)
    s = cache.stats()
    return dict(requests=steps * prompts, hit_rate=round(s["hit_rate"], 3), misses=s["misses"],
                decode_s=round(s["decode_seconds"], 3), saved_s=round(s["seconds_saved"], 3),
                wall_s=round(time.perf_counter() - t0, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the generated long video")
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--gop", type=int, default=250, help="keyframe interval of the generated video, frames")
    p.add_argument("--size", default="640x360", help="WxH of the generated video")
    p.add_argument("--cache-dir", default=os.path.join(os.environ.get("PARAVT_CACHE") or os.path.expanduser("~/.cache/paravt"), "video_bench"))
    p.add_argument("--workers", type=int, default=2, help="DecodePool workers")
    p.add_argument("--pool-k", type=int, default=16, help="K of each of the 8 overviews, serial vs pooled")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (resizing)")
    p.add_argument("--skip-768", action="store_true", help="skip the 768-frame rule (the slowest case)")
    args = p.parse_args()
    set_threads(args.threads)
    width, height = (int(v) for v in args.size.lower().split("x"))
    os.makedirs(args.cache_dir, exist_ok=True)
    path = long_video(args.cache_dir, args.minutes, args.fps, args.gop, height, width)
    info = video.probe(path)
    video.keyframe_times(path)  # learned once per file (free from the mp4 index): not part of any timing
    print(f"long video: {info.duration:.0f} s, {info.num_frames} frames, {info.fps:g} fps, {info.width}x{info.height}, "
          f"GOP {args.gop}, cpus {os.cpu_count()}", flush=True)
    t_start, rows, out = time.perf_counter(), [], {}
    mp = 16384 // 4 * 32 * 32  # rollout's overview budget at K = 8: 4096 tokens a frame pair
    ov = lambda method, **kw: (lambda: video.sample_overview(path, method=method, **kw))
    side_by_side("overview_K8", ov("auto", nframes=8), ov("sequential", nframes=8), rows, out)
    side_by_side("overview_K64", ov("auto", nframes=64), ov("sequential", nframes=64), rows, out)
    if not args.skip_768:
        px = min(768, 16384 // 384) * 32 * 32  # rollout's budget at 768 frames
        side_by_side("overview_2fps_768", ov("auto", max_pixels=px), ov("sequential", max_pixels=px), rows, out)
    mid = info.duration / 2
    cr = lambda method, s, e, **kw: (lambda: video.crop(path, s, e, method=method, **kw))
    side_by_side("crop_4s", cr("auto", mid, mid + 4), cr("sequential", mid, mid + 4), rows, out)
    side_by_side("crop_60s", cr("auto", mid, mid + 60), cr("sequential", mid, mid + 60), rows, out)
    sub = dict(level=None, fps=1, max_frames=16, max_pixels=224 * 224)
    end = min(info.duration, 600.0)
    side_by_side("crop_subagent_600s", cr("auto", 0.0, end, **sub), cr("sequential", 0.0, end, **sub), rows, out)

    # 8 overviews (no cache), serial vs pooled
    ks = [dict(nframes=args.pool_k, max_pixels=mp // (1 + i % 2)) for i in range(8)]  # two sizes: 8 distinct jobs
    t_serial, t_pool = [], []
    with video.DecodePool(args.workers, timeout=600) as pool:
        for _ in range(2):  # interleaved, median (here: mean) of 2 each
            t, serial = timed(lambda: [video.sample_overview(path, **kw) for kw in ks])
            t_serial.append(t)
            t, pooled = timed(lambda: [pool.result(f) for f in [pool.submit_overview(path, **kw) for kw in ks]])
            t_pool.append(t)
    t_serial, t_pool = sum(t_serial) / 2, sum(t_pool) / 2
    ok = all(same(a, b) for a, b in zip(serial, pooled))
    out["pool_8_overviews"] = dict(k=args.pool_k, workers=args.workers, serial_s=round(t_serial, 3),
                                   pooled_s=round(t_pool, 3), speedup=round(t_serial / t_pool, 2), same_frames=ok)
    print(table([["8 overviews", t_serial, t_pool, t_serial / t_pool, ok]], ["case", "serial s", "pooled s", "speedup", "same"]))

    # the real files
    real = {}
    for name, stream in [("nasa_13013.mp4", None), ("nasa_13013.mp4", 1), ("av1_video.mkv", None),
                         ("h265_video.mp4", None), ("h264_10bits.mp4", None)]:
        for k in (8, 64):
            f = REAL / name
            if not f.exists():
                continue
            s = video.sample_overview(f, nframes=k, stream=stream, method="sequential")
            a = video.sample_overview(f, nframes=k, stream=stream, method="auto")
            e = video.sample_overview(f, nframes=k, stream=stream, method="seek")
            real[f"{name}:{stream or 0}:K{k}"] = dict(seq_frames=s.decoded, auto_frames=a.decoded,
                                                      seek_frames=e.decoded, same_frames=same(s, a) and same(s, e))
    print(table([[k, v["seq_frames"], v["auto_frames"], v["seek_frames"], v["same_frames"]] for k, v in real.items()],
                ["real file:stream:K", "seq frames", "auto frames", "seek frames", "same"]))

    # the frame cache over a default-length RL run
    cache = {"K8": cache_run(args.cache_dir, 256, 20, 4, [8], seed=0),
             "gated": cache_run(args.cache_dir, 256, 20, 4, [4, 8, 16, 32, 64], seed=0)}
    hit_long = timed(lambda: video.FrameCache().overview(path, nframes=64))[0]
    print(f"cache over 20 steps x 4 prompts of 256 records: {json.dumps(cache)}")

    all_same = all(v.get("same_frames", True) for v in out.values()) and all(v["same_frames"] for v in real.values())
    summary = dict(
        video=dict(path=os.path.basename(path), seconds=round(info.duration, 1), frames=info.num_frames,
                   fps=info.fps, width=info.width, height=info.height, gop=args.gop),
        **out, real=real, cache=cache,
        cache_seconds_saved_per_hit_long_K64=round(hit_long, 3),
        targets=dict(K8_10x=out["overview_K8"]["speedup"] >= 10, K64_2x=out["overview_K64"]["speedup"] >= 2,
                     rule768_not_slower=out["overview_2fps_768"]["speedup"] >= 0.95 if "overview_2fps_768" in out else None,
                     pool_1p5x=out["pool_8_overviews"]["speedup"] >= 1.5),
        all_same_frames=all_same, cpus=os.cpu_count(), bench_s=round(time.perf_counter() - t_start, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
