"""
Rollout beside training (async_rl.py) against the synchronous loop, on the embedded default: the same RL steps with
the same samples per step, each side on this machine's cores.

    python bench/async_bench.py                         # 2 cores: sync = 1 rank x 2 threads; async = 2 ranks x 1
    python bench/async_bench.py --steps 12 --warm 3 --sft-steps 150 --staleness 2

1. A warm start: `train.py --stage sft` (--sft-steps), so the RL steps sample the tool-calling trajectories of a
   trained policy, not an untrained model's noise. Both sides start RL from its checkpoint.
2. sync:  `train.py --stage rl --threads 2` (one process: rollout, then update, then rollout).
   async: `train.py --stage rl --gpus 2 --device cpu --rollout-ranks 1 --async-staleness eta --threads 1` (one
   rollout rank and one trainer, each with one core), at eta = 1 and at --staleness (2, ParaVT's release: with eta
   = 1 the two sides meet at every step, so either waits when the other's step runs long; with 2 the rollout may
   run a step further ahead and a long step is absorbed).
3. exact_at_0: two short runs, with `--async-staleness 0` and without: the same checkpoint bytes.

Figures over the steps after --warm (metrics.jsonl): sync_step_s and async_step_s (mean step time), speedup (their
ratio), rollout_busy (the rollout rank's sampling time / its sampling + waiting time), trainer_busy (update time /
step time), max_staleness; the top-level figures and `targets` are eta = --staleness's, `by_staleness` holds each
eta's. On 2 cores the speed-up is bounded by thread scaling: the async side runs each phase on 1
thread where the sync side had 2 for both, so thread_scaling = (async rollout_s + update_s) / sync_step_s says how
much slower one thread does the same work (1: threads did not help, the overlap is all gain; 2: perfect scaling,
nothing to gain), and ideal_speedup = sync_step_s / max(rollout_s, update_s) is what a perfect overlap would give.
gloo_weights: a 1 GB fp32 model sent from one process to another by async_rl.broadcast_weights / load_weights (gloo,
256 MiB host buckets), the rate bench/plan.py's --gloo-gbps takes. The last line is one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, print_json, table  # bench/common.py (puts the repo on sys.path)

import runtime


def train(argv: list, env: dict) -> float:
    """One `train.py` run; returns its wall seconds (raises with its stderr's tail on failure)."""
    t0 = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"async_bench: train.py {' '.join(map(str, argv))} failed:\n{done.stderr[-4000:]}")
    return time.time() - t0


def _gloo_rank(rank: int, port: int, out: str, mb: int, bucket_mb: int) -> None:
    """Rank 0 sends a `mb` MB fp32 model to rank 1 with async_rl's functions (gloo, host buckets), twice; rank 1
    times the second from both ranks' barrier to its loaded weights."""
    import torch
    import torch.distributed as dist

    import async_rl
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, 2, False)
    torch.set_num_threads(1)
    group = dist.new_group([0, 1], backend="gloo")
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.full((16 * 2 ** 20,), float(rank)))   # 64 MB each
                                    for _ in range(mb // 64)])
    full = {n: p for n, p in model.named_parameters()} if rank == 0 else None
    for _ in range(2):
        dist.barrier(group)
        t0 = time.perf_counter()
        t = async_rl.broadcast_weights(model, full, group, torch.float32, bucket_bytes=bucket_mb * 2 ** 20)
        if rank == 0:
            t.wait()
        else:
            async_rl.load_weights(model, t)
            seconds = time.perf_counter() - t0
    if rank == 1:
        assert all(bool((p == 0).all()) for p in model.parameters())
        Path(out).write_text(json.dumps({"gb": t.bytes / 1e9, "seconds": seconds}))
    dist.destroy_process_group()


def gloo_rate(work: Path, mb: int = 1024, bucket_mb: int = 256) -> dict:
    """The weights' transfer rate between two processes over gloo (bench/plan.py's --gloo-gbps), GB/s."""
    import torch
    out = work / "gloo.json"
    torch.multiprocessing.spawn(_gloo_rank, args=(runtime.find_free_port(), str(out), mb, bucket_mb), nprocs=2)
    r = json.loads(out.read_text())
    return {"gb": round(r["gb"], 3), "seconds": round(r["seconds"], 3), "gbps": round(r["gb"] / r["seconds"], 2)}


def rl_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["stage"] == "rl"]


def checkpoint_bytes(ckpt: Path) -> dict:
    """Every file of a checkpoint but trainer.pt (RNG state, counters) and DCP's .metadata (a fresh uuid a save)."""
    return {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name not in ("trainer.pt", ".metadata")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="RL steps per side")
    p.add_argument("--warm", type=int, default=3, help="first steps left out of the figures (compile, caches, the "
                                                       "async pipeline filling)")
    p.add_argument("--staleness", type=int, default=2, help="eta of the headline figures (2: ParaVT's release, "
                                                            "AReaL's max_head_offpolicyness); eta 1 runs beside it")
    p.add_argument("--sft-steps", type=int, default=150, help="the warm start's SFT steps")
    p.add_argument("--prompts", type=int, default=4, help="--prompts-per-step of both sides")
    p.add_argument("--group", type=int, default=16, help="--group-size of both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="async_bench_"))
    env = {**os.environ, "PARAVT_CACHE": os.environ.get("PARAVT_CACHE", str(work / "cache"))}
    common = ["--seed", a.seed, "--prompts-per-step", a.prompts, "--group-size", a.group, "--device", "cpu"]

    wall = {"sft": train(["--stage", "sft", "--sft-steps", a.sft_steps, "--run-dir", work / "sft", *common,
                          "--threads", 2], env)}
    start = runtime.latest_checkpoint(str(work / "sft"))
    rl = ["--stage", "rl", "--model", start, "--rl-steps", a.steps, "--save-every", 10 ** 6, *common]
    wall["sync"] = train([*rl, "--run-dir", work / "sync", "--threads", 2], env)
    sync = rl_rows(str(work / "sync"))[a.warm:]
    mean = lambda rows, k: statistics.mean(r[k] for r in rows)
    sync_step, by_eta = mean(sync, "step_time"), {}
    for eta in sorted({1, a.staleness}):
        wall[f"async_eta{eta}"] = train([*rl, "--run-dir", work / f"async_eta{eta}", "--threads", 1, "--gpus", 2,
                                         "--rollout-ranks", 1, "--async-staleness", eta], env)
        rows = rl_rows(str(work / f"async_eta{eta}"))
        m = {"max_staleness": max(r["staleness"] for r in rows)}
        rows = rows[a.warm:]
        m.update(async_step_s=mean(rows, "step_time"), rollout_s=mean(rows, "rollout_s"), update_s=mean(rows, "update_s"),
                 rollout_busy=sum(r["rollout_s"] for r in rows) / sum(r["rollout_s"] + r["rollout_wait_s"] for r in rows),
                 trainer_busy=sum(r["update_s"] for r in rows) / sum(r["step_time"] for r in rows))
        m.update(speedup=sync_step / m["async_step_s"], thread_scaling=(m["rollout_s"] + m["update_s"]) / sync_step,
                 ideal_speedup=sync_step / max(m["rollout_s"], m["update_s"]))
        by_eta[eta] = {k: v if isinstance(v, int) else round(v, 3) for k, v in m.items()}
    head = by_eta[a.staleness]

    tiny = ["--stage", "rl", "--rl-steps", 2, "--n-train", 8, "--set", "n_rl=4", "--group-size", 2,
            "--prompts-per-step", 2, "--max-new-tokens", 12, "--gating-choices", "4,8", "--threads", 2]
    train([*tiny, "--run-dir", work / "plain"], env)
    train([*tiny, "--run-dir", work / "eta0", "--async-staleness", 0], env)
    exact = checkpoint_bytes(work / "plain" / "ckpt-rl-000002") == checkpoint_bytes(work / "eta0" / "ckpt-rl-000002")
    gloo = gloo_rate(work)

    print(table([["sync (1 rank x 2 threads)", f"{sync_step:.2f}", "-", "-", "-", "-"]] +
                [[f"async, eta {eta} (1 rollout + 1 trainer, 1 thread each)", f"{m['async_step_s']:.2f}",
                  f"{m['rollout_s']:.2f}", f"{m['update_s']:.2f}", f"{m['rollout_busy']:.2f} / {m['trainer_busy']:.2f}",
                  f"{m['speedup']:.2f}x"] for eta, m in by_eta.items()],
                ["side", "step s", "rollout s", "update s", "busy rollout / trainer", "speed-up"]))
    print(f"runs in {work}; wall s: {json.dumps({k: round(v, 1) for k, v in wall.items()})}; weights over gloo: "
          f"{gloo['gb']} GB in {gloo['seconds']} s, {gloo['gbps']} GB/s")
    print_json({"sync_step_s": round(sync_step, 3), "async_step_s": head["async_step_s"], "speedup": head["speedup"],
                "rollout_busy": head["rollout_busy"], "trainer_busy": head["trainer_busy"],
                "max_staleness": head["max_staleness"], "exact_at_0": exact, "staleness": a.staleness,
                "rollout_s": head["rollout_s"], "update_s": head["update_s"], "thread_scaling": head["thread_scaling"],
                "ideal_speedup": head["ideal_speedup"], "by_staleness": by_eta, "gloo_weights": gloo,
                "targets": {"rollout_busy_ge_0.85": head["rollout_busy"] >= 0.85,
                            "trainer_busy_ge_0.85": head["trainer_busy"] >= 0.85, "exact_at_0": exact},
                "steps": a.steps, "warm": a.warm, "prompts": a.prompts, "group": a.group, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
