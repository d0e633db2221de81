"""
Rollout beside training (async_rl.py) against the synchronous loop, on the embedded default: the same RL steps with
the same samples per step, each side on this machine's cores.

    python bench/async_bench.py                         # 2 cores: sync = 1 rank x 2 threads; async = 2 ranks x 1
    python bench/async_bench.py --steps 8 --warm 2 --sft-steps 150

1. A warm start: `train.py --stage sft` (--sft-steps), so the RL steps sample the tool-calling trajectories of a
   trained policy, not an untrained model's noise. Both sides start RL from its checkpoint.
2. sync:  `train.py --stage rl --threads 2` (one process: rollout, then update, then rollout).
   async: `train.py --stage rl --gpus 2 --device cpu --rollout-ranks 1 --async-staleness 1 --threads 1` (one rollout
   rank and one trainer, each with one core).
3. exact_at_0: two short runs, with `--async-staleness 0` and without: the same checkpoint bytes.

Figures over the steps after --warm (metrics.jsonl): sync_step_s and async_step_s (mean step time), speedup (their
ratio), rollout_busy (the rollout rank's sampling time / its sampling + waiting time), trainer_busy (update time /
step time), max_staleness. On 2 cores the speed-up is bounded by thread scaling: the async side runs each phase on 1
thread where the sync side had 2 for both, so thread_scaling = (async rollout_s + update_s) / sync_step_s says how
much slower one thread does the same work (1: threads did not help, the overlap is all gain; 2: perfect scaling,
nothing to gain), and ideal_speedup = sync_step_s / max(rollout_s, update_s) is what a perfect overlap would give.
The last line is one JSON object.
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


def rl_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["stage"] == "rl"]


def checkpoint_bytes(ckpt: Path) -> dict:
    """Every file of a checkpoint but trainer.pt (RNG state, counters) and DCP's .metadata (a fresh uuid a save)."""
    return {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name not in ("trainer.pt", ".metadata")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="RL steps per side")
    p.add_argument("--warm", type=int, default=2, help="first steps left out of the figures (compile, caches, the "
                                                       "async pipeline filling)")
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
    wall["async"] = train([*rl, "--run-dir", work / "async", "--threads", 1, "--gpus", 2, "--rollout-ranks", 1,
                           "--async-staleness", 1], env)
    sync, asyn = rl_rows(str(work / "sync"))[a.warm:], rl_rows(str(work / "async"))
    staleness = max(r["staleness"] for r in asyn)
    asyn = asyn[a.warm:]
    mean = lambda rows, k: statistics.mean(r[k] for r in rows)
    sync_step, async_step = mean(sync, "step_time"), mean(asyn, "step_time")
    rollout_s, update_s = mean(asyn, "rollout_s"), mean(asyn, "update_s")
    busy_r = sum(r["rollout_s"] for r in asyn) / sum(r["rollout_s"] + r["rollout_wait_s"] for r in asyn)
    busy_t = sum(r["update_s"] for r in asyn) / sum(r["step_time"] for r in asyn)

    tiny = ["--stage", "rl", "--rl-steps", 2, "--n-train", 8, "--set", "n_rl=4", "--group-size", 2,
            "--prompts-per-step", 2, "--max-new-tokens", 12, "--gating-choices", "4,8", "--threads", 2]
    train([*tiny, "--run-dir", work / "plain"], env)
    train([*tiny, "--run-dir", work / "eta0", "--async-staleness", 0], env)
    exact = checkpoint_bytes(work / "plain" / "ckpt-rl-000002") == checkpoint_bytes(work / "eta0" / "ckpt-rl-000002")

    print(table([["sync (1 rank x 2 threads)", f"{sync_step:.2f}", "-", "-", "-"],
                 ["async (1 rollout + 1 trainer, 1 thread each)", f"{async_step:.2f}", f"{rollout_s:.2f}",
                  f"{update_s:.2f}", f"{busy_r:.2f} / {busy_t:.2f}"]],
                ["side", "step s", "rollout s", "update s", "busy rollout / trainer"]))
    print(f"runs in {work}; wall s: {json.dumps({k: round(v, 1) for k, v in wall.items()})}")
    print_json({"sync_step_s": round(sync_step, 3), "async_step_s": round(async_step, 3),
                "speedup": round(sync_step / async_step, 3), "rollout_busy": round(busy_r, 3),
                "trainer_busy": round(busy_t, 3), "max_staleness": staleness, "exact_at_0": exact,
                "rollout_s": round(rollout_s, 3), "update_s": round(update_s, 3),
                "thread_scaling": round((rollout_s + update_s) / sync_step, 3),
                "ideal_speedup": round(sync_step / max(rollout_s, update_s), 3),
                "steps": a.steps, "warm": a.warm, "prompts": a.prompts, "group": a.group, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
