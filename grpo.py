"""
The GRPO step of this project's training: the objective, collecting scored groups, the policy update, and the
policy and optimizer they act on. train.py runs it in its loop (`run_rl`); async_rl.py runs the same step with
rollout ranks beside trainer ranks. Reads top to bottom (docs/method.md has every formula and its source):

    1. the objective   policy_mask, kl_penalty, grpo_token_terms (PPO-clip + KL per token, and the decoupled
                       objective's behaviour weight: the one place they live), grpo_loss (the loss the RL step runs:
                       ops.token_logprobs, the fused log-prob gather, then grpo_token_terms, token-mean over the
                       policy's tokens), grpo_loss_on_logprobs (the same on (B, L) log-probs: the tests' reference),
                       anchor_credit (token-level anchoring), get_lr
    2. the RL step     collect_groups (nFrames gating -> rollout.run_agent -> rewards.score_trajectory -> group
                       advantages, dynamic sampling; placebo_advantages, the control run), policy_update (the
                       PPO-clip step over micro_batches), the step's metrics (rollout_metrics, reduce_metrics)
    3. forward passes  hidden_and_targets, policy_head, forward_logprobs: whole trajectories -> hidden states /
                       log-probs (the SFT loss in train.py takes them too); shared_prompts / pack_prompts: the
                       update's micro-batch as one row that holds each shared prompt once
    4. the policy      policy_model (fp32 master weights, FSDP2), autocast / head_inputs (the compute dtype),
                       make_optimizer / set_lr (AdamW, the vision tower's rate)

Algorithm (docs/method.md §4-§5). Per RL step the ranks draw `--prompts-per-step` records in all (each its
share), gate each overview to K frames (nFrames gating: K drawn uniformly from the gating_choices, {4, 8, 16,
32} on the tiny default, {4, ..., 64} in ParaVT's recipe; the same K for a prompt's whole group), roll out G
samples per prompt (parallel crop_video calls, up to --max-turns tool rounds, the K/V cache reused across
turns), score every trajectory under the chosen recipe, optionally shape the task reward and subtract a
per-token k1 KL from it (ParaVT: shaped first, then the KL), turn rewards into group advantages
A = (R - mean) / (std + eps) (dynamic sampling draws more prompts until the batch holds groups with signal),
optionally add the exploration-anchoring credit on the closing-tag tokens, and take a PPO-clip step on the
policy's own tokens (token-mean). Every log-prob in the loss is taken at the sampling temperature.

Departures from the papers' releases are noted where they happen and listed in docs/method.md ("Departures").
"""
import contextlib
import dataclasses
import math
import random

import torch

import data
import model as model_lib
import recipes
import rewards
import rollout
import runtime
import sft
import video
from ops import CAUSAL, FULL, TdamSpec, policy_rows, token_logprobs
from runtime import Run, all_gather_objects, all_max, all_mean, all_sum, all_sum_float, full_weights

T = recipes.TINY      # the settings dataclasses' defaults: what `python train.py` runs


# -----------------------------------------------------------------------------
# 1. The PARA-GRPO objective (docs/method.md §4-§5): the equations, and the loss training runs

def policy_mask(roles: torch.Tensor) -> torch.Tensor:
    """(B, L) roles -> (B, L-1) bool: True where the NEXT token is the policy's own (the positions whose
    log-prob enters the loss: never the prompt, tool responses, frames, forced text or pads)."""
    return roles[:, 1:] == rollout.POLICY


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """
    Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (same shape as the inputs).

        k1 = log pi_theta - log pi_ref                      unbiased, can be negative (ParaVT, in the reward)
        k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1
                                                            unbiased, always >= 0 (DeepSeekMath's choice)
    Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = ref_logprobs - logprobs
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_penalty: estimator must be 'k1' or 'k3', got {estimator!r}")


def grpo_token_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, clip_low: float,
                     clip_high: float, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                     kl_estimator: str = "k3", behav_logprobs: torch.Tensor | None = None, behav_cap: float = 5.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    The PPO-clip surrogate with group advantages (GRPO, arXiv 2402.03300), per token, elementwise:

        r_it = exp(log pi_theta(o_it) - log pi_old(o_it))
        l_it = -w_it min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it) + beta KL_it

    w_it = 1 unless behav_logprobs are given: then AReaL's decoupled PPO objective (arXiv 2505.24298; docs/method.md
    §5.1) of asynchronous training: pi_old is the proximal policy (the trainer's weights before this update), and
    the behaviour policy that sampled the token (an older version) enters as the importance
    weight w_it = pi_old(o_it) / pi_behav(o_it); tokens whose w exceeds behav_cap (ParaVT 5) are dropped (w = 0,
    as AReaL's behav_imp_weight_cap filters them). With behav = old, w = 1: plain PPO-clip.

    eps_low / eps_high = clip_low / clip_high (ParaVT 0.2 / 0.2, Video-o3 "clip higher" 0.2 / 0.3). KL_it is
    `kl_penalty(logprobs, ref_logprobs, kl_estimator)` against a frozen reference, weighted by beta = kl_coef
    (Video-o3: 0; ParaVT folds k1 into the reward instead, `sequence_kl`); 0 without a reference. A_it is the
    group advantage of the trajectory, plus the anchoring credit on closing tags with --anchoring token.
    With one optimiser update per batch pi_old == pi_theta, so r = 1 and clipping does nothing: the gradient
    is the plain policy gradient. Any shape; the inputs hold policy tokens only (or zeros elsewhere).
    Returns (l, r, KL, clipped), clipped = the tokens whose gradient the clip cuts off. The one place these
    terms live: `grpo_loss` (training) and `grpo_loss_on_logprobs` (the tests' reference) both call it.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    if behav_logprobs is not None:
        w = torch.exp(old_logprobs.detach() - behav_logprobs)
        per_token = per_token * torch.where(w <= behav_cap, w, 0.0)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return per_token, ratio, kl, clipped


def grpo_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
              old_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float, clip_high: float, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
              kl_estimator: str = "k3", num_tokens: float | torch.Tensor | None = None,
              temperature: float = 1.0, chunk_size: int | None = None, compile: bool = True,
              behav_logprobs: torch.Tensor | None = None, behav_cap: float = 5.0) -> tuple[torch.Tensor, dict]:
    """
    The loss the RL step runs: `grpo_token_terms`, token-mean over the policy's tokens of the whole batch (DAPO,
    arXiv 2503.14476), from the final hidden states, never the (B, L, V) logits:

        logp_it = log_softmax(h_it W^T / T)[o_it]            over the policy tokens (mask m_it = 1) only
        loss    = sum_it m_it l_it(logp_it) / num_tokens      (num_tokens default sum(m), at least 1)

    Shapes: hidden (B, L, D) (the final hidden states predicting targets), lm_head_weight (V, D), targets,
    mask (B, L); old_logprobs, ref_logprobs (B, L); advantages (B,) or (B, L). The mask m is 1 only on the
    policy's own sampled tokens: never the prompt, tool responses, inserted frames, forced text or pads; only
    those rows are gathered (ops.policy_rows), so garbage at masked positions never enters.
    old_logprobs None: the single on-policy epoch, ratio = exp(logp - logp.detach()) = 1 with logp's gradient.
    behav_logprobs (B, L): the sampling version's log-probs (asynchronous runs): the decoupled objective.
    num_tokens: with micro-batches (or ranks) the policy-token count of the whole batch, so the summed
    gradients equal one big batch's. Temperature: the rollouts sample from softmax(logits / T), so every
    log-prob here (old, reference, current) is of that same tempered distribution, as verl and TRL compute
    them. logp comes from `ops.token_logprobs`, the fused log-prob gather (chunked logits in a (V, C) buffer,
    its backward hand-written; plain log_softmax when the logits are small); tests/test_ops.py holds it to
    `grpo_loss_on_logprobs` over naive log-probs in value and gradient. Returns (loss, stats): clip_frac, kl,
    n_tokens, ratio_mean (numbers).
    """
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_loss: kl_coef != 0 needs ref_logprobs")
    h, t, mask, rows = policy_rows("grpo_loss", hidden, targets, mask, old_logprobs=old_logprobs,
                                   advantages=advantages, ref_logprobs=ref_logprobs, behav_logprobs=behav_logprobs)
    logp = token_logprobs(h, lm_head_weight, t, chunk_size, compile, temperature)           # (N,) fp32
    old = logp.detach() if rows["old_logprobs"] is None else rows["old_logprobs"]
    per_token, ratio, kl, clipped = grpo_token_terms(logp, old, rows["advantages"], clip_low, clip_high, kl_coef,
                                                     rows["ref_logprobs"], kl_estimator, rows["behav_logprobs"],
                                                     behav_cap)
    n_tokens = h.shape[0]
    loss = per_token.sum() / (max(n_tokens, 1) if num_tokens is None else num_tokens)
    denom = max(n_tokens, 1)
    with torch.no_grad():   # summed on the device; one host sync
        sums = torch.stack([clipped.float().sum(), kl.float().sum(), ratio.float().sum()]).tolist()
    stats = {"clip_frac": sums[0] / denom, "kl": sums[1] / denom, "n_tokens": n_tokens, "ratio_mean": sums[2] / denom}
    return loss, stats


def grpo_loss_on_logprobs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                          ref_logprobs: torch.Tensor | None = None, kl_estimator: str = "k3",
                          num_tokens: float | torch.Tensor | None = None, behav_logprobs: torch.Tensor | None = None,
                          behav_cap: float = 5.0) -> tuple[torch.Tensor, dict]:
    """`grpo_loss` on (B, L) log-prob tensors instead of hidden states: the reference the tests and benches hold
    the fused path to (same terms, same token-mean, same stats). Masked positions are cut out before any
    arithmetic, so garbage there (inf, NaN) gets exactly zero gradient."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"grpo_loss_on_logprobs: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} must all be (B, L)")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"grpo_loss_on_logprobs: advantages {tuple(advantages.shape)} must be (B,) or (B, L) "
                         f"for logprobs {tuple(logprobs.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_loss_on_logprobs: kl_coef != 0 needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"grpo_loss_on_logprobs: ref_logprobs {tuple(ref_logprobs.shape)} != logprobs "
                         f"{tuple(logprobs.shape)}")
    mask = mask.bool()
    cut = lambda x: None if x is None else torch.where(mask, x, 0.0)       # (B, L), 0 where masked
    adv = cut((advantages[:, None] if advantages.dim() == 1 else advantages).to(logprobs.dtype))
    per_token, ratio, kl, clipped = grpo_token_terms(cut(logprobs), cut(old_logprobs.detach()), adv, clip_low,
                                                     clip_high, kl_coef, cut(None if ref_logprobs is None else
                                                                             ref_logprobs.detach()), kl_estimator,
                                                     cut(behav_logprobs), behav_cap)
    n_tokens = mask.sum()
    loss = torch.where(mask, per_token, 0.0).sum() / (n_tokens.clamp(min=1) if num_tokens is None else num_tokens)
    with torch.no_grad():
        denom = n_tokens.clamp(min=1)
        stats = {"clip_frac": float((clipped & mask).sum() / denom), "kl": float(kl.sum() / denom),
                 "n_tokens": int(n_tokens), "ratio_mean": float(torch.where(mask, ratio, 0.0).sum() / denom)}
    return loss, stats


def anchor_credit(input_ids: torch.Tensor, tokenizer, anchors: list[float]) -> torch.Tensor:
    """Token-level exploration anchoring: (B, L-1) extra advantage ANCHOR_WEIGHT * anchor_b on the positions that
    predict a token covering a closing tag (</think>, </tool_call>, </answer>), found in the decoded text
    however the tokenizer splits the tag (model.tag_token_mask: one token in the tiny tokenizer, '</', 'answer',
    '>' on Qwen's); 0 elsewhere. The loss reads it on the policy's own tokens only."""
    tags = model_lib.tag_token_mask(tokenizer, input_ids)[:, 1:]                       # (B, L-1) bool
    return rewards.ANCHOR_WEIGHT * torch.tensor(anchors, dtype=torch.float32)[:, None] * tags


def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1) -> float:
    """
    Linear warmup to lr over `warmup_steps`, then cosine decay to min_lr = min_lr_ratio * lr at `total_steps`.

        step < warmup:  lr * (step + 1) / warmup
        else:           min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,  p = (step - warmup) / (total - warmup)
    Steps past total_steps stay at min_lr (nanoGPT's get_lr, with the ratio instead of an absolute floor).
    """
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"get_lr: need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got total_steps={total_steps}, warmup_steps={warmup_steps}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = min_lr_ratio * lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------
# 2. The RL step: roll out groups, score them, update the policy

@dataclasses.dataclass
class GRPOSettings:
    """The knobs of one PARA-GRPO / VTGR step (flags or --set keys of the same names; docs/method.md §5).
    Defaults: what `python train.py` runs (recipes.TINY); a run's come from its preset (recipes.PRESETS)."""
    recipe: str = T["recipe"]                        # rewards.score_trajectory's recipe (recipes.RECIPES)
    anchoring: str = T["anchoring"]                  # sequence | token | none
    released_scoring: bool = T["released_scoring"]
    group_size: int = T["group_size"]
    prompts_per_step: int = T["prompts_per_step"]    # over all ranks (the papers' global batch), split by rank_share
    gating: bool = T["gating"]
    gating_choices: tuple = T["gating_choices"]
    dynamic_sampling: bool = T["dynamic_sampling"]
    max_draws: int = T["max_draws"]                  # dynamic sampling: rollout rounds per step at most
    placebo: bool = T["placebo"]                     # a control run: each group's advantages dealt at random
    shaping: bool = T["shaping"]
    kl_coef: float = T["kl_coef"]
    kl_estimator: str = T["kl_estimator"]
    kl_in_reward: bool = T["kl_in_reward"]           # ParaVT: R -= kl_coef * sum_t k1_t before the advantages
    mask_truncated: bool = T["mask_truncated"]
    train_subagents: bool = T["train_subagents"]
    ppo_epochs: int = T["ppo_epochs"]
    micro_batch: int = T["micro_batch"]              # rows per training forward at most
    micro_batch_tokens: int = T["micro_batch_tokens"]    # ... and rows x longest row at most (`micro_batches`)
    packed_tokens: int = T["packed_tokens"]          # ... or, packed (pack_prompts), its tokens at most
    clip_low: float = T["clip_low"]
    clip_high: float = T["clip_high"]
    temperature: float = T["temperature"]            # the rollout's T; every log-prob in the loss uses it too
    logprob_chunk: int = T["logprob_chunk"]          # token_logprobs' chunk (old / reference log-probs, no grad)
    loss_chunk: int = T["loss_chunk"]                # token_logprobs' chunk in the loss; 0: its own rule
    compile: bool = False                            # resolve: True on CUDA
    precision: str = "fp32"                          # fp32 | bf16 (resolve: bf16 on CUDA): the compute dtype
    async_staleness: int = T["async_staleness"]      # >= 1: rollout beside training (async_rl.py), the decoupled loss
    behav_weight_cap: float = T["behav_weight_cap"]  # the decoupled loss's cap on pi_prox / pi_behav
    pack_prompts: bool = T["pack_prompts"]            # the update runs each shared prompt once (`pack_prompts`)


@dataclasses.dataclass
class Groups:
    """What a step's rollouts leave for the update and the log."""
    trajs: list                          # every sampled trajectory of the step (all draws)
    comps: list                          # their reward components
    rewards: torch.Tensor                # (n,) task rewards R as scored (before shaping and KL)
    seq_kl: torch.Tensor                 # (n,) sum_t k1 folded into the reward (--kl-in-reward), else 0
    items: list                          # (trajectory, advantage, components) kept for the update
    n_groups: int                        # groups whose samples entered the update
    draws: int                           # rollout rounds it took
    zero_var_frac: float                 # of the groups drawn


def dealt(total: int, rank: int, world: int) -> range:
    """The positions of a global draw of `total` a rank takes, dealt round-robin: r, r + world, ..."""
    return range(rank, total, world)


def rank_share(total: int, rank: int, world: int) -> int:
    """A rank's part of a global count, the positions it is dealt: total // world, plus one on the first
    total % world ranks (ParaVT's 7 prompts on 8 GPUs: one each on ranks 0-6, none on rank 7)."""
    return len(dealt(total, rank, world))


def draw_seed(seed: int, step: int, draw: int) -> int:
    """A draw's rollout seed, the same on every rank (rollout.row_seed takes it with each prompt's place in the draw)."""
    return seed * 1_000_003 + step * 101 + draw * 7_919


def draw_prompts(records: list, s: GRPOSettings, seed: int, rank: int, world: int, step: int,
                 draw: int = 0) -> tuple[list, list]:
    """The prompts of a step's draw on a rank and their overview sizes: K gated per prompt (the same K for its whole
    group) or None (the rollout's own rule). One draw of the global s.prompts_per_step, seeded by (seed, step, draw)
    alone and dealt out round-robin (`dealt`), as SFT's batch is (train.sft_draw): W ranks roll out the prompts one
    rank would, whatever W, a resumed run draws the same prompts, and the next step's can be prefetched. (Before,
    each rank drew its share from a generator seeded by its rank, so --gpus 3 trained on other prompts than one
    rank; the seed keeps the ':0' of those one-rank draws, so a one-rank run draws what it drew.)"""
    rng = random.Random(f"rl:{seed}:{step}:0" + (f":{draw}" if draw else ""))
    every = [records[rng.randrange(len(records))] for _ in range(s.prompts_per_step)]
    recs = [every[i] for i in dealt(len(every), rank, world)]
    return recs, [rewards.gate_nframes(r["id"], step, s.gating_choices, seed=seed) if s.gating else None for r in recs]


def placebo_advantages(adv: torch.Tensor, group_size: int, seed: int) -> torch.Tensor:
    """A placebo for RL studies (`--placebo`): each group's advantages permuted among its samples, at random
    (seeded). The update keeps every size of the real one (each group's multiset of advantages, zero-variance
    groups at 0, the same tokens, clip, rate and optimizer) and loses what the reward says about which sample did
    better. So what RL gains over its placebo is what the reward taught, and what the placebo loses is what the
    updates' noise alone costs (docs/experiments.md, "the placebo"). Token-level anchoring's credit (--anchoring
    token) is added later and stays the sample's own. adv: (B,), groups contiguous."""
    gen = torch.Generator().manual_seed(seed)
    groups = adv.view(-1, group_size)
    order = torch.stack([torch.randperm(group_size, generator=gen) for _ in range(len(groups))])
    return groups.gather(1, order).view(-1)


def collect_groups(run: Run, model, ref_model, processor, records: list, video_root: str,
                   cfg: rollout.RolloutConfig, s: GRPOSettings, step: int, pad_id: int,
                   pool: video.DecodePool | None = None) -> Groups:
    """Roll out and score this rank's groups for one step: its share of the global s.prompts_per_step
    (`rank_share`; a rank whose share is 0 rolls out nothing and joins the update with zero-weight passes). A
    prompt's rows are seeded by the draw and the prompt's place in the global draw (run_agent's seed_index), so W
    ranks roll out the rows one rank would (the placebo's permutations stay the rank's own).
    Without dynamic sampling: one draw. With it (DAPO, arXiv 2503.14476): groups whose rewards are all equal carry
    no signal and are dropped, and more prompts are drawn until the rank holds its share of groups with signal or
    s.max_draws rounds were rolled out. The caller holds the full weights (one all-gather for every draw)."""
    G, video_id = s.group_size, model.config.video_token_id
    share = rank_share(s.prompts_per_step, run.rank, run.world)
    trajs, comps, R, KL, items, n_groups, n_zero = [], [], [], [], [], 0, 0
    draws = 0
    places = list(dealt(s.prompts_per_step, run.rank, run.world))     # this rank's prompts' places in each draw
    while share and draws < (s.max_draws if s.dynamic_sampling else 1):
        recs, ks = draw_prompts(records, s, run.seed, run.rank, run.world, step, draws)
        with autocast(s.precision, model):
            out = rollout.run_agent(model, processor, recs, video_root, cfg, nframes=ks, pool=pool,
                                    seed=draw_seed(run.seed, step, draws), seed_index=places)
        draws += 1
        scored = [rewards.score_trajectory(t, recs[i // G], s.recipe, s.anchoring, s.released_scoring)
                  for i, t in enumerate(out)]
        r = torch.tensor([x for x, _ in scored])         # the task reward R
        zero = rewards.zero_variance_groups(r, G)        # on the task reward, before any KL term
        kl = torch.zeros_like(r)
        if s.kl_in_reward and s.kl_coef:
            kl = torch.tensor(sequence_kl(model, ref_model, out, s, pad_id))
        # shape R first (ParaVT), then subtract beta sum_t k1 (verl's use_kl_in_reward): the KL is never scaled
        # by the shaping's 10 or clipped with the reward; then normalise within the group
        total = (rewards.shape_reward(r) if s.shaping else r) - s.kl_coef * kl
        adv = rewards.group_advantages(total, G)
        if s.placebo:
            adv = placebo_advantages(adv, G, seed=draw_seed(run.seed, step, draws) + run.rank)   # draws counted up
        keep = torch.tensor([t.error is None and t.token_ids != [] and trainable(t, video_id) for t in out])
        if s.mask_truncated:
            keep &= torch.tensor([not (t.truncated or t.hit_turn_limit) for t in out])
        for g in range(len(recs)):
            n_zero += bool(zero[g])
            if s.dynamic_sampling and (zero[g] or n_groups >= share):
                continue
            n_groups += 1
            items += [(out[i], float(adv[i]), scored[i][1]) for i in range(g * G, (g + 1) * G) if keep[i]]
        trajs += out
        comps += [c for _, c in scored]
        R.append(r)
        KL.append(kl)
        if not s.dynamic_sampling or n_groups >= share:
            break
    if s.train_subagents:
        items += [(sub, a, c) for t, a, c in list(items) for sub in t.subagents if trainable(sub, video_id)]
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)
    return Groups(trajs, comps, cat(R), cat(KL), items, n_groups, draws, n_zero / max(1, len(trajs) // G))


def micro_batches(lengths: list[int], rows: int, tokens: int, prompts: list | None = None) -> list[slice]:
    """Consecutive micro-batches of items of these lengths, in their order: a micro-batch takes the next item
    while it holds fewer than `rows` and (items + 1) x its longest length stays <= `tokens` (the padded tensor's
    size); an item longer than `tokens` goes alone. Why by tokens: rows of unequal length are padded, and a padded
    batch makes transformers build a dense (B, 1, L, L) attention mask, which leaves SDPA's flash path (8 rows of
    32k tokens: 8.6 G mask elements a layer call); one row (or rows of one length) has no padding, no mask and
    the causal flash kernel. So Video-o3's and ParaVT's rows (17k-32k tokens) go one at a time under the default
    budget, and the tiny model's (a few hundred tokens) eight at a time, as `rows` alone groups them
    (docs/method.md §5). `prompts` (`shared_prompts`, --set pack_prompts): a micro-batch is one packed row
    (`pack_prompts`), so its size is each distinct prompt once plus every item's suffix, <= `tokens` (the update
    passes packed_tokens: a row with no padding, sized so that one ParaVT group packs)."""
    out, start, longest, size, seen = [], 0, 0, 0, set()
    for i, n in enumerate(lengths):
        key, p = (prompts[i][0], prompts[i][1]) if prompts and prompts[i] else (None, 0)
        grown = size + n - (p if key in seen else 0)
        cost = grown if prompts else (i - start + 1) * max(longest, n)
        if i > start and (i - start >= rows or cost > tokens):
            out.append(slice(start, i))
            start, longest, seen, grown = i, 0, set(), n
        longest, size = max(longest, n), grown
        seen.add(key)
    return out + [slice(start, len(lengths))] if lengths else out


def update_micro_batches(lengths: list[int], s: GRPOSettings, prompts: list | None) -> list[slice]:
    """The update's micro-batches: packed rows within s.packed_tokens when `prompts` are shared (pack_prompts),
    else padded rows within s.micro_batch_tokens; s.micro_batch items at most either way."""
    return micro_batches(lengths, s.micro_batch, s.packed_tokens if prompts else s.micro_batch_tokens, prompts)


def sequence_kl(model, ref_model, trajs: list, s: GRPOSettings, pad_id: int) -> list[float]:
    """sum_t k1_t = sum_t (log pi(o_t) - log pi_ref(o_t)) over each trajectory's policy tokens, at temperature T
    (0 for a trajectory that cannot be collated): ParaVT's per-token KL folded into the reward (verl's
    use_kl_in_reward), R_i <- shape(R_i) - beta sum_t k1_t after the task reward's shaping, before the group
    advantages."""
    out = [0.0] * len(trajs)
    ok = [i for i, t in enumerate(trajs) if t.error is None and t.token_ids and trainable(t, model.config.video_token_id)]
    for sl in micro_batches([len(trajs[i].token_ids) for i in ok], s.micro_batch, s.micro_batch_tokens):
        idx = ok[sl]
        b = rollout.collate([trajs[i] for i in idx], model, pad_id, share_videos=True)
        with torch.no_grad():
            lp = forward_logprobs(model, b, s.logprob_chunk, s.temperature, compile=s.compile, precision=s.precision)
            ref = forward_logprobs(ref_model, b, s.logprob_chunk, s.temperature, compile=s.compile,
                                   precision=s.precision)
        k1 = (kl_penalty(lp, ref, "k1") * policy_mask(b["roles"]).to(lp.device)).sum(1)
        for i, v in zip(idx, k1.tolist()):
            out[i] = v
    return out


def rank_totals(n_tokens: int, n_batches: int, world: int, group=None) -> tuple[int, int]:
    """The policy tokens of all ranks (a step's loss is their token mean) and the zero-weight passes this rank owes:
    the most micro-batches any rank runs, less its own, so every rank joins the same FSDP collectives. Both are
    collectives themselves: every rank calls this at the same point, before its forwards."""
    if world == 1:
        return n_tokens, 0
    return all_sum(n_tokens, group), all_max(n_batches, group) - n_batches


def policy_update(model, ref_model, optimizer, items: list, s: GRPOSettings, pad_id: int, tokenizer,
                  world: int, filler=None, step_fn=None, group=None) -> tuple[float | None, dict]:
    """GRPO update on the kept trajectories: s.ppo_epochs passes of micro-batches (`micro_batches`: at most
    s.micro_batch rows and s.micro_batch_tokens padded tokens each, in order), token-mean over the policy
    tokens of ALL ranks (each rank normalises by N_global / world, FSDP averages the ranks' gradients; `group`:
    the ranks that train, when others roll out). With several epochs the old (proximal) log-probs are recomputed
    first by a no-grad forward; with one they are the current ones (the weights before this update), detached.
    s.async_staleness: the decoupled loss, its behaviour log-probs those the rollout recorded. A rank with nothing
    to learn still runs zero-weight passes on `filler` (any trajectory it sampled), so every rank joins the same
    collectives; the step is skipped only when no rank has a token.
    `step_fn(loss)` clips, checks and applies the gradients (Run.optimizer_step). Returns (grad norm, stats)."""
    video_id = model.config.video_token_id
    prompts = shared_prompts([t for t, _, _ in items], video_id, model.config.vision_config.spatial_merge_size) \
        if s.pack_prompts else None
    slices = update_micro_batches([len(t.token_ids) for t, _, _ in items], s, prompts)
    chunks = [items[sl] for sl in slices]
    batches = [rollout.collate([t for t, _, _ in c], model, pad_id, share_videos=True) for c in chunks]
    if prompts:                         # each shared prompt once per micro-batch (hidden_and_targets reads it)
        for c, b, sl in zip(chunks, batches, slices):
            b["packed"] = pack_prompts(b, [t for t, _, _ in c], prompts[sl], video_id)
    advs = []
    for c, b in zip(chunks, batches):
        a = torch.tensor([x for _, x, _ in c])[:, None].expand(-1, b["input_ids"].shape[1] - 1).clone()
        if s.anchoring == "token":       # anchor credit on the closing-tag tokens only (docs/method.md §4.1)
            a += anchor_credit(b["input_ids"], tokenizer, [cm["anchor"] for _, _, cm in c])
        advs.append(a)
    n_local = sum(int(policy_mask(b["roles"]).sum()) for b in batches)
    n_global, n_pad = rank_totals(n_local, len(batches), world, group)
    if n_global == 0:                                   # no rank has a token to learn from: skip, all together
        return None, {"clip_frac": 0.0, "kl": 0.0, "loss": 0.0}
    use_ref = ref_model is not None and s.kl_coef > 0 and not s.kl_in_reward
    with torch.no_grad(), full_weights(model):
        old = [forward_logprobs(model, b, s.logprob_chunk, s.temperature, compile=s.compile, precision=s.precision)
               if s.ppo_epochs > 1 else None for b in batches]
        ref = [forward_logprobs(ref_model, b, s.logprob_chunk, s.temperature, compile=s.compile, precision=s.precision)
               if use_ref else None for b in batches]
    behav = [rollout.behaviour_logprobs([t for t, _, _ in c], b) if s.async_staleness else None
             for c, b in zip(chunks, batches)]
    norm = n_global / world                             # FSDP averages over ranks: sum_all / N_global overall
    if n_pad and not batches:                           # nothing kept here: zero-weight passes on a filler row
        fb = rollout.collate([filler], model, pad_id)
        with torch.no_grad():                           # a KL loss term needs the filler's reference log-probs
            fill_ref = forward_logprobs(ref_model, fb, s.logprob_chunk, s.temperature, compile=s.compile,
                                        precision=s.precision) if use_ref else None
        fill = (fb, None, torch.zeros(1, fb["input_ids"].shape[1] - 1), fill_ref, None)
    else:
        fill = (batches[-1], old[-1], advs[-1], ref[-1], behav[-1]) if batches else None
    gn, stats = None, {"clip_frac": 0.0, "kl": 0.0}
    terms = dict(clip_low=s.clip_low, clip_high=s.clip_high, kl_coef=0.0 if s.kl_in_reward else s.kl_coef,
                 kl_estimator=s.kl_estimator, num_tokens=norm, temperature=s.temperature,
                 chunk_size=s.loss_chunk or None, compile=s.compile, behav_cap=s.behav_weight_cap)
    for epoch in range(s.ppo_epochs):
        total = torch.zeros(())
        for b, o, a, r, w in zip(batches, old, advs, ref, behav):
            hidden, weight, targets, mask = policy_head(model, b, s.precision)
            loss, st = grpo_loss(hidden, weight, targets, o, a, mask, ref_logprobs=r, behav_logprobs=w, **terms)
            loss.backward()
            total = total + loss.detach().cpu()
            for k in stats:
                stats[k] += float(st.get(k, 0.0)) * st["n_tokens"] / max(1, n_local) / s.ppo_epochs
        for _ in range(n_pad):                          # zero-weight passes: no gradient, matching collectives
            b, o, a, r, w = fill
            hidden, weight, targets, mask = policy_head(model, b, s.precision)
            (grpo_loss(hidden, weight, targets, o, a, mask, ref_logprobs=r, behav_logprobs=w, **terms)[0] * 0.0).backward()
        total = all_sum_float(float(total), group) / world if world > 1 else float(total)
        gn = step_fn(torch.tensor(total))
        stats["loss"] = total                           # the last epoch's token-mean loss, all ranks
    return gn, stats


def rollout_metrics(trajs: list, comps: list[dict], records: dict | None = None) -> dict:
    """Means over a step's trajectories: accuracy, format compliance, tool use (ParaVT's curves; the figures are
    rewards.py's agent figures over the non-error trajectories, turns = tool turns, 0 where undefined); with the
    records by id, on the synthetic task, also sums and counts per tool need (data.tool_needed under the overview
    the rollout drew): on the questions that needed the tool and on those that did not, the accuracy and the
    tool-call ratio (a trajectory that ended in an error counts as no call). split_accuracy turns the all-rank
    sums into ratios, so a rank's share of the step weighs by its count, not as a rank mean."""
    ok = [t for t in trajs if t.error is None]
    n = max(1, len(ok))
    calls = sum(t.n_calls for t in ok)
    tool_turns = sum(t.n_tool_turns for t in ok)
    zero = lambda x: 0.0 if x is None else x           # a step without a finished trajectory logs 0
    out = {f"reward/{k}": sum(c[k] for c in comps) / max(1, len(comps)) for k in (comps[0] if comps else {})}
    out.update(accuracy=out.get("reward/acc", 0.0),
               format_compliance=zero(rewards.format_compliance(t.text for t in ok)),
               tool_call_ratio=zero(rewards.tool_call_ratio(t.n_calls for t in ok)),
               calls_per_turn=rewards.calls_per_turn(calls, max(1, tool_turns)),
               turns=zero(rewards.mean_turns(t.n_tool_turns for t in ok)),
               tool_failure_rate=rewards.tool_failure_rate(sum(t.tool_failures for t in ok), max(1, calls)),
               truncated=sum(t.truncated or t.hit_turn_limit for t in ok) / n,
               mean_k=sum(t.nframes for t in ok) / n, bad_samples=len(trajs) - len(ok))
    if records is not None:      # sums and counts, the same keys on every rank (split_accuracy divides)
        need = [data.tool_needed(records[t.record_id], t.nframes) if t.record_id in records else None for t in trajs]
        for name, want in (("tool_needed", True), ("tool_not_needed", False)):
            group = [(t, c) for t, c, nd in zip(trajs, comps, need) if nd is want]
            out.update({f"{name}_hits": sum(c["acc"] for _, c in group),
                        f"{name}_calls": sum(t.error is None and t.n_calls > 0 for t, _ in group),
                        f"{name}_n": len(group)})
    return out


def reduce_metrics(per_sample: dict, n: int, world: int, step: dict) -> dict:
    """A step's row over all ranks: this rank's rollout_metrics (of n trajectories) merged with the others' by
    merge_figures; `step`'s figures (times, losses, counts) the mean of the ranks'."""
    return {**merge_figures(all_gather_objects((n, per_sample), world)), **all_mean(step, world)}


SUMMED = ("_hits", "_calls", "_n")          # rollout_metrics' per-need sums and counts (the other keys are means)


def merge_figures(parts: list[tuple[int, dict]]) -> dict:
    """rollout_metrics' figures of several shares of a step, (n trajectories, figures) each, as one: the means
    weighted by n (a key a share lacks weighs 0 there; a key of one share as it is), the per-need sums summed and
    turned into split_accuracy's ratios, so a share weighs by its count, not as a rank mean."""
    out = {}
    for k in sorted(set().union(*(f for _, f in parts))):
        have = [(n, f[k]) for n, f in parts if k in f]
        if k.endswith(SUMMED):
            out[k] = float(sum(v for _, v in have))
        else:
            weight = sum(n for n, _ in have)
            out[k] = float(have[0][1]) if len(have) == 1 else sum(n * v for n, v in have) / max(1, weight)
    return split_accuracy(out)


def split_accuracy(m: dict) -> dict:
    """rollout_metrics' (all-rank) sums -> acc_tool_needed / acc_tool_not_needed and tool_call_ratio_needed /
    tool_call_ratio_not_needed (hits / n, calls / n), left out where no question was."""
    for name in ("tool_needed", "tool_not_needed"):
        hits, calls, n = (m.pop(f"{name}_{k}", 0.0) for k in ("hits", "calls", "n"))
        if n:
            m[f"acc_{name}"] = hits / n
            m[f"tool_call_ratio_{name.removeprefix('tool_')}"] = calls / n
    return m


def recipe_line(s: GRPOSettings) -> str:
    """The run's first words on the method, e.g. 'recipe: para_grpo (PARA-GRPO: R_acc + R_fmt + R_tool, exploration
    anchoring (sequence), nFrames gating K in {4, 8, 16, 32}, no KL)': what the reward and the step really use."""
    recipe = recipes.RECIPES[s.recipe]
    parts = [recipe.reward, f"exploration anchoring ({s.anchoring})" if s.anchoring != "none" else "no anchoring",
             f"nFrames gating K in {{{', '.join(map(str, s.gating_choices))}}}" if s.gating else "no gating",
             (f"k1 KL {s.kl_coef:g} in the reward" if s.kl_in_reward else f"{s.kl_estimator} KL {s.kl_coef:g}")
             if s.kl_coef else "no KL"] + (["shaping clip(10 (R - 0.2), +-20)"] if s.shaping else []) + (
             ["PLACEBO: each group's advantages dealt to its samples at random"] if s.placebo else [])
    return f"recipe: {s.recipe} ({recipe.title}: {', '.join(parts)})"


# -----------------------------------------------------------------------------
# 3. Whole trajectories -> hidden states and per-token log-probs of the policy's tokens

def hidden_and_targets(model, batch: dict, attn_mask_4d=None, tdam: TdamSpec | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (B, L-1, D), targets (B, L-1), policy mask (B, L-1)): the final hidden states that predict each
    next token, for the fused kernels. A batch collated with share_videos=True runs the vision tower once per
    distinct video (the G samples of a prompt share its overview), as the rollout did. `tdam`: each decoder
    layer attends by `ops.tdam_attention` (no L x L mask), picked by the `tdam` keyword (layers.attention;
    gradient checkpointing's recompute in backward gets the same keyword); `attn_mask_4d`: a dense 4-D mask.
    A batch with "packed" (`pack_prompts`) runs its one packed row instead and gathers each row's states from it.
    FSDP: the lm_head unit is gathered here, since the kernels read lm_head.weight directly (its gradient is
    reduce-scattered with the final norm's, in backward)."""
    device = next(model.parameters()).device
    packed = batch.get("packed")          # --set pack_prompts: each shared prompt once (`pack_prompts`)
    if packed is not None and (tdam is not None or attn_mask_4d is not None):
        raise ValueError("hidden_and_targets: a packed batch carries its own attention spec (no tdam / mask)")
    # the pixels go in the compute dtype (bf16 under --precision bf16, where the parameters, FSDP2's shards
    # included, are fp32 master weights); the tower's first matmul rounds them so under autocast anyway
    cast = {"pixel_values_videos": model_lib.compute_dtype(model)}
    kw = {k: v.to(device, cast.get(k, v.dtype)) for k, v in (packed or batch).items()
          if k not in ("roles", "packed", "gather", "tdam")}
    if attn_mask_4d is not None:
        kw["attention_mask"] = attn_mask_4d.to(device)
    tdam = packed["tdam"] if packed is not None else tdam
    if tdam is not None:                  # the spec is the mask (padding included); positions come from collate
        kw.pop("attention_mask", None)
        kw["tdam"] = tdam
    hidden = rollout.shared_video_hidden_states(model, kw)                  # vision once per distinct video
    # (B, L-1, D): the states that predict each row's next token (packed: gathered from the packed rows)
    hidden = hidden[:, :-1] if packed is None else hidden.flatten(0, 1)[packed["gather"].to(device)]
    if hasattr(model.lm_head, "unshard"):
        model.lm_head.unshard()
    return hidden, batch["input_ids"][:, 1:].to(device), policy_mask(batch["roles"]).to(device)


def shared_prompts(trajs: list, video_id: int, merge: int) -> list[tuple | None]:
    """Per trajectory, (key, P, prompt videos) for `pack_prompts`, or None when it cannot be packed: key names
    its prompt (its first P = prompt_len tokens and the identity of the video tensors they show: a group's G
    samples share both, as the rollout shares them), `prompt videos` the grid rows (videos) of its `videos`
    that lie inside the prompt. merge: the vision config's spatial_merge_size (a grid row of t x h x w patches
    is t h w / merge^2 tokens)."""
    out = []
    for t in trajs:
        p = t.prompt_len
        in_prompt = sum(1 for x in t.token_ids[:p] if x == video_id)
        grids = [(pix, g) for pix, grid in t.videos for g in grid]
        n, seen = 0, 0
        while seen < in_prompt and n < len(grids):
            seen += int(grids[n][1].prod()) // merge ** 2
            n += 1
        if not 0 < p < len(t.token_ids) or seen != in_prompt:    # nothing after the prompt, or a video cut by it
            out.append(None)
            continue
        shown = tuple((pix.data_ptr(), tuple(pix.shape), tuple(g.tolist())) for pix, g in grids[:n])
        out.append(((tuple(t.token_ids[:p]), shown), p, n))
    return out


def pack_prompts(batch: dict, trajs: list, prompts: list, video_id: int) -> dict:
    """
    The inputs of ONE packed row that runs each shared prompt once for the rows of a `collate(...,
    share_videos=True)` batch (--set pack_prompts; ParaVT's G = 8 samples repeat a 16k-token overview, Video-o3's
    G = 16 a 12k one). Its segments, in the rows' order, a prompt the first time its key (`shared_prompts`) comes:

        prompt_A (P_A tokens) | suffix_1 | suffix_2 | ... | prompt_B | suffix_k | ...     suffix = a row after P

    A prompt attends to itself causally; a suffix to its prompt (all of it) and to itself causally, never to
    another segment. A row with no key is one segment of its own. Each token keeps its row's M-RoPE position
    (position_ids sliced from the collated rows) and its videos their features (each prompt's once, then each
    suffix's, in order: video_index), so each hidden state equals its row's in the unpacked forward (float sums
    may round in another order). `gather` (B, L-1) maps each row position to the packed position whose hidden
    state predicts its next token: the prompt's for t < P (the prompt's last token predicts every suffix's
    first), the suffix's after; gradients of a prompt sum over its rows, as over G copies. No padding, no mask:
    the attention is ops.tdam_attention with the segments as exact runs (TdamSpec.plan, the CPU kernel) and as
    rectangles (the keys a segment may not see; flex_attention's block mask on CUDA).
    Shapes: input_ids, mm_token_type_ids (1, Lp), position_ids (3, 1, Lp), gather (B, L-1); pixel_values_videos
    and video_grid_thw are the batch's (each distinct video once).
    """
    ids, pos = batch["input_ids"], batch["position_ids"]
    B, L = ids.shape
    index = batch["video_index"].tolist() if "video_index" in batch else []
    n_grids = [sum(len(g) for _, g in t.videos) for t in trajs]
    lens = [len(t.token_ids) for t in trajs]
    pieces, order, rects, plan, seen = [], [], [], [], {}     # seen: prompt key -> its segment (start, end)
    gather, t, at = torch.zeros(B, L - 1, dtype=torch.long), torch.arange(L - 1), 0
    for i, pr in enumerate(prompts):
        p, n_pre = (pr[1], pr[2]) if pr else (0, 0)
        first = sum(n_grids[:i])
        if pr and pr[0] not in seen:                          # the prompt's segment, the first time
            seen[pr[0]] = (at, at + p)
            pieces.append((i, 0, p))
            order += index[first:first + n_pre]
            rects.append((at, at + p, 0, at))
            plan.append((0, at, at + p, [(at, at + p, CAUSAL)]))
            at += p
        a, b = seen[pr[0]] if pr else (at, at)
        n = lens[i] - p
        pieces.append((i, p, lens[i]))
        order += index[first + n_pre:first + n_grids[i]]
        rects += [(at, at + n, 0, a), (at, at + n, b, at)]
        plan.append((0, at, at + n, ([(a, b, FULL)] if b > a else []) + [(at, at + n, CAUSAL)]))
        gather[i] = torch.where(t < p, a + t, at + t - p).clamp(max=at + n - 1)
        at += n
    out_ids = torch.cat([ids[i, s:e] for i, s, e in pieces])[None]
    out = dict(input_ids=out_ids, position_ids=torch.cat([pos[:, i, s:e] for i, s, e in pieces], 1)[:, None],
               mm_token_type_ids=(out_ids == video_id).int() * 2, gather=gather,
               tdam=TdamSpec(torch.tensor([at]), torch.tensor([[r for r in rects if r[1] > r[0] and r[3] > r[2]]
                                                               or [(0, 0, 0, 0)]]), plan=plan))
    for k in ("pixel_values_videos", "video_grid_thw"):
        if k in batch:
            out[k] = batch[k]
    if index:
        out["video_index"] = torch.tensor(order, dtype=torch.long)
    return out


def policy_head(model, batch: dict, precision: str, attn_mask_4d=None, tdam: TdamSpec | None = None):
    """(hidden (B, L-1, D), lm_head weight (V, D), targets, policy mask (B, L-1)): `hidden_and_targets` under the
    compute dtype of `precision` (`autocast`), the head's inputs cast for the fused kernel (`head_inputs`); what
    the losses and `forward_logprobs` take."""
    with autocast(precision, model):
        hidden, targets, mask = hidden_and_targets(model, batch, attn_mask_4d, tdam)
    hidden, weight = head_inputs(hidden, model.lm_head.weight, precision)
    return hidden, weight, targets, mask


def forward_logprobs(model, batch: dict, chunk_size: int, temperature: float = 1.0, attn_mask_4d=None,
                     compile: bool = True, precision: str = "fp32") -> torch.Tensor:
    """(B, L-1) log p_T(next token) at POLICY positions (0 elsewhere), through `token_logprobs`: the no-grad
    uses (old and reference log-probs, the KL folded into the reward). T is the sampling temperature (RL: the
    rollout's T, so the policy optimised is the policy that sampled; SFT and evaluation: 1). precision: the
    compute dtype, as in the loss (`autocast`, `head_inputs`), so old and current log-probs agree."""
    hidden, weight, targets, policy = policy_head(model, batch, precision, attn_mask_4d)
    out = torch.zeros(targets.shape, device=hidden.device, dtype=torch.float32)
    if policy.any():
        out[policy] = token_logprobs(hidden[policy], weight, targets[policy], chunk_size, compile,
                                     temperature=temperature)
    return out


def filler_trajectory(processor, records: list, video_root: str, cfg: rollout.RolloutConfig) -> rollout.Trajectory:
    """A trajectory for the zero-weight passes of a rank that sampled nothing to train on (its share of the step's
    prompts was 0, or every sample failed): the first record that encodes, with a one-line answer. Its weight is 0;
    it only makes this rank's forward and backward enter every FSDP unit, the vision tower's included, as the
    other ranks' do (a text-only filler would leave the tower without gradients here and the reduce-scatters
    would differ between ranks)."""
    errors = []
    for rec in records[:8]:
        try:
            return sft.encode_messages(processor, rec, [{"role": "assistant", "content": "<answer>A</answer>"}],
                                           video_root, cfg)
        except (ValueError, KeyError, OSError) as e:      # video.VideoError is a ValueError
            errors.append(f"{rec.get('id')}: {e}")
    raise RuntimeError(f"no filler trajectory for this rank's zero-weight passes: {'; '.join(errors)}")


def trainable(traj, video_id: int) -> bool:
    """False when the policy sampled a <|video_pad|>: `collate` would take it for a video placeholder with no
    frames, so the sample is scored (as text) but left out of the update."""
    return not any(role == rollout.POLICY and tok == video_id for tok, role in zip(traj.token_ids, traj.roles))


# -----------------------------------------------------------------------------
# 4. The policy and its optimizer: fp32 master weights, the compute dtype, AdamW

PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}     # --precision -> the compute dtype


def policy_model(source: str, device, precision: str, world: int, seed: int = 0, grad_checkpointing: bool = False):
    """(model, processor): the policy to train. Its parameters are fp32 whatever the precision: they are the master
    weights AdamW updates (a bf16 weight does not move under an update below half its ulp: at lr 1e-6, nearly
    none does). bf16 is the compute dtype: `autocast` around the forward passes, and with FSDP2 (world > 1) the
    dtype the shards are all-gathered in (gradients reduce-scattered in fp32, runtime.shard_model)."""
    model, processor = model_lib.load_model(source, device=device, dtype=torch.float32, seed=seed,
                                            tiny_corpus=rollout.prompt_corpus())
    if grad_checkpointing:
        model.gradient_checkpointing_enable()
    if world > 1:
        runtime.shard_model(model, PRECISION[precision])
    return model, processor


def sampler_model(source: str, device, precision: str, seed: int = 0):
    """(model, processor): an asynchronous run's rollout rank's policy. It only samples (its weights are the trainers'
    broadcasts), so it holds them in the compute dtype without gradients: 2 bytes a parameter under bf16, with no fp32
    master for autocast to keep bf16 copies of (kvcache.autocast_copies: 0); fp32 in a CPU fp32 run, as before."""
    model, processor = model_lib.load_model(source, device=device, dtype=PRECISION[precision], seed=seed,
                                            tiny_corpus=rollout.prompt_corpus())
    model.requires_grad_(False)
    return model, processor


def uses_reference(s, rollout_side: bool) -> bool:
    """Whether a rank needs the reference model: where the KL is computed. ParaVT folds k1 into the reward, on the
    side that samples (collect_groups: sequence_kl); a KL loss term (kl_in_reward off) is the update's."""
    return s.kl_coef > 0 and s.kl_in_reward == rollout_side


def autocast(precision: str, where):
    """The forward passes' compute dtype (docs/method.md §8): bf16 runs them under torch.autocast (matmuls and
    attention in bf16 on the fp32 parameters; backward outside it, as autocast asks), fp32 as they are.
    `where`: the device, or the model whose device it is (looked at only for bf16)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    device = where if isinstance(where, torch.device) else next(where.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16)


def head_inputs(hidden: torch.Tensor, weight: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, lm_head weight) for the fused kernel (ops.token_logprobs), both in the compute dtype.
    The kernels run their own GEMMs, which autocast does not reach, and they take one dtype: under autocast on fp32
    parameters the final norm's output and the weight are fp32, so bf16 casts both here (the cast's backward hands
    the weight's gradient to the fp32 master in fp32). Under FSDP2's bf16 policy both are bf16 already."""
    if precision != "bf16":
        return hidden, weight
    return hidden.to(torch.bfloat16), weight.to(torch.bfloat16)


def make_optimizer(model, lr: float, vision_lr_scale: float = 1.0) -> torch.optim.AdamW:
    """AdamW (no weight decay) in two parameter groups: the vision tower (`model.visual`, its merger included)
    at vision_lr_scale x lr, the rest at lr; a scale of 0 freezes the tower (requires_grad off, no AdamW state,
    no backward through it). A lower rate or a frozen encoder is common VLM practice; the tiny model's random
    tower is frozen because training it at the SFT rate merged colours the answer needs (docs/experiments.md,
    "a default that learns on every seed")."""
    vision, rest = [], []
    for name, p in model.named_parameters():
        (vision if ".visual." in f".{name}" else rest).append(p)
    if vision_lr_scale == 0:
        for p in vision:
            p.requires_grad_(False)
        vision = []
    groups = [{"params": rest, "lr_scale": 1.0}] + ([{"params": vision, "lr_scale": vision_lr_scale}] if vision else [])
    low = sorted({str(p.dtype) for g in groups for p in g["params"] if p.dtype != torch.float32})
    if low:      # an AdamW step on bf16 weights rounds away any update below half an ulp (lr 1e-6: nearly all)
        raise ValueError(f"make_optimizer: AdamW updates fp32 master weights only, got {low} parameters; load the "
                         f"policy with train.policy_model (--precision bf16 computes in bf16 on fp32 weights)")
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    set_lr(optimizer, lr)
    return optimizer


def set_lr(optimizer, lr: float) -> float:
    """Every group at lr x its lr_scale (make_optimizer's); returns lr."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr
