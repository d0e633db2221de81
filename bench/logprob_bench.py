"""
Benchmark: the GRPO loss from hidden states x lm_head, forward + backward, four ways.

    naive        log_softmax(h @ W^T).gather(t), then grpo_loss: the full (N, V) logits
    rowwise      full logits, log_softmax one sequence at a time (as TRL's selective_log_softmax for bf16)
    fused        grpo.grpo_loss, what trains: ops.token_logprobs (chunks, logits recomputed in backward: 4 GEMMs)
                 at its default chunk (ops._auto_chunk), then the GRPO terms on the log-probs
    fused_liger  the same with Liger's chunk rule (ops._liger_chunk)

    python bench/logprob_bench.py                                  # N 4096, D 4096, V 151,936, fp32, CPU
    python bench/logprob_bench.py --device cuda --dtype bfloat16   # on a GPU

The same loss for all (PPO-clip 0.2 / 0.3, a k3 KL 0.01, token-mean, T 0.7), each method in its own process. Peak
extra memory: a timed pass's peak minus what was resident before (CPU: VmHWM - VmRSS; CUDA: the allocator);
"working": that minus the gradients of h and W every method returns. Time: the median of --repeats passes after
two warm-ups (their difference: torch.compile's time). Loss and gradient norms must agree across methods. On CPU
N is halved until naive fits --mem-fraction of MemAvailable. Targets: fused memory <= 1/8 of naive's, time <= 0.9x.
The last line of output is one JSON object.
"""
import argparse
import gc
import json
import math
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from common import median  # bench/common.py (puts the repo on sys.path)

import grpo
import oracles   # tests/oracles.py: the naive loss the fused one is held to (common puts tests/ on sys.path)
import ops

METHODS = ("naive", "rowwise", "fused", "fused_liger")
TEMPERATURE = 0.7
GRPO = dict(clip_low=0.2, clip_high=0.3, kl_coef=0.01, kl_estimator="k3", behav_cap=5.0)
GB = 1024 ** 3


def grpo_loss(logp, problem):
    """The GRPO loss on (N,) log-probs, the batch as (rows, N / rows)."""
    old, adv, ref, mask = problem
    return oracles.grpo_loss_on_logprobs(logp.view(mask.shape), old, adv, mask, ref_logprobs=ref, **GRPO)[0]


def naive(hidden, weight, targets, problem, chunk_size, use_compile):
    logits = (hidden @ weight.T).float() / TEMPERATURE
    return grpo_loss(F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1), problem)


def rowwise(hidden, weight, targets, problem, chunk_size, use_compile):
    rows = problem[-1].shape[0]
    logits = (hidden @ weight.T).view(rows, -1, weight.shape[0])   # (rows, N / rows, V), all of it
    per_row = [F.log_softmax(row.float() / TEMPERATURE, dim=-1).gather(1, t[:, None]).squeeze(1)
               for row, t in zip(logits, targets.view(rows, -1))]
    return grpo_loss(torch.cat(per_row), problem)


def fused(hidden, weight, targets, problem, chunk_size, use_compile):
    old, adv, ref, mask = problem
    return grpo.grpo_loss(hidden.view(*mask.shape, -1), weight, targets.view(mask.shape), old, adv, mask,
                                 ref_logprobs=ref, temperature=TEMPERATURE, chunk_size=chunk_size,
                                 compile=use_compile, **GRPO)[0]


def proc_status_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def worker(args) -> dict:
    """Run one method in this process; return its timings and peak extra memory."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    fn = {"naive": naive, "rowwise": rowwise, "fused": fused, "fused_liger": fused}[args.worker]
    chunk_size = {"fused": args.fused_chunk, "fused_liger": ops._liger_chunk(args.n, args.d, args.vocab)}.get(args.worker)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.n, args.d, generator=gen, device=device, dtype=dtype)
    weight = (torch.randn(args.vocab, args.d, generator=gen, device=device, dtype=dtype)
              * args.d ** -0.5).requires_grad_()                                 # logits of std ~1
    targets = torch.randint(0, args.vocab, (args.n,), generator=gen, device=device)
    near = -math.log(args.vocab) - 0.5                                           # ~ log p of a random target
    old = near + 0.5 * torch.randn(args.n, generator=gen, device=device)         # ratios spread around 1
    ref = old + 0.1 * torch.randn(args.n, generator=gen, device=device)
    adv = torch.randn(args.rows, generator=gen, device=device)                   # one advantage per sequence
    cuda = device.type == "cuda"
    checksums = []

    def problem(n: int):
        """old, adv, ref, mask for the first n tokens: --rows sequences for the full N, one for a warm-up."""
        rows = args.rows if n == args.n else 1
        seq_adv = adv if n == args.n else adv[:1]
        return old[:n].view(rows, -1), seq_adv, ref[:n].view(rows, -1), torch.ones(rows, n // rows, dtype=torch.bool,
                                                                                    device=device)

    def resident() -> int:
        return torch.cuda.memory_allocated() if cuda else proc_status_kb("VmRSS") * 1024

    def fwd_bwd(n: int) -> tuple[float, float, int]:
        """One forward + backward over n tokens: (wall seconds, CPU seconds, peak bytes)."""
        prob = problem(n)
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:                        # reset VmHWM to VmRSS
                f.write("5")
        t0, cpu0 = time.perf_counter(), time.process_time()
        h = hidden[:n].detach().requires_grad_()                                 # a leaf of n tokens
        loss = fn(h, weight, targets[:n], prob, chunk_size, not args.no_compile)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        peak = torch.cuda.max_memory_allocated() if cuda else proc_status_kb("VmHWM") * 1024
        if n == args.n and not checksums:  # to cross-check the methods; after the peak is read (fp64 copies)
            checksums.extend([float(loss), float(h.grad.double().norm()), float(weight.grad.double().norm())])
        del h, loss
        weight.grad = None                                                       # free the (V, D) gradient
        return wall, cpu, peak

    n_warm = min(args.n, chunk_size or args.n)
    first, second = fwd_bwd(n_warm)[0], fwd_bwd(n_warm)[0]                      # the first pays the compile
    gc.collect()
    before = resident()
    runs = [fwd_bwd(args.n) for _ in range(args.repeats)]
    peak = max(r[2] for r in runs)
    grad_bytes = (args.n + args.vocab) * args.d * hidden.element_size()          # grad h + grad W, returned by all
    return {"time_s": median(r[0] for r in runs), "times_s": [r[0] for r in runs],
            "cpu_s": median(r[1] for r in runs), "first_call_extra_s": first - second,
            "peak_extra_gb": (peak - before) / GB, "working_gb": (peak - before - grad_bytes) / GB,
            "checksums": checksums}


def over_naive(results: dict) -> dict:
    """Each method over naive: extra peak, working memory, wall time, CPU seconds (steadier on a shared machine).
    None where naive's figure is not above 0: at tiny sizes (gpu.py's dry run) the resident-memory figures are
    page-granular noise around 0 (-0.0002 to 0.03 GB over 12 runs of its naive worker), no ratio to take."""
    nv = results["naive"]
    return {f"{name}_{m}_over_naive": results[m][key] / nv[key] if nv[key] > 0 else None for m in results
            if m != "naive"
            for name, key in (("mem", "peak_extra_gb"), ("working", "working_gb"), ("time", "time_s"), ("cpu", "cpu_s"))}


def fit_n(args) -> tuple[int, str]:
    """Largest N (halving from --n) whose naive run fits in --mem-fraction of the free memory."""
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    if args.device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        free = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    budget = args.mem_fraction * free
    naive_bytes = lambda n: 3 * n * args.vocab * 4 + 2 * (n + args.vocab) * args.d * elem   # 3 fp32 (N, V) in backward
    n = args.n
    while n > args.rows and naive_bytes(n) + 0.5 * GB > budget:
        n //= 2
    n -= n % args.rows
    note = "" if n == args.n else (f"N reduced from {args.n} to {n}: the naive method would need "
                                   f"~{naive_bytes(args.n) / GB:.1f} GB, budget {budget / GB:.1f} GB "
                                   f"({args.mem_fraction} x {free / GB:.1f} GB free)")
    return n, note


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="tokens (N)")
    p.add_argument("--d", type=int, default=4096, help="hidden size (D); Qwen3-VL-8B: 4096")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary (V); Qwen: 151,936")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of h and W")
    p.add_argument("--fused-chunk", type=int, default=0,
                   help="tokens per chunk for fused; 0 = the losses' own choice (ops._auto_chunk) for this N, D, V")
    p.add_argument("--rows", type=int, default=8, help="sequences the N tokens form (rowwise, the advantages)")
    p.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes per method")
    p.add_argument("--mem-fraction", type=float, default=0.6, help="share of free memory the naive run may use")
    p.add_argument("--no-compile", action="store_true", help="run the chunked methods without torch.compile")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)  # internal: run one method
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    methods = args.methods.split(",")
    if "naive" not in methods or any(m not in METHODS for m in methods):
        raise SystemExit(f"logprob_bench.py: --methods must name naive and any of {METHODS}, got {args.methods!r}")

    n, note = fit_n(args)
    if note:
        print(note)
    # the fused chunk, fixed for the warm-up and the timed passes alike (one compiled shape)
    fused_chunk = args.fused_chunk or ops._auto_chunk(n, args.d, args.vocab)
    print(f"device {args.device}  dtype {args.dtype}  N {n}  D {args.d}  V {args.vocab}  "
          f"fused chunk {fused_chunk}  rows {args.rows}  repeats {args.repeats}  T {TEMPERATURE}", flush=True)
    results = {}
    for method in methods:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", method, "--n", str(n), "--device", args.device,
               "--fused-chunk", str(fused_chunk)]                           # this run's flags, N fitted, one method
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"logprob_bench.py: the {method} worker failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        r = results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{method:11s} time {r['time_s']:8.2f} s  cpu {r['cpu_s']:8.1f} s  peak extra {r['peak_extra_gb']:7.2f} GB  "
              f"working {r['working_gb']:7.2f} GB  first call +{r['first_call_extra_s']:5.1f} s", flush=True)

    nv = results["naive"]
    # the loss and the norms of grad h and grad W against the naive method's: all must agree
    agree = max([abs(a - b) / max(1.0, abs(b)) for m in methods for a, b in zip(results[m]["checksums"], nv["checksums"])])
    if agree > 1e-3:
        raise SystemExit(f"logprob_bench.py: the methods disagree (relative checksum difference {agree:.2e})")
    ratios = over_naive(results)
    at_most = lambda k, bound: ratios[k] is not None and ratios[k] <= bound
    targets = {}
    if "fused" in results:
        targets = {"fused_mem_le_1/8_naive": at_most("mem_fused_over_naive", 1 / 8),
                   "fused_working_le_1/8_naive": at_most("working_fused_over_naive", 1 / 8),
                   "fused_time_le_0.9_naive": at_most("time_fused_over_naive", 0.9)}
    print("\n".join(f"{k:28s} {'-' if v is None else f'{v:.3f}'}" for k, v in ratios.items()))
    print(json.dumps({"device": args.device, "dtype": args.dtype, "n_requested": args.n, "n": n, "d": args.d,
                      "vocab": args.vocab, "fused_chunk": fused_chunk,
                      "rows": args.rows, "temperature": TEMPERATURE, "repeats": args.repeats, "note": note,
                      "checksum_rel_diff": agree, "compile_s": {m: results[m]["first_call_extra_s"] for m in methods},
                      "results": results, "ratios": ratios, "targets_met": targets}))


if __name__ == "__main__":
    main()
