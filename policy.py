"""
The policy being trained, and whole trajectories through it: what the SFT step (sft.py) and the RL step (grpo.py)
share below their objectives.

    1. the policy      policy_model (fp32 master weights, FSDP2), sampler_model (a rollout rank's copy),
                       autocast / head_inputs (the compute dtype), make_optimizer / set_lr / get_lr (AdamW, the
                       vision tower's rate, warmup + cosine)
    2. forward passes  policy_mask, hidden_and_targets (shared_video_hidden_states: the vision tower once per
                       distinct video), policy_head, forward_logprobs: collated trajectories -> the final hidden
                       states / log-probs of the policy's own tokens
    3. batching        micro_batches (by rows and padded tokens), shared_prompts / pack_prompts (a micro-batch as
                       one row that holds each shared prompt once)

Shapes: a batch is rollout.collate's dict (input_ids, roles (B, L), position_ids (3, B, L), the vision inputs);
hidden states (B, L-1, D) predict targets (B, L-1); log-probs are fp32 (B, L-1).
"""
import contextlib
import math

import torch

import layers
import model as model_lib
import rollout
import runtime
from ops import CAUSAL, FULL, TdamSpec, tiled_linear, token_logprobs


# -----------------------------------------------------------------------------
# 1. The policy and its optimizer: fp32 master weights, the compute dtype, AdamW

def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
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


def autocast(precision: str, where):
    """The forward passes' compute dtype (docs/method.md §8): bf16 runs them under torch.autocast (matmuls and
    attention in bf16 on the fp32 parameters; backward outside it, as autocast asks), fp32 as they are.
    `where`: the device, or the model whose device it is (looked at only for bf16)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    device = where if isinstance(where, torch.device) else next(where.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16)


def head_inputs(hidden: torch.Tensor, weight: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, lm_head weight) in the compute dtype for the fused kernel, whose own GEMMs autocast does not reach
    (the cast's backward hands the weight's gradient to the fp32 master)."""
    if precision != "bf16":
        return hidden, weight
    return hidden.to(torch.bfloat16), weight.to(torch.bfloat16)


def make_optimizer(model, lr: float, vision_lr_scale: float) -> torch.optim.AdamW:
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
                         f"policy with policy.policy_model (--precision bf16 computes in bf16 on fp32 weights)")
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    set_lr(optimizer, lr)
    return optimizer


def set_lr(optimizer, lr: float) -> float:
    """Every group at lr x its lr_scale (make_optimizer's); returns lr."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


# -----------------------------------------------------------------------------
# 2. Whole trajectories -> hidden states and per-token log-probs of the policy's tokens

def policy_mask(roles: torch.Tensor) -> torch.Tensor:
    """(B, L) roles -> (B, L-1) bool: True where the NEXT token is the policy's own (its log-prob enters the loss)."""
    return roles[:, 1:] == rollout.POLICY


def hidden_and_targets(model, batch: dict, tdam: TdamSpec | None = None, exact: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (B, L-1, D), targets (B, L-1), policy mask (B, L-1)): the final hidden states that predict each
    next token, for the fused kernels. A batch collated with share_videos=True runs the vision tower once per
    distinct video (the G samples of a prompt share its overview), as the rollout did. `tdam`: each decoder
    layer attends by `ops.tdam_attention` (no L x L mask), picked by the `tdam` keyword (layers.attention;
    gradient checkpointing's recompute in backward gets the same keyword).
    A batch with "packed" (`pack_prompts`) runs its one packed row instead and gathers each row's states from it.
    FSDP: the lm_head unit is gathered here, since the kernels read lm_head.weight directly (its gradient is
    reduce-scattered with the final norm's, in backward).
    `exact`: the exact mode's forward (layers.attention's `exact` keyword; the vision tower once per chunk, as the
    engine called it: layers.vision_per_chunk)."""
    device = next(model.parameters()).device
    packed = batch.get("packed")          # --set pack_prompts: each shared prompt once (`pack_prompts`)
    if packed is not None and (tdam is not None or exact):
        raise ValueError("hidden_and_targets: a packed batch carries its own attention spec (no tdam / mask / exact)")
    # the pixels go in the compute dtype (bf16 under --precision bf16, where the parameters, FSDP2's shards
    # included, are fp32 master weights); the tower's first matmul rounds them so under autocast anyway
    cast = {"pixel_values_videos": model_lib.compute_dtype(model)}
    kw = {k: v.to(device, cast.get(k, v.dtype)) for k, v in (packed or batch).items()
          if k not in ("roles", "packed", "gather", "tdam", "video_chunks")}
    tdam = packed["tdam"] if packed is not None else tdam
    if tdam is not None:                  # the spec is the mask (padding included); positions come from collate
        kw.pop("attention_mask", None)
        kw["tdam"] = tdam
    if exact:                             # causal by token index: padding sits past every real token
        kw.pop("attention_mask", None)
        kw["exact"] = True
    chunks = batch["video_chunks"].tolist() if exact and "video_chunks" in batch else None
    with layers.vision_per_chunk(model, chunks) if chunks else contextlib.nullcontext():
        hidden = shared_video_hidden_states(model, kw)                      # vision once per distinct video
    # (B, L-1, D): the states that predict each row's next token (packed: gathered from the packed rows)
    hidden = hidden[:, :-1] if packed is None else hidden.flatten(0, 1)[packed["gather"].to(device)]
    if hasattr(model.lm_head, "unshard"):
        model.lm_head.unshard()
    return hidden, batch["input_ids"][:, 1:].to(device), policy_mask(batch["roles"]).to(device)


def shared_video_hidden_states(model, batch: dict) -> torch.Tensor:
    """(B, L, D) last hidden states of a `collate(..., share_videos=True)` batch (without `roles`): the
    vision tower runs once per DISTINCT video (once per prompt, not G times), and its features (and
    deepstack features) are handed to every row that shows that video. The same numbers as
    `model.model(**batch).last_hidden_state` on the unshared batch; gradients of a shared video sum
    over its rows, as they would for G separate copies."""
    kw = dict(batch)
    kw.pop("video_chunks", None)
    index = kw.pop("video_index", None)
    if index is None or "pixel_values_videos" not in kw:
        return model.model(**kw, use_cache=False).last_hidden_state
    order = index.tolist()
    inner = model.model.get_video_features

    def shared(pixel_values_videos, video_grid_thw=None, **k):     # runs inside model.model's forward (FSDP hooks)
        feats = inner(pixel_values_videos, video_grid_thw, **k)
        feats.pooler_output = tuple(feats.pooler_output[j] for j in order)
        if getattr(feats, "deepstack_features", None) is not None:         # Qwen3-VL's; Qwen2.5-VL has none
            feats.deepstack_features = [tuple(layer[j] for j in order) for layer in feats.deepstack_features]
        return feats

    with layers.replaced_video_features(model, shared):
        return model.model(**kw, use_cache=False).last_hidden_state


def policy_head(model, batch: dict, precision: str, tdam: TdamSpec | None = None):
    """(hidden (B, L-1, D), lm_head weight (V, D), targets, policy mask (B, L-1)): `hidden_and_targets` under the
    compute dtype of `precision` (`autocast`), the head's inputs cast for the fused kernel (`head_inputs`); what
    the losses and `forward_logprobs` take."""
    with autocast(precision, model):
        hidden, targets, mask = hidden_and_targets(model, batch, tdam)
    hidden, weight = head_inputs(hidden, model.lm_head.weight, precision)
    return hidden, weight, targets, mask


def exact_logprobs(model, batch: dict, temperature: float, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mode's (log-probs (B, L-1) at POLICY positions, 0 elsewhere; the policy mask): the exact forward
    (`hidden_and_targets(exact=True)`), the lm_head on fixed row tiles and rollout.sampled_logprobs, the engine's
    calls for the same tokens: the bits the rollout recorded (tests/test_exact.py). Differentiable (the loss's)."""
    with autocast(precision, model):
        hidden, targets, policy = hidden_and_targets(model, batch, exact=True)
        logits = tiled_linear(hidden[policy], model.lm_head.weight)
    out = torch.zeros(targets.shape, device=hidden.device, dtype=torch.float32)
    out[policy] = rollout.sampled_logprobs(logits, targets[policy], temperature)
    return out, policy


def forward_logprobs(model, batch: dict, chunk_size: int, temperature: float, compile: bool, precision: str,
                     exact: bool = False) -> torch.Tensor:
    """(B, L-1) log p_T(next token) at POLICY positions (0 elsewhere), through `token_logprobs`: the no-grad
    uses (old and reference log-probs, the KL folded into the reward). T is the sampling temperature (RL: the
    rollout's T, so the policy optimised is the policy that sampled; SFT and evaluation: 1). precision: the
    compute dtype, as in the loss (`autocast`, `head_inputs`), so old and current log-probs agree. `exact`: the
    exact mode's (`exact_logprobs`)."""
    if exact:
        return exact_logprobs(model, batch, temperature, precision)[0]
    hidden, weight, targets, policy = policy_head(model, batch, precision)
    out = torch.zeros(targets.shape, device=hidden.device, dtype=torch.float32)
    if policy.any():
        out[policy] = token_logprobs(hidden[policy], weight, targets[policy], chunk_size, compile=compile,
                                     temperature=temperature)
    return out


# -----------------------------------------------------------------------------
# 3. Batching: micro-batches, and shared prompts packed once

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

