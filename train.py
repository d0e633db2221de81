"""
Training: SFT warm start (with TDAM) and GRPO for agentic long-video RL. The file reads top to bottom:

    1. the loss math       policy_mask, kl_penalty, grpo_loss, get_lr          (pure, importable alone)
    2. fused kernels       token_logprobs: hidden (N, D) x lm_head (V, D) -> log p(target) (N,) in chunks,
                           so the (N, V) logits (V = 151,936 for Qwen) never exist whole
    3. TDAM                tdam_spans from the text, tdam_rects, TdamSpec + tdam_attention (by query blocks,
                           never L x L), tdam_mask (L, L) bool / tdam_batch_mask (B, 1, L, L): the dense form
    4. the SFT step        sft_examples, sft_backward, run_sft
    5. the RL step         GRPOSettings, collect_groups (rollouts + rewards + dynamic sampling),
                           policy_update (PPO-clip on the policy's own tokens), run_rl
    6. main(rank, args)    model, data, run_sft, run_rl, the held-out evaluation (eval.py's runner)
    7. plumbing            checkpoints (torch.distributed.checkpoint + a Hugging Face export), metrics,
                           curves, the run-dir lock, distributed helpers, arguments, the launcher

Algorithm (docs/method.md §4-§6). Per RL step each rank draws `--prompts-per-step` records, gates each
overview to K frames (nFrames gating: K ~ Uniform{4..64}, the same K for a prompt's whole group), rolls out G
samples per prompt with rollout.py (parallel crop_video calls, up to --max-turns tool rounds, the KV cache reused
across turns), scores every trajectory with rewards.score_trajectory under the chosen recipe, optionally folds a
per-token k1 KL into the reward (ParaVT), turns rewards into group advantages A = (R - mean) / (std + eps), with
dynamic sampling draws more prompts until the batch holds groups with signal, optionally adds the
exploration-anchoring credit on the closing-tag tokens, and takes a PPO-clip step on the policy's own tokens
(token-mean). Every log-prob that enters the loss is taken at the sampling temperature (logits / T).

Recipes (--recipe): paravt = ParaVT R_acc + R_fmt(anchored) + R_tool with gating and k1 KL in the reward
(PARA-GRPO); vtgr = Video-o3 R_acc + strict R_fmt + hybrid-clue tool term with turn decay; combined (default) =
ParaVT's accuracy and anchored format terms, gating, and the VTGR tool term wherever a record has clue windows;
vanilla = accuracy + format + tool reward, no gating, no anchoring (the ablation). Presets (--preset paravt |
videoo3) set each paper's overview, limits, clip range, KL, temperature and learning rates (rollout.PRESETS).

Departures from the papers' releases (each also noted where it happens; docs/method.md lists them all):
 1. Rewards score the trajectory as the model saw it (forced "<think>\n" prefix and tool responses
    included); ParaVT scored generated tokens only (--released-scoring restores that). Environment
    messages are never read as the policy's answer or format (rewards.policy_view).
 2. Token-level exploration anchoring is available (--anchoring token), as the ParaVT paper words it;
    the release adds the anchor to the sequence reward only (--anchoring sequence).
 3. nFrames gating really acts (the release's config replaced K by 64 frames).
 4. Sub-agent tokens can be trained with their caller's advantage (--train-subagents); ParaVT did not.
 5. Old log-probs are recomputed by a training forward (not taken from the sampler), so ratio == 1 on
    the first PPO epoch and clipping only acts from the second epoch (--ppo-epochs > 1) on.
 6. ParaVT's release has its format reward's answer body anywhere in the completion; we follow it
    (rewards._format_parts), so an unclosed <think> followed by an answer scores 0.55, not 0.05.
 7. k1 KL is used only folded into the reward (ParaVT); as a loss term its expected gradient is zero
    on-policy, so `--kl-estimator k1` without --kl-in-reward is refused.

Run commands:
    python train.py                                   # the embedded default on CPU: tiny model, synthetic task
    python train.py --stage rl --rl-steps 2 --n-train 8 --group-size 2 --prompts-per-step 2   # CPU smoke
    python train.py --model /ckpt/Qwen3-VL-8B-Instruct --preset paravt --data rl.jsonl --video-root /videos --stage rl
    python train.py --gpus 8 --model /ckpt/Qwen3-VL-8B-Instruct --preset paravt --data rl.jsonl \
        --video-root /videos --stage rl --prompts-per-step 1 --grad-checkpointing
    torchrun --nnodes 2 --nproc-per-node 8 ... train.py ...   # multi-node: torchrun's environment is used
"""
import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import data
import eval as evaluation
import model as model_lib
import rewards
import rollout
import video

# -----------------------------------------------------------------------------
# 1. The loss math

def policy_mask(roles: torch.Tensor) -> torch.Tensor:
    """(B, L) roles -> (B, L-1) bool: True where the NEXT token is the policy's own (the positions whose
    log-prob enters the loss: never the prompt, tool responses, frames, forced text or pads)."""
    return roles[:, 1:] == rollout.POLICY

# ----- GRPO loss, KL, learning-rate schedule

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


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
              ref_logprobs: torch.Tensor | None = None, kl_estimator: str = "k3",
              num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """
    PPO-clip surrogate with group advantages (GRPO, arXiv 2402.03300), token-mean as in DAPO (arXiv 2503.14476).

        r_it  = exp(log pi_theta(o_it) - log pi_old(o_it))
        l_it  = -min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it) + beta KL_it
        loss  = sum_it m_it l_it / sum_it m_it                  (token-mean over the whole batch)

    Shapes: logprobs, old_logprobs, ref_logprobs, mask (B, L); advantages (B,) broadcast over the
    sequence, or (B, L) per token (token-level anchoring adds credit at closing-tag positions).
    The mask m is 1 only on the policy's own sampled tokens: never the prompt, tool responses,
    inserted video frames, forced text (a forced "<answer>"), or pads. Masked positions are cut out
    before any arithmetic, so garbage there (inf, NaN) gets exactly zero gradient.
    eps_low / eps_high = clip_low / clip_high (ParaVT 0.2 / 0.2, Video-o3 "clip higher" 0.2 / 0.3).
    KL_it is `kl_penalty(logprobs, ref_logprobs, kl_estimator)` against a frozen reference, weighted by
    beta = kl_coef (Video-o3: 0; ParaVT folds k1 into the reward upstream instead).
    With one optimiser update per batch pi_old == pi_theta, so r = 1 and clipping does nothing: the
    loss is -mean(A) over policy tokens and its gradient is the plain policy gradient.
    num_tokens: the normaliser; default this call's sum(mask). With micro-batches (or ranks), pass
    the policy-token count of the whole batch, so the summed gradients equal one big batch's.
    Temperature: the rollouts sample from softmax(logits / T) (T = --temperature, 0.7 in ParaVT's
    recipe), so logprobs, old_logprobs and ref_logprobs must all be log-probs of that same tempered
    distribution (`token_logprobs` / `token_loss` with temperature=T), as verl and TRL compute them;
    at T = 1 the ratio and the KL would be those of a policy other than the one that sampled.
    Returns (loss, stats) with stats = clip_frac, kl, n_tokens, ratio_mean as Python numbers.
    The same loss without the (B, L, V) logits, from hidden states: `grpo_token_loss`.
    """
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"grpo_loss: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must all be (B, L)")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"grpo_loss: advantages {tuple(advantages.shape)} must be (B,) or (B, L) "
                         f"for logprobs {tuple(logprobs.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_loss: kl_coef != 0 needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"grpo_loss: ref_logprobs {tuple(ref_logprobs.shape)} != logprobs {tuple(logprobs.shape)}")
    mask = mask.bool()
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logprobs.dtype)  # (B, 1) or (B, L)
    adv = torch.where(mask, adv, 0.0)                                                          # (B, L)
    logprobs = torch.where(mask, logprobs, 0.0)            # cut masked positions out before any arithmetic
    old_logprobs = torch.where(mask, old_logprobs.detach(), 0.0)

    ref = None if ref_logprobs is None else torch.where(mask, ref_logprobs.detach(), 0.0)    # 0 where masked
    # ratio: (B, L), exactly 1 where masked; kl: 0 where masked
    per_token, ratio, kl, clipped = grpo_token_terms(logprobs, old_logprobs, adv, clip_low, clip_high,
                                                     kl_coef, ref, kl_estimator)
    n_tokens = mask.sum()
    normaliser = n_tokens.clamp(min=1) if num_tokens is None else num_tokens
    # the normaliser: token-mean over all policy tokens of the batch (DAPO), not GRPO's per-sequence mean
    loss = torch.where(mask, per_token, 0.0).sum() / normaliser

    with torch.no_grad():
        denom = n_tokens.clamp(min=1)
        stats = {
            "clip_frac": float((clipped & mask).sum() / denom),
            "kl": float(kl.sum() / denom),
            "n_tokens": int(n_tokens),
            "ratio_mean": float(torch.where(mask, ratio, 0.0).sum() / denom),
        }
    return loss, stats


def grpo_token_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, clip_low: float,
                     clip_high: float, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                     kl_estimator: str = "k3") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    GRPO's per-token terms, elementwise (any shape; the inputs hold policy tokens only, or zeros elsewhere):

        r   = exp(log pi_theta - log pi_old)
        l   = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta KL       (KL = 0 without a reference)

    Returns (l, r, KL, clipped), clipped = the tokens whose gradient the clip cuts off. Shared by
    `grpo_loss` (on log-prob tensors) and `grpo_token_loss` (chunk by chunk inside `token_loss`).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return per_token, ratio, kl, clipped


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
# 2. Fused kernels. Chunked log-probabilities: hidden states x lm_head -> log p(token), never the (N, V) matrix

# `TOKEN_LOGPROBS_COMPILE=0` runs the chunk kernels of token_logprobs and token_loss eagerly everywhere
# (for debugging and pdb). `TORCH_COMPILE_DISABLE=1` does the same for every torch.compile in the process.
_compiled_kernels: dict = {}
_MIN_CHUNK_LOGITS = 1 << 23   # token_loss's smallest chunk buffer, in elements (32 MB fp32); below it, no chunks

# Layout: a chunk of C tokens has its logits vocab-major, logits^T = W h_c^T of shape (V, C), in one reused buffer,
# so the GEMMs are (V, D) x (D, C), (D, V) x (V, C) and (V, C) x (C, D). `python bench/chunk_layout.py` (CPU, MKL,
# fp32, N = 1,024, D = 4,096, V = 151,936): the three GEMMs chunk by chunk took 1.31x / 1.12x / 1.05x the time of
# the whole-batch GEMMs at C = 128 / 256 / 512 token-major (C, V), 1.09x / 1.01x / 1.00x vocab-major. The softmax
# reductions then run over the buffer's outer axis.


def _kernel(fn, use_compile: bool):
    """The chunk kernel `fn`, compiled on first use with fixed shapes, or `fn` itself when compile is off."""
    if not use_compile or os.environ.get("TOKEN_LOGPROBS_COMPILE", "1") == "0":
        return fn
    if fn not in _compiled_kernels:
        _compiled_kernels[fn] = torch.compile(fn, dynamic=False)
    return _compiled_kernels[fn]


def _chunk_logprobs(logits_t, targets, temperature: float = 1.0):
    """One chunk forward: logits^T (V, C) -> log p(target) (C,) and logsumexp (C,) of logits / T, both fp32."""
    z = logits_t.float()                                          # the upcast fuses into the reductions
    if temperature != 1.0:                                        # (T = 1 skips it: bit-for-bit the plain model)
        z = z / temperature
    if torch.compiler.is_compiling():
        # compiled, the sum over the vocab (the buffer's outer axis) runs serially per column: in fp32 it is off
        # by ~1.6e-5 at V = 151,936, summed in fp64 by ~1.2e-6, at the same speed
        m = z.amax(dim=0)                                         # (C,)
        lse = m + torch.log(torch.exp(z - m).sum(dim=0, dtype=torch.float64)).float()
    else:
        lse = torch.logsumexp(z, dim=0)                           # (C,); eager ATen's sum: ~1.1e-6 in fp32
    target_logit = z.gather(0, targets[None, :]).squeeze(0)       # (C,)
    return target_logit - lse, lse


def _chunk_grad_logits_(logits_t, targets, lse, grad_out, temperature: float = 1.0):
    """One chunk backward, in place: logits^T (V, C) <- (g / T) (onehot(t) - softmax(logits / T)), vocab-major."""
    z = logits_t.float() if temperature == 1.0 else logits_t.float() / temperature
    probs = torch.exp(z - lse[None, :])                           # softmax from the saved logsumexp, fp32
    vocab = torch.arange(logits_t.shape[0], device=logits_t.device)
    onehot = (vocab[:, None] == targets[None, :]).float()
    logits_t.copy_((grad_out / temperature)[None, :] * (onehot - probs))  # compiled: one fused kernel, no new (V, C)


def _chunk(x: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """Rows [start, start + chunk) of x, zero-padded at the end so every chunk has `chunk` rows."""
    part = x[start:start + chunk]
    pad = chunk - part.shape[0]
    if pad == 0:
        return part
    return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])


def _accumulate_grad_weight(grad_weight, grad_logits_t, h) -> None:
    """grad_W (V, D) fp32 += grad_logits^T (V, C) @ h (C, D): in place in fp32; bf16 GEMM summed in fp32 otherwise."""
    if grad_logits_t.dtype == torch.float32:
        grad_weight.addmm_(grad_logits_t, h)                   # no (V, D) temporary
    else:
        grad_weight += grad_logits_t @ h


def _check_head(name: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Shapes, dtypes and target ids of a (hidden, lm_head weight, targets) triple, with a clear message."""
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(f"{name}: hidden has size {hidden.shape[-1]} in its last dim, "
                         f"lm_head_weight is {tuple(weight.shape)}; expected (V, {hidden.shape[-1]})")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{name}: hidden is {hidden.dtype} but lm_head_weight is {weight.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{name}: targets shape {tuple(targets.shape)} != hidden shape "
                         f"{tuple(hidden.shape)} without its last dim")
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):  # one host sync; else garbage reads
        raise ValueError(f"{name}: targets must lie in [0, {vocab}), got min {int(targets.min())} "
                         f"max {int(targets.max())} (mask pads with a valid id, not -100)")


def _check_temperature(name: str, temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")


class _TokenLogprobs(torch.autograd.Function):
    """Chunked log p(target) with a hand-written backward; see `token_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, temperature, use_compile):
        n = hidden.shape[0]
        forward_kernel = _kernel(_chunk_logprobs, use_compile)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)       # (N,), the only saved activation
        buf = hidden.new_empty((weight.shape[0], chunk))                        # (V, C): logits^T, reused
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            torch.mm(weight, _chunk(hidden, start, chunk).T, out=buf)           # GEMM in the input dtype
            lp, ls = forward_kernel(buf, _chunk(targets, start, chunk), temperature)
            logprobs[start:stop] = lp[:stop - start]
            lse[start:stop] = ls[:stop - start]
        del buf
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.temperature, ctx.use_compile = chunk, temperature, use_compile
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        chunk, n = ctx.chunk, hidden.shape[0]
        backward_kernel = _kernel(_chunk_grad_logits_, ctx.use_compile)
        grad_out = grad_out.float()
        grad_hidden = torch.empty_like(hidden) if need_hidden else None       # (N, D)
        grad_weight = None
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, D) fp32 sum
        buf = hidden.new_empty((weight.shape[0], chunk))                        # (V, C), reused
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            h = _chunk(hidden, start, chunk)                                   # (C, D)
            # the logits again, exactly as in forward, then overwritten with d loss / d logits;
            # padded columns carry g = 0, so their columns of grad_logits^T are exactly zero
            torch.mm(weight, h.T, out=buf)                                     # logits^T (V, C)
            backward_kernel(buf, _chunk(targets, start, chunk), _chunk(lse, start, chunk),
                            _chunk(grad_out, start, chunk), ctx.temperature)
            if need_hidden:
                grad_hidden[start:stop] = (weight.T @ buf).T[:stop - start]    # (D, V) @ (V, C), transposed
            if need_weight:
                _accumulate_grad_weight(grad_weight, buf, h)                   # += (V, C) @ (C, D)
        del buf
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                   chunk_size: int = 1024, compile: bool = True, temperature: float = 1.0) -> torch.Tensor:
    """
    log p(target) for each token from final hidden states, at temperature T, without materialising the logits.

        z_i = h_i W^T / T                              (T = temperature; T = 1 is the plain model)
        logp_i = z_i[t_i] - logsumexp_v(z_i[v])
        d logp_i / d (h_i W^T) = (onehot(t_i) - softmax(z_i)) / T
        grad_h_i = (g_i / T) (onehot(t_i) - p_i) W      grad_W = sum_i (g_i / T) (onehot(t_i) - p_i)^T h_i

    Shapes: hidden (..., D), lm_head_weight (V, D), targets (...) int64 in [0, V) -> (...) float32.
    Forward walks the tokens in chunks of C = chunk_size rows: a chunk's logits come from one GEMM
    into a (V, C) buffer (vocab-major: see "Layout" above), are reduced in fp32 to the target logit and
    the logsumexp, and dropped; only lse (N,) is saved. Backward recomputes each chunk's logits with
    the same GEMM, overwrites them in place with grad_logits = (g / T) (onehot - exp(logits / T - lse)),
    then grad_hidden chunk = grad_logits @ W and grad_W += grad_logits^T h_chunk (an fp32
    accumulator, cast to W's dtype at the end).
    Temperature: the RL loop samples from softmax(logits / T); the log-probs that enter its loss (old,
    reference and current) must be those of the same distribution, so they pass the sampling T here.

    Memory: O(C V) working memory instead of O(N V). With Qwen's vocab V = 151,936 the naive path
    at N = 8192 tokens holds 5 GB of fp32 logits, and autograd keeps two to three such (N, V)
    tensors alive in backward; here one (V, C) buffer, 0.6 GB for C = 1024 in fp32, whatever N is.
    The price is one extra GEMM (the logits recomputed in backward): 4 GEMMs of N x D x V instead
    of 3 (bench/logprob_bench.py, method `logprobs`; figures in docs/experiments.md). A loss that is a sum of per-token
    terms should use `token_loss` instead (3 GEMMs, gradients formed in the forward); this function
    is for the no-grad uses (old and reference log-probs, evaluation) and for losses that are not.
    bf16/fp16 inputs: the GEMMs run in the input dtype (fp32 accumulation inside the GEMM), the
    softmax math in fp32, and grad_W sums the chunks in fp32.

    The softmax math of a chunk (forward: logsumexp and gather; backward: the in-place gradient) runs
    under `torch.compile(dynamic=False)`, compiled lazily on first use, which fuses it into one pass
    over the buffer; the GEMMs are library calls either way. The last chunk is zero-padded to
    C tokens so one shape is compiled; when N < chunk_size the chunk shrinks to the next power of two
    >= N. `compile=False` or env TOKEN_LOGPROBS_COMPILE=0 runs the same code eagerly (with a few
    (V, C) temporaries). Call it outside any compiled region: its Python loop is the point.
    Source: the fused "linear + cross-entropy" of Liger-Kernel (arXiv 2410.10989), here returning
    per-token log-probs (GRPO needs those, not one summed loss), hence the recompute in backward.
    """
    _check_head("token_logprobs", hidden, lm_head_weight, targets)
    _check_temperature("token_logprobs", temperature)
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    lead_shape, dim = targets.shape, lm_head_weight.shape[1]
    hidden, targets = hidden.reshape(-1, dim), targets.reshape(-1).long()  # (N, D), (N,)
    n = targets.shape[0]
    chunk = min(chunk_size, 1 << max(n - 1, 0).bit_length())  # a few fixed shapes, so dynamic=False stays cheap
    return _TokenLogprobs.apply(hidden, lm_head_weight, targets, chunk, float(temperature),
                                compile).reshape(lead_shape)


def _liger_chunk(n: int, dim: int, vocab: int) -> int:
    """
    Liger-Kernel's chunk size (arXiv 2410.10989, fused linear cross-entropy): C = next_pow2(ceil(N / ceil(V / D))),
    so the (C, V) logits buffer is about the size of the (N, D) hidden states; here at least
    _MIN_CHUNK_LOGITS / V rows (a tiny D would otherwise give chunks of one row and a Python loop of N).
    """
    chunk = -(-n // -(-vocab // dim))                              # ceil(N / ceil(V / D))
    chunk = max(chunk, -(-_MIN_CHUNK_LOGITS // vocab), 1)
    return 1 << (chunk - 1).bit_length()                           # the next power of two


def _auto_chunk(n: int, dim: int, vocab: int) -> int:
    """
    token_loss's default chunk: Liger's (`_liger_chunk`), but at most MAX_CHUNKS chunks:
    C = next_pow2(max(ceil(N / ceil(V / D)), ceil(N / MAX_CHUNKS))).
    Departure from Liger: every chunk reads W twice (GEMMs 1 and 2) and reads and writes the fp32 grad_W once
    (GEMM 3), and each GEMM's fixed cost is paid once per chunk. Measured side by side (bench/logprob_bench.py,
    the GRPO loss, fp32, N = D = 4,096, V = 151,936, 2-core CPU, 2026-12-01): 8 chunks of 512 rows 0.92x naive's
    time at 0.080x its working memory; Liger's 32 chunks of 128 rows 1.01x at 0.029x. At most 8 chunks keep the
    buffer <= 1/8 of the naive (N, V) logits. The bench runs both rules (methods `fused` and `fused_liger`).
    """
    chunk = max(_liger_chunk(n, dim, vocab), -(-n // MAX_CHUNKS))
    return 1 << (chunk - 1).bit_length()


MAX_CHUNKS = 8


class _TokenLoss(torch.autograd.Function):
    """sum_i loss over chunks with the gradients formed in the forward; see `token_loss`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, chunk, temperature, use_compile, need_hidden, need_weight):
        n, (vocab, dim) = hidden.shape[0], weight.shape
        forward_kernel = _kernel(_chunk_logprobs, use_compile)
        grad_kernel = _kernel(_chunk_grad_logits_, use_compile)
        buf = hidden.new_empty((vocab, chunk))                          # (V, C): the one logits^T buffer, reused
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None                     # (N, D)
        grad_weight = torch.zeros((vocab, dim), dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            rows = stop - start
            h, t = _chunk(hidden, start, chunk), _chunk(targets, start, chunk)               # (C, D), (C,)
            torch.mm(weight, h.T, out=buf)                                                   # GEMM 1: logits^T
            logp, lse = forward_kernel(buf, t, temperature)                                  # (C,), (C,) fp32
            with torch.enable_grad():           # autograd on the small (rows,) tensor only: d loss / d logp
                lp = logp[:rows].detach().requires_grad_()
                loss = loss_fn(lp, slice(start, stop))
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"token_loss: loss_fn must return a scalar tensor, got {loss!r:.80}")
                g = None
                if (need_hidden or need_weight) and loss.requires_grad:
                    g = torch.autograd.grad(loss, lp, allow_unused=True)[0]                  # (rows,)
            total += loss.detach().float()
            if not (need_hidden or need_weight):
                continue
            g_pad = torch.zeros(chunk, dtype=torch.float32, device=hidden.device)            # padded rows: g = 0
            if g is not None:
                g_pad[:rows] = g
            grad_kernel(buf, t, lse, g_pad, temperature)       # buf <- (g / T)(onehot - softmax(logits / T))^T
            if need_hidden:
                grad_hidden[start:stop] = (weight.T @ buf).T[:rows]                          # GEMM 2: (D, V) @ (V, C)
            if need_weight:
                _accumulate_grad_weight(grad_weight, buf, h)                                 # GEMM 3: (V, C) @ (C, D)
        del buf
        if need_weight and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.grads = (grad_hidden, grad_weight)                 # nothing else is kept: not h, not W, not logits
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("token_loss: backward through the same loss twice; its gradients were formed in "
                               "the forward and handed over by the first backward (call token_loss again)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None        # handed over to autograd, which owns (and may accumulate into) them now
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_out)                            # d total / d loss = upstream gradient, in place
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def token_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss_fn,
               chunk_size: int | None = None, temperature: float = 1.0, compile: bool = True) -> torch.Tensor:
    """
    A loss that is a sum of per-token terms of log p(target), with the gradients formed in the forward.

        logp_i = log_softmax(h_i W^T / T)[t_i]                              (T = temperature)
        loss   = sum over chunks c of loss_fn(logp_c, rows_c)               (a scalar, fp32)
        g_i    = d loss / d logp_i                                          (autograd on the (C,) tensor)
        grad_logits_i = (g_i / T) (onehot(t_i) - softmax(h_i W^T / T))
        grad_h_i = grad_logits_i W          grad_W = sum_i grad_logits_i^T h_i

    Shapes: hidden (N, D), weight (V, D), targets (N,) int64 in [0, V) -> scalar float32.
    loss_fn(logp (n,) float32, rows: slice) -> scalar tensor: the loss of one chunk of rows, where
    `rows` is the Python slice of those rows in the flattened batch, so loss_fn can index per-token
    tensors (old and reference log-probs, advantages, mask); every other tensor it reads is a
    constant (no gradient reaches it). Each token's term must depend on its own log-prob only (GRPO's
    clipped ratio, a KL to a reference, cross-entropy): that is what lets the gradient be known as
    soon as the chunk's log-probs are.

    Per chunk of C rows, in the forward: the logits by one GEMM into a reused (V, C) buffer, the
    log-sum-exp and log-probs, g by autograd on the small (C,) tensor, grad_logits written in place
    over the logits, then grad_h for the chunk (GEMM 2) and grad_W accumulated in fp32 (GEMM 3).
    The backward only scales the stored grad_h and grad_W by the upstream gradient: 3 GEMMs of
    N x D x V in all, as the naive path, where `token_logprobs` needs 4 (it recomputes the logits).
    Nothing of the forward is saved but the two gradients, not even W (so on this path FSDP may free the
    unsharded lm_head weight after the forward); backward through one result twice is refused.
    Chunk size: by default Liger's rule with at most 8 chunks (`_auto_chunk`: 512 rows for N = 4096, D = 4096,
    V = 151,936, where Liger's alone gives 128), and when the whole (N, V) logits are no bigger
    than that smallest buffer, the plain path (log_softmax over all logits, ordinary autograd). An
    explicit chunk_size always takes the fused path (shrunk to the next power of two >= N when N is
    smaller). The softmax math of a chunk runs under torch.compile(dynamic=False) on the padded (V, C)
    shape as in `token_logprobs` (env TOKEN_LOGPROBS_COMPILE=0 or compile=False: eager); the GEMMs are
    library calls. bf16: GEMMs in bf16, softmax math in fp32, grad_W summed in fp32, cast to W's dtype.
    Measured (bench/logprob_bench.py, the GRPO loss, fp32, 2-core CPU): see docs/experiments.md.
    Sources: Liger-Kernel's fused linear losses (arXiv 2410.10989) and Cut Cross-Entropy (arXiv
    2411.09009) form the gradient inside the forward the same way; here the per-token loss is any
    function of log p, so one kernel serves GRPO and SFT.
    """
    _check_head("token_loss", hidden, weight, targets)
    _check_temperature("token_loss", temperature)
    if hidden.dim() != 2:
        raise ValueError(f"token_loss: hidden must be (N, D), got {tuple(hidden.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"token_loss: chunk_size must be >= 1 or None, got {chunk_size}")
    (n, dim), vocab = hidden.shape, weight.shape[0]
    targets = targets.long()
    if chunk_size is None and n * vocab <= _MIN_CHUNK_LOGITS:     # small logits: plain autograd, no chunks
        logits = (hidden @ weight.T).float() / temperature
        logp = F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
        return loss_fn(logp, slice(0, n)).float()
    chunk = _auto_chunk(n, dim, vocab) if chunk_size is None else chunk_size
    chunk = min(chunk, 1 << max(n - 1, 0).bit_length())          # N < C: the next power of two >= N
    grad_on = torch.is_grad_enabled()
    return _TokenLoss.apply(hidden, weight, targets, loss_fn, chunk, float(temperature), compile,
                            grad_on and hidden.requires_grad, grad_on and weight.requires_grad)


def _policy_rows(name: str, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, **per_token):
    """Policy rows of (B, L, D) hidden / (B, L) targets and of each (B, L) or (B,) per-token tensor, flattened."""
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or mask.shape != targets.shape:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} must be (B, L, D), targets {tuple(targets.shape)} "
                         f"and mask {tuple(mask.shape)} (B, L)")
    mask = mask.to(hidden.device).bool()
    rows = {}
    for key, x in per_token.items():
        if x is None:
            rows[key] = None
            continue
        if x.shape not in (mask.shape, mask.shape[:1]):
            raise ValueError(f"{name}: {key} {tuple(x.shape)} must be (B, L) or (B,) for mask {tuple(mask.shape)}")
        x = x.to(hidden.device).detach()
        rows[key] = (x[:, None].expand(mask.shape) if x.dim() == 1 else x)[mask].float()   # (N,)
    return hidden[mask], targets.to(hidden.device)[mask], mask, rows


def grpo_token_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                    old_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
                    clip_low: float, clip_high: float, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                    kl_estimator: str = "k3", num_tokens: float | torch.Tensor | None = None,
                    temperature: float = 1.0, chunk_size: int | None = None,
                    compile: bool = True) -> tuple[torch.Tensor, dict]:
    """
    `grpo_loss` computed from hidden states through `token_loss`: the same PPO-clip surrogate, KL term and
    token-mean normaliser, without the (B, L, V) logits and with 3 GEMMs of N x D x V.

        logp_it = log_softmax(h_it W^T / T)[o_it]        over the policy tokens (mask m_it = 1) only
        loss    = sum_it m_it l_it(logp_it) / num_tokens   with l_it of `grpo_token_terms`

    Shapes: hidden (B, L, D) (the final hidden states predicting targets), lm_head_weight (V, D),
    targets, mask (B, L); old_logprobs, ref_logprobs (B, L) at the same temperature T; advantages (B,)
    or (B, L). old_logprobs None: the single on-policy epoch, ratio = exp(logp - logp.detach()) = 1
    with the gradient of logp. Only the masked rows are gathered (N = sum(mask) of them) and run
    through the kernel, so garbage at masked positions never enters. num_tokens: as in `grpo_loss`
    (default sum(mask), at least 1). Returns (loss, stats) with grpo_loss's stats.
    """
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_token_loss: kl_coef != 0 needs ref_logprobs")
    h, t, mask, rows = _policy_rows("grpo_token_loss", hidden, targets, mask, old_logprobs=old_logprobs,
                                    advantages=advantages, ref_logprobs=ref_logprobs)
    n_tokens = h.shape[0]
    normaliser = max(n_tokens, 1) if num_tokens is None else num_tokens
    sums = {"clip": 0.0, "kl": 0.0, "ratio": 0.0}

    def chunk_loss(logp: torch.Tensor, sl: slice) -> torch.Tensor:
        old = logp.detach() if rows["old_logprobs"] is None else rows["old_logprobs"][sl]
        ref = None if rows["ref_logprobs"] is None else rows["ref_logprobs"][sl]
        per_token, ratio, kl, clipped = grpo_token_terms(logp, old, rows["advantages"][sl], clip_low, clip_high,
                                                         kl_coef, ref, kl_estimator)
        with torch.no_grad():   # summed on the device; one host sync at the end
            for key, x in (("clip", clipped), ("kl", kl), ("ratio", ratio)):
                sums[key] = sums[key] + x.float().sum()
        return per_token.sum() / normaliser

    loss = token_loss(h, lm_head_weight, t, chunk_loss, chunk_size, temperature, compile)
    denom = max(n_tokens, 1)
    stats = {"clip_frac": float(sums["clip"]) / denom, "kl": float(sums["kl"]) / denom,
             "n_tokens": n_tokens, "ratio_mean": float(sums["ratio"]) / denom}
    return loss, stats


def sft_token_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                   num_tokens: float | torch.Tensor | None = None, temperature: float = 1.0,
                   chunk_size: int | None = None, compile: bool = True) -> tuple[torch.Tensor, int]:
    """
    Cross-entropy on the masked (assistant) tokens through `token_loss`, token mean:

        loss = -sum_it m_it log_softmax(h_it W^T / T)[t_it] / num_tokens        (num_tokens default sum(m))

    Shapes: hidden (B, L, D), lm_head_weight (V, D), targets, mask (B, L). With micro-batches pass the
    whole batch's token count as num_tokens so the gradients add up. Returns (loss, n_tokens of this call).
    """
    h, t, mask, _ = _policy_rows("sft_token_loss", hidden, targets, mask)
    n_tokens = h.shape[0]
    normaliser = max(n_tokens, 1) if num_tokens is None else num_tokens
    loss = token_loss(h, lm_head_weight, t, lambda logp, sl: -logp.sum() / normaliser, chunk_size,
                      temperature, compile)
    return loss, n_tokens


# -----------------------------------------------------------------------------
# 3. TDAM: Task-Decoupled Attention Masking (Video-o3 SFT)

def _check_span(name: str, span: tuple[int, int], seq_len: int) -> tuple[int, int]:
    start, end = span
    if not 0 <= start <= end <= seq_len:
        raise ValueError(f"tdam_mask: {name} {span} is not a [start, end) span inside a sequence of {seq_len} tokens")
    return start, end


def tdam_mask(seq_len: int, overview_span: tuple[int, int] | None, answer_span: tuple[int, int] | None,
              call_spans: list[tuple[int, int]], obs_spans: list[tuple[int, int]]) -> torch.Tensor:
    """
    Video-o3's Task-Decoupled Attention Masking (arXiv 2601.23224, used on 10% of SFT batches).

    Start from the causal mask M[i, j] = (j <= i), True = query i may attend to key j, then:
      (1) rows of the final answer span may not see columns of the overview video span, when the
          sequence holds more than one video (obs_spans non-empty), so the answer must rest on the
          cropped evidence;
      (2) rows of every tool-call span after the first may not see columns of the tool-observation
          video spans that end before that call starts, so each new call plans from the overview
          rather than copying the last crop.
    Every other entry stays causal. Spans are [start, end) token indices; `answer_span` is the text
    after `<answer>`. Returns (L, L) bool; `to_additive_mask` turns it into HF's 4-D float form.
    """
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()  # (L, L) causal
    for q0, q1, k0, k1 in tdam_rects(seq_len, overview_span, answer_span, call_spans, obs_spans):
        mask[q0:q1, k0:k1] = False
    return mask


def tdam_rects(seq_len: int, overview_span: tuple[int, int] | None, answer_span: tuple[int, int] | None,
               call_spans: list[tuple[int, int]], obs_spans: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """TDAM's two rules as the rectangles (q0, q1, k0, k1) of queries [q0, q1) that may not see keys [k0, k1),
    on top of the causal mask: the whole rule set in O(#rules), for the dense mask (`tdam_mask`) and the
    blocked attention (`tdam_attention`, which never builds L x L) alike."""
    obs = [_check_span("obs_span", s, seq_len) for s in obs_spans]
    calls = sorted(_check_span("call_span", s, seq_len) for s in call_spans)
    rects = []
    if overview_span is not None and answer_span is not None and obs:
        v0, v1 = _check_span("overview_span", overview_span, seq_len)
        a0, a1 = _check_span("answer_span", answer_span, seq_len)
        if a0 < v1 and a1 > v0:
            raise ValueError(f"tdam_mask: answer_span {answer_span} overlaps overview_span {overview_span}")
        rects.append((a0, a1, v0, v1))                            # rule (1)
    rects += [(c0, c1, o0, o1) for c0, c1 in calls[1:] for o0, o1 in obs if o1 <= c0]   # rule (2)
    return rects


def to_additive_mask(bool_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """
    Bool mask (True = attend) -> HF's 4-D additive float mask: 0 where allowed, finfo(dtype).min elsewhere.
    (L, L) -> (1, 1, L, L); (B, L, L) -> (B, 1, L, L), the head dim broadcast.
    """
    if bool_mask.dim() not in (2, 3) or bool_mask.shape[-1] != bool_mask.shape[-2]:
        raise ValueError(f"to_additive_mask: expected (L, L) or (B, L, L), got {tuple(bool_mask.shape)}")
    additive = torch.zeros(bool_mask.shape, dtype=dtype, device=bool_mask.device)
    additive = additive.masked_fill(~bool_mask.bool(), torch.finfo(dtype).min)
    return additive[None, None] if bool_mask.dim() == 2 else additive[:, None]



def tdam_spans(ids: list[int], roles: list[int], tokenizer, video_id: int) -> dict:
    """The spans TDAM needs, for one trajectory of token ids (no pads), found from the DECODED TEXT mapped back
    to tokens (model.decode_with_offsets), so they hold for any tokenizer: on Qwen's `<answer>` is three tokens
    and its '>' can share a token with the answer; such a token counts as part of the answer.
      overview  the prompt's video (its first to last <|video_pad|>, the frame timestamps between included)
      obs       each <tool_response> block's video, likewise
      calls     each <tool_call> / <grounding> block of the policy's turns, tags included
      answer    after the last "<answer>" of the policy's turns to the end; None when there is none
    The prompt ends at the forced "<think>" before the first policy token (the system prompt and the Hermes
    tools block mention the tags themselves). Token spans are [start, end)."""
    n = len(ids)
    text, offsets = model_lib.decode_with_offsets(tokenizer, ids)
    to_tokens = lambda chars: model_lib.text_spans_to_token_spans(offsets, chars)
    first_policy = roles.index(rollout.POLICY) if rollout.POLICY in roles else n
    policy_char = offsets[first_policy][0] if first_policy < n else len(text)
    think = [c for c, _ in model_lib.find_text(text[:policy_char], "<think>")]
    prompt_len = to_tokens([(think[-1], think[-1])])[0][0] if think else first_policy
    start_char = offsets[prompt_len][0] if prompt_len < n else len(text)
    runs, s = [], None
    for j, t in enumerate(list(ids) + [-1]):          # maximal runs of video tokens
        if t == video_id and s is None:
            s = j
        elif t != video_id and s is not None:
            runs.append((s, j))
            s = None
    hull = lambda vs: (vs[0][0], vs[-1][1]) if vs else None
    blocks = to_tokens([b for b in model_lib.tagged_spans(text, "<tool_response>", "</tool_response>") if b[0] >= start_char])
    obs = [sp for o, c in blocks if (sp := hull([v for v in runs if o <= v[0] and v[1] <= c]))]
    calls = sorted(to_tokens([b for tag in ("tool_call", "grounding")
                              for b in model_lib.tagged_spans(text, f"<{tag}>", f"</{tag}>", inner=False)
                              if b[0] >= start_char]))
    answers = [a for a in model_lib.tagged_spans(text, "<answer>", "</answer>") if a[0] >= start_char]
    answer = (to_tokens(answers[-1:])[0][0], n) if answers else None
    return {"overview": hull([v for v in runs if v[1] <= prompt_len]), "obs": obs, "calls": calls,
            "answer": answer if answer and answer[0] < n else None}


def tdam_batch_mask(batch: dict, tokenizer, video_id: int, counts: dict | None = None) -> torch.Tensor:
    """(B, 1, L, L) additive mask: the dense form of `tdam_spec` (TDAM on each row plus padding), for models
    and tests that take a 4-D mask. Training uses the spec itself (`tdam_attention`), which never builds it."""
    L = batch["input_ids"].shape[1]
    return to_additive_mask(tdam_spec(batch, tokenizer, video_id, counts).allowed(0, L, L, "cpu")[:, 0])


@dataclasses.dataclass
class TdamSpec:
    """TDAM for a batch without an L x L mask: each row's length (B,) and its blocked rectangles (B, M, 4) =
    (q0, q1, k0, k1), empty ones (0, 0, 0, 0) padding M. Passed to the model as the `tdam` keyword, read by
    `tdam_attention`."""
    lengths: torch.Tensor
    rects: torch.Tensor
    block: int = 256                     # query rows per block: memory O(block x L) per head, not O(L x L)

    def allowed(self, q0: int, q1: int, kv_len: int, device) -> torch.Tensor:
        """(B, 1, q1 - q0, kv_len) bool: causal, padding (a pad row sees only itself), minus the rectangles."""
        q = torch.arange(q0, q1, device=device)[None, :, None]
        k = torch.arange(kv_len, device=device)[None, None, :]
        n = self.lengths.to(device)[:, None, None]
        ok = torch.where(q < n, k <= q, k == q)                  # causal; a pad row sees itself only
        for r in self.rects.to(device).unbind(1):                # (B, 4) each
            ok &= ~((q >= r[:, 0, None, None]) & (q < r[:, 1, None, None]) &
                    (k >= r[:, 2, None, None]) & (k < r[:, 3, None, None]))
        return ok[:, None]


def tdam_spec(batch: dict, tokenizer, video_id: int, counts: dict | None = None) -> TdamSpec:
    """The batch's TdamSpec from each row's spans (tdam_spans); rows without an answer keep the causal mask,
    counted in counts["tdam_no_answer"]."""
    lengths = batch["attention_mask"].sum(1)
    rows = []
    for i, n in enumerate(lengths.tolist()):
        sp = tdam_spans(batch["input_ids"][i, :n].tolist(), batch["roles"][i, :n].tolist(), tokenizer, video_id)
        if sp["answer"] is None and counts is not None:
            counts["tdam_no_answer"] = counts.get("tdam_no_answer", 0) + 1
        rows.append(tdam_rects(n, sp["overview"], sp["answer"], sp["calls"], sp["obs"]) if sp["answer"] else [])
    m = max([len(r) for r in rows] + [1])
    rects = torch.tensor([r + [(0, 0, 0, 0)] * (m - len(r)) for r in rows], dtype=torch.long).view(len(rows), m, 4)
    return TdamSpec(lengths, rects)


def _tdam_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: TdamSpec, q0: int, scaling: float):
    allowed = spec.allowed(q0, q0 + q.shape[2], k.shape[2], q.device)      # built here: never saved for backward
    scores = (q @ k.transpose(-1, -2)).float() * scaling                  # (B, H, b, L)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs.to(v.dtype) @ v                                          # (B, H, b, d)


def tdam_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tdam: TdamSpec = None,
                   **kwargs):
    """The attention function registered as "paravt_tdam": softmax(q k^T / sqrt(d) + TDAM) v by blocks of
    queries, each block's mask built from the spec's rectangles and its scores recomputed in backward
    (activation checkpointing), so neither the mask nor the scores ever exist as L x L: O(block x L) memory
    per head. The same rows are masked as by the dense `tdam_mask` (tests/test_rl_correctness.py checks).
    Shapes: query (B, H, L, d), key / value (B, H_kv, L, d) -> (B, L, H, d). Without `tdam`: plain SDPA."""
    if tdam is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rep = query.shape[1] // key.shape[1]                                  # grouped-query attention
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scaling = module.scaling if scaling is None else scaling
    L = query.shape[2]
    blocks = []
    for q0 in range(0, L, tdam.block):
        blocks.append(torch.utils.checkpoint.checkpoint(_tdam_block, query[:, :, q0:q0 + tdam.block], key, value, tdam,
                                                        q0, scaling, use_reentrant=False))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("paravt_tdam", tdam_attention)
AttentionMaskInterface.register("paravt_tdam", lambda *a, **k: None)    # the spec is the mask: no L x L tensor


# -----------------------------------------------------------------------------
# Whole trajectories -> per-token log-probs of the policy's tokens

def forward_hidden(model, batch: dict, attn_mask_4d=None, tdam: TdamSpec | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (B, L-1, D), targets (B, L-1), policy mask (B, L-1)): the final hidden states that predict each
    next token, for the fused kernels. A batch collated with share_videos=True runs the vision tower once per
    distinct video (the G samples of a prompt share its overview), as the rollout did. `tdam`: the decoder's
    attention is `tdam_attention` for this forward (no L x L mask); `attn_mask_4d`: a dense 4-D mask instead.
    FSDP: the lm_head unit is gathered here, since the kernels read lm_head.weight directly (its gradient is
    reduce-scattered with the final norm's, in backward)."""
    device = next(model.parameters()).device
    kw = {k: v.to(device) for k, v in batch.items() if k not in ("roles",)}
    if "pixel_values_videos" in kw:
        kw["pixel_values_videos"] = kw["pixel_values_videos"].to(next(model.parameters()).dtype)
    if attn_mask_4d is not None:
        kw["attention_mask"] = attn_mask_4d.to(device)
    lm = model.model.language_model.config
    impl = lm._attn_implementation
    if tdam is not None:
        lm._attn_implementation, kw["tdam"] = "paravt_tdam", tdam
    try:
        hidden = rollout.forward_hidden(model, kw)[:, :-1]      # (B, L-1, D); vision once per distinct video
    finally:
        lm._attn_implementation = impl
    if hasattr(model.lm_head, "unshard"):
        model.lm_head.unshard()
    return hidden, batch["input_ids"][:, 1:].to(device), policy_mask(batch["roles"]).to(device)


def forward_logprobs(model, batch: dict, chunk_size: int, temperature: float = 1.0, attn_mask_4d=None,
                     compile: bool = True) -> torch.Tensor:
    """(B, L-1) log p_T(next token) at POLICY positions (0 elsewhere), through `token_logprobs`: the no-grad
    uses (old and reference log-probs, the KL folded into the reward). T is the sampling temperature (RL: the
    rollout's T, so the policy optimised is the policy that sampled; SFT and evaluation: 1)."""
    hidden, targets, policy = forward_hidden(model, batch, attn_mask_4d)
    out = torch.zeros(targets.shape, device=hidden.device, dtype=torch.float32)
    if policy.any():
        out[policy] = token_logprobs(hidden[policy], model.lm_head.weight, targets[policy], chunk_size, compile,
                                     temperature=temperature)
    return out


def trainable(traj, video_id: int) -> bool:
    """False when the policy sampled a <|video_pad|>: `collate` would take it for a video placeholder with no
    frames, so the sample is scored (as text) but left out of the update."""
    return not any(role == rollout.POLICY and tok == video_id for tok, role in zip(traj.token_ids, traj.roles))


# -----------------------------------------------------------------------------
# 4. The SFT step

def sft_pairs(path: str) -> tuple[list, list[str]]:
    """(record, messages, where) of each trajectory record in a JSONL file, and the bad lines' reasons."""
    pairs, errors = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                pairs.append((r.get("prompt") or r, r["messages"], f"{path}:{n}"))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
                errors.append(f"{path}:{n}: not a trajectory record ({type(e).__name__}: {e})")
    return pairs, errors


def bad_calls(messages: list[dict], duration: float | None, min_window: float) -> list[str]:
    """Why the assistant turns of a recorded trajectory hold tool calls the environment would refuse (an unknown
    tool, bad arguments, a window past the end of the video): training on them teaches such calls."""
    problems = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        text = rollout.message_text(m)
        for c in rewards.parse_tool_calls(text):
            if c.error is not None:
                problems.append(f"turn {k}: {c.error}")
            elif c.name != "crop_video":
                problems.append(f"turn {k}: unknown tool {c.name!r}")
            elif duration is not None:
                try:
                    video.check_window(c.arguments.get("start_time"), c.arguments.get("end_time"), duration, min_window)
                except ValueError as e:
                    problems.append(f"turn {k}: {e}")
    return problems


def sft_examples(records: list[dict], processor, video_root: str, cfg: rollout.RolloutConfig, *,
                 sft_data: str | None, seed: int, gated_choices: list[int], always_call: bool = False,
                 direct_crop: float = 0.0, budget_fraction: float = 0.0, keep_bad_calls: bool = False,
                 max_bad_fraction: float = 0.2, log=print) -> tuple[list, int]:
    """(encoded SFT trajectories, number skipped). From `sft_data` (trajectory records, docs/data.md), or the
    synthetic task's oracle: each record with the evaluation overview, and once more with a K drawn from
    `gated_choices` when given; with probability `budget_fraction` a trajectory that calls the tool is also
    recorded at a smaller tool-turn budget (the forced-answer message, then an answer from what was seen), so
    the model learns to answer when its budget runs out. Bad records and trajectories whose tool calls the environment would refuse
    are reported (file:line, reason) and skipped (`keep_bad_calls` keeps the latter); more than
    `max_bad_fraction` bad stops the run."""
    errors, pairs = [], []
    if sft_data:
        found, errors = sft_pairs(sft_data)
        pairs = [(rec, msgs, where, None, cfg) for rec, msgs, where in found]
    else:
        rng = np.random.default_rng(seed)
        k_eval = cfg.overview_nframes or 8
        for r in records:
            for k in [k_eval] + ([int(rng.choice(gated_choices))] if gated_choices else []):
                oracle = functools.partial(data.oracle_turns, r, rng, always_call=always_call, nframes=k,
                                           direct_crop=direct_crop, crop_fps=cfg.crop_fps,
                                           crop_max_frames=cfg.crop_max_frames)
                try:
                    msgs = oracle()
                    pairs.append((r, msgs, r["id"], k, cfg))
                    if (rounds := data.oracle_rounds(msgs)) and rng.random() < budget_fraction:
                        b = int(rng.integers(rounds))
                        pairs.append((r, oracle(budget=b), f"{r['id']} (budget {b})", k,
                                      dataclasses.replace(cfg, max_turns=b)))
                except (ValueError, KeyError) as e:
                    errors.append(f"{r.get('id')}: no oracle trajectory ({e}); pass --sft-data for real data")
    items, n_bad_calls = [], 0
    for rec, msgs, where, k, c in pairs:     # k: the overview's frame count (None: the rollout's own rule)
        try:
            item = rollout.encode_messages(processor, rec, msgs, video_root, c, nframes=k)
        except (ValueError, KeyError, TypeError, OSError) as e:
            errors.append(f"{where}: {e}")
            continue
        why = bad_calls(msgs, rec.get("duration") or video.probe(data.resolve_video(video_root, rec["video"])).duration,
                        cfg.min_window)
        if why and not keep_bad_calls:
            errors.append(f"{where}: tool calls the environment would refuse ({'; '.join(why[:3])}); "
                          f"skipped (--keep-bad-calls trains on them)")
            n_bad_calls += 1
            continue
        items.append(item)
    for e in errors[:5]:
        log(f"skipped SFT record: {e}")
    if len(errors) > 5:
        log(f"... {len(errors) - 5} more SFT records skipped")
    if not items or len(errors) > max_bad_fraction * (len(items) + len(errors)):
        raise ValueError(f"{len(errors)} of {len(items) + len(errors)} SFT records are bad; first: {errors[:3]}")
    return items, len(errors)


def sft_loss(model, batch: dict, chunk_size: int | None = None, attn_mask_4d=None, compile: bool = True,
             tdam: TdamSpec | None = None) -> tuple[torch.Tensor, int]:
    """Cross-entropy on assistant (POLICY) tokens only, token mean, through the fused `sft_token_loss`."""
    hidden, targets, mask = forward_hidden(model, batch, attn_mask_4d, tdam)
    return sft_token_loss(hidden, model.lm_head.weight, targets, mask, chunk_size=chunk_size, compile=compile)


def sft_micro_batches(items: list, rows: int, model, pad_id: int):
    """Collated micro-batches of `rows` trajectories, shortest first: rows of like length share a pad length,
    so a batch of mixed lengths costs fewer padded tokens (measured: bench/sft_microbatch.py)."""
    items, rows = sorted(items, key=lambda t: len(t.token_ids)), max(1, rows)
    for i in range(0, len(items), rows):
        yield rollout.collate(items[i:i + rows], model, pad_id)


def sft_backward(model, items: list, rows: int, pad_id: int, loss_chunk: int | None = None, tdam_tokenizer=None,
                 compile: bool = True, counts: dict | None = None) -> tuple[torch.Tensor, int]:
    """Backward of the batch's SFT loss (token mean over all its policy tokens) through micro-batches of
    `rows`: each micro-batch's token mean weighted by its share n_i / N of the tokens, so the gradients add
    up to those of one forward over the whole batch. loss_chunk: token_loss's chunk (None: its own rule).
    tdam_tokenizer: TDAM masks on (spans found from the text; rows without an answer counted in `counts`).
    Returns (the batch loss, detached; N)."""
    batches = list(sft_micro_batches(items, rows, model, pad_id))
    n_tok = max(1, sum(int(policy_mask(b["roles"]).sum()) for b in batches))   # sft_loss's own token count
    parts = []
    for batch in batches:
        spec = tdam_spec(batch, tdam_tokenizer, model.config.video_token_id, counts) if tdam_tokenizer else None
        micro, n = sft_loss(model, batch, loss_chunk, None, compile, spec)
        (micro * (n / n_tok)).backward()
        parts.append(micro.detach() * (n / n_tok))
    return torch.stack(parts).sum(), n_tok


@dataclasses.dataclass
class SFTSettings:
    steps: int = 600
    batch: int = 8
    micro_batch: int = 2
    lr: float = 2e-3
    tdam_ratio: float = 0.1
    loss_chunk: int = 0                  # token_loss's chunk; 0: its own rule (_auto_chunk)
    compile: bool = False


def run_sft(run: "Run", model, items: list, optimizer, s: SFTSettings, pad_id: int, tokenizer,
            start: int = 0) -> None:
    """SFT steps start+1 .. s.steps: a batch drawn per step (per rank), TDAM on a fraction of batches, AdamW
    with warmup + cosine, a checkpoint every run.save_every steps and at the end."""
    model.train()
    for step in tqdm(range(start + 1, s.steps + 1), desc="sft", disable=run.rank != 0, initial=start, total=s.steps):
        t0 = time.time()
        lr = set_lr(optimizer, get_lr(step - 1, s.steps, s.lr, warmup_steps=min(10, s.steps // 10)))
        rng = random.Random(f"sft:{run.seed}:{step}:{run.rank}")   # string seeds: draws independent across steps
        batch = [items[rng.randrange(len(items))] for _ in range(s.batch)]
        tdam = rng.random() < s.tdam_ratio
        loss, n_tok = sft_backward(model, batch, s.micro_batch, pad_id, s.loss_chunk or None, tokenizer if tdam else None,
                                   s.compile, run.counters)
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
# 5. The RL step

@dataclasses.dataclass
class GRPOSettings:
    """The knobs of one PARA-GRPO / VTGR step (flags of the same names; docs/method.md §5)."""
    recipe: str = "combined"
    anchoring: str = "sequence"          # sequence | token | none
    released_scoring: bool = False
    group_size: int = 8
    prompts_per_step: int = 4
    gating: bool = False
    gating_choices: tuple = (4, 8, 16, 32, 64)
    dynamic_sampling: bool = False
    max_draws: int = 4                   # dynamic sampling: rollout rounds per step at most
    shaping: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False           # ParaVT: R -= kl_coef * sum_t k1_t before the advantages
    mask_truncated: bool = True
    train_subagents: bool = False
    ppo_epochs: int = 1
    micro_batch: int = 8
    clip_low: float = 0.2
    clip_high: float = 0.3
    temperature: float = 0.7             # the rollout's T; every log-prob in the loss uses it too
    logprob_chunk: int = 1024            # token_logprobs' chunk (old / reference log-probs, no grad)
    loss_chunk: int = 0                  # token_loss's chunk; 0: its own rule (_auto_chunk)
    compile: bool = False


@dataclasses.dataclass
class Groups:
    """What a step's rollouts leave for the update and the log."""
    trajs: list                          # every sampled trajectory of the step (all draws)
    comps: list                          # their reward components
    rewards: torch.Tensor                # (n,) total rewards, KL folded in when asked
    items: list                          # (trajectory, advantage, components) kept for the update
    draws: int                           # rollout rounds it took
    zero_var_frac: float                 # of the groups drawn


def sequence_kl(model, ref_model, trajs: list, s: GRPOSettings, pad_id: int) -> list[float]:
    """sum_t k1_t = sum_t (log pi(o_t) - log pi_ref(o_t)) over each trajectory's policy tokens, at temperature T
    (0 for a trajectory that cannot be collated): ParaVT's per-token KL folded into the reward (verl's
    use_kl_in_reward), R_i <- R_i - beta sum_t k1_t, before the group advantages."""
    out = [0.0] * len(trajs)
    ok = [i for i, t in enumerate(trajs) if t.error is None and t.token_ids and trainable(t, model.config.video_token_id)]
    for j in range(0, len(ok), s.micro_batch):
        idx = ok[j:j + s.micro_batch]
        b = rollout.collate([trajs[i] for i in idx], model, pad_id, share_videos=True)
        with torch.no_grad():
            lp = forward_logprobs(model, b, s.logprob_chunk, s.temperature, compile=s.compile)
            ref = forward_logprobs(ref_model, b, s.logprob_chunk, s.temperature, compile=s.compile)
        k1 = (kl_penalty(lp, ref, "k1") * policy_mask(b["roles"]).to(lp.device)).sum(1)
        for i, v in zip(idx, k1.tolist()):
            out[i] = v
    return out


def draw_prompts(records: list, s: GRPOSettings, seed: int, rank: int, step: int, draw: int = 0) -> tuple[list, list]:
    """The prompts of a step's draw on a rank, and their overview sizes: K gated per prompt (the same K for its
    whole group) or None (the rollout's own rule). Seeded by (seed, step, rank, draw) alone, so a resumed run
    draws the same prompts and the next step's can be prefetched."""
    rng = random.Random(f"rl:{seed}:{step}:{rank}" + (f":{draw}" if draw else ""))
    recs = [records[rng.randrange(len(records))] for _ in range(s.prompts_per_step)]
    return recs, [rewards.gate_nframes(r["id"], step, s.gating_choices, seed=seed) if s.gating else None for r in recs]


def collect_groups(run: "Run", model, ref_model, processor, records: list, video_root: str,
                   cfg: rollout.RolloutConfig, s: GRPOSettings, step: int, pad_id: int,
                   pool: video.DecodePool | None = None) -> Groups:
    """Roll out and score groups for one step. Without dynamic sampling: one draw of s.prompts_per_step prompts.
    With it (DAPO, arXiv 2503.14476): groups whose rewards are all equal carry no signal and are dropped, and
    more prompts are drawn until the batch holds s.prompts_per_step groups with signal or s.max_draws rounds
    were rolled out. The caller holds the full weights (one all-gather for every draw of the step)."""
    G, video_id = s.group_size, model.config.video_token_id
    trajs, comps, R, items, n_groups, n_zero = [], [], [], [], 0, 0
    draws = 0
    while draws < (s.max_draws if s.dynamic_sampling else 1):
        recs, ks = draw_prompts(records, s, run.seed, run.rank, step, draws)
        out = rollout.run_agent(model, processor, recs, video_root, cfg,
                                seed=run.seed * 1_000_003 + step * 101 + run.rank + draws * 7_919, nframes=ks, pool=pool)
        draws += 1
        scored = [rewards.score_trajectory(t, recs[i // G], s.recipe, s.anchoring, s.released_scoring)
                  for i, t in enumerate(out)]
        r = torch.tensor([x for x, _ in scored])
        zero = rewards.zero_variance_groups(r, G)        # on the task reward, before any KL term
        if s.kl_in_reward and s.kl_coef:
            r = r - s.kl_coef * torch.tensor(sequence_kl(model, ref_model, out, s, pad_id))
        adv = rewards.group_advantages(r, G, shaping=s.shaping)
        keep = torch.tensor([t.error is None and t.token_ids != [] and trainable(t, video_id) for t in out])
        if s.mask_truncated:
            keep &= torch.tensor([not (t.truncated or t.hit_turn_limit) for t in out])
        for g in range(len(recs)):
            n_zero += bool(zero[g])
            if s.dynamic_sampling and (zero[g] or n_groups >= s.prompts_per_step):
                continue
            n_groups += 1
            items += [(out[i], float(adv[i]), scored[i][1]) for i in range(g * G, (g + 1) * G) if keep[i]]
        trajs += out
        comps += [c for _, c in scored]
        R.append(r)
        if not s.dynamic_sampling or n_groups >= s.prompts_per_step:
            break
    if s.train_subagents:
        items += [(sub, a, c) for t, a, c in list(items) for sub in t.subagents if trainable(sub, video_id)]
    return Groups(trajs, comps, torch.cat(R), items, draws, n_zero / max(1, len(trajs) // G))


def anchor_credit(input_ids: torch.Tensor, tokenizer, anchors: list[float]) -> torch.Tensor:
    """Token-level exploration anchoring: (B, L-1) extra advantage ANCHOR_WEIGHT * anchor_b on the positions that
    predict a token covering a closing tag (</think>, </tool_call>, </answer>), found in the decoded text
    however the tokenizer splits the tag (model.tag_token_mask: one token in the tiny tokenizer, '</', 'answer',
    '>' on Qwen's); 0 elsewhere. The loss reads it on the policy's own tokens only."""
    tags = model_lib.tag_token_mask(tokenizer, input_ids)[:, 1:]                       # (B, L-1) bool
    return rewards.ANCHOR_WEIGHT * torch.tensor(anchors, dtype=torch.float32)[:, None] * tags


def policy_update(model, ref_model, optimizer, items: list, s: GRPOSettings, pad_id: int, tokenizer,
                  world: int, filler=None, step_fn=None) -> tuple[float | None, dict]:
    """GRPO update on the kept trajectories: s.ppo_epochs passes of micro-batches, token-mean over the policy
    tokens of ALL ranks (each rank normalises by N_global / world, and FSDP averages the ranks' gradients).
    With several epochs the old log-probs are recomputed first by a no-grad forward (with one, they equal the
    current ones). A rank with nothing to learn still runs zero-weight passes on `filler` (any trajectory it
    sampled), so every rank joins the same collectives; the step is skipped only when no rank has a token.
    `step_fn(loss)` clips, checks and applies the gradients (Run.optimizer_step). Returns (grad norm, stats)."""
    chunks = [items[i:i + s.micro_batch] for i in range(0, len(items), s.micro_batch)]
    batches = [rollout.collate([t for t, _, _ in c], model, pad_id, share_videos=True) for c in chunks]
    advs = []
    for c, b in zip(chunks, batches):
        a = torch.tensor([x for _, x, _ in c])[:, None].expand(-1, b["input_ids"].shape[1] - 1).clone()
        if s.anchoring == "token":       # anchor credit on the closing-tag tokens only (docs/method.md §4.1)
            a += anchor_credit(b["input_ids"], tokenizer, [cm["anchor"] for _, _, cm in c])
        advs.append(a)
    n_local = sum(int(policy_mask(b["roles"]).sum()) for b in batches)
    n_global = all_sum(n_local) if world > 1 else n_local
    if n_global == 0:                                   # no rank has a token to learn from: skip, all together
        return None, {"clip_frac": 0.0, "kl": 0.0, "loss": 0.0}
    use_ref = ref_model is not None and s.kl_coef > 0 and not s.kl_in_reward
    with torch.no_grad(), full_weights(model):
        old = [forward_logprobs(model, b, s.logprob_chunk, s.temperature, compile=s.compile)
               if s.ppo_epochs > 1 else None for b in batches]
        ref = [forward_logprobs(ref_model, b, s.logprob_chunk, s.temperature, compile=s.compile)
               if use_ref else None for b in batches]
    norm = n_global / world                             # FSDP averages over ranks: sum_all / N_global overall
    n_pad = (all_max(len(batches)) if world > 1 else len(batches)) - len(batches)
    if n_pad and not batches:                           # nothing kept here: zero-weight passes on a filler row
        fb = rollout.collate([filler], model, pad_id)
        fill = (fb, None, torch.zeros(1, fb["input_ids"].shape[1] - 1), None)
    else:
        fill = (batches[-1], old[-1], advs[-1], ref[-1]) if batches else None
    gn, stats = None, {"clip_frac": 0.0, "kl": 0.0}

    def loss_of(b, o, a, r):                         # the fused loss: gradients formed in its forward
        hidden, targets, mask = forward_hidden(model, b)
        return grpo_token_loss(hidden, model.lm_head.weight, targets, o, a, mask, clip_low=s.clip_low,
                               clip_high=s.clip_high, kl_coef=0.0 if s.kl_in_reward else s.kl_coef, ref_logprobs=r,
                               kl_estimator=s.kl_estimator, num_tokens=norm, temperature=s.temperature,
                               chunk_size=s.loss_chunk or None, compile=s.compile)

    for epoch in range(s.ppo_epochs):
        total = torch.zeros(())
        for b, o, a, r in zip(batches, old, advs, ref):
            loss, st = loss_of(b, o, a, r)
            loss.backward()
            total = total + loss.detach().cpu()
            for k in stats:
                stats[k] += float(st.get(k, 0.0)) * st["n_tokens"] / max(1, n_local) / s.ppo_epochs
        for _ in range(n_pad):                          # zero-weight passes: no gradient, matching collectives
            (loss_of(*fill)[0] * 0.0).backward()
        total = all_sum_float(float(total)) / world if world > 1 else float(total)
        gn = step_fn(torch.tensor(total))
        stats["loss"] = total                           # the last epoch's token-mean loss, all ranks
    return gn, stats


def rollout_metrics(trajs: list, comps: list[dict], records: dict | None = None) -> dict:
    """Means over a step's trajectories: accuracy, format compliance, tool use (ParaVT's curves); with the
    records by id, on the synthetic task, also the accuracy on the questions whose overview needed the tool
    (`acc_tool_needed`) and on those it did not (`acc_tool_not_needed`, data.tool_needed)."""
    ok = [t for t in trajs if t.error is None]
    n = max(1, len(ok))
    calls = sum(t.n_calls for t in ok)
    tool_turns = sum(t.n_tool_turns for t in ok)
    out = {f"reward/{k}": sum(c[k] for c in comps) / max(1, len(comps)) for k in (comps[0] if comps else {})}
    out.update(accuracy=out.get("reward/acc", 0.0),
               format_compliance=sum(rewards.format_compliant(t.text) for t in ok) / n,
               tool_call_ratio=sum(t.n_calls > 0 for t in ok) / n,
               calls_per_turn=calls / max(1, tool_turns), turns=tool_turns / n,
               tool_failure_rate=sum(t.tool_failures for t in ok) / max(1, calls),
               truncated=sum(t.truncated or t.hit_turn_limit for t in ok) / n,
               mean_k=sum(t.nframes for t in ok) / n, bad_samples=len(trajs) - len(ok))
    if records is not None:      # sums and counts, the same keys on every rank (split_accuracy divides)
        need = [data.tool_needed(records[t.record_id], t.nframes) if t.record_id in records else None for t in trajs]
        for name, want in (("tool_needed", True), ("tool_not_needed", False)):
            accs = [c["acc"] for c, nd in zip(comps, need) if nd is want]
            out.update({f"{name}_hits": sum(accs), f"{name}_n": len(accs)})
    return out


def split_accuracy(m: dict) -> dict:
    """rollout_metrics' (all-rank) sums -> acc_tool_needed / acc_tool_not_needed, left out where no question was."""
    for name in ("tool_needed", "tool_not_needed"):
        hits, n = m.pop(f"{name}_hits", 0.0), m.pop(f"{name}_n", 0.0)
        if n:
            m[f"acc_{name}"] = hits / n
    return m


def run_rl(run: "Run", model, ref_model, processor, optimizer, records: list, video_root: str,
           cfg: rollout.RolloutConfig, s: GRPOSettings, steps: int, lr: float, warmup_steps: int, pad_id: int,
           start: int = 0, eval_every: int = 0, evaluate=None, pool: video.DecodePool | None = None) -> None:
    """RL steps start+1 .. steps: collect_groups, policy_update, one metrics row per step, checkpoints, and the
    held-out evaluation every `eval_every` steps (`evaluate(model, name) -> metrics`). With a decode pool the
    next step's overviews decode in its threads while this step trains (first draw; more draws of dynamic
    sampling decode when they come), and each row logs decode seconds, wait seconds and the cache hit rate."""
    failed, by_id = 0, {str(r["id"]): r for r in records}
    for step in tqdm(range(start + 1, steps + 1), desc="rl", disable=run.rank != 0, initial=start, total=steps):
        t0 = time.time()
        step_lr = set_lr(optimizer, get_lr(step - 1, steps, lr, warmup_steps))
        model.eval()
        with full_weights(model):
            g = collect_groups(run, model, ref_model, processor, records, video_root, cfg, s, step, pad_id, pool)
        if pool is not None and step < steps:           # the next step's overviews decode while this one trains
            upcoming, ks = draw_prompts(records, s, run.seed, run.rank, step + 1)
            rollout.prefetch(pool, upcoming, video_root, cfg, rollout.video_factor(processor), ks)
        failed += sum(t.error is not None for t in g.trajs)
        run.counters["bad_samples"] += sum(t.error is not None for t in g.trajs)
        for t in g.trajs[::s.group_size]:
            run.warn_sample(t, step)
        if failed > run.max_bad_fraction * (step - start) * len(g.trajs) and step - start > 5:
            raise RuntimeError(f"more than {run.max_bad_fraction:.0%} of samples failed by step {step}: "
                               f"see the skipped-sample messages above")
        model.train()
        filler = next((t for t in g.trajs if t.error is None and t.token_ids and trainable(t, model.config.video_token_id)),
                      None)
        gn, stats = policy_update(model, ref_model, optimizer, g.items, s, pad_id, processor.tokenizer, run.world, filler,
                                  lambda loss: run.optimizer_step(model, optimizer, loss, "rl", step,
                                                                  [t.record_id for t, _, _ in g.items]))
        m = rollout_metrics(g.trajs, g.comps, by_id)
        if pool is not None:
            ps = pool.stats(reset=True)
            m.update(decode_s=ps["decode_seconds"], decode_wait_s=ps["wait_seconds"],
                     frame_cache_hit_rate=pool.cache.stats()["hit_rate"] if pool.cache else 0.0)
        m.update(reward=float(g.rewards.mean()), zero_var_frac=g.zero_var_frac, kept=len(g.items), draws=g.draws,
                 grad_norm=float("nan") if gn is None else gn, lr=step_lr, step_time=time.time() - t0,
                 tokens_per_s=sum(len(t.token_ids) for t in g.trajs) / (time.time() - t0), **stats)
        m = split_accuracy(all_mean(m, run.world))
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
            result = evaluate(model, f"rl-{step:06d}")
            run.log("eval", step, result)
            if run.is_best(result):
                if not saved:
                    run.save("rl", step, model, optimizer)
                run.mark_best("rl", step, result)
    model.eval()


# -----------------------------------------------------------------------------
# 6. main

def main(rank: int, args) -> dict:
    """One rank of a run: model and data, SFT, RL, the held-out evaluation; returns the summary."""
    t_start = time.time()
    rank, world, device = setup_distributed(rank, args.gpus, args.device, args.threads)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    run = Run(args.run_dir, rank, world, args.seed, args.save_every, args.keep_last, args.strict,
              args.max_bad_fraction, args.report_to)
    print0(rank, json.dumps({"settings": vars(args), "world": world, "device": str(device)}))
    ckpt = latest_checkpoint(args.run_dir) if args.resume else None
    model, processor = model_lib.load_model(ckpt or args.model, device=device, seed=args.seed,
                                            tiny_corpus=rollout.prompt_corpus())
    pad_id = processor.tokenizer.pad_token_id
    run.processor = processor
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if world > 1:
        shard_model(model)
    if args.data:
        train_recs, held, video_root, held_note = load_data(args.data, args.eval_data, args.video_root, args.held_out,
                                                            args.seed, args.max_bad_fraction, lambda m: print0(rank, m))
    else:
        train_recs, held, video_root = synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration,
                                                      args.task_mix, os.environ.get("PARAVT_CACHE", "cache"))
        held_note = "synthetic"
    run.static["held_out"] = held_note
    cfg = rollout_config(args)
    state = run.resume(ckpt, model) if ckpt else None
    stage0, step0 = (state["stage"], state["step"]) if state else (None, 0)
    evaluate = lambda m, name: evaluate_held_out(m, processor, held, video_root, cfg, run, name)
    summary = {}
    if args.stage == "all" and not state:
        summary["before"] = evaluate(model, "before")
    if args.stage in ("all", "sft") and stage0 != "rl":
        items, n_bad = sft_examples(train_recs, processor, video_root, cfg, sft_data=args.sft_data, seed=args.seed,
                                    gated_choices=args.gating_choices if args.sft_gated_overviews else [],
                                    always_call=args.always_call, direct_crop=args.direct_crop,
                                    budget_fraction=args.sft_budget_fraction, keep_bad_calls=args.keep_bad_calls, max_bad_fraction=args.max_bad_fraction,
                                    log=lambda m: print0(rank, m))
        run.counters["bad_samples"] += 0 if state else n_bad          # a resumed run counted them before
        optimizer = make_optimizer(model, args.sft_lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "sft")
        run_sft(run, model, items, optimizer, sft_settings(args), pad_id, processor.tokenizer, start=step0 if stage0 == "sft" else 0)
        if args.stage == "all":
            summary["sft"] = evaluate(model, "sft")
    if args.stage in ("all", "rl"):
        optimizer = make_optimizer(model, args.lr, args.vision_lr_scale)
        run.load_optimizer(ckpt, model, optimizer, state, "rl")
        ref_model = reference_model(args.run_dir, args.model, args.stage == "all", device, args.seed) \
            if args.kl_coef > 0 else None
        with video.DecodePool(args.decode_workers, args.decode_timeout,
                              video.FrameCache(int(args.frame_cache_gb * 2 ** 30), disk_dir=args.frame_cache)) as pool:
            run_rl(run, model, ref_model, processor, optimizer, train_recs, video_root, cfg, grpo_settings(args),
                   args.rl_steps, args.lr, args.warmup_steps, pad_id, start=step0 if stage0 == "rl" else 0,
                   eval_every=args.eval_every, evaluate=evaluate, pool=pool)
    if args.stage == "all" or args.final_eval:
        summary["after"] = evaluate(model, "final")
        summary["seconds"] = round(time.time() - t_start, 1)
        if rank == 0:
            print_summary(summary, plot_run(args.run_dir))
    if world > 1:
        dist.barrier()                       # no rank tears the group down while another still talks to it
        dist.destroy_process_group()
    return summary


def evaluate_held_out(model, processor, records: list, video_root: str, cfg: rollout.RolloutConfig, run: "Run",
                      name: str, report_questions: int = 8) -> dict:
    """The greedy agent on the held-out records through eval.py's runner (official-style scores plus format
    compliance, tool-call ratio, clue score, turns); predictions in RUN_DIR/eval/<name>.jsonl and a trajectory
    report of the first `report_questions` questions in RUN_DIR/report/<name>/index.html (rank 0)."""
    out = os.path.join(run.run_dir, "eval", f"{name}.rank{run.rank}.jsonl")
    if os.path.exists(out):                            # new weights: never resume another evaluation's answers
        os.remove(out)
    with full_weights(model):
        m = evaluation.evaluate(model, processor, records, video_root, cfg, bench="records", out_path=out, batch_size=8)
    if run.rank == 0 and report_questions:
        import report
        rows = evaluation.read_predictions(out)
        report.write_report(os.path.join(run.run_dir, "report", name), records, rows, metrics=m, video_root=video_root,
                            title=f"held-out evaluation: {name}", max_questions=report_questions)
    keys = ("accuracy", "miou", "r_acc", "format_compliance", "tool_call_ratio", "clue_score", "turns")
    row = {k: float(m[k]) for k in keys if isinstance(m.get(k), (int, float))}
    print0(run.rank, f"eval {name}: " + json.dumps(row))
    return row


def print_summary(summary: dict, png: str | None) -> None:
    cols = [s for s in ("before", "sft", "after") if s in summary]
    print(f"{'':18s}" + "".join(f"{ {'sft': 'SFT', 'after': 'final'}.get(s, s):>10s}" for s in cols))
    for k in summary["after"]:
        print(f"{k:18s}" + "".join(f"{summary[s].get(k, float('nan')):10.3f}" for s in cols))
    print("(accuracy and miou in %, official-style scoring; r_acc is the reward's 0-1 accuracy, grounding IoU included)")
    print(f"curves: {png}")
    print(json.dumps(summary))


# -----------------------------------------------------------------------------
# 7. Plumbing: the run (metrics, checkpoints), data, settings, distributed helpers, arguments, launcher

STAGE_ORDER = {"sft": 0, "rl": 1}


class Run:
    """A run directory as the loops see it: metrics rows, counters kept across resumes, atomic checkpoints
    (torch.distributed.checkpoint for model + optimizer, resumable on any number of ranks, and a Hugging Face
    export of the weights beside it), --keep-last pruning, the best-by-eval checkpoint, skip-and-count."""

    def __init__(self, run_dir: str, rank: int, world: int, seed: int, save_every: int, keep_last: int,
                 strict: bool, max_bad_fraction: float, report_to: str = "none"):
        self.run_dir, self.rank, self.world, self.seed = run_dir, rank, world, seed
        self.save_every, self.keep_last, self.strict = save_every, keep_last, strict
        self.max_bad_fraction = max_bad_fraction
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.counters = {"skipped_steps": 0, "bad_samples": 0}
        self.static, self.best, self.warned, self.processor = {}, None, set(), None
        self.tracker = make_tracker(report_to, run_dir) if rank == 0 else None
        os.makedirs(run_dir, exist_ok=True)

    def log(self, stage: str, step: int, row: dict) -> None:
        """One JSON line per step, flushed at once (a killed run loses at most the step in flight)."""
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"stage": stage, "step": step, **row, **self.counters, **self.static}) + "\n")
        if self.tracker is not None:
            self.tracker(stage, step, row)

    def optimizer_step(self, model, optimizer, loss: torch.Tensor, stage: str, step: int, sample_ids: list) -> float:
        """Clip to norm 1 and step; a non-finite loss or gradient skips the step (counted), or raises with --strict.
        Returns the gradient norm (nan when skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            msg = f"non-finite loss/grad at {stage} step {step} (samples {sample_ids[:8]})"
            if self.strict:
                raise FloatingPointError(msg)
            print0(self.rank, "skipped:", msg)
            self.counters["skipped_steps"] += 1
            optimizer.zero_grad(set_to_none=True)
            return float("nan")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)                      # .item() sync, once per step

    def warn_sample(self, traj, step: int) -> None:
        if traj.error is not None and traj.record_id not in self.warned:
            self.warned.add(traj.record_id)
            tqdm.write(f"skipped sample {traj.record_id} (rl step {step}, rank {self.rank}): {traj.error}")

    def save(self, stage: str, step: int, model, optimizer) -> str:
        path = save_checkpoint(self.run_dir, step, model, self.processor, optimizer,
                               {"stage": stage, "counters": self.counters}, rank=self.rank, world=self.world)
        if self.rank == 0 and self.keep_last > 0:
            prune_checkpoints(self.run_dir, self.keep_last)
        return path

    def resume(self, ckpt: str, model) -> dict:
        """The trainer state of `ckpt` (the weights were loaded from its export); metrics after it are dropped."""
        state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)   # tensors and plain data only
        self.counters.update(state.get("counters", {}))
        torch.set_rng_state(state["rng_torch"])
        random.setstate(state["rng_random"])
        if self.rank == 0:
            truncate_metrics(self.metrics_path, state["stage"], state["step"])
        print0(self.rank, f"resumed from {ckpt} ({state['stage']} step {state['step']})")
        return state

    def load_optimizer(self, ckpt: str | None, model, optimizer, state: dict | None, stage: str) -> None:
        """AdamW's moments from the checkpoint's distributed state, when it was saved in this stage."""
        if ckpt and state and state["stage"] == stage:
            load_train_state(ckpt, model, optimizer)

    def is_best(self, result: dict) -> bool:
        score = result.get("r_acc", result.get("accuracy"))
        return score is not None and (self.best is None or score > self.best[1])

    def mark_best(self, stage: str, step: int, result: dict) -> None:
        self.best = (f"ckpt-{stage}-{step:06d}", result.get("r_acc", result.get("accuracy")))
        if self.rank == 0:
            atomic_write_json(os.path.join(self.run_dir, "best.json"), {"checkpoint": self.best[0], "eval": result})


def make_tracker(report_to: str, run_dir: str):
    """--report-to: metrics also go to TensorBoard or Weights & Biases (imported only when asked for)."""
    if report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        return lambda stage, step, row: [writer.add_scalar(f"{stage}/{k}", v, step) for k, v in row.items()
                                         if isinstance(v, (int, float))] and writer.flush()
    if report_to == "wandb":
        import wandb
        wandb.init(dir=run_dir, config={"run_dir": run_dir})
        return lambda stage, step, row: wandb.log({f"{stage}/{k}": v for k, v in row.items()
                                                   if isinstance(v, (int, float))})
    return None


def atomic_write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def save_checkpoint(run_dir: str, step: int, model, processor, optimizer, extra: dict, rank: int = 0,
                    world: int = 1) -> str:
    """RUN_DIR/ckpt-<stage>-<step>: `train_state/` (torch.distributed.checkpoint: model and optimizer, each rank
    its shard, loadable on any number of ranks), the Hugging Face export (model.safetensors + config + processor,
    gathered on rank 0) and `trainer.pt` (step, counters, RNG: tensors and plain data, no pickled code).
    Atomic: everything goes to `.tmp`, and one rename makes it visible; trainer.pt is written last."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    final = os.path.join(run_dir, f"ckpt-{extra['stage']}-{step:06d}")   # SFT step 2 and RL step 2 are two models
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():             # one process, no process group: DCP says so, rightly
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "train_state"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if world > 1 else None
    if rank == 0:
        if full is None:
            model_lib.save_model(model, processor, tmp)
        else:
            model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
            processor.save_pretrained(tmp)
        torch.save({"step": step, "rng_torch": torch.get_rng_state(), "rng_random": random.getstate(),
                    **{k: v for k, v in extra.items()}}, os.path.join(tmp, "trainer.pt"))
        shutil.rmtree(final + ".old", ignore_errors=True)
        if os.path.exists(final):                # saving a step again: move the old one aside whole
            os.replace(final, final + ".old")
        os.replace(tmp, final)                   # the only moment a checkpoint becomes visible
        shutil.rmtree(final + ".old", ignore_errors=True)
    barrier(world)
    return final


def load_train_state(ckpt: str, model, optimizer) -> None:
    """Model and optimizer from a checkpoint's `train_state/`, resharded to this run's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    path = os.path.join(ckpt, "train_state")
    if not os.path.isdir(path):
        raise ValueError(f"{ckpt} has no train_state/ (written by an older train.py): resume needs it for AdamW's state")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # partial: a parameter that never had a gradient has no AdamW state in the file and keeps fresh zeros
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def checkpoints(run_dir: str) -> list[tuple[int, int, str]]:
    """(stage order, step, name) of the complete checkpoints (a `.tmp` dir or one without trainer.pt is not)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((STAGE_ORDER[m[1]], int(m[2]), d) for d in os.listdir(run_dir)
                  if (m := re.fullmatch(r"ckpt-(sft|rl)-(\d{6})", d)) and os.path.exists(os.path.join(run_dir, d, "trainer.pt")))


def latest_checkpoint(run_dir: str) -> str | None:
    """Newest complete checkpoint, RL after SFT, then by step."""
    done = checkpoints(run_dir)
    return os.path.join(run_dir, done[-1][2]) if done else None


def prune_checkpoints(run_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints of each stage; the last SFT checkpoint (the RL start and
    reference) and the best-by-eval one (best.json) are always kept. Returns the deleted names."""
    best = None
    if os.path.exists(os.path.join(run_dir, "best.json")):
        best = json.load(open(os.path.join(run_dir, "best.json"))).get("checkpoint")
    done = checkpoints(run_dir)
    deleted = []
    for order in STAGE_ORDER.values():
        stage = [d for o, _, d in done if o == order]
        for d in stage[:-keep_last] if keep_last else []:
            if d != best:
                shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
                deleted.append(d)
    return deleted


def truncate_metrics(path: str, stage: str, step: int) -> None:
    """On resume: drop rows logged after the checkpoint, so no step appears twice."""
    if not os.path.exists(path):
        return
    rows = [json.loads(l) for l in open(path) if l.strip()]
    order = {**STAGE_ORDER, "eval": STAGE_ORDER["rl"]}
    keep = [r for r in rows if (order.get(r.get("stage"), 0), r.get("step", 0)) <= (order[stage], step)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


def plot_run(run_dir: str) -> str | None:
    """RUN_DIR/curves.png from metrics.jsonl: the SFT loss, then reward, format compliance and tool-call ratio
    against RL step (ParaVT's training curves): faint raw points, a moving average, ratios on a fixed [0, 1]
    axis, held-out evaluations as markers. None when the run logged no step (e.g. --rl-steps 0)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
    if not any(r.get("stage") in ("sft", "rl") for r in rows):
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("sft", "loss", None), ("rl", "reward", None), ("rl", "format_compliance", (0, 1.02)),
              ("rl", "tool_call_ratio", (0, 1.02))]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.2))
    for ax, (stage, key, ylim) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get("stage") == stage and isinstance(r.get(key), (int, float))]
        if pts:
            x, y = np.array(pts, dtype=float).T
            w = max(1, len(y) // 10)
            smooth = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(x, y, ".", alpha=0.25, color="C0")
            ax.plot(x[w - 1:], smooth, color="C0", label=f"mean of {w}")
        evals = [(r["step"], r[key]) for r in rows if r.get("stage") == "eval" and isinstance(r.get(key), (int, float))]
        if evals:
            ax.plot(*zip(*evals), "D", color="C3", label="held-out")
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(f"{stage}: {key}")
        ax.set_xlabel(f"{stage.upper()} step")
        if pts or evals:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ----- data and settings

def synthetic_data(seed: int, n_train: int, n_eval: int, duration: float, mix: str | None,
                   cache: str) -> tuple[list, list, str]:
    """The synthetic needle task: a training split (seed 1000 + s) and a held-out one (2000 + s), disjoint."""
    root = os.path.join(cache, "synthetic")
    mix = data.parse_mix(mix)
    train = data.make_split(root, n_train, seed=1000 + seed, mix=mix, duration=duration)
    held = data.make_split(root, n_eval, seed=2000 + seed, mix=mix, duration=duration)
    return train, held, root


def split_held_out(records: list, n: int, seed: int) -> tuple[list, list]:
    """(train, held-out): `n` records drawn with `seed` are held out, and training never draws them."""
    if len(records) < 2:
        raise ValueError(f"--data has {len(records)} usable record(s): nothing to hold out; pass --eval-data")
    n = max(1, min(n, len(records) // 5 or 1))
    order = list(range(len(records)))
    random.Random(f"held-out:{seed}").shuffle(order)
    held = set(order[:n])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def load_data(data_path: str | None, eval_path: str | None, video_root: str | None, held_out: int, seed: int,
              max_bad_fraction: float, log=print) -> tuple[list, list, str, str]:
    """(training records, held-out records, video root, where the held-out set came from): the prompt records
    of `data_path` with `eval_path` held out, or `held_out` of them split off (never drawn for training)."""
    train, errors = data.load_records(data_path, video_root, max_bad_fraction)
    for e in errors[:5]:
        log(f"skipped record: {e}")
    if eval_path:
        return train, data.load_records(eval_path, video_root)[0], video_root, eval_path
    train, held = split_held_out(train, held_out, seed)
    note = f"split: {len(held)} of --data's records (seed {seed}), never drawn for training"
    log(f"held-out set: {note}")
    return train, held, video_root, note


# The embedded tiny model's settings; a real checkpoint without --preset gets paravt's (rollout.PRESETS).
TINY_DEFAULTS = dict(tool_mode="interleaved", overview_nframes=None, overview_fps=2.0, overview_max_frames=768,
                     max_turns=3, max_calls_per_turn=5, max_new_tokens=128, recipe="combined", group_size=8,
                     prompts_per_step=4, lr=1e-4, sft_lr=2e-3, clip_low=0.2, clip_high=0.3, kl_coef=0.0,
                     kl_estimator="k3", kl_in_reward=0, temperature=0.7, shaping=0, gating=None, dynamic_sampling=0,
                     mask_truncated=1, vision_lr_scale=0.0)


def rollout_config(args) -> rollout.RolloutConfig:
    extra = dict(rollout.TINY_ROLLOUT) if args.tiny else {}          # the tiny model's frame sizes
    if args.overview_nframes is not None or args.preset:             # a preset's overview rule, or the flag's
        extra["overview_nframes"] = args.overview_nframes or None     # 0 / None: the fps rule (Video-o3)
    return rollout.RolloutConfig(**{**dict(tool_mode=args.tool_mode, max_turns=args.max_turns,
                                           max_calls_per_turn=args.max_calls_per_turn,
                                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           group_size=args.group_size, overview_fps=args.overview_fps,
                                           overview_max_frames=args.overview_max_frames), **extra})


def sft_settings(args) -> SFTSettings:
    return SFTSettings(steps=args.sft_steps, batch=args.sft_batch, micro_batch=args.sft_micro_batch, lr=args.sft_lr,
                       tdam_ratio=args.tdam_ratio, loss_chunk=args.loss_chunk, compile=bool(args.compile))


def grpo_settings(args) -> GRPOSettings:
    names = {f.name for f in dataclasses.fields(GRPOSettings)}
    return GRPOSettings(**{k: v for k, v in vars(args).items() if k in names})


def reference_model(run_dir: str, model_path: str, after_sft: bool, device, seed: int):
    """The frozen reference for KL: the policy as RL began (this run's last SFT checkpoint when SFT ran before,
    else the model RL started from)."""
    sft = [d for o, _, d in checkpoints(run_dir) if o == STAGE_ORDER["sft"]]
    src = os.path.join(run_dir, sft[-1]) if sft and after_sft else model_path
    ref, _ = model_lib.load_model(src, device=device, seed=seed, tiny_corpus=rollout.prompt_corpus())
    return ref.requires_grad_(False).eval()


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
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    set_lr(optimizer, lr)
    return optimizer


def set_lr(optimizer, lr: float) -> float:
    """Every group at lr x its lr_scale (make_optimizer's); returns lr."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


# ----- distributed

def print0(rank: int, *a, **k) -> None:
    if rank == 0:
        tqdm.write(" ".join(str(x) for x in a), **k)


def die_with_parent() -> None:
    """A spawned rank dies with its launcher: the kernel sends SIGKILL when the parent goes (Linux prctl
    PR_SET_PDEATHSIG), and a watchdog thread checks the parent's pid elsewhere. Orphaned ranks would train on,
    alongside a --resume started meanwhile."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:                           # the parent died before the signal was armed
        os._exit(1)


def setup_distributed(rank: int, gpus: int | None, device: str, threads: int) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). One process: no process group. Several: nccl on CUDA, gloo on CPU."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", gpus or 1))
    if world > 1:
        if "RANK" not in os.environ:                     # spawned by this launcher (not torchrun)
            die_with_parent()
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        if use_cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=int(os.environ["RANK"]), world_size=world)
        rank = dist.get_rank()
    if threads or (world > 1 and not use_cuda):          # CPU ranks split the cores
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    return rank, world, torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")


def shard_model(model) -> None:
    """FSDP2: each decoder layer its own unit, the final norm with the lm_head (token_logprobs reads
    lm_head.weight directly), and the root (the vision tower and embeddings), which every forward enters."""
    from torch.distributed.fsdp import fully_shard
    # The root returns the visual features beside the hidden states (video_outputs.pooler_output: per-video
    # torch.split views), and the final-norm unit's output is a view on some torch versions; FSDP2 warns that an
    # in-place op on such a view would skip its hook. Nothing here writes into them (the loss slices and gathers
    # last_hidden_state out of place); tests/test_rl_correctness.py checks the 2-rank gradients against one
    # process's.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDPQwen3VLModel|FSDPQwen3VLTextRMSNorm, "
                                              r"FSDPLinear)\) returned a view tensor")
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard([model.model.language_model.norm, model.lm_head])
    fully_shard(model.model)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _all_reduce(values: list[float], op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_sum(value: int) -> int:
    return int(_all_reduce([value], dist.ReduceOp.SUM)[0])


def all_sum_float(value: float) -> float:
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def all_max(value: int) -> int:
    return int(_all_reduce([value], dist.ReduceOp.MAX)[0])


def all_mean(values: dict, world: int) -> dict:
    """Average scalar metrics across ranks (each rank rolled out its own prompts)."""
    if world == 1:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    return {k: v / world for k, v in zip(keys, _all_reduce([float(values[k]) for k in keys], dist.ReduceOp.SUM))}


@contextlib.contextmanager
def full_weights(model):
    """FSDP: all-gather every shard once and keep the full weights for a block of no-grad forwards whose
    number differs between ranks (rollouts, evaluation), so no rank waits in an all-gather that another
    never reaches; resharded on exit. A model without FSDP units passes through untouched."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model.model]
    root = [model.model] if isinstance(model.model, FSDPModule) else []
    for m in root + units:
        m.unshard()
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True, recurse=False)
        for m in root + units:
            m.reshard()


# ----- the run directory: one run at a time

class RunLock:
    """An exclusive fcntl lock on RUN_DIR/.lock for the life of the launcher: a second run on the same directory
    is refused with the holder's pid. The kernel drops the lock when the holder dies, even by SIGKILL."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise ValueError(f"{run_dir} is in use by another run (pid {holder}); wait for it, stop it, or use "
                             f"another --run-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def stale_run(run_dir: str, stage: str, resume: bool) -> str | None:
    """Why a run must not start in run_dir, or None. Without --resume, a stage whose checkpoints (or, for
    SFT, whose metrics.jsonl) are already there would append to another run's curves and leave its
    checkpoints for a later --resume to pick up; nothing is deleted for the user."""
    if resume or not os.path.isdir(run_dir):
        return None
    stages = ("sft", "rl") if stage == "all" else (stage,)
    found = sorted(d for d in os.listdir(run_dir) if re.fullmatch(rf"ckpt-({'|'.join(stages)})-\d{{6}}", d))
    if "sft" in stages and os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        found.append("metrics.jsonl")
    if not found:
        return None
    return (f"{run_dir} already holds a run ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): pass --resume "
            f"to continue it, or another --run-dir (or delete this one)")


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ----- arguments: parsed, checked and resolved once

# The embedded default (`python train.py` with no arguments): sizes chosen for a 2-core CPU
# (frame sizes and prompt settings of the tiny model: rollout.TINY_ROLLOUT).
TINY_TASK = dict(n_train=256, n_eval=48, duration=64.0)


def parse_args(argv=None) -> argparse.Namespace:
    """Flags -> the run's effective settings: every default that depends on another flag (the preset, the
    model, the recipe, the device) is settled here, and combinations that cannot work are refused."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--stage", choices=("all", "sft", "rl"), default="all",
                   help="all = the default pipeline: SFT warm start, then RL, then held-out evaluation")
    g.add_argument("--run-dir", default="runs/default", help="checkpoints, metrics.jsonl, curves.png")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --run-dir")
    g.add_argument("--seed", type=int, default=0, help="seeds the model init, the data draws and the sampling")
    g.add_argument("--strict", action="store_true", help="raise on a non-finite loss/grad instead of skipping the step")
    g.add_argument("--plot", metavar="RUN_DIR", default=None, help="only draw RUN_DIR/curves.png from its metrics.jsonl")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-last", type=int, default=3,
                   help="keep the newest N checkpoints of each stage (0 = all); the last SFT one and the best "
                        "by evaluation are always kept")
    g.add_argument("--report-to", choices=("none", "tensorboard", "wandb"), default="none",
                   help="also send the metrics there (metrics.jsonl and curves.png are always written)")
    g.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", type=int, default=None, help="processes on this node (default: visible CUDA devices, or 1)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto = cuda when visible")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads per process (0 = torch's default; 1 is far faster on a busy or shared CPU)")
    g.add_argument("--compile", type=int, default=None, help="torch.compile the log-prob kernels (default: 1 on CUDA, 0 on CPU)")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward (large models)")
    g.add_argument("--decode-workers", type=int, default=2, help="threads decoding overviews and crops (per rank)")
    g.add_argument("--decode-timeout", type=float, default=120.0,
                   help="seconds a video decode may take before the sample is an error (never a hang)")
    g.add_argument("--frame-cache-gb", type=float, default=2.0, help="in-memory cache of decoded overviews (per rank)")
    g.add_argument("--frame-cache", metavar="DIR", default=None,
                   help="also keep decoded overviews on disk here (written atomically, size-capped)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a Qwen3-VL / Qwen2.5-VL checkpoint dir")
    g.add_argument("--preset", choices=sorted(rollout.PRESETS), default=None,
                   help="a paper's recipe (overview, limits, clip, KL, temperature, learning rates); default: "
                        "paravt for a real checkpoint, the tiny settings for the embedded model")
    g.add_argument("--data", default=None, help="RL prompt records JSONL (docs/data.md); default: the synthetic task")
    g.add_argument("--sft-data", default=None, help="SFT trajectory records JSONL (docs/data.md); needs --data")
    g.add_argument("--video-root", default=None, help="folder the records' video paths are relative to (needs --data)")
    g.add_argument("--eval-data", default=None, help="held-out prompt records (default: --held-out records split off --data)")
    g.add_argument("--held-out", type=int, default=32,
                   help="with --data and no --eval-data: records held out of training for evaluation (at most 20%%)")
    g.add_argument("--max-bad-fraction", type=float, default=0.2, help="stop if more than this fraction of samples is bad")
    g.add_argument("--keep-bad-calls", action="store_true",
                   help="train on SFT trajectories whose tool calls the environment would refuse (default: skip them)")
    g.add_argument("--n-train", type=int, default=TINY_TASK["n_train"], help="synthetic task: training prompts")
    g.add_argument("--n-eval", type=int, default=TINY_TASK["n_eval"], help="synthetic task: held-out prompts")
    g.add_argument("--task-duration", type=float, default=TINY_TASK["duration"], help="synthetic task: video seconds")
    g.add_argument("--task-mix", default=None, help="synthetic task: kind=weight,... (default: data.DEFAULT_MIX)")
    g.add_argument("--direct-crop", type=float, default=0.0,
                   help="synthetic SFT: chance the oracle crops a direct clue it could read off the overview")
    g.add_argument("--sft-budget-fraction", type=float, default=0.1,
                   help="synthetic SFT: chance a trajectory that calls the tool is also recorded at a smaller tool-turn "
                        "budget (forced answer from what was seen), so budget-limited evaluation finds a trained model")
    g.add_argument("--sft-gated-overviews", type=int, default=0,
                   help="synthetic SFT: each record also with a K-frame overview, K drawn from --gating-choices")
    g.add_argument("--always-call", action="store_true", help="SFT oracle calls the tool on every question (a strong tool prior)")
    g = p.add_argument_group("SFT")
    g.add_argument("--sft-steps", type=int, default=600, help="SFT optimizer steps")
    g.add_argument("--sft-batch", type=int, default=8, help="trajectories per SFT step (per rank)")
    g.add_argument("--sft-micro-batch", type=int, default=2,
                   help="rows per forward, grouped by length within the batch (same gradient, fewer pad tokens)")
    g.add_argument("--sft-lr", type=float, default=None, help="SFT peak learning rate (tiny: 2e-3; presets: 1e-5)")
    g.add_argument("--tdam-ratio", type=float, default=0.1, help="fraction of SFT batches trained with TDAM masks")
    g.add_argument("--vision-lr-scale", type=float, default=None,
                   help="learning rate of the vision tower, as a multiple of --sft-lr / --lr (SFT and RL; 0 freezes "
                        "it); tiny: 0 (its random features keep colours apart), else 1.0")
    g = p.add_argument_group("RL (defaults: the preset's, or the tiny model's)")
    g.add_argument("--rl-steps", type=int, default=20, help="RL optimizer steps")
    g.add_argument("--recipe", choices=rewards.RECIPES, default=None, help="reward recipe (see the module docstring)")
    g.add_argument("--group-size", type=int, default=None, help="G: samples per prompt (>= 2)")
    g.add_argument("--prompts-per-step", type=int, default=None, help="groups per step and rank")
    g.add_argument("--lr", type=float, default=None, help="RL peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=0, help="RL linear warmup steps")
    g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer passes per batch (old log-probs recomputed first)")
    g.add_argument("--micro-batch", type=int, default=8, help="trajectories per training forward")
    g.add_argument("--clip-low", type=float, default=None, help="PPO clip eps_low")
    g.add_argument("--clip-high", type=float, default=None, help="PPO clip eps_high (Video-o3's clip higher: 0.3)")
    g.add_argument("--kl-coef", type=float, default=None, help="beta of the KL to the frozen reference (0 = off)")
    g.add_argument("--kl-estimator", choices=("k1", "k3"), default=None, help="per-token KL estimator")
    g.add_argument("--kl-in-reward", type=int, default=None,
                   help="1: fold beta * sum_t k1 into the reward (ParaVT); 0: a KL loss term (k3)")
    g.add_argument("--shaping", type=int, default=None, help="1: ParaVT reward shaping clip(10 (R - 0.2), +-20)")
    g.add_argument("--dynamic-sampling", type=int, default=None,
                   help="1: drop zero-variance groups and draw more prompts until the batch is full (DAPO)")
    g.add_argument("--max-draws", type=int, default=4, help="dynamic sampling: rollout rounds per step at most")
    g.add_argument("--mask-truncated", type=int, default=None, help="1: exclude trajectories cut by a limit from the loss")
    g.add_argument("--train-subagents", action="store_true", help="train sub-agent tokens with their caller's advantage")
    g.add_argument("--tool-mode", choices=("interleaved", "subagent"), default=None,
                   help="crops interleaved into the context (Video-o3) or summarised by sub-agents (ParaVT)")
    g.add_argument("--max-turns", type=int, default=None, help="tool rounds before the forced answer")
    g.add_argument("--max-calls-per-turn", type=int, default=None, help="parallel calls executed per turn")
    g.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per assistant turn")
    g.add_argument("--temperature", type=float, default=None, help="RL sampling temperature (ParaVT: 0.7)")
    g.add_argument("--overview-nframes", type=int, default=None,
                   help="overview frames when gating is off (0 = the fps rule; default: the preset's, 8 on the tiny model)")
    g.add_argument("--overview-fps", type=float, default=None, help="overview fps when no frame count is set")
    g.add_argument("--overview-max-frames", type=int, default=None, help="overview frame cap of the fps rule")
    g.add_argument("--gating", type=int, default=None,
                   help="nFrames gating on/off (default: on for paravt/combined on real data (--data) or with "
                        "--sft-gated-overviews)")
    g.add_argument("--gating-choices", default="4,8,16,32,64", help="overview frame counts K is drawn from")
    g.add_argument("--anchoring", choices=("sequence", "token", "none"), default=None,
                   help="exploration anchoring (default: sequence for paravt/combined, none for vanilla/vtgr)")
    g.add_argument("--released-scoring", action="store_true",
                   help="score generated tokens only, as the ParaVT release did (forced prefix/tool responses unseen)")
    g.add_argument("--final-eval", action="store_true", help="held-out evaluation at the end (always on for --stage all)")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate on the held-out split every N RL steps (0 = only at the end)")
    g.add_argument("--logprob-chunk", type=int, default=1024,
                   help="tokens per chunk of token_logprobs (old and reference log-probs, no grad)")
    g.add_argument("--loss-chunk", type=int, default=0,
                   help="tokens per chunk of the fused SFT and GRPO loss (token_loss); 0: its own rule")
    args = p.parse_args(argv)
    try:
        resolve(args)
    except ValueError as e:
        p.error(str(e))
    return args


def is_tiny(name_or_path: str) -> bool:
    """The embedded tiny model, fresh ('tiny', 'tiny-qwen') or trained (its config.json says so)."""
    if name_or_path in ("tiny", "tiny-qwen"):
        return True
    config = os.path.join(name_or_path, "config.json")
    return os.path.isfile(config) and "tiny_model_config" in json.load(open(config))


def resolve(args) -> None:
    """Fill every None default from the preset (or the tiny settings), then refuse what cannot work."""
    args.tiny = is_tiny(args.model)
    if args.preset is None and not args.tiny:
        args.preset = "paravt"                           # a real checkpoint never inherits the tiny settings
    base = {**rollout.PRESETS[args.preset]["rollout"], **rollout.PRESETS[args.preset]["train"]} if args.preset \
        else TINY_DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.vision_lr_scale is None:
        args.vision_lr_scale = 1.0
    if args.vision_lr_scale < 0:
        raise ValueError(f"--vision-lr-scale must be >= 0 (0 freezes the vision tower), got {args.vision_lr_scale}")
    try:
        args.gating_choices = [int(c) for c in args.gating_choices.split(",")]
    except ValueError:
        raise ValueError(f"--gating-choices: expected comma-separated frame counts, got {args.gating_choices!r}") from None
    if args.gating is None:  # the synthetic SFT shows K = 8 overviews only, unless --sft-gated-overviews: gated
        # RL would then sample on overview sizes the tiny model never saw (measured: format 0.0-0.6 vs 0.94-1.0)
        args.gating = int(args.recipe in ("paravt", "combined") and (args.data is not None or args.sft_gated_overviews))
    if args.anchoring is None:
        args.anchoring = "sequence" if args.recipe in ("paravt", "combined") else "none"
    if args.compile is None:
        args.compile = int(args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()))
    for flag in ("kl_in_reward", "shaping", "dynamic_sampling", "mask_truncated", "gating"):
        setattr(args, flag, bool(getattr(args, flag)))
    if args.group_size < 2:
        raise ValueError("--group-size must be >= 2 (group advantages need a group)")
    if args.recipe == "vtgr" and args.anchoring == "sequence":
        raise ValueError("--recipe vtgr --anchoring sequence: VTGR's strict format reward has no anchor term to "
                         "weight; use --anchoring token (credit on the closing tags) or --anchoring none")
    if args.kl_coef and args.kl_estimator == "k1" and not args.kl_in_reward:
        raise ValueError("--kl-estimator k1 as a loss term has zero expected gradient on-policy (it regularises "
                         "nothing); use --kl-in-reward 1 (ParaVT) or --kl-estimator k3")
    if args.video_root and not (args.data or args.eval_data):
        raise ValueError("--video-root without --data: the synthetic task renders its own videos and ignores it; "
                         "pass --data RECORDS.jsonl with it")
    if args.sft_data and not args.data:
        raise ValueError("--sft-data without --data: RL and the held-out evaluation would run on the synthetic task, "
                         "not on the records the trajectories belong to; pass --data too")


def launch(args) -> None:
    """The launcher: torchrun's environment, `--gpus N` processes spawned here, or one process.
    A bad device request, a --run-dir holding another run, or one in use is a ValueError before anything starts."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible (use --device cpu, or leave --device auto)")
    if args.gpus is None:   # default: every visible CUDA device, or one CPU process
        args.gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 1
    spawn = "RANK" not in os.environ and (args.gpus or 1) > 1
    if spawn and args.device != "cpu" and args.gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {args.gpus} but only {torch.cuda.device_count()} CUDA devices are visible "
                         f"(use --device cpu for a gloo run on CPU)")
    if args.plot:
        print(plot_run(args.plot))
        return
    first = os.environ.get("RANK", "0") == "0"       # under torchrun, rank 0 checks (before any rank writes)
    if first and (why := stale_run(args.run_dir, args.stage, args.resume)):
        raise ValueError(why)
    lock = RunLock(args.run_dir) if first else None
    try:
        if "RANK" in os.environ:                      # started by torchrun (multi-node, or habit)
            main(int(os.environ.get("LOCAL_RANK", 0)), args)
        elif spawn:                                   # python train.py --gpus 8
            os.environ.setdefault("MASTER_ADDR", "localhost")
            os.environ.setdefault("MASTER_PORT", str(find_free_port()))
            torch.multiprocessing.spawn(main, args=(args,), nprocs=args.gpus)
        else:                                         # one GPU or CPU: no process group
            main(0, args)
    finally:
        if lock is not None:
            lock.release()


def cli(argv=None) -> None:
    """`python train.py ...`: a bad input is one line saying what and where (exit 2); --debug shows the traceback.
    Only this project's own checks speak in one line: an error raised inside a library keeps its traceback."""
    args = parse_args(argv)
    try:
        launch(args)
    except (ValueError, FileNotFoundError, data.RecordError) as e:
        here = os.path.dirname(os.path.abspath(__file__))
        raised_by_us = os.path.dirname(os.path.abspath(traceback.extract_tb(e.__traceback__)[-1].filename)) == here
        if args.debug or not raised_by_us:
            raise
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
