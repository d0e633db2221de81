"""Small helpers shared by the bench scripts: threads, A/B timing interleaved, medians, a table.

A bench compares two ways of doing the same work on a shared, noisy machine. So the two sides run
interleaved (A, B, A, B, ...) after one untimed warm-up each, and each side reports the median of its
repeats; ratios are ratios of medians. The last line a bench prints is one JSON object.
"""
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # run from anywhere: the modules are one folder up


def checkpoint_dir(path: str) -> str:
    """A checkpoint dir (has config.json) as is, or a run dir's newest complete checkpoint (runtime.latest_checkpoint).
    Raises FileNotFoundError naming the path otherwise."""
    import os
    from runtime import latest_checkpoint
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint dir (no config.json) nor a run dir with a ckpt-* inside")
    return found


def set_threads(n: int) -> int:
    """Use n intra-op threads (0 = leave torch's default). Token-by-token decoding of a tiny model is
    latency-bound; on a shared CPU, threads waiting on each other slow every small matmul, so the
    benches default to 1. Returns the count in use."""
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def ab_times(sides: dict[str, Callable[[], object]], repeats: int, warmup: bool = True
             ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, cpu): seconds of each side's repeats, run interleaved A, B, A, B, ... after one untimed
    call each. CPU time (process_time) is the steadier figure on a shared machine when threads = 1."""
    if warmup:
        for fn in sides.values():
            fn()
    wall, cpu = {name: [] for name in sides}, {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            w, c, _ = timed(fn)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(rows: list[list], header: list[str]) -> str:
    """Plain text table; floats with 4 significant digits."""
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def print_json(obj: dict) -> None:
    """The bench's last line: one JSON object (floats rounded to 4 significant digits)."""
    def rnd(x):
        if isinstance(x, float):
            return float(f"{x:.4g}")
        if isinstance(x, dict):
            return {k: rnd(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rnd(v) for v in x]
        return x
    print(json.dumps(rnd(obj)), flush=True)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class PeakRSS:
    """Peak resident memory (MB) above the level at entry, sampled every 2 ms by a thread: on CPU there is
    no allocator counter, and everything a side allocates (K/V, activations, logits) is resident."""

    def __enter__(self):
        import ctypes
        import threading
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)      # give back what setup freed, for a clean base
        except OSError:
            pass
        self.base = self.peak = rss_mb()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mb())
        self.mb = self.peak - self.base
