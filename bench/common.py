"""Helpers shared by the bench scripts: checkpoints, a synthetic MCQ scored as eval.py scores it, threads, A/B timing
(two sides run interleaved after one untimed warm-up each, medians compared: the machine is shared and noisy), a
table, the last-line JSON, a scripted sampler, memory counters (LiveTensors: the peak of live tensor bytes, the same
in every run; PeakRSS: resident memory)."""
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # run from anywhere: the modules are one folder up
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))   # the tests' oracles (tests/oracles.py), the naive references


def checkpoint_dir(path: str, script: str) -> str:
    """A checkpoint dir (has config.json) as is, or a run dir's newest complete checkpoint (runtime.latest_checkpoint);
    otherwise the command-line script exits with `script: the reason`."""
    from runtime import latest_checkpoint
    found = path if os.path.exists(os.path.join(path, "config.json")) else latest_checkpoint(path)
    if found is None:
        raise SystemExit(f"{script}: {path}: neither a checkpoint dir (no config.json) nor a run dir with a ckpt-* "
                         "inside")
    return found


def synthetic_root() -> str:
    """The folder the synthetic task's videos are rendered into ($PARAVT_CACHE/synthetic, as train.py and eval.py)."""
    return os.path.join(os.environ.get("PARAVT_CACHE", "cache"), "synthetic")


def synthetic_right(record: dict, row: dict) -> bool:
    """A synthetic MCQ answered right, as eval.py scores it: benchmarks.judge on the row's response with the synthetic
    split's extractor (a letter inside a wordy <answer> span counts; an errored row does not)."""
    import benchmarks
    return benchmarks.judge(record, row, benchmarks.DEFAULT_EXTRACT["synthetic"])["score"] == 1.0


def set_threads(n: int) -> int:
    """Use n intra-op threads (0 = torch's default; the benches default to 1: on a shared CPU threads waiting on each
    other slow every small matmul). Returns the count in use."""
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def ab_times(sides: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list], dict[str, list]]:
    """(wall, cpu): seconds of each side's repeats, run interleaved A, B, A, B, ... after one untimed call each (CPU
    time is the steadier figure on a shared machine at one thread)."""
    for fn in sides.values():
        fn()
    wall, cpu = {name: [] for name in sides}, {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            w, c, _ = timed(fn)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


median = statistics.median


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


class Script:
    """Stand-in for rollout.sample_tokens: the row with seed s writes the token lists turns(s), one per assistant turn
    (the last repeating). With `sample` (the real sampler) that runs first, its cost counted, and its draws are
    replaced."""

    def __init__(self, turns: Callable[[int], list[list[int]]], sample=None):
        self.turns, self.sample, self.pos = turns, sample, {}

    def __call__(self, logits, seeds, counters, temperature, top_p):
        if self.sample is not None:
            self.sample(logits, seeds, counters, temperature, top_p)
        out = []
        for seed in seeds.tolist():
            turns, (t, p) = self.turns(seed), self.pos.get(seed, (0, 0))
            toks = turns[min(t, len(turns) - 1)]
            self.pos[seed] = (t + 1, 0) if p + 1 == len(toks) else (t, p + 1)
            out.append(toks[p])
        return torch.tensor(out, device=logits.device)


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


class LiveTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of tensor storage alive at once among the storages created inside the block (each storage once,
    however many views share it; what existed before, e.g. the weights, is not counted): unlike RSS, the same
    figure in every run. A Python hook on every operation: slow, so time a side in another run. The instance may
    be entered again and again; storages created inside stay counted until they die. `extra`: bytes no operation
    creates, added to every reading (FSDP2's all-gathered parameters live in storages it resizes in place)."""

    def __init__(self, extra: Callable[[], int] | None = None):
        from torch.multiprocessing.reductions import StorageWeakRef
        super().__init__()
        self.ref, self.live, self.count, self.peak = StorageWeakRef, {}, 0, 0     # entered again: counts on
        self.extra = extra or (lambda: 0)

    @property
    def now(self) -> int:
        """Bytes alive (an upper bound until `_sweep`)."""
        return self.count + self.extra()

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.count -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        subclass = torch.utils._python_dispatch.is_traceable_wrapper_subclass   # a DTensor: no storage of its own
        leaves = lambda x: [t for t in torch.utils._pytree.tree_leaves(x)
                            if isinstance(t, torch.Tensor) and not subclass(t)]
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs))}
        for t in leaves(out):
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if not n or key in inputs:
                continue
            if key in self.live:                            # the address of a storage that has died since
                if not self.live[key][0].expired():
                    continue
                self.count -= self.live.pop(key)[1]
            self.live[key] = (self.ref(st), n)
            self.count += n
        # `count` counts storages that may have died since the last sweep: an upper bound, made exact (a sweep)
        # whenever `now` passes the peak, so the peak is exact while most operations sweep nothing
        now = self.now
        if now > self.peak or len(self.live) > 100_000:
            self._sweep()
            self.peak = max(self.peak, self.now)
        return out

    @property
    def mb(self) -> float:
        return self.peak / 2 ** 20
