"""
Training: an SFT warm start (with TDAM), then GRPO with the rewards of ParaVT (PARA-GRPO) and Video-o3 (VTGR).

    run_rl     one RL step after another: collect scored groups (grpo.collect_groups), take the GRPO step
               (grpo.policy_update), log the step's row, save, evaluate
    main       one rank of a run: the model and data, SFT (sft.run_sft), RL (run_rl here, or async_rl.run_rl with
               --async-staleness >= 1), the held-out evaluation, the summary

The method lives in grpo.py (the RL step), sft.py (the warm start and TDAM) and rewards.py; every setting's default
in recipes.py (presets and recipes); docs/method.md has every formula and its source, and the departures from the
papers' releases.

    python train.py                                   # the embedded default on CPU: tiny model, synthetic task
    python train.py --stage rl --rl-steps 2 --n-train 8 --group-size 2 --prompts-per-step 2   # CPU smoke
    python train.py --model /ckpt/Qwen3-VL-8B-Instruct --preset paravt --data rl.jsonl --video-root /videos --stage rl
    python train.py --gpus 8 --model /ckpt/Qwen3-VL-8B-Instruct --preset paravt --data rl.jsonl \
        --video-root /videos --stage rl --grad-checkpointing
    torchrun --nnodes 2 --nproc-per-node 8 ... train.py ...   # multi-node: torchrun's environment is used
"""
import dataclasses
import gc
import json
import os
import random
import sys
import time
import traceback

import torch
from tqdm import tqdm

import async_rl
import data
import eval as evaluation
import grpo
import policy
import recipes
import rollout
import runtime
import sft
import video
from runtime import Run, all_gather_objects, all_mean, all_sum, full_weights, print0


def run_rl(run: Run, model, ref_model, processor, optimizer, job: grpo.RLJob) -> None:
    """RL steps job.start+1 .. s.rl_steps: roll out and score groups, take the GRPO step, log, save, evaluate."""
    s, by_id = job.s, {str(r["id"]): r for r in job.records}
    for step in tqdm(range(job.start + 1, s.rl_steps + 1), desc="rl", disable=run.rank != 0, initial=job.start,
                     total=s.rl_steps):
        t0 = time.time()
        lr = policy.set_lr(optimizer, policy.get_lr(step - 1, s.rl_steps, s.lr, s.warmup_steps, s.min_lr_ratio))
        model.eval()
        with full_weights(model):
            g = grpo.collect_groups(run, model, ref_model, processor, job.records, job.video_root, job.cfg, s, step,
                                    processor.tokenizer.pad_token_id, job.pool)
        grpo.prefetch(job, processor, run.seed, run.rank, run.world, step + 1)    # decoded while this step trains
        run.sampled(g.trajs, step, job.start, s.group_size)
        model.train()
        grad_norm, stats = grpo.policy_update(run, model, ref_model, optimizer, g.items, job, step, processor)
        update = dict(stats, kept=len(g.items), draws=g.draws, grad_norm=float("nan") if grad_norm is None else grad_norm,
                      lr=lr, step_time=time.time() - t0, **evaluation.decode_figures(job.pool),
                      tokens_per_s=sum(len(t.token_ids) for t in g.trajs) / (time.time() - t0))
        row = evaluation.step_row(all_gather_objects(evaluation.rollout_figures(g, by_id), run.world),
                                  all_mean(update, run.world), all_sum(g.n_groups) if run.world > 1 else g.n_groups)
        run.log("rl", step, row)
        if run.rank == 0:
            tqdm.write(evaluation.step_line(step, s.rl_steps, row))
        saved = step % run.save_every == 0 or step == s.rl_steps
        if saved:
            run.save("rl", step, model, optimizer)
        if s.eval_every and step % s.eval_every == 0 and job.evaluate is not None:
            result = runtime.broadcast_object(job.evaluate(model, f"rl-{step:06d}"), run.world)   # rank 0's, everywhere
            run.evaluated("rl", step, result, model, optimizer, saved)
    model.eval()


# -----------------------------------------------------------------------------
# main: one rank of a run

def main(rank: int, args) -> dict:
    """One rank of a run: model and data, SFT, RL, the held-out evaluation; returns the summary."""
    t_start = time.time()
    timeout_s = args.dist_timeout_min * 60
    rank, world, device = runtime.setup_distributed(rank, args.gpus, args.device, args.threads, timeout_s)
    if args.async_staleness:    # rollout ranks beside trainer ranks: async_rl.py
        layout = async_rl.make_layout(world, args.rollout_ranks, timeout_s)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    run = Run(args.run_dir, rank, world, args.seed, args.save_every, args.keep_last, args.strict,
              args.max_bad_fraction, args.report_to, export_dtype=torch.bfloat16 if args.precision == "bf16" else None,
              max_grad_norm=args.max_grad_norm)
    print0(rank, json.dumps({"settings": vars(args), "world": world, "device": str(device)}))
    if args.stage != "sft":
        print0(rank, grpo.recipe_line(grpo_settings(args)))
    ckpt = runtime.latest_checkpoint(args.run_dir) if args.resume else None
    model, processor = policy.policy_model(ckpt or args.model, device, args.precision, world, args.seed,
                                           args.grad_checkpointing)
    run.processor = processor
    cache = os.environ.get("PARAVT_CACHE", "cache")     # the synthetic task's rendered videos
    if args.data:
        train_recs, held, video_root, held_note = data.load_data(args.data, args.eval_data, args.video_root, args.held_out,
                                                            args.seed, args.max_bad_fraction, lambda m: print0(rank, m))
    else:
        train_recs, held, video_root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration,
                                                      args.task_mix, cache)
        held_note = "synthetic"
    rl_recs = train_recs                 # real data: --data's prompts (the SFT trajectories are --sft-data's)
    if not args.data and args.n_rl and args.stage != "sft":
        rl_recs = data.synthetic_rl(args.seed, args.n_rl, args.task_duration, args.task_mix, cache)
    run.static["held_out"] = held_note
    cfg = rollout_config_of_args(args)
    state = run.resume(ckpt, model) if ckpt else None
    stage0, step0 = (state["stage"], state["step"]) if state else (None, 0)

    def evaluate(m, name: str) -> dict:
        with policy.autocast(args.precision, device):
            return evaluation.evaluate_held_out(m, processor, held, video_root, cfg, run, name,
                                                batch_size=args.eval_batch)

    summary = {}
    if args.stage == "all" and not state and args.eval_before:
        summary["before"] = evaluate(model, "before")
    if args.stage in ("all", "sft") and stage0 != "rl":
        items, n_bad = sft.sft_examples(train_recs, processor, video_root, cfg, sft_data=args.sft_data, seed=args.seed,
                                        gated_choices=args.gating_choices if args.sft_gated_overviews else [],
                                        always_call=args.always_call, direct_crop=args.direct_crop,
                                        tool_free=args.sft_tool_free, budget_fraction=args.sft_budget_fraction,
                                        keep_bad_calls=args.keep_bad_calls, max_bad_fraction=args.max_bad_fraction,
                                        workers=torch.get_num_threads(), cache_bytes=args.sft_cache_gb * 2 ** 30,
                                        log=lambda m: print0(rank, m))
        run.counters["bad_samples"] += 0 if state else n_bad          # a resumed run counted them before
        optimizer = policy.make_optimizer(model, args.sft_lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "sft")
        sft.run_sft(run, model, items, optimizer, sft_settings(args), processor.tokenizer,
                    start=step0 if stage0 == "sft" else 0)
        if args.stage == "all":
            summary["sft"] = evaluate(model, "sft")
    pool = lambda: video.DecodePool(args.decode_workers, args.decode_timeout,
                                    video.FrameCache(int(args.frame_cache_gb * 2 ** 30), disk_dir=args.frame_cache))
    reference = lambda: runtime.reference_model(args.run_dir, args.model, args.stage == "all", device, args.seed,
                                                policy.PRECISION[args.precision])
    if args.stage in ("all", "rl") and args.async_staleness:    # its own models, from the newest checkpoint
        source = ckpt if stage0 == "rl" else runtime.latest_checkpoint(args.run_dir)
        model = optimizer = items = None       # the SFT stage's model, AdamW and items go before RL builds its own
        gc.collect()
        with pool() as p:
            job = grpo.RLJob(rl_recs, video_root, cfg, grpo_settings(args), step0 if stage0 == "rl" else 0, evaluate,
                             p, args.model, source, state, reference)
            model = async_rl.run_rl(run, layout, processor, job, device)
    elif args.stage in ("all", "rl"):
        optimizer = policy.make_optimizer(model, args.lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "rl")
        ref_model = reference() if args.kl_coef > 0 else None
        with pool() as p:
            job = grpo.RLJob(rl_recs, video_root, cfg, grpo_settings(args), step0 if stage0 == "rl" else 0, evaluate, p)
            run_rl(run, model, ref_model, processor, optimizer, job)
    if args.stage == "all" or args.final_eval:
        summary["after"] = evaluate(model, "final")
        summary["seconds"] = round(time.time() - t_start, 1)
        if rank == 0:
            print_summary(summary, runtime.plot_run(args.run_dir))
    runtime.finish(world)
    return summary


def print_summary(summary: dict, png: str | None) -> None:
    cols = [s for s in ("before", "sft", "after") if s in summary]
    print(f"{'':18s}" + "".join(f"{ {'sft': 'SFT', 'after': 'final'}.get(s, s):>10s}" for s in cols))
    for k in summary["after"]:
        print(f"{k:18s}" + "".join(f"{summary[s].get(k, float('nan')):10.3f}" for s in cols))
    print("(accuracy and miou in %, official-style scoring; r_acc is the reward's 0-1 accuracy, grounding IoU included)")
    print(f"curves: {png}")
    print(json.dumps(summary))


# -----------------------------------------------------------------------------
# the settings objects of the resolved flags (recipes.resolve)

def rollout_config_of_args(args) -> rollout.RolloutConfig:
    """The run's RolloutConfig: every field is a resolved setting of the same name (recipes.resolve)."""
    return rollout.RolloutConfig.of(vars(args), memory_budget_bytes=int(args.rollout_memory_gb * 2 ** 30)
                                    if args.rollout_memory_gb else None)


def sft_settings(args) -> sft.SFTSettings:
    return sft.SFTSettings(steps=args.sft_steps, batch=args.sft_batch, micro_batch=args.sft_micro_batch,
                           micro_batch_tokens=args.micro_batch_tokens, lr=args.sft_lr,
                           warmup_steps=args.sft_warmup_steps, tdam_ratio=args.tdam_ratio, loss_chunk=args.loss_chunk,
                           min_lr_ratio=args.min_lr_ratio, compile=bool(args.compile), precision=args.precision)


def grpo_settings(args) -> grpo.GRPOSettings:
    names = {f.name for f in dataclasses.fields(grpo.GRPOSettings)}
    return grpo.GRPOSettings(**{k: v for k, v in vars(args).items() if k in names})


def start(args) -> None:
    """`--plot` alone, or the run: refused when --run-dir holds another run (without --resume), then main on
    every rank (runtime.launch) under the run directory's lock."""
    if args.plot:
        print(runtime.plot_run(args.plot))
        return
    if os.environ.get("RANK", "0") == "0" and (why := runtime.stale_run(args.run_dir, args.stage, args.resume)):
        raise ValueError(why)                        # under torchrun, rank 0 checks (before any rank writes)
    runtime.launch(main, args, lock_dir=args.run_dir)


def cli(argv=None) -> None:
    """`python train.py ...`: a bad input is one line saying what and where (exit 2); --debug shows the traceback.
    Only this project's own checks speak in one line: an error raised inside a library keeps its traceback."""
    args = recipes.parse_train_args(argv, description=__doc__.split("\n\n")[0])
    try:
        start(args)
    except (ValueError, FileNotFoundError, data.RecordError) as e:
        here = os.path.dirname(os.path.abspath(__file__))
        raised_by_us = os.path.dirname(os.path.abspath(traceback.extract_tb(e.__traceback__)[-1].filename)) == here
        if args.debug or not raised_by_us:
            raise
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
