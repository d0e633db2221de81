"""
Training: GRPO with the rewards of ParaVT (PARA-GRPO) and Video-o3 (VTGR), after an SFT warm start with TDAM.
The file reads top to bottom (docs/method.md has every formula and its source):

    the RL loop        run_rl: per step grpo.collect_groups (roll out, score, group advantages), grpo.policy_update
                       (the PPO-clip step), one metrics row, checkpoints, the held-out evaluation
    the SFT step       sft_token_loss, sft_loss (TDAM on a fraction of batches), sft_backward, run_sft
    main               one rank of a run: model, data, SFT, RL (here, or async_rl.run_rl with --async-staleness >= 1),
                       the held-out evaluation
    settings           rollout_config_of_args, sft_settings, grpo_settings (from the resolved flags), start, cli
The GRPO step itself (the objective, collecting groups, the update, the policy and its optimizer) is grpo.py; the
flags, the presets and the recipes (every default) live in recipes.py; the kernels (fused log-prob gather and loss,
TDAM's blocked attention) in ops.py, the decoder layer the model runs in layers.py, the rollout engine in
rollout.py (its K/V cache in kvcache.py), the rewards in rewards.py, the run directory and the processes
(checkpoints, metrics, FSDP2, the launcher) in runtime.py; rollout ranks beside trainer ranks in async_rl.py.

Recipes (--recipe, recipes.RECIPES): para_grpo (ParaVT's PARA-GRPO), vtgr (Video-o3's trajectory-guided reward),
combined, vanilla (the ablation); presets (--preset tiny | paravt | videoo3, recipes.PRESETS) set a whole run.

Departures from the papers' releases are noted where they happen and listed in docs/method.md ("Departures").

Run commands:
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
import recipes
import rollout
import runtime
import sft
import video
from ops import TdamSpec, policy_rows, token_logprobs
from runtime import Run, all_mean, all_sum, full_weights, print0

T = recipes.TINY      # the settings dataclasses' defaults: what `python train.py` runs


def run_rl(run: Run, model, ref_model, processor, optimizer, records: list, video_root: str,
           cfg: rollout.RolloutConfig, s: grpo.GRPOSettings, steps: int, lr: float, warmup_steps: int, pad_id: int,
           start: int = 0, eval_every: int = 0, evaluate=None, pool: video.DecodePool | None = None) -> None:
    """RL steps start+1 .. steps: grpo.collect_groups, grpo.policy_update, one metrics row per step, checkpoints, and the
    held-out evaluation every `eval_every` steps (`evaluate(model, name) -> metrics`). With a decode pool the
    next step's overviews decode in its threads while this step trains (first draw; more draws of dynamic
    sampling decode when they come), and each row logs decode seconds, wait seconds and the cache hit rate."""
    failed, by_id, spare = 0, {str(r["id"]): r for r in records}, None
    for step in tqdm(range(start + 1, steps + 1), desc="rl", disable=run.rank != 0, initial=start, total=steps):
        t0 = time.time()
        step_lr = grpo.set_lr(optimizer, grpo.get_lr(step - 1, steps, lr, warmup_steps))
        model.eval()
        with full_weights(model):
            g = grpo.collect_groups(run, model, ref_model, processor, records, video_root, cfg, s, step, pad_id, pool)
        if pool is not None and step < steps:           # the next step's overviews decode while this one trains
            upcoming, ks = grpo.draw_prompts(records, s, run.seed, run.rank, run.world, step + 1)
            rollout.prefetch(pool, upcoming, video_root, cfg, rollout.video_factor(processor), ks)
        run.counters["bad_samples"] += sum(t.error is not None for t in g.trajs)
        failed = run.failed_samples(g.trajs, step, start, failed, s.group_size)
        model.train()
        filler = next((t for t in g.trajs if t.error is None and t.token_ids and grpo.trainable(t, model.config.video_token_id)),
                      None)
        if filler is None and run.world > 1:   # nothing sampled here (a share of 0, or every sample failed)
            spare = spare or grpo.filler_trajectory(processor, records, video_root, cfg)
            filler = spare
        gn, stats = grpo.policy_update(model, ref_model, optimizer, g.items, s, pad_id, processor.tokenizer, run.world, filler,
                                  lambda loss: run.optimizer_step(model, optimizer, loss, "rl", step,
                                                                  [t.record_id for t, _, _ in g.items]))
        per_sample = grpo.rollout_metrics(g.trajs, g.comps, by_id)   # means over this rank's samples (maybe none)
        per_sample.update(reward=float(g.rewards.mean()) if g.trajs else 0.0, zero_var_frac=g.zero_var_frac,
                          reward_kl=float(g.seq_kl.mean()) if g.trajs else 0.0)
        m = {}
        if pool is not None:
            ps = pool.stats(reset=True)
            m.update(decode_s=ps["decode_seconds"], decode_wait_s=ps["wait_seconds"],
                     frame_cache_hit_rate=pool.cache.stats()["hit_rate"] if pool.cache else 0.0)
        m.update(kept=len(g.items), draws=g.draws, grad_norm=float("nan") if gn is None else gn, lr=step_lr,
                 step_time=time.time() - t0, tokens_per_s=sum(len(t.token_ids) for t in g.trajs) / (time.time() - t0),
                 **stats)
        m = {**grpo.reduce_metrics(per_sample, len(g.trajs), run.world, m),
             "groups": all_sum(g.n_groups) if run.world > 1 else g.n_groups}
        run.log("rl", step, m)
        if run.rank == 0:
            tqdm.write(f"rl {step}/{steps} | R {m['reward']:.3f} | acc {m['accuracy']:.2f} | "
                       f"fmt {m['format_compliance']:.2f} | tool {m['tool_call_ratio']:.2f} | "
                       f"turns {m['turns']:.2f} | K {m['mean_k']:.1f} | zero-var {m['zero_var_frac']:.2f} | "
                       f"draws {m['draws']:.0f} | clip {m['clip_frac']:.3f} | kl {m['kl']:.4f} | {m['step_time']:.1f}s")
        saved = step % run.save_every == 0 or step == steps
        if saved:
            run.save("rl", step, model, optimizer)
        if eval_every and step % eval_every == 0 and evaluate is not None:
            result = runtime.broadcast_object(evaluate(model, f"rl-{step:06d}"), run.world)   # rank 0's, everywhere
            run.evaluated("rl", step, result, model, optimizer, saved)
    model.eval()


# -----------------------------------------------------------------------------
# 4. The SFT step (warm start; TDAM on a fraction of batches)

def sft_token_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                   num_tokens: float | torch.Tensor | None = None, temperature: float = 1.0,
                   chunk_size: int | None = None, compile: bool = True) -> tuple[torch.Tensor, int]:
    """
    Cross-entropy on the masked (assistant) tokens, token mean, with log p from the fused `ops.token_logprobs`:

        loss = -sum_it m_it log_softmax(h_it W^T / T)[t_it] / num_tokens        (num_tokens default sum(m))

    Shapes: hidden (B, L, D), lm_head_weight (V, D), targets, mask (B, L). With micro-batches pass the
    whole batch's token count as num_tokens so the gradients add up. Returns (loss, n_tokens of this call).
    """
    h, t, mask, _ = policy_rows("sft_token_loss", hidden, targets, mask)
    n_tokens = h.shape[0]
    logp = token_logprobs(h, lm_head_weight, t, chunk_size, compile, temperature)           # (N,) fp32
    return -logp.sum() / (max(n_tokens, 1) if num_tokens is None else num_tokens), n_tokens


@dataclasses.dataclass
class SFTSettings:
    """The SFT warm start's knobs (flags or --set keys sft_steps, sft_batch, ...); defaults: recipes.TINY."""
    steps: int = T["sft_steps"]
    batch: int = T["sft_batch"]
    micro_batch: int = T["sft_micro_batch"]
    micro_batch_tokens: int = T["micro_batch_tokens"]    # ... and rows x longest row at most: the RL update's budget
    lr: float = T["sft_lr"]
    tdam_ratio: float = T["tdam_ratio"]
    loss_chunk: int = T["loss_chunk"]                # token_logprobs' chunk in the loss; 0: its own rule
    compile: bool = False                            # resolve: True on CUDA
    precision: str = "fp32"                          # fp32 | bf16: the forward passes' compute dtype (grpo.autocast)


def sft_loss(model, batch: dict, chunk_size: int | None = None, attn_mask_4d=None, compile: bool = True,
             tdam: TdamSpec | None = None, precision: str = "fp32") -> tuple[torch.Tensor, int]:
    """Cross-entropy on assistant (POLICY) tokens only, token mean, through the fused `sft_token_loss`; the forward
    in the compute dtype of `precision` (`autocast`, `head_inputs`)."""
    hidden, weight, targets, mask = grpo.policy_head(model, batch, precision, attn_mask_4d, tdam)
    return sft_token_loss(hidden, weight, targets, mask, chunk_size=chunk_size, compile=compile)


def sft_micro_batches(items: list, rows: int, model, pad_id: int, tokens: int | None = None):
    """Collated micro-batches, shortest first (rows of like length share a pad length: docs/experiments.md), of at
    most `rows` trajectories and, as the RL update's (grpo.micro_batches), (rows x longest) <= `tokens` padded
    tokens, a longer row alone: unequal rows are right-padded, and padding makes the model build a dense (B, 1, L, L)
    mask (2 rows of 32k tokens: 2 GiB, and 4 GiB in its additive form, each layer call); one row has none."""
    items = sorted(items, key=lambda t: len(t.token_ids))
    for sl in grpo.micro_batches([len(t.token_ids) for t in items], max(1, rows), tokens or 2 ** 62):
        yield rollout.collate(items[sl], model, pad_id)


def sft_backward(model, items: list, rows: int, pad_id: int, loss_chunk: int | None = None, tdam_tokenizer=None,
                 compile: bool = True, counts: dict | None = None, precision: str = "fp32", world: int = 1,
                 filler=None, tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """Backward of the batch's SFT loss (token mean over all its policy tokens, on every rank) through micro-batches
    of `rows` and `tokens` (`sft_micro_batches`): each micro-batch's token mean weighted by n_i / (N / world), N the
    tokens of all ranks (FSDP averages the ranks' gradients), so the gradients add up to those of one forward over
    the whole global batch. A rank with fewer micro-batches than another (or none) runs zero-weight passes (on its
    last micro-batch, or on `filler`), so every rank joins the same collectives. loss_chunk: token_logprobs' chunk
    (None: its own rule). tdam_tokenizer: TDAM masks on (spans found from the text; rows without an answer counted
    in `counts`). precision: the compute dtype (`autocast`). Returns (this rank's part of the batch loss, detached, scaled as the gradients are: the
    ranks' mean is the batch loss; N)."""
    batches = list(sft_micro_batches(items, rows, model, pad_id, tokens))
    n_local = sum(int(grpo.policy_mask(b["roles"]).sum()) for b in batches)   # sft_loss's own token count
    n_tok, n_pad = grpo.rank_totals(n_local, len(batches), world)
    n_tok = max(1, n_tok)
    norm = n_tok / world
    parts = []
    for batch in batches:
        spec = sft.tdam_spec(batch, tdam_tokenizer, model.config.video_token_id, counts) if tdam_tokenizer else None
        micro, n = sft_loss(model, batch, loss_chunk, None, compile, spec, precision)
        (micro * (n / norm)).backward()
        parts.append(micro.detach() * (n / norm))
    fill = (batches[-1] if batches else rollout.collate([filler], model, pad_id)) if n_pad else None
    for _ in range(n_pad):                            # zero-weight passes: no gradient, matching collectives
        (sft_loss(model, fill, loss_chunk, None, compile, None, precision)[0] * 0.0).backward()
    return (torch.stack(parts).sum() if parts else torch.zeros(())), n_tok


def sft_draw(seed: int, step: int, rank: int, world: int, n: int, s: SFTSettings) -> tuple[list[int], bool]:
    """A step's SFT batch on a rank (indices into the items) and whether the step runs TDAM. s.batch is the global
    batch, as --prompts-per-step is RL's: one draw seeded by (seed, step) alone, dealt out round-robin (rank r
    takes draws r, r + world, ...), so W ranks train on the trajectories one rank would (before, each rank drew
    s.batch of its own: --gpus 8 trained on 8x the batch). String seeds: draws independent across steps, and the
    next step's can be prefetched; the seed keeps the ':0' of the one-rank draws from before."""
    rng = random.Random(f"sft:{seed}:{step}:0")
    idx = [rng.randrange(n) for _ in range(s.batch)]
    return idx[rank::world], rng.random() < s.tdam_ratio


def run_sft(run: Run, model, items: list, optimizer, s: SFTSettings, pad_id: int, tokenizer,
            start: int = 0) -> None:
    """SFT steps start+1 .. s.steps: a global batch drawn per step (`sft_draw`, its share on each rank), TDAM on a
    fraction of batches, AdamW with warmup + cosine, a checkpoint every run.save_every steps and at the end."""
    model.train()
    for step in tqdm(range(start + 1, s.steps + 1), desc="sft", disable=run.rank != 0, initial=start, total=s.steps):
        t0 = time.time()
        lr = grpo.set_lr(optimizer, grpo.get_lr(step - 1, s.steps, s.lr, warmup_steps=min(10, s.steps // 10)))
        idx, tdam = sft_draw(run.seed, step, run.rank, run.world, len(items), s)
        if step < s.steps and hasattr(items, "prefetch"):   # the next step's trajectories, encoded meanwhile
            items.prefetch(sft_draw(run.seed, step + 1, run.rank, run.world, len(items), s)[0])
        batch = [items[i] for i in idx]
        loss, n_tok = sft_backward(model, batch, s.micro_batch, pad_id, s.loss_chunk or None, tokenizer if tdam else None,
                                   s.compile, run.counters, s.precision, run.world, None if idx else items[0],
                                   s.micro_batch_tokens)
        if tdam and run.counters.get("tdam_no_answer") and "tdam" not in run.warned:
            run.warned.add("tdam")
            print0(run.rank, "TDAM: a trajectory has no <answer> after its prompt, so it keeps the causal mask "
                             "(counted as tdam_no_answer in metrics.jsonl)")
        gn = run.optimizer_step(model, optimizer, loss.detach(), "sft", step, [t.record_id for t in batch])
        row = all_mean({"loss": float(loss), "grad_norm": gn, "lr": lr, "tokens_per_s": n_tok / (time.time() - t0),
                        "step_time": time.time() - t0, "tdam": float(tdam)}, run.world)
        run.log("sft", step, row)
        if run.rank == 0 and (step % 25 == 0 or step == s.steps):
            tqdm.write(f"sft {step}/{s.steps} | loss {row['loss']:.4f} | lr {lr:.2e} | {row['step_time']:.2f}s")
        if step % run.save_every == 0 or step == s.steps:
            run.save("sft", step, model, optimizer)
    model.eval()


# -----------------------------------------------------------------------------
# 5. main: one rank of a run

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
              args.max_bad_fraction, args.report_to, export_dtype=torch.bfloat16 if args.precision == "bf16" else None)
    print0(rank, json.dumps({"settings": vars(args), "world": world, "device": str(device)}))
    if args.stage != "sft":
        print0(rank, grpo.recipe_line(grpo_settings(args)))
    ckpt = runtime.latest_checkpoint(args.run_dir) if args.resume else None
    model, processor = grpo.policy_model(ckpt or args.model, device, args.precision, world, args.seed, args.grad_checkpointing)
    pad_id = processor.tokenizer.pad_token_id
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
        with grpo.autocast(args.precision, device):
            return evaluation.evaluate_held_out(m, processor, held, video_root, cfg, run, name,
                                                batch_size=args.eval_batch)

    summary = {}
    if args.stage == "all" and not state and args.eval_before:
        summary["before"] = evaluate(model, "before")
    if args.stage in ("all", "sft") and stage0 != "rl":
        items, n_bad = sft.sft_examples(train_recs, processor, video_root, cfg, sft_data=args.sft_data, seed=args.seed,
                                    gated_choices=args.gating_choices if args.sft_gated_overviews else [],
                                    always_call=args.always_call, direct_crop=args.direct_crop,
                                    tool_free=args.sft_tool_free,
                                    budget_fraction=args.sft_budget_fraction, keep_bad_calls=args.keep_bad_calls, max_bad_fraction=args.max_bad_fraction,
                                    workers=torch.get_num_threads(), cache_bytes=args.sft_cache_gb * 2 ** 30,
                                    log=lambda m: print0(rank, m))
        run.counters["bad_samples"] += 0 if state else n_bad          # a resumed run counted them before
        optimizer = grpo.make_optimizer(model, args.sft_lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "sft")
        run_sft(run, model, items, optimizer, sft_settings(args), pad_id, processor.tokenizer, start=step0 if stage0 == "sft" else 0)
        if args.stage == "all":
            summary["sft"] = evaluate(model, "sft")
    pool = lambda: video.DecodePool(args.decode_workers, args.decode_timeout,
                                    video.FrameCache(int(args.frame_cache_gb * 2 ** 30), disk_dir=args.frame_cache))
    reference = lambda: runtime.reference_model(args.run_dir, args.model, args.stage == "all", device, args.seed,
                                                grpo.PRECISION[args.precision])
    if args.stage in ("all", "rl") and args.async_staleness:    # its own models, from the newest checkpoint
        source = ckpt if stage0 == "rl" else runtime.latest_checkpoint(args.run_dir)
        model = optimizer = items = None       # the SFT stage's model, AdamW and items go before RL builds its own
        gc.collect()
        with pool() as p:
            model = async_rl.run_rl(run, layout, processor, args.model, source, state, device, args.precision,
                                    args.seed, args.grad_checkpointing, reference, rl_recs, video_root, cfg,
                                    grpo_settings(args), args.rl_steps, args.lr, args.vision_lr_scale,
                                    args.warmup_steps, step0 if stage0 == "rl" else 0, pad_id, args.eval_every,
                                    evaluate, p)
    elif args.stage in ("all", "rl"):
        optimizer = grpo.make_optimizer(model, args.lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "rl")
        ref_model = reference() if args.kl_coef > 0 else None
        with pool() as p:
            run_rl(run, model, ref_model, processor, optimizer, rl_recs, video_root, cfg, grpo_settings(args),
                   args.rl_steps, args.lr, args.warmup_steps, pad_id, start=step0 if stage0 == "rl" else 0,
                   eval_every=args.eval_every, evaluate=evaluate, pool=p)
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
# 6. Flags: parsed, checked and resolved once


def rollout_config_of_args(args) -> rollout.RolloutConfig:
    """The run's RolloutConfig: every field is a resolved setting of the same name (recipes.resolve)."""
    return rollout.RolloutConfig.of(vars(args), memory_budget_bytes=int(args.rollout_memory_gb * 2 ** 30)
                                    if args.rollout_memory_gb else None)


def sft_settings(args) -> SFTSettings:
    return SFTSettings(steps=args.sft_steps, batch=args.sft_batch, micro_batch=args.sft_micro_batch,
                       micro_batch_tokens=args.micro_batch_tokens, lr=args.sft_lr,
                       tdam_ratio=args.tdam_ratio, loss_chunk=args.loss_chunk, compile=bool(args.compile),
                       precision=args.precision)


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
