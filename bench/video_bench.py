"""
Long videos, fast: the overview seeks instead of decoding everything, and decoding runs in a pool. Side by side,
against sequential decoding (method="sequential", as video.py did before), the frames checked equal: overviews of a
generated long video (10 min, 30 fps, 640x360 H.264, a keyframe every 250 frames) at K = 8, K = 64 and the 2 fps /
768-frame rule (seconds, frames decoded); 8 overviews serial vs in a DecodePool. The long video is written once into --cache-dir. Targets: K = 8 >= 10x, K = 64 >= 2x, the 768 rule no slower,
pooled >= 1.5x on 2 cores. The last line printed is one JSON object.

    python bench/video_bench.py                  # ~ a few minutes (+ ~1-2 min to write the video once)
    python bench/video_bench.py --minutes 2      # smaller and quicker
"""
import argparse
import json
import os
import time

import numpy as np
import torch
from common import set_threads, table, timed  # bench/common.py (puts the repo on sys.path)

import video


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


def same(a: video.Clip, b: video.Clip) -> bool:
    return np.array_equal(a.times, b.times) and a.frames.shape == b.frames.shape and torch.equal(a.frames, b.frames)


def side_by_side(name: str, fast, slow, out: dict) -> None:
    """Run slow then fast once each, check the frames agree, record seconds and frames decoded."""
    ts, _, s = timed(slow)
    tf, _, f = timed(fast)
    ok = same(f, s)
    row = [name, ts, s.decoded, tf, f.decoded, ts / tf, ok]
    out[name] = dict(seq_s=round(ts, 3), seq_frames=s.decoded, fast_s=round(tf, 3), fast_frames=f.decoded,
                     speedup=round(ts / tf, 2), same_frames=ok)
    print(table([row], ["case", "seq s", "seq frames", "fast s", "fast frames", "speedup", "same"]), flush=True)


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
    t_start, out = time.perf_counter(), {}
    mp = 16384 // 4 * 32 * 32  # rollout's overview budget at K = 8: 4096 tokens a frame pair
    ov = lambda method, **kw: (lambda: video.sample_overview(path, method=method, **kw))
    side_by_side("overview_K8", ov("auto", nframes=8), ov("sequential", nframes=8), out)
    side_by_side("overview_K64", ov("auto", nframes=64), ov("sequential", nframes=64), out)
    if not args.skip_768:
        px = min(768, 16384 // 384) * 32 * 32  # rollout's budget at 768 frames
        fps768 = dict(fps=2.0, max_frames=768, max_pixels=px)  # Video-o3's overview: 2 fps, at most 768 frames
        side_by_side("overview_2fps_768", ov("auto", **fps768), ov("sequential", **fps768), out)

    # 8 overviews (no cache), serial vs pooled
    ks = [dict(nframes=args.pool_k, max_pixels=mp // (1 + i % 2)) for i in range(8)]  # two sizes: 8 distinct jobs
    t_serial, t_pool = [], []
    with video.DecodePool(args.workers, timeout=600) as pool:
        for _ in range(2):  # interleaved, median (here: mean) of 2 each
            t, _, serial = timed(lambda: [video.sample_overview(path, **kw) for kw in ks])
            t_serial.append(t)
            t, _, pooled = timed(lambda: [pool.result(f) for f in [pool.submit_overview(path, **kw) for kw in ks]])
            t_pool.append(t)
    t_serial, t_pool = sum(t_serial) / 2, sum(t_pool) / 2
    ok = all(same(a, b) for a, b in zip(serial, pooled))
    out["pool_8_overviews"] = dict(k=args.pool_k, workers=args.workers, serial_s=round(t_serial, 3),
                                   pooled_s=round(t_pool, 3), speedup=round(t_serial / t_pool, 2), same_frames=ok)
    print(table([["8 overviews", t_serial, t_pool, t_serial / t_pool, ok]], ["case", "serial s", "pooled s", "speedup", "same"]))

    video_info = dict(path=os.path.basename(path), seconds=round(info.duration, 1), frames=info.num_frames,
                      fps=info.fps, width=info.width, height=info.height, gop=args.gop)
    targets = dict(K8_10x=out["overview_K8"]["speedup"] >= 10, K64_2x=out["overview_K64"]["speedup"] >= 2,
                   rule768_not_slower=out["overview_2fps_768"]["speedup"] >= 0.95 if "overview_2fps_768" in out else None,
                   pool_1p5x=out["pool_8_overviews"]["speedup"] >= 1.5)
    summary = dict(video=video_info, **out, targets=targets, all_same_frames=all(v["same_frames"] for v in out.values()),
                   cpus=os.cpu_count(), bench_s=round(time.perf_counter() - t_start, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
