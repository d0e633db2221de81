"""
The RL update with each shared prompt once (--set pack_prompts=1, policy.pack_prompts: one packed row per micro-batch,
prompt | suffix | suffix | ...) against a padded row per sample (--set pack_prompts=0), on the same trajectories:
one RL step's groups of the embedded default, sampled by a warm-started policy.

    python bench/pack_bench.py                        # a fresh 150-step SFT warm start, then the step
    python bench/pack_bench.py --model RUN_OR_CKPT --repeats 5

Both sides run grpo.policy_update on the same items (gradients formed, no optimizer step, so every repeat sees
the same weights), interleaved A, B, A, B after one untimed call each (common.ab_times), one thread. Figures:
the update's seconds each side (median wall and CPU), speedup (unpacked / packed, CPU time), the tokens each
forward runs (the samples' lengths summed vs the packed rows'), the peak of live tensor bytes during one update
each (common.LiveTensors), and that both give the same update: the largest gradient difference relative to
the gradient's scale (the on-policy loss is -mean A whatever the forward, so it is printed, not compared).
Target: speedup >= 1.5 with the same gradients (1e-4).
The last line is one JSON object.
"""
import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from common import ROOT, LiveTensors, ab_times, checkpoint_dir, median, print_json, set_threads, table

import data
import grpo
import recipes
import train
import policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint or run dir (default: a fresh SFT warm start)")
    p.add_argument("--sft-steps", type=int, default=150, help="the warm start's SFT steps, without --model")
    p.add_argument("--step", type=int, default=1, help="the RL step whose prompts are drawn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.model is None:
        work = Path(tempfile.mkdtemp(prefix="pack_bench_"))
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--stage", "sft", "--sft-steps", str(a.sft_steps),
                               "--seed", str(a.seed), "--device", "cpu", "--run-dir", str(work)], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"pack_bench: the SFT warm start failed:\n{done.stderr[-3000:]}")
        a.model = str(work)
    set_threads(a.threads)
    args = recipes.parse_train_args(["--device", "cpu", "--seed", str(a.seed)])
    s, cfg = train.grpo_settings(args), train.rollout_config_of_args(args)
    model, processor = policy.policy_model(checkpoint_dir(a.model, "pack_bench"), "cpu", "fp32", 1, a.seed)
    pad = processor.tokenizer.pad_token_id
    recs, _, root = data.synthetic_data(a.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                        os.environ.get("PARAVT_CACHE", "cache"))
    share = types.SimpleNamespace(seed=a.seed, rank=0, world=1)
    items = grpo.collect_groups(share, model, None, processor, recs, root, cfg, s, a.step, pad).items
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def update(pack: bool):
        grads = []
        model.zero_grad(set_to_none=True)
        spy = types.SimpleNamespace(world=1, group=None, rank=0, optimizer_step=lambda *a: grads.append(
            [None if p.grad is None else p.grad.clone() for p in params]) or 0.0)
        job = grpo.RLJob([], "", cfg, dataclasses.replace(s, pack_prompts=pack))
        _, stats = grpo.policy_update(spy, model, None, None, items, job, 1, processor)
        return stats["loss"], grads[0]

    wall, cpu = ab_times({"packed": lambda: update(True), "unpacked": lambda: update(False)}, a.repeats)
    live = {}
    for name, pack in (("packed", True), ("unpacked", False)):
        with LiveTensors() as m:
            out = update(pack)
        live[name] = (m.mb, out)
    (loss_p, grads_p), (loss_u, grads_u) = live["packed"][1], live["unpacked"][1]
    grad_diff = max(float((gp - gu).abs().max() / gu.abs().max().clamp(min=1e-12))
                    for gp, gu in zip(grads_p, grads_u) if gu is not None)
    video_id, merge = model.config.video_token_id, model.config.vision_config.spatial_merge_size
    trajs = [t for t, _, _ in items]
    prompts = policy.shared_prompts(trajs, video_id, merge)
    lengths = [len(t.token_ids) for t in trajs]
    tokens = sum(lengths)
    # what the packed forwards run: per micro-batch (as policy_update forms them) each distinct prompt once
    slices = grpo.update_micro_batches(lengths, s, prompts)
    packed_tokens = sum(n - (pr[1] if pr else 0) for n, pr in zip(lengths, prompts)) + sum(
        sum({pr[0]: pr[1] for pr in prompts[sl] if pr}.values()) for sl in slices)
    med = {k: (median(wall[k]), median(cpu[k])) for k in wall}
    speedup = med["unpacked"][1] / med["packed"][1]
    exact = grad_diff <= 1e-4
    print(table([[name, f"{med[name][0]:.2f}", f"{med[name][1]:.2f}", n, f"{live[name][0]:.0f}"]
                 for name, n in (("packed", packed_tokens), ("unpacked", tokens))],
                ["side", "update wall s", "update CPU s", "tokens", "peak live MB"]))
    print_json({"packed_s": med["packed"][1], "unpacked_s": med["unpacked"][1], "speedup": speedup,
                "tokens": tokens, "packed_tokens": packed_tokens, "token_ratio": tokens / packed_tokens,
                "peak_live_mb_packed": live["packed"][0], "peak_live_mb_unpacked": live["unpacked"][0],
                "loss_packed": loss_p, "loss_unpacked": loss_u, "max_rel_grad_diff": grad_diff, "samples": len(items),
                "groups": len({pr[0] for pr in prompts if pr}), "repeats": a.repeats, "threads": a.threads,
                "targets": {"speedup_ge_1_5": speedup >= 1.5, "same_update": exact}})


if __name__ == "__main__":
    main()
