"""
The GRPO step: the objective, collecting scored groups, and the policy update. train.py's `run_rl` runs it in its
loop; async_rl.py runs the same step with rollout ranks beside trainer ranks. Reads top to bottom (docs/method.md
has every formula and its source):

    1. the objective   kl_penalty, grpo_token_terms (PPO-clip + KL per token, and the decoupled objective's
                       behaviour weight), grpo_loss (the loss the step runs: ops.token_logprobs, then
                       grpo_token_terms, token-mean over the policy's tokens), anchor_credit (token-level anchoring)
    2. the draw        GRPOSettings, RLJob, draw_prompts (the step's prompts and their nFrames-gated K)
    3. the RL step     collect_groups (rollout.run_agent -> the recipe's reward -> group advantages, dynamic
                       sampling), policy_update (the PPO-clip step over micro-batches, then the optimizer step)

Per step: draw `prompts_per_step` records over all ranks, gate each overview to K frames (one K per group), roll
out G samples per prompt, score each under the recipe, optionally shape the reward and subtract a per-token k1 KL
(ParaVT), normalise within the group, A = (R - mean) / (std + eps), add the anchoring credit on closing tags
(`--anchoring token`), and take a PPO-clip step on the policy's own tokens (token mean). Every log-prob is taken
at the sampling temperature. The forward passes and the optimizer are policy.py's.
"""
import dataclasses
import math
import random
from typing import Callable

import torch

import eval as evaluation
import model as model_lib
import policy
import recipes
import rewards
import rollout
import runtime
import sft
import video
from ops import policy_rows, token_logprobs
from policy import forward_logprobs, policy_head, policy_mask
from runtime import Run, all_sum_float, rank_totals

T, CPU = recipes.TINY, recipes.ON_DEVICE["cpu"]     # the settings' defaults: what `python train.py` runs


# -----------------------------------------------------------------------------
# 1. The PARA-GRPO objective (docs/method.md §4-§5): the equations, and the loss training runs

def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
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
                     clip_high: float, kl_coef: float, ref_logprobs: torch.Tensor | None, kl_estimator: str,
                     behav_logprobs: torch.Tensor | None, behav_cap: float, *, correction: str | None = None,
                     correction_cap: float | None = None, seq_index: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    The PPO-clip surrogate with group advantages (GRPO, arXiv 2402.03300), per token, elementwise:

        r_it = exp(log pi_theta(o_it) - log pi_old(o_it))
        l_it = -w_it min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it) + beta KL_it

    w_it = 1 without behav_logprobs; with them `behaviour_weight` (AReaL's decoupled objective, or by `correction`
    tis / mis, with correction_cap and seq_index; docs/method.md §5.1-§5.2). eps_low / eps_high = clip_low /
    clip_high; KL_it = kl_penalty(logprobs, ref_logprobs, kl_estimator), weighted by beta = kl_coef (0 without a
    reference). Any shape. Returns (l, r, KL, clipped): clipped = the tokens whose gradient the clip cuts off.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    if behav_logprobs is not None:
        per_token = per_token * behaviour_weight(old_logprobs.detach() - behav_logprobs, behav_cap, correction,
                                                 correction_cap, seq_index)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return per_token, ratio, kl, clipped


def behaviour_weight(log_u: torch.Tensor, behav_cap: float, correction: str | None, cap: float | None,
                     seq_index: torch.Tensor | None) -> torch.Tensor:
    """grpo_token_terms' weight w_it from log u_it, u_it = pi_old(o_it) / pi_behav(o_it) (pi_old detached), by
    `correction`, C = cap:
        None / "none"  AReaL's decoupled objective (arXiv 2505.24298): w_it = u_it, 0 where u_it > behav_cap
        "tis"          truncated IS (Yao et al. 2025, fengyao.notion.site/off-policy-rl): w_it = min(u_it, C)
        "mis"          sequence-level masked IS (Liu et al. 2025, "When Speed Kills Stability"):
                       rho_i = exp(sum_t log u_it) over sequence i's tokens, w_it = rho_i 1[rho_i <= C]
    seq_index: each token's sequence (None: the last dimension is one; masked-out tokens must carry log u = 0)."""
    u = torch.exp(log_u)
    if correction in (None, "none"):
        return torch.where(u <= behav_cap, u, 0.0)
    if correction == "tis":
        return u.clamp(max=cap)
    if correction != "mis":
        raise ValueError(f"rollout_correction must be one of {recipes.ROLLOUT_CORRECTIONS}, got {correction!r}")
    if seq_index is None:
        log_rho = log_u.sum(-1, keepdim=True).expand(log_u.shape)
    else:
        seqs, at = torch.unique(seq_index, return_inverse=True)
        log_rho = torch.zeros(len(seqs), dtype=log_u.dtype, device=log_u.device).index_add_(
            0, at.flatten(), log_u.flatten())[at]
    return torch.where(log_rho <= math.log(cap), torch.exp(log_rho), 0.0)


def grpo_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
              old_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float, clip_high: float, kl_coef: float, kl_estimator: str, temperature: float, compile: bool,
              behav_cap: float, ref_logprobs: torch.Tensor | None = None, behav_logprobs: torch.Tensor | None = None,
              num_tokens: float | torch.Tensor | None = None, chunk_size: int | None = None,
              correction: str | None = None, correction_cap: float | None = None,
              logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """
    The loss the RL step runs: `grpo_token_terms`, token-mean over the policy's tokens of the whole batch (DAPO,
    arXiv 2503.14476), from the final hidden states through the fused `ops.token_logprobs`, never (B, L, V) logits:

        logp_it = log_softmax(h_it W^T / T)[o_it]          on the policy's own tokens (mask m_it = 1) only
        loss    = sum_it m_it l_it(logp_it) / num_tokens    (num_tokens: the whole batch's count, all ranks)

    Shapes: hidden (B, L, D), lm_head_weight (V, D), targets, mask (B, L); old / ref / behav log-probs (B, L);
    advantages (B,) or (B, L). old_logprobs None: one on-policy epoch, ratio exp(logp - logp.detach()) = 1.
    T is the sampling temperature: every log-prob is of the tempered distribution that sampled. behav_logprobs:
    weighted by `correction` (grpo_token_terms; mis: each row a sequence). Returns (loss, stats: clip_frac, kl,
    n_tokens, ratio_mean, logprobs: the (N,) detached logp_it of the mask's tokens in row-major order).
    `logprobs` (B, L): the exact mode's, computed by the caller (policy.exact_logprobs, differentiable); hidden and
    lm_head_weight are then unused.
    """
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_loss: kl_coef != 0 needs ref_logprobs")
    h, t, mask, rows = policy_rows("grpo_loss", hidden if logprobs is None else logprobs[..., None], targets, mask,
                                   old_logprobs=old_logprobs, advantages=advantages, ref_logprobs=ref_logprobs,
                                   behav_logprobs=behav_logprobs)
    logp = token_logprobs(h, lm_head_weight, t, chunk_size, compile=compile, temperature=temperature) \
        if logprobs is None else h[:, 0]                                   # (N,) fp32
    old = logp.detach() if rows["old_logprobs"] is None else rows["old_logprobs"]
    seq = mask.nonzero()[:, 0] if correction == "mis" else None            # (N,) each token's row
    per_token, ratio, kl, clipped = grpo_token_terms(logp, old, rows["advantages"], clip_low, clip_high, kl_coef,
                                                     rows["ref_logprobs"], kl_estimator, rows["behav_logprobs"],
                                                     behav_cap, correction=correction, correction_cap=correction_cap,
                                                     seq_index=seq)
    n_tokens = h.shape[0]
    loss = per_token.sum() / (max(n_tokens, 1) if num_tokens is None else num_tokens)
    denom = max(n_tokens, 1)
    with torch.no_grad():   # summed on the device; one host sync
        sums = torch.stack([clipped.float().sum(), kl.float().sum(), ratio.float().sum()]).tolist()
    stats = {"clip_frac": sums[0] / denom, "kl": sums[1] / denom, "n_tokens": n_tokens, "ratio_mean": sums[2] / denom,
             "logprobs": logp.detach()}
    return loss, stats


def anchor_credit(input_ids: torch.Tensor, tokenizer, anchors: list[float]) -> torch.Tensor:
    """Token-level anchoring: (B, L-1) advantage ANCHOR_WEIGHT * anchor_b where the next token covers a closing tag
    (model.tag_token_mask, whatever the tokenizer's split), 0 elsewhere."""
    tags = model_lib.tag_token_mask(tokenizer, input_ids)[:, 1:]                       # (B, L-1) bool
    return rewards.ANCHOR_WEIGHT * torch.tensor(anchors, dtype=torch.float32)[:, None] * tags


# -----------------------------------------------------------------------------
# 2. The draw: the settings, the stage, the prompts of a step

@dataclasses.dataclass
class GRPOSettings:
    """The knobs of one PARA-GRPO / VTGR step (flags or --set keys of the same names; docs/method.md §5).
    Defaults: what `python train.py` runs (recipes.TINY); a run's come from its preset (recipes.PRESETS)."""
    recipe: str = T["recipe"]                        # a key of recipes.RECIPES: its reward is Recipe.score
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
    compile: bool = CPU["compile"]                   # resolve: on with CUDA (recipes.ON_DEVICE)
    precision: str = CPU["precision"]                # fp32 | bf16 (resolve: bf16 on CUDA): the compute dtype
    async_staleness: int = T["async_staleness"]      # >= 1: rollout beside training (async_rl.py), the decoupled loss
    behav_weight_cap: float = T["behav_weight_cap"]  # the decoupled loss's cap on pi_prox / pi_behav
    rollout_correction: str = T["rollout_correction"]    # none | tis | mis: the sampler/trainer gap's weight (§5.2)
    rollout_correction_cap: float = T["rollout_correction_cap"]   # its C
    exact_policy: bool = T["exact_policy"]           # the loss's log-probs the rollout's bit for bit (ops.py §4)
    pack_prompts: bool = T["pack_prompts"]            # the update runs each shared prompt once (`pack_prompts`)
    rl_steps: int = T["rl_steps"]
    lr: float = T["lr"]                              # peak rate: warmup_steps linear, then cosine (policy.get_lr)
    warmup_steps: int = T["warmup_steps"]
    min_lr_ratio: float = T["min_lr_ratio"]          # the cosine's floor, x lr
    vision_lr_scale: float = T["vision_lr_scale"]    # the vision tower's rate, x lr (0: frozen)
    eval_every: int = T["eval_every"]                # a held-out evaluation every so many steps (0: none)
    grad_checkpointing: bool = False


@dataclasses.dataclass
class RLJob:
    """An RL stage: what both loops (train.run_rl, async_rl.run_rl) roll out, train and evaluate on."""
    records: list                        # the prompts
    video_root: str
    cfg: rollout.RolloutConfig
    s: GRPOSettings
    start: int = 0                       # steps done before (a resumed run)
    evaluate: Callable | None = None     # (model, name) -> the held-out metrics, every s.eval_every steps
    pool: video.DecodePool | None = None     # decodes overviews and crops; the next step's meanwhile
    model_source: str = ""               # the asynchronous stage builds its models: --model's architecture,
    checkpoint: str | None = None        # ... the checkpoint they load (None: model_source's weights),
    state: dict | None = None            # ... and its trainer state when resuming RL
    reference: Callable | None = None    # () -> the frozen reference model, built where the KL is computed
    spare: rollout.Trajectory | None = dataclasses.field(default=None, repr=False)

    def filler(self, processor) -> rollout.Trajectory:
        """The trajectory of a rank's zero-weight passes (`filler_trajectory`), encoded once."""
        if self.spare is None:
            self.spare = filler_trajectory(processor, self.records, self.video_root, self.cfg)
        return self.spare


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
    """A rank's part of a global count: total // world, plus one on the first total % world ranks."""
    return len(dealt(total, rank, world))


def draw_seed(seed: int, step: int, draw: int) -> int:
    """A draw's rollout seed, the same on every rank (rollout.row_seed takes it with each prompt's place in the draw)."""
    return seed * 1_000_003 + step * 101 + draw * 7_919


def draw_prompts(records: list, s: GRPOSettings, seed: int, rank: int, world: int, step: int,
                 draw: int = 0) -> tuple[list, list]:
    """The prompts of a step's draw on a rank and their overview sizes: K gated per prompt (the same K for its whole
    group) or None (the rollout's own rule). One draw of the global s.prompts_per_step, seeded by (seed, step, draw)
    alone and dealt out round-robin (`dealt`), as SFT's batch is (sft.sft_draw): W ranks roll out the prompts one
    rank would, whatever W, a resumed run draws the same prompts, and the next step's can be prefetched."""
    rng = random.Random(f"rl:{seed}:{step}:0" + (f":{draw}" if draw else ""))
    every = [records[rng.randrange(len(records))] for _ in range(s.prompts_per_step)]
    recs = [every[i] for i in dealt(len(every), rank, world)]
    return recs, [rewards.gate_nframes(r["id"], step, s.gating_choices, seed=seed) if s.gating else None for r in recs]


def prefetch(job: RLJob, processor, seed: int, rank: int, world: int, step: int) -> None:
    """The overviews of `step`'s first draw on this rank, decoded in the pool's threads meanwhile (no pool, or past
    the last step: nothing)."""
    if job.pool is not None and step <= job.s.rl_steps:
        recs, ks = draw_prompts(job.records, job.s, seed, rank, world, step)
        rollout.prefetch(job.pool, recs, job.video_root, job.cfg, rollout.video_factor(processor), ks)


def placebo_advantages(adv: torch.Tensor, group_size: int, seed: int) -> torch.Tensor:
    """The placebo (`--placebo`): each group's advantages permuted among its samples at random (seeded), so the update
    keeps every size of the real one and loses only what the reward says (docs/experiments.md, "the placebo").
    adv: (B,), groups contiguous."""
    gen = torch.Generator().manual_seed(seed)
    groups = adv.view(-1, group_size)
    order = torch.stack([torch.randperm(group_size, generator=gen) for _ in range(len(groups))])
    return groups.gather(1, order).view(-1)


# -----------------------------------------------------------------------------
# 3. The RL step: roll out groups, score them, update the policy

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
    G, video_id, recipe = s.group_size, model.config.video_token_id, recipes.RECIPES[s.recipe]
    share = rank_share(s.prompts_per_step, run.rank, run.world)
    trajs, comps, R, KL, items, n_groups, n_zero = [], [], [], [], [], 0, 0
    draws = 0
    places = list(dealt(s.prompts_per_step, run.rank, run.world))     # this rank's prompts' places in each draw
    while share and draws < (s.max_draws if s.dynamic_sampling else 1):
        recs, ks = draw_prompts(records, s, run.seed, run.rank, run.world, step, draws)
        with policy.autocast(s.precision, model):
            out = rollout.run_agent(model, processor, recs, video_root, cfg, nframes=ks, pool=pool,
                                    seed=draw_seed(run.seed, step, draws), seed_index=places)
        draws += 1
        scored = [recipe.score(t, recs[i // G], s.anchoring, s.released_scoring) for i, t in enumerate(out)]
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


def update_micro_batches(lengths: list[int], s: GRPOSettings, prompts: list | None) -> list[slice]:
    """The update's micro-batches: packed rows within s.packed_tokens, else padded rows within s.micro_batch_tokens."""
    return policy.micro_batches(lengths, s.micro_batch, s.packed_tokens if prompts else s.micro_batch_tokens, prompts)


def sequence_kl(model, ref_model, trajs: list, s: GRPOSettings, pad_id: int) -> list[float]:
    """sum_t k1_t = sum_t (log pi(o_t) - log pi_ref(o_t)) over each trajectory's policy tokens, at temperature T
    (0 for a trajectory that cannot be collated): ParaVT's per-token KL folded into the reward (verl's
    use_kl_in_reward), R_i <- shape(R_i) - beta sum_t k1_t after the task reward's shaping, before the group
    advantages."""
    out = [0.0] * len(trajs)
    ok = [i for i, t in enumerate(trajs) if t.error is None and t.token_ids and trainable(t, model.config.video_token_id)]
    for sl in policy.micro_batches([len(trajs[i].token_ids) for i in ok], s.micro_batch, s.micro_batch_tokens):
        idx = ok[sl]
        b = rollout.collate([trajs[i] for i in idx], model, pad_id, share_videos=True)
        with torch.no_grad():
            lp = forward_logprobs(model, b, s.logprob_chunk, s.temperature, s.compile, s.precision)
            ref = forward_logprobs(ref_model, b, s.logprob_chunk, s.temperature, s.compile, s.precision)
        k1 = (kl_penalty(lp, ref, "k1") * policy_mask(b["roles"]).to(lp.device)).sum(1)
        for i, v in zip(idx, k1.tolist()):
            out[i] = v
    return out


def policy_update(run: Run, model, ref_model, optimizer, items: list, job: RLJob, step: int, processor
                  ) -> tuple[float | None, dict]:
    """The GRPO update on the kept items (trajectory, advantage, reward components), then the optimizer step:
    s.ppo_epochs passes over micro-batches (`update_micro_batches`), the loss a token mean over the policy tokens
    of ALL ranks (each rank divides by N_global / world; FSDP averages the ranks' gradients). With several epochs
    pi_old is recomputed first by a no-grad forward (s.exact_policy: it is the rollout's recorded log-probs, the same
    bits, and the loss runs the exact forward: `update_loss`); with one it is the current policy, detached (ratio 1).
    s.async_staleness: the decoupled loss, with the behaviour log-probs the rollout recorded. A rank with fewer
    micro-batches than another runs zero-weight passes (on its last one, or on `job.filler`), so every rank joins
    the same collectives; the step is skipped only when no rank has a token. `run.group`: the ranks that train.
    With the rollout's log-probs recorded (record_logprobs, always in the asynchronous loop) the stats carry the
    mismatch figures of the trainer's first forward of the step (the no-grad pi_old with ppo_epochs > 1, else the
    loss's own) against them (`update_mismatch`); s.rollout_correction tis / mis weighs the loss by them.
    Returns (gradient norm, stats); the norm is None when skipped, nan when the step was not finite."""
    s, world, group, pad_id = job.s, run.world, run.group, processor.tokenizer.pad_token_id
    video_id = model.config.video_token_id
    prompts = policy.shared_prompts([t for t, _, _ in items], video_id, model.config.vision_config.spatial_merge_size) \
        if s.pack_prompts and not s.exact_policy else None
    slices = update_micro_batches([len(t.token_ids) for t, _, _ in items], s, prompts)
    chunks = [items[sl] for sl in slices]
    batches = [rollout.collate([t for t, _, _ in c], model, pad_id, share_videos=True) for c in chunks]
    if prompts:                         # each shared prompt once per micro-batch (hidden_and_targets reads it)
        for c, b, sl in zip(chunks, batches, slices):
            b["packed"] = policy.pack_prompts(b, [t for t, _, _ in c], prompts[sl], video_id)
    advs = []
    for c, b in zip(chunks, batches):
        a = torch.tensor([x for _, x, _ in c])[:, None].expand(-1, b["input_ids"].shape[1] - 1).clone()
        if s.anchoring == "token":       # anchor credit on the closing-tag tokens only (docs/method.md §4.1)
            a += anchor_credit(b["input_ids"], processor.tokenizer, [cm["anchor"] for _, _, cm in c])
        advs.append(a)
    n_local = sum(int(policy_mask(b["roles"]).sum()) for b in batches)
    n_global, n_pad = rank_totals(n_local, len(batches), world, group)
    measure = job.cfg.record_logprobs or s.async_staleness > 0          # the same on every rank
    if n_global == 0:                                   # no rank has a token to learn from: skip, all together
        return None, {"clip_frac": 0.0, "kl": 0.0, "loss": 0.0, **(update_mismatch([], 1, None) if measure else {})}
    use_ref = ref_model is not None and s.kl_coef > 0 and not s.kl_in_reward
    logprobs = lambda m, b: forward_logprobs(m, b, s.logprob_chunk, s.temperature, s.compile, s.precision)
    with torch.no_grad(), runtime.full_weights(model):     # the exact mode's pi_old: what the rollout recorded
        old = [(rollout.behaviour_logprobs([t for t, _, _ in c], b) if s.exact_policy else logprobs(model, b))
               if s.ppo_epochs > 1 else None for c, b in zip(chunks, batches)]
        ref = [logprobs(ref_model, b) if use_ref else None for b in batches]
    weigh = s.async_staleness > 0 or s.rollout_correction != "none"     # the loss reads the behaviour log-probs
    behav = [rollout.behaviour_logprobs([t for t, _, _ in c], b) if weigh else None for c, b in zip(chunks, batches)]
    recorded = [None if not measure else (w, policy_mask(b["roles"])) if w is not None else
                recorded_logprobs([t for t, _, _ in c], b) for c, b, w in zip(chunks, batches, behav)]
    seen = []                                           # per micro-batch: (train, behav, policy mask, sub rows)
    if n_pad and not batches:                           # nothing kept here: zero-weight passes on a filler row
        fb = rollout.collate([job.filler(processor)], model, pad_id)
        with torch.no_grad():                           # a KL loss term needs the filler's reference log-probs
            fill_ref = logprobs(ref_model, fb) if use_ref else None
        fill = (fb, None, torch.zeros(1, fb["input_ids"].shape[1] - 1), fill_ref, None)
    else:
        fill = (batches[-1], old[-1], advs[-1], ref[-1], behav[-1]) if batches else None
    gn, stats = None, {"clip_frac": 0.0, "kl": 0.0}
    terms = dict(clip_low=s.clip_low, clip_high=s.clip_high, kl_coef=0.0 if s.kl_in_reward else s.kl_coef,
                 kl_estimator=s.kl_estimator, num_tokens=n_global / world, temperature=s.temperature,
                 chunk_size=s.loss_chunk or None, compile=s.compile, behav_cap=s.behav_weight_cap,
                 correction=s.rollout_correction, correction_cap=s.rollout_correction_cap)
    for epoch in range(s.ppo_epochs):
        total = torch.zeros(())
        for b, o, a, r, w, c, rec in zip(batches, old, advs, ref, behav, chunks, recorded):
            loss, st, mask = update_loss(model, b, o, a, r, w, s, terms)
            if epoch == 0 and rec is not None:          # the step's first forward: pi_old, else the loss's own
                train = o if o is not None and not s.exact_policy else \
                    torch.zeros(mask.shape, device=mask.device).masked_scatter(mask.bool(), st["logprobs"])
                seen.append((train.float().cpu(), *rec, torch.tensor([t.parent is not None for t, _, _ in c])))
            loss.backward()
            total = total + loss.detach().cpu()
            for k in stats:
                stats[k] += float(st.get(k, 0.0)) * st["n_tokens"] / max(1, n_local) / s.ppo_epochs
        for _ in range(n_pad):                          # zero-weight passes: no gradient, matching collectives
            b, o, a, r, w = fill
            (update_loss(model, b, o, a, r, w, s, terms)[0] * 0.0).backward()
        total = all_sum_float(float(total), group) / world if world > 1 else float(total)
        gn = run.optimizer_step(model, optimizer, torch.tensor(total), "rl", step, [t.record_id for t, _, _ in items])
        stats["loss"] = total                           # the last epoch's token-mean loss, all ranks
    if measure:
        stats.update(update_mismatch(seen, world, group))
    return gn, stats


def recorded_logprobs(trajs: list, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour log-probs (B, L-1) as rollout.behaviour_logprobs, and the (B, L-1) policy mask of the rows that
    recorded theirs): a row without recorded log-probs (not one per policy token) is left out, not an error."""
    policy = policy_mask(batch["roles"])
    keep = [i for i, t in enumerate(trajs) if len(t.logprobs) == int(policy[i].sum())]
    out, has = torch.zeros(policy.shape), torch.zeros(len(trajs), dtype=torch.bool)
    if keep:
        out[keep] = rollout.behaviour_logprobs([trajs[i] for i in keep], {"roles": batch["roles"][keep]})
        has[keep] = True
    return out, policy & has[:, None]


def update_mismatch(seen: list, world: int, group) -> dict:
    """The step's mismatch figures over every rank's micro-batches (eval.mismatch_figures, eval.mismatch_classes):
    seen holds (train (B, L-1), behav (B, L-1), policy mask of the rows with recorded log-probs, sub-agent rows
    (B,)) per micro-batch. A collective when world > 1: every rank calls it, with or without micro-batches."""
    train, behav, classes = [], [], []
    for t, b, m, sub in seen:
        cls = evaluation.mismatch_classes(m, sub, b)
        train.append(t[m])
        behav.append(b[m])
        classes.append({k: v[m] for k, v in cls.items()})
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)
    flat = {k: cat([c[k] for c in classes]).bool() for k in evaluation.MISMATCH_CLASSES if k}
    t, b = cat(train), cat(behav)
    return evaluation.mismatch_figures(t, b, torch.ones(t.shape, dtype=torch.bool), flat, world, group)


def update_loss(model, b: dict, old, adv, ref, behav, s: GRPOSettings, terms: dict) -> tuple:
    """(loss, stats, policy mask) of micro-batch b: grpo_loss over the fused head (`policy_head`), or in the exact
    mode over the exact forward's log-probs (`policy.exact_logprobs`: the rollout's bits for the same policy)."""
    if s.exact_policy:
        lp, mask = policy.exact_logprobs(model, b, s.temperature, s.precision)
        loss, st = grpo_loss(None, None, b["input_ids"][:, 1:].to(lp.device), old, adv, mask, ref_logprobs=ref,
                             behav_logprobs=behav, logprobs=lp, **terms)
        return loss, st, mask
    hidden, weight, targets, mask = policy_head(model, b, s.precision)
    return (*grpo_loss(hidden, weight, targets, old, adv, mask, ref_logprobs=ref, behav_logprobs=behav, **terms), mask)


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
    """False when the policy sampled a <|video_pad|> (collate would read it as a video): scored, not trained."""
    return not any(role == rollout.POLICY and tok == video_id for tok, role in zip(traj.token_ids, traj.roles))


def uses_reference(s, rollout_side: bool) -> bool:
    """Whether this side computes the KL: the sampling side for k1 in the reward (ParaVT), else the update's."""
    return s.kl_coef > 0 and s.kl_in_reward == rollout_side


