"""One policy, measured (docs/method.md §5.2-5.3): the default's RL at learning rate 0, so the policy never moves and
every gap between the rollout's log-probs and the trainer's is arithmetic, in the fast mode and the exact mode
(--set exact_policy=1), fp32 and bf16 autocast; then the exact mode's rollout speed, the recompute it saves and the
contract's cost, side by side in one process.

    python bench/mismatch_bench.py                               # the default's SFT warm start, then 4 RL runs
    python bench/mismatch_bench.py --checkpoint runs/default     # a trained run's newest checkpoint instead of SFT
    python bench/mismatch_bench.py --sft-steps 50 --rl-steps 5   # a quick look

Per run (train.py --stage rl --lr 0, the rest the default's): each step's mismatch/abs_diff_mean, its max over the
steps' abs_diff_max, the mean k3, and `drift`, the least-squares slope of abs_diff_mean over the steps (per step: at
learning rate 0 a gap that grows would be a bug). In process, on the warm-started model and one step's draw:
- exact_rollout_speed_ratio: the exact mode's sampled tokens a second over the fast mode's (run_agent, the default's
  prompts, fp32, the two interleaved after a warm-up each, medians);
- recompute_saved_s: the no-grad exact forward over the step's trajectories that the exact mode skips where the update
  needs pi_old (ppo_epochs > 1: the recorded log-probs are pi_old);
- contract_overhead: what the contract costs a step (the engine's digests: the same rollout with contract.RECORD on and
  off; collate's check: collate with check=True and False), over the fast fp32 run's mean step time.
The last line is one JSON object: {fast: {fp32, bf16}: {abs_diff_mean, abs_diff_max, k3, drift}, exact: {fp32, bf16}:
{abs_diff_max}, exact_rollout_speed_ratio, recompute_saved_s, contract_overhead, ...}.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, ab_times, print_json, set_threads, table  # bench/common.py (puts the repo on sys.path)

import torch

import contract
import data
import grpo
import policy
import recipes
import rollout
import runtime
import train
from model import load_model


def train_py(argv: list, threads: int) -> None:
    """One `train.py` run (raises with its stderr's tail on failure)."""
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, argv), "--threads", str(threads)],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mismatch_bench: train.py {' '.join(map(str, argv))} failed:\n{done.stderr[-4000:]}")


def rl_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("stage") == "rl"]


def slope(ys: list[float]) -> float:
    """The least-squares slope of ys over steps 1, 2, ... (0 for fewer than two)."""
    if len(ys) < 2:
        return 0.0
    xs = range(len(ys))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def gap(rows: list[dict]) -> dict:
    means = [r["mismatch/abs_diff_mean"] for r in rows]
    return dict(abs_diff_mean=statistics.fmean(means), abs_diff_max=max(r["mismatch/abs_diff_max"] for r in rows),
                k3=statistics.fmean(r["mismatch/k3"] for r in rows), drift=slope(means),
                tokens=sum(r["mismatch/tokens"] for r in rows), step_s=statistics.fmean(r["step_time"] for r in rows))


def in_process(ckpt: str, threads: int, repeats: int) -> dict:
    """The rollout's speed in both modes, the skipped recompute and the contract's cost, on one step's draw."""
    args = recipes.parse_train_args(["--model", ckpt, "--threads", str(threads)])
    model, processor = load_model(ckpt, device="cpu")
    cache = os.environ.get("PARAVT_CACHE", "cache")
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix, cache)
    if args.n_rl:
        records = data.synthetic_rl(args.seed, args.n_rl, args.task_duration, args.task_mix, cache)
    s = train.grpo_settings(args)
    recs, ks = grpo.draw_prompts(records, s, args.seed, 0, 1, step=1)
    cfg = train.rollout_config_of_args(args)
    exact_cfg = rollout.RolloutConfig.of(vars(args), exact_policy=True)
    sample = lambda c: (lambda: rollout.run_agent(model, processor, recs, root, c, seed=grpo.draw_seed(args.seed, 1, 0),
                                                  nframes=ks))
    tokens = lambda trajs: sum(t.draws + sum(u.draws for u in t.subagents) for t in trajs)
    out = {}
    with torch.no_grad():
        runs = {"fast": sample(cfg)(), "exact": sample(exact_cfg)()}
        wall, _ = ab_times({"fast": sample(cfg), "exact": sample(exact_cfg)}, repeats)
        speed = {k: tokens(runs[k]) / statistics.median(wall[k]) for k in runs}
        out.update(fast_tokens_per_s=speed["fast"], exact_tokens_per_s=speed["exact"],
                   exact_rollout_speed_ratio=speed["exact"] / speed["fast"])
        # the pi_old forward the exact mode skips (policy_update's micro-batches, unpacked as the exact mode runs them)
        trajs = [t for t in runs["exact"] if t.error is None and t.token_ids]
        pad = processor.tokenizer.pad_token_id
        slices = policy.micro_batches([len(t.token_ids) for t in trajs], s.micro_batch, s.micro_batch_tokens)
        batches = [rollout.collate(trajs[sl], model, pad, share_videos=True) for sl in slices]
        t0 = time.perf_counter()
        for b in batches:
            policy.exact_logprobs(model, b, s.temperature, s.precision)
        out["recompute_saved_s"] = time.perf_counter() - t0
        # the contract: the engine's digests (recording on / off), collate's check (on / off)
        def recording(on: bool):
            def go():
                contract.RECORD = on
                try:
                    return sample(cfg)()
                finally:
                    contract.RECORD = True
            return go
        wall, _ = ab_times({"on": recording(True), "off": recording(False)}, repeats)
        out["record_s"] = max(0.0, statistics.median(wall["on"]) - statistics.median(wall["off"]))
        fast = [t for t in runs["fast"] if t.error is None and t.token_ids]
        check = lambda on: (lambda: [rollout.collate(fast[sl], model, pad, share_videos=True, check=on)
                                     for sl in policy.micro_batches([len(t.token_ids) for t in fast], s.micro_batch,
                                                                    s.micro_batch_tokens)])
        wall, _ = ab_times({"on": check(True), "off": check(False)}, repeats * 3)
        out["check_s"] = max(0.0, statistics.median(wall["on"]) - statistics.median(wall["off"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a checkpoint dir or a run dir (its newest checkpoint) instead of the SFT stage")
    p.add_argument("--sft-steps", type=int, default=recipes.TINY["sft_steps"], help="the warm start's steps")
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (the exact mode's tests use 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts a side")
    p.add_argument("--out-dir", default=None, help="where the runs go (default: a temporary folder); a run already "
                   "complete there is read, not run again")
    args = p.parse_args()
    set_threads(args.threads)
    work = args.out_dir or tempfile.mkdtemp(prefix="mismatch_bench_")
    if args.checkpoint:
        from common import checkpoint_dir
        ckpt = checkpoint_dir(args.checkpoint, "mismatch_bench")
    else:
        train_py(["--stage", "sft", "--run-dir", os.path.join(work, "sft"), "--sft-steps", args.sft_steps], args.threads)
        ckpt = runtime.latest_checkpoint(os.path.join(work, "sft"))
    figures = {"fast": {}, "exact": {}}
    for mode in ("fast", "exact"):
        for precision in ("fp32", "bf16"):
            run_dir = os.path.join(work, f"{mode}-{precision}")
            done = os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(rl_rows(run_dir)) >= args.rl_steps
            if not done:                  # a run already complete in --out-dir is read, not run again
                train_py(["--stage", "rl", "--resume", "--model", ckpt, "--run-dir", run_dir, "--rl-steps",
                          args.rl_steps, "--lr", 0, "--precision", precision, "--set",
                          f"exact_policy={int(mode == 'exact')}"], args.threads)
            figures[mode][precision] = gap(rl_rows(run_dir))
    extra = in_process(ckpt, args.threads, args.repeats)
    step_s = figures["fast"]["fp32"]["step_s"]
    print(table([[m, p, f["tokens"], f"{f['abs_diff_mean']:.3g}", f"{f['abs_diff_max']:.3g}", f"{f['k3']:.3g}",
                  f"{f['drift']:.3g}", f"{f['step_s']:.1f}"] for m, by in figures.items() for p, f in by.items()],
                ["mode", "precision", "tokens", "|d| mean", "|d| max", "k3", "drift/step", "step s"]))
    print(f"rollout tokens/s: fast {extra['fast_tokens_per_s']:.0f}, exact {extra['exact_tokens_per_s']:.0f}; "
          f"the exact mode's skipped pi_old forward {extra['recompute_saved_s']:.2f} s a step; the contract "
          f"{extra['record_s'] + extra['check_s']:.3f} s a step (digests {extra['record_s']:.3f}, check "
          f"{extra['check_s']:.3f}) of {step_s:.1f} s; checkpoint {ckpt}, runs in {work}")
    keep = ("abs_diff_mean", "abs_diff_max", "k3", "drift")
    print_json({"fast": {p: {k: f[k] for k in keep} for p, f in figures["fast"].items()},
                "exact": {p: {"abs_diff_max": f["abs_diff_max"]} for p, f in figures["exact"].items()},
                "exact_rollout_speed_ratio": extra["exact_rollout_speed_ratio"],
                "recompute_saved_s": extra["recompute_saved_s"],
                "contract_overhead": (extra["record_s"] + extra["check_s"]) / step_s,
                "fast_step_s": step_s, "rl_steps": args.rl_steps, "threads": args.threads})


if __name__ == "__main__":
    main()
