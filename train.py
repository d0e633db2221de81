"""
Training: SFT warm start (with TDAM) and GRPO for agentic long-video RL, one file that reads top to
bottom: pure math, arguments, `main(rank, args)`, the launcher.

Algorithm. Per RL step each rank draws `--prompts-per-step` records, gates each overview to K frames
(nFrames gating: K ~ Uniform{4..64}, the same K for a prompt's whole group), rolls out G samples per
prompt with rollout.py (parallel crop_video calls, up to --max-turns tool rounds, KV cache reused across
turns), scores every trajectory with rewards.py under the chosen recipe, turns rewards into group
advantages A = (R - mean) / (std + eps), optionally adds the exploration-anchoring credit on the
closing-tag tokens, and takes a PPO-clip step on the policy's own tokens only (token-mean).

Recipes (--recipe): paravt = ParaVT R_acc + R_fmt(anchored) + R_tool, with gating (PARA-GRPO; on the
synthetic default gating is off unless --sft-gated-overviews 1, because its SFT shows K = 8 overviews only);
vtgr = Video-o3 R_acc + strict R_fmt + hybrid-clue tool term with turn decay; combined (default) =
ParaVT's accuracy and anchored format terms, gating, and the VTGR tool term wherever a record has clue
windows; vanilla = accuracy + format + tool reward, no gating, no anchoring (the ablation).

Departures from the papers' releases (each also noted where it happens):
 1. Rewards score the trajectory as the model saw it (forced "<think>\n" prefix and tool responses
    included); ParaVT scored generated tokens only (--released-scoring restores that).
 2. Token-level exploration anchoring is available (--anchoring token), as the ParaVT paper words it;
    the release adds the anchor to the sequence reward only (--anchoring sequence).
 3. nFrames gating really acts (the release's config replaced K by 64 frames).
 4. Sub-agent tokens can be trained with their caller's advantage (--train-subagents); ParaVT did not.
 5. Old log-probs are recomputed by a training forward (not taken from the sampler), so ratio == 1 on
    the first PPO epoch and clipping only acts from the second epoch (--ppo-epochs > 1) on.

Run commands:
    python train.py                                   # the embedded default on CPU: tiny model, synthetic task
    python train.py --stage rl --rl-steps 2 --n-train 8 --group-size 2 --prompts-per-step 2   # CPU smoke
    python train.py --model /ckpt/Qwen3-VL-8B-Instruct --data rl.jsonl --video-root /videos --stage rl
    python train.py --gpus 8 --model /ckpt/Qwen3-VL-8B-Instruct --data rl.jsonl --video-root /videos \
        --stage rl --group-size 8 --prompts-per-step 1 --lr 2e-6 --shaping --kl-coef 0.01 --grad-checkpointing
    torchrun --nnodes 2 --nproc-per-node 8 ... train.py ...   # multi-node: torchrun's environment is used

The top of this file holds the pure math the loop uses, importable on its own
(`from train import grpo_loss`):

    token_logprobs  hidden (N, D) x lm_head (V, D) -> log p(target) (N,), in token chunks, so the
                    (N, V) logits never exist whole (vocab V = 151,936 for Qwen)
    grpo_loss       PPO-clip surrogate + optional KL to a frozen reference, token-mean over policy tokens
    kl_penalty      per-token k1 / k3 KL estimators
    get_lr          linear warmup, then cosine decay to min_lr_ratio * lr
    tdam_mask       Video-o3 Task-Decoupled Attention Masking (SFT), (L, L) bool, True = may attend
"""
import argparse
import contextlib
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import data
import model as model_lib
import rewards
import rollout

# -----------------------------------------------------------------------------
# Chunked log-probabilities: hidden states x lm_head -> log p(token), never the (N, V) matrix

# `TOKEN_LOGPROBS_COMPILE=0` runs the chunk kernels of token_logprobs and token_loss eagerly everywhere
# (for debugging and pdb). `TORCH_COMPILE_DISABLE=1` does the same for every torch.compile in the process.
_compiled_kernels: dict = {}
_MIN_CHUNK_LOGITS = 1 << 23   # token_loss's smallest (C, V) buffer, in elements (32 MB fp32); below it, no chunks


def _kernel(fn, use_compile: bool):
    """The chunk kernel `fn`, compiled on first use with fixed shapes, or `fn` itself when compile is off."""
    if not use_compile or os.environ.get("TOKEN_LOGPROBS_COMPILE", "1") == "0":
        return fn
    if fn not in _compiled_kernels:
        _compiled_kernels[fn] = torch.compile(fn, dynamic=False)
    return _compiled_kernels[fn]


def _chunk_logprobs(logits, targets, temperature: float = 1.0):
    """One chunk forward: logits (C, V) -> log p(target) (C,) and logsumexp (C,) of logits / T, both fp32."""
    logits = logits.float()                                       # the upcast fuses into the reductions
    if temperature != 1.0:                                        # (T = 1 skips it: bit-for-bit the plain model)
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)                         # (C,)
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)  # (C,)
    return target_logit - lse, lse


def _chunk_grad_logits_(logits, targets, lse, grad_out, temperature: float = 1.0):
    """One chunk backward, in place: logits (C, V) <- (g / T) (onehot(t) - softmax(logits / T)) = d loss / d logits."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    probs = torch.exp(z - lse[:, None])                           # softmax from the saved logsumexp, fp32
    vocab = torch.arange(logits.shape[1], device=logits.device)
    onehot = (targets[:, None] == vocab[None, :]).float()
    logits.copy_((grad_out / temperature)[:, None] * (onehot - probs))  # compiled: one fused kernel, no new (C, V)


def _chunk(x: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """Rows [start, start + chunk) of x, zero-padded at the end so every chunk has `chunk` rows."""
    part = x[start:start + chunk]
    pad = chunk - part.shape[0]
    if pad == 0:
        return part
    return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])


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
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            logits = _chunk(hidden, start, chunk) @ weight.T                   # (C, V), GEMM in the input dtype
            lp, ls = forward_kernel(logits, _chunk(targets, start, chunk), temperature)
            logprobs[start:stop] = lp[:stop - start]
            lse[start:stop] = ls[:stop - start]
            del logits  # free this chunk's buffer before the next GEMM allocates one
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
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            h = _chunk(hidden, start, chunk)                                   # (C, D)
            # the logits again, exactly as in forward, then overwritten with d loss / d logits;
            # padded rows carry g = 0, so their rows of grad_logits are exactly zero
            grad_logits = h @ weight.T                                         # (C, V)
            backward_kernel(grad_logits, _chunk(targets, start, chunk), _chunk(lse, start, chunk),
                            _chunk(grad_out, start, chunk), ctx.temperature)
            if need_hidden:
                grad_hidden[start:stop] = (grad_logits @ weight)[:stop - start]  # (C, V) @ (V, D)
            if need_weight:
                if grad_logits.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.T, h)                       # in place, no (V, D) temporary
                else:
                    grad_weight += grad_logits.T @ h                           # bf16 GEMM, fp32 sum over chunks
            del grad_logits  # free this chunk's buffer before the next GEMM allocates one
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
    Forward walks the tokens in chunks of C = chunk_size rows: a chunk's (C, V) logits come from one
    GEMM, are reduced in fp32 to the target logit and the logsumexp, and dropped; only lse (N,) is
    saved. Backward recomputes each chunk's logits with the same GEMM, overwrites them in place with
    grad_logits = (g / T) (onehot - exp(logits / T - lse)), then grad_hidden chunk = grad_logits @ W and
    grad_W += grad_logits^T h_chunk (an fp32 accumulator, cast to W's dtype at the end).
    Temperature: the RL loop samples from softmax(logits / T); the log-probs that enter its loss (old,
    reference and current) must be those of the same distribution, so they pass the sampling T here.

    Memory: O(C V) working memory instead of O(N V). With Qwen's vocab V = 151,936 the naive path
    at N = 8192 tokens holds 5 GB of fp32 logits, and autograd keeps two to three such (N, V)
    tensors alive in backward; here one (C, V) buffer, 0.6 GB for C = 1024 in fp32, whatever N is.
    The price is one extra GEMM (the logits recomputed in backward): 4 GEMMs of N x D x V instead
    of 3. bench/logprob_bench.py, fp32 on a 2-core CPU, N = 4096, D = 4096: 0.63 GB of working
    memory (beyond the returned gradients) against 4.57 GB naive and 2.32 GB for a row-by-row
    log_softmax over full logits, at 1.35x the latter's time. A loss that is a sum of per-token
    terms should use `token_loss` instead (3 GEMMs, gradients formed in the forward); this function
    is for the no-grad uses (old and reference log-probs, evaluation) and for losses that are not.
    bf16/fp16 inputs: the GEMMs run in the input dtype (fp32 accumulation inside the GEMM), the
    softmax math in fp32, and grad_W sums the chunks in fp32.

    The softmax math of a chunk (forward: logsumexp and gather; backward: the in-place gradient) runs
    under `torch.compile(dynamic=False)`, compiled lazily on first use, which fuses it into one pass
    over the (C, V) buffer; the GEMMs are library calls either way. The last chunk is zero-padded to
    C rows so one shape is compiled; when N < chunk_size the chunk shrinks to the next power of two
    >= N. `compile=False` or env TOKEN_LOGPROBS_COMPILE=0 runs the same code eagerly (with a few
    (C, V) temporaries). Call it outside any compiled region: its Python loop is the point.
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


def _auto_chunk(n: int, dim: int, vocab: int) -> int:
    """
    Liger-Kernel's chunk size (arXiv 2410.10989, fused linear cross-entropy): C = next_pow2(ceil(N / ceil(V / D))),
    so the (C, V) logits buffer is about the size of the (N, D) hidden states; here at least
    _MIN_CHUNK_LOGITS / V rows (a tiny D would otherwise give chunks of one row and a Python loop of N).
    """
    chunk = -(-n // -(-vocab // dim))                              # ceil(N / ceil(V / D))
    chunk = max(chunk, -(-_MIN_CHUNK_LOGITS // vocab), 1)
    return 1 << (chunk - 1).bit_length()                           # the next power of two


class _TokenLoss(torch.autograd.Function):
    """sum_i loss over chunks with the gradients formed in the forward; see `token_loss`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, chunk, temperature, use_compile, need_hidden, need_weight):
        n, (vocab, dim) = hidden.shape[0], weight.shape
        forward_kernel = _kernel(_chunk_logprobs, use_compile)
        grad_kernel = _kernel(_chunk_grad_logits_, use_compile)
        buf = hidden.new_empty((chunk, vocab))                          # (C, V): the one logits buffer, reused
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None                     # (N, D)
        grad_weight = torch.zeros((vocab, dim), dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            rows = stop - start
            h, t = _chunk(hidden, start, chunk), _chunk(targets, start, chunk)               # (C, D), (C,)
            torch.mm(h, weight.T, out=buf)                                                   # GEMM 1: logits
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
            grad_kernel(buf, t, lse, g_pad, temperature)       # buf <- (g / T)(onehot - softmax(logits / T))
            if need_hidden:
                torch.mm(buf[:rows], weight, out=grad_hidden[start:stop])                    # GEMM 2: (C, V) @ (V, D)
            if need_weight:
                if buf.dtype == torch.float32:
                    grad_weight.addmm_(buf.T, h)                                             # GEMM 3, in place
                else:
                    grad_weight += buf.T @ h                   # bf16 GEMM, summed over chunks in fp32
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

    Per chunk of C rows, in the forward: the (C, V) logits by one GEMM into a reused buffer, the
    log-sum-exp and log-probs, g by autograd on the small (C,) tensor, grad_logits written in place
    over the logits, then grad_h for the chunk (GEMM 2) and grad_W accumulated in fp32 (GEMM 3).
    The backward only scales the stored grad_h and grad_W by the upstream gradient: 3 GEMMs of
    N x D x V in all, as the naive path, where `token_logprobs` needs 4 (it recomputes the logits).
    Nothing of the forward is saved but the two gradients, not even W (so on this path FSDP may free the
    unsharded lm_head weight after the forward); backward through one result twice is refused.
    Chunk size: by default Liger's rule (`_auto_chunk`: the (C, V) buffer about the size of the hidden
    states, 128 rows for N = 4096, D = 4096, V = 151,936), and when the whole (N, V) logits are no bigger
    than that smallest buffer, the plain path (log_softmax over all logits, ordinary autograd). An
    explicit chunk_size always takes the fused path (shrunk to the next power of two >= N when N is
    smaller). The softmax math of a chunk runs under torch.compile(dynamic=False) on the padded (C, V)
    shape as in `token_logprobs` (env TOKEN_LOGPROBS_COMPILE=0 or compile=False: eager); the GEMMs are
    library calls. bf16: GEMMs in bf16, softmax math in fp32, grad_W summed in fp32, cast to W's dtype.
    Measured (bench/logprob_bench.py, the GRPO loss, fp32, 2-core CPU): see docs/benchmarks.md.
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
# GRPO loss, KL, learning-rate schedule

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
# TDAM: Task-Decoupled Attention Masking (Video-o3 SFT)

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
    obs = [_check_span("obs_span", s, seq_len) for s in obs_spans]
    calls = sorted(_check_span("call_span", s, seq_len) for s in call_spans)
    if overview_span is not None and answer_span is not None and obs:
        v0, v1 = _check_span("overview_span", overview_span, seq_len)
        a0, a1 = _check_span("answer_span", answer_span, seq_len)
        if a0 < v1 and a1 > v0:
            raise ValueError(f"tdam_mask: answer_span {answer_span} overlaps overview_span {overview_span}")
        mask[a0:a1, v0:v1] = False                                # rule (1)
    for c0, c1 in calls[1:]:
        for o0, o1 in obs:
            if o1 <= c0:
                mask[c0:c1, o0:o1] = False                        # rule (2)
    return mask


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


# ----- parse_args / main / launcher: below -----


# -----------------------------------------------------------------------------
# rewards per recipe, and the per-step metrics

def score_trajectory(traj, record: dict, recipe: str, anchoring: str, released_scoring: bool) -> tuple[float, dict]:
    """Total reward and its components for one trajectory under a recipe (see module docstring).
    anchoring == "token": the anchor term leaves the sequence reward and goes onto closing tags instead."""
    text = traj.policy_text if released_scoring else traj.text
    target, task = record["answer"], record["task"]
    clues = record.get("clues") or []
    data_type = rewards.infer_data_type(task, clues, record.get("data_type"))
    anchor_w = 0.5 if anchoring == "sequence" else 0.0
    if recipe == "vtgr":
        total, parts = rewards.vtgr_reward(traj.turns, text, target, task, data_type, traj.windows, clues, traj.n_tool_turns)
        parts["anchor"] = rewards.format_anchor(text)
    else:
        total, parts = rewards.paravt_reward(text, target, task, anchor_weight=anchor_w)
        if recipe == "combined" and clues:   # the VTGR tool term wherever the record has clue windows
            fmt_ok = rewards.grounding_format_reward(traj.turns) == 1.0
            tool = rewards.vtgr_tool_term(data_type, traj.windows, clues, traj.n_tool_turns, parts["acc"] == 1.0, fmt_ok)
            total += tool - parts["tool"]
            parts["tool"] = tool
    parts["clue"] = rewards.hybrid_clue_score(traj.windows, clues, multi_clue=data_type == "multi_clue") if clues else 0.0
    return float(total), {k: float(v) for k, v in parts.items()}


def rollout_metrics(trajs: list, comps: list[dict]) -> dict:
    """Means over a step's trajectories: accuracy, format compliance, tool use (ParaVT's curves)."""
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
    return out


# -----------------------------------------------------------------------------
# batches: whole trajectories -> log-probs of the policy tokens

def forward_logprobs(model, batch: dict, chunk_size: int, attn_mask_4d=None, compile: bool = True) -> torch.Tensor:
    """(B, L-1) log p(next token) at POLICY positions (0 elsewhere), through `token_logprobs`."""
    device = next(model.parameters()).device
    kw = {k: v.to(device) for k, v in batch.items() if k not in ("roles",)}
    if "pixel_values_videos" in kw:
        kw["pixel_values_videos"] = kw["pixel_values_videos"].to(next(model.parameters()).dtype)
    if attn_mask_4d is not None:
        kw["attention_mask"] = attn_mask_4d.to(device)
    hidden = model.model(**kw, use_cache=False).last_hidden_state[:, :-1]            # (B, L-1, D)
    targets = batch["input_ids"][:, 1:].to(device)
    policy = (batch["roles"][:, 1:] == 1).to(device)
    out = torch.zeros(targets.shape, device=device, dtype=torch.float32)
    if hasattr(model.lm_head, "unshard"):     # FSDP: the weight is read below, not through lm_head's forward
        model.lm_head.unshard()               # (its gradient is reduce-scattered with the norm's, in backward)
    if policy.any():
        out[policy] = token_logprobs(hidden[policy], model.lm_head.weight, targets[policy], chunk_size, compile)
    return out


def trainable(traj, video_id: int) -> bool:
    """False when the policy sampled a <|video_pad|>: `collate` would take it for a video placeholder with no
    frames, so the sample is scored (as text) but left out of the update."""
    return not any(role == rollout.POLICY and tok == video_id for tok, role in zip(traj.token_ids, traj.roles))


def tdam_batch_mask(batch: dict, ids: dict, video_id: int) -> torch.Tensor:
    """(B, 1, L, L) additive mask: TDAM on each row (spans found from the tokens) plus padding."""
    B, L = batch["input_ids"].shape
    masks = []
    for i in range(B):
        row = batch["input_ids"][i].tolist()
        n = int(batch["attention_mask"][i].sum())
        vids, s = [], None
        for j, t in enumerate(row[:n] + [-1]):       # maximal runs of video tokens, merged per video
            if t == video_id and s is None:
                s = j
            elif t != video_id and s is not None:
                vids.append((s, j))
                s = None
        # the prompt ends at the forced "<think>" before the first policy token (the system prompt and the
        # Hermes tools block mention <think>, <answer> and <tool_call> themselves)
        roles = batch["roles"][i, :n].tolist()
        first_policy = roles.index(1) if 1 in roles else n
        prompt_len = max([j for j in range(first_policy) if row[j] == ids["<think>"]], default=first_policy)
        span = lambda vs: (vs[0][0], vs[-1][1]) if vs else None   # a video's runs + the timestamps between them
        overview = [v for v in vids if v[1] <= prompt_len]
        obs = [v for v in vids if v[0] >= prompt_len]
        if ids.get("<tool_response>") is not None:      # one span per observation video, like the overview
            opens = [j for j in range(prompt_len, n) if row[j] == ids["<tool_response>"]]
            closes = [j for j in range(prompt_len, n) if row[j] == ids["</tool_response>"]]
            obs = [sp for o, c in zip(opens, closes) if (sp := span([v for v in obs if o < v[0] and v[1] <= c]))]
        calls = [(j, row.index(ids["</tool_call>"], j) + 1) for j in range(prompt_len, n)
                 if row[j] == ids["<tool_call>"] and ids["</tool_call>"] in row[j:n]]
        ans = [j for j in range(prompt_len, n) if row[j] == ids["<answer>"]]
        answer = (ans[-1] + 1, n) if ans else None
        m = tdam_mask(n, span(overview), answer, calls, obs) if answer and answer[0] < n else \
            torch.ones(n, n, dtype=torch.bool).tril()
        full = torch.zeros(L, L, dtype=torch.bool)
        full[:n, :n] = m
        full[torch.arange(L), torch.arange(L)] = True        # pads attend to themselves (no NaN rows)
        masks.append(full)
    return to_additive_mask(torch.stack(masks)).squeeze(1)[:, None]


def sft_loss(model, batch: dict, chunk_size: int, attn_mask_4d=None, compile: bool = True) -> tuple[torch.Tensor, int]:
    """Cross-entropy on assistant (POLICY) tokens only, token mean."""
    lp = forward_logprobs(model, batch, chunk_size, attn_mask_4d, compile)
    mask = (batch["roles"][:, 1:] == 1).to(lp.device)
    n = int(mask.sum())
    return -(lp * mask).sum() / max(1, n), n


def sft_micro_batches(items: list, rows: int, model, pad_id: int):
    """Collated micro-batches of `rows` trajectories, shortest first: rows of like length share a pad length,
    so a batch of mixed lengths costs fewer padded tokens (measured: bench/sft_microbatch.py)."""
    items, rows = sorted(items, key=lambda t: len(t.token_ids)), max(1, rows)
    for i in range(0, len(items), rows):
        yield rollout.collate(items[i:i + rows], model, pad_id)


def sft_backward(model, items: list, rows: int, pad_id: int, chunk_size: int, tdam_ids: dict | None = None,
                 compile: bool = True) -> tuple[torch.Tensor, int]:
    """Backward of the batch's SFT loss (token mean over all its policy tokens) through micro-batches of
    `rows`: each micro-batch's token mean weighted by its share n_i / N of the tokens, so the gradients add
    up to those of one forward over the whole batch. tdam_ids (special token ids): TDAM masks on.
    Returns (the batch loss, detached; N)."""
    batches = list(sft_micro_batches(items, rows, model, pad_id))
    n_tok = max(1, sum(int((b["roles"][:, 1:] == 1).sum()) for b in batches))   # sft_loss's own token count
    parts = []
    for batch in batches:
        mask4 = tdam_batch_mask(batch, tdam_ids, model.config.video_token_id) if tdam_ids else None
        micro, n = sft_loss(model, batch, chunk_size, mask4, compile)
        (micro * (n / n_tok)).backward()
        parts.append(micro.detach() * (n / n_tok))
    return torch.stack(parts).sum(), n_tok


def grpo_step_loss(model, batch: dict, old_lp, adv_tok, ref_lp, args) -> tuple[torch.Tensor, dict]:
    """GRPO loss of one micro-batch. old_lp None = on-policy single epoch: the old log-probs ARE the current
    ones (ratio 1), so they are taken detached from this forward instead of from an extra one."""
    lp = forward_logprobs(model, batch, args.logprob_chunk, compile=bool(args.compile))
    mask = (batch["roles"][:, 1:] == 1).to(lp.device)
    old_lp = lp.detach() if old_lp is None else old_lp
    return grpo_loss(lp, old_lp, adv_tok.to(lp.device), mask, clip_low=args.clip_low, clip_high=args.clip_high,
                     kl_coef=args.kl_coef, ref_logprobs=ref_lp, kl_estimator=args.kl_estimator)


# -----------------------------------------------------------------------------
# checkpoints (atomic: written to a temp dir, then renamed)

def save_checkpoint(run_dir: str, step: int, model, processor, optimizer, extra: dict, state_dict=None) -> str:
    final = os.path.join(run_dir, f"ckpt-{extra['stage']}-{step:06d}")   # SFT step 2 and RL step 2 are two models
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if state_dict is None:
        model_lib.save_model(model, processor, tmp)
    else:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None, "step": step,
                "rng_torch": torch.get_rng_state(), "rng_random": random.getstate(), **extra},
               os.path.join(tmp, "trainer.pt"))
    shutil.rmtree(final + ".old", ignore_errors=True)
    if os.path.exists(final):                # saving a step again: move the old one aside whole, never half-delete it
        os.replace(final, final + ".old")
    os.replace(tmp, final)                   # the only moment a checkpoint becomes visible
    shutil.rmtree(final + ".old", ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str) -> str | None:
    """Newest complete checkpoint, RL after SFT, then by step (a half-written `.tmp` dir is never picked up)."""
    if not os.path.isdir(run_dir):
        return None
    order = {"sft": 0, "rl": 1}
    done = [(order[m[1]], int(m[2]), d) for d in os.listdir(run_dir) if (m := re.fullmatch(r"ckpt-(sft|rl)-(\d{6})", d))
            and os.path.exists(os.path.join(run_dir, d, "trainer.pt"))]
    return os.path.join(run_dir, max(done)[2]) if done else None


def append_metrics(path: str, row: dict) -> None:
    """One JSON line per step, flushed at once (a killed run loses at most the step in flight)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_metrics(path: str, stage: str, step: int) -> None:
    """On resume: drop rows logged after the checkpoint, so no step appears twice."""
    if not os.path.exists(path):
        return
    rows = [json.loads(l) for l in open(path) if l.strip()]
    order = {"sft": 0, "rl": 1}
    keep = [r for r in rows if (order.get(r.get("stage"), 0), r.get("step", 0)) <= (order[stage], step)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


def plot_run(run_dir: str) -> str:
    """Reward, format compliance and tool-call ratio against RL step (ParaVT's training curves) -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    rows = [r for r in rows if r.get("stage") == "rl"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key in zip(axes, ("reward", "format_compliance", "tool_call_ratio")):
        ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows])
        ax.set_title(key)
        ax.set_xlabel("RL step")
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -----------------------------------------------------------------------------
# arguments

# The embedded default (`python train.py` with no arguments): sizes chosen for a 2-core CPU
# (frame sizes and prompt settings of the tiny model: rollout.TINY_ROLLOUT).
TINY_TASK = dict(n_train=256, n_eval=48, duration=64.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--stage", choices=("all", "sft", "rl"), default="all",
                   help="all = the default pipeline: SFT warm start, then RL, then held-out evaluation")
    g.add_argument("--run-dir", default="runs/default", help="checkpoints, metrics.jsonl, curves.png")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --run-dir")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--strict", action="store_true", help="raise on a non-finite loss/grad instead of skipping the step")
    g.add_argument("--plot", metavar="RUN_DIR", default=None, help="only draw RUN_DIR/curves.png from its metrics.jsonl")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", type=int, default=None, help="processes on this node (default: visible CUDA devices, or 1)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads per process (0 = torch's default; 1 is far faster on a busy or shared CPU)")
    g.add_argument("--compile", type=int, default=None, help="torch.compile the log-prob kernels (default: 1 on CUDA, 0 on CPU)")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward (large models)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a Qwen3-VL / Qwen2.5-VL checkpoint dir")
    g.add_argument("--data", default=None, help="RL prompt records JSONL (SPEC 9); default: the synthetic task")
    g.add_argument("--sft-data", default=None, help="SFT trajectory records JSONL; default: synthetic oracle trajectories")
    g.add_argument("--video-root", default=None, help="folder the records' video paths are relative to")
    g.add_argument("--eval-data", default=None, help="held-out prompt records for evaluation (default: synthetic split)")
    g.add_argument("--max-bad-fraction", type=float, default=0.2, help="stop if more than this fraction of samples is bad")
    g.add_argument("--n-train", type=int, default=TINY_TASK["n_train"], help="synthetic task: training prompts")
    g.add_argument("--n-eval", type=int, default=TINY_TASK["n_eval"], help="synthetic task: held-out prompts")
    g.add_argument("--task-duration", type=float, default=TINY_TASK["duration"], help="synthetic task: video seconds")
    g.add_argument("--task-mix", default=None, help="synthetic task: kind=weight,... (default: data.DEFAULT_MIX)")
    g.add_argument("--direct-crop", type=float, default=0.0,
                   help="synthetic SFT: chance the oracle crops a direct clue it could read off the overview")
    g.add_argument("--sft-gated-overviews", type=int, default=0,
                   help="synthetic SFT: each record also with a K-frame overview, K drawn from --gating-choices")
    g.add_argument("--always-call", action="store_true", help="SFT oracle calls the tool on every question (a strong tool prior)")
    g = p.add_argument_group("SFT")
    g.add_argument("--sft-steps", type=int, default=600)
    g.add_argument("--sft-batch", type=int, default=8)
    g.add_argument("--sft-micro-batch", type=int, default=2,
                   help="rows per forward, grouped by length within the batch (same gradient, fewer pad tokens)")
    g.add_argument("--sft-lr", type=float, default=2e-3)
    g.add_argument("--tdam-ratio", type=float, default=0.1, help="fraction of SFT batches trained with TDAM masks")
    g = p.add_argument_group("RL")
    g.add_argument("--rl-steps", type=int, default=20)
    g.add_argument("--recipe", choices=("combined", "paravt", "vtgr", "vanilla"), default="combined")
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--prompts-per-step", type=int, default=4)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer passes per batch (old log-probs recomputed first)")
    g.add_argument("--micro-batch", type=int, default=8)
    g.add_argument("--clip-low", type=float, default=0.2)
    g.add_argument("--clip-high", type=float, default=0.3)
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL to a frozen reference (0 = off, no reference kept)")
    g.add_argument("--kl-estimator", choices=("k1", "k3"), default="k3")
    g.add_argument("--shaping", action="store_true", help="ParaVT reward shaping clip(10 (R - 0.2), +-20)")
    g.add_argument("--dynamic-sampling", action="store_true", help="drop zero-variance groups from the update")
    g.add_argument("--mask-truncated", type=int, default=1, help="exclude trajectories cut by a limit from the loss")
    g.add_argument("--train-subagents", action="store_true", help="train sub-agent tokens with their caller's advantage")
    g.add_argument("--tool-mode", choices=("interleaved", "subagent"), default="interleaved")
    g.add_argument("--max-turns", type=int, default=3)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7, help="RL sampling temperature (ParaVT: 0.7)")
    g.add_argument("--overview-nframes", type=int, default=None,
                   help="overview frames when gating is off (default: 8 on the tiny model, 64 otherwise)")
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
    g.add_argument("--logprob-chunk", type=int, default=1024)
    args = p.parse_args(argv)
    if args.group_size < 2:
        p.error("--group-size must be >= 2 (group advantages need a group)")
    try:
        args.gating_choices = [int(c) for c in args.gating_choices.split(",")]
    except ValueError:
        p.error(f"--gating-choices: expected comma-separated frame counts, got {args.gating_choices!r}")
    if args.gating is None:  # the synthetic SFT shows K = 8 overviews only, unless --sft-gated-overviews: gated
        # RL would then sample on overview sizes the tiny model never saw (measured: format 0.0-0.6 vs 0.94-1.0)
        args.gating = int(args.recipe in ("paravt", "combined") and (args.data is not None or args.sft_gated_overviews))
    if args.anchoring is None:
        args.anchoring = "sequence" if args.recipe in ("paravt", "combined") else "none"
    return args


# -----------------------------------------------------------------------------
# the run

def print0(rank: int, *a, **k) -> None:
    if rank == 0:
        print(*a, **k, flush=True)


def setup_distributed(rank: int, args) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). One process: no process group. Several: nccl on CUDA, gloo on CPU."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", args.gpus or 1))
    if world > 1:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        if use_cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=int(os.environ["RANK"]), world_size=world)
        rank = dist.get_rank()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")
    return rank, world, device


def all_min(value: int) -> int:
    """The smallest of an integer across ranks."""
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def all_mean(values: dict, world: int) -> dict:
    """Average scalar metrics across ranks (each rank rolled out its own prompts)."""
    if world == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / world for k, v in zip(keys, t)}


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


def synthetic_data(args, cache: str) -> tuple[list, list, str]:
    root = os.path.join(cache, "synthetic")
    mix = data.parse_mix(args.task_mix)
    train = data.make_split(root, args.n_train, seed=1000 + args.seed, mix=mix, duration=args.task_duration)
    held = data.make_split(root, args.n_eval, seed=2000 + args.seed, mix=mix, duration=args.task_duration)
    return train, held, root


def rollout_cfg(args, tiny: bool, **over) -> rollout.RolloutConfig:
    extra = dict(rollout.TINY_ROLLOUT) if tiny else {"overview_nframes": 64}
    if args.overview_nframes:
        extra["overview_nframes"] = args.overview_nframes
    return rollout.RolloutConfig(**{**dict(tool_mode=args.tool_mode, max_turns=args.max_turns,
                                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           group_size=args.group_size), **extra, **over})


def evaluate_split(model, processor, records, video_root, cfg) -> dict:
    """Greedy agent on held-out records -> the summary fields of the default run. clue_score is the hybrid
    clue score of the crops averaged over the questions whose evidence needs them (single and multi clue):
    a direct question answered from the overview, or a grounding answer, has no crops to score."""
    greedy = rollout.RolloutConfig(**{**cfg.__dict__, "temperature": 0.0, "group_size": 1})
    trajs, comps = [], []
    for i in range(0, len(records), 8):
        batch = records[i:i + 8]
        with full_weights(model):
            out = rollout.run_agent(model, processor, batch, video_root, greedy, seed=0)
        for rec, t in zip(batch, out):
            trajs.append(t)
            comps.append(score_trajectory(t, rec, "combined", "sequence", False)[1])
    m = rollout_metrics(trajs, comps)
    clue = [c["clue"] for c, r in zip(comps, records) if rewards.infer_data_type(
        r["task"], r.get("clues"), r.get("data_type")) in ("single_clue", "multi_clue")]
    return {"accuracy": m["accuracy"], "format_compliance": m["format_compliance"], "tool_call_ratio": m["tool_call_ratio"],
            "clue_score": sum(clue) / len(clue) if clue else 0.0, "turns": m["turns"]}


def main(rank: int, args) -> dict:
    t_start = time.time()
    # ----- compute init
    rank, world, device = setup_distributed(rank, args)
    if args.threads or (world > 1 and device.type == "cpu"):     # CPU ranks split the cores
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    use_compile = bool(args.compile if args.compile is not None else device.type == "cuda")
    args.compile = int(use_compile)                  # resolved once: the loss functions read it
    os.makedirs(args.run_dir, exist_ok=True)
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    print0(rank, json.dumps({"args": vars(args), "world": world, "device": str(device)}))

    # ----- model (from the newest checkpoint when resuming)
    ckpt = latest_checkpoint(args.run_dir) if args.resume else None
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True) if ckpt else None  # no pickle code
    model, processor = model_lib.load_model(ckpt or args.model, device=device, seed=args.seed,
                                            tiny_corpus=rollout.prompt_corpus())
    tiny = hasattr(model.config, "tiny_model_config")     # the embedded default, fresh or from a checkpoint
    ids = model_lib.special_token_ids(processor)
    pad_id = processor.tokenizer.pad_token_id
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.language_model.layers:
            fully_shard(layer)
        fully_shard([model.model.language_model.norm, model.lm_head])  # token_logprobs reads lm_head.weight directly
        fully_shard(model.model)                      # the root: every forward (rollout, training) enters here

    # ----- data
    cache = os.environ.get("PARAVT_CACHE", "cache")
    if args.data:
        train_recs, errors = data.load_records(args.data, args.video_root, args.max_bad_fraction)
        held = data.load_records(args.eval_data, args.video_root)[0] if args.eval_data else train_recs[:32]
        video_root = args.video_root
        for e in errors[:5]:
            print0(rank, f"skipped record: {e}")
    else:
        train_recs, held, video_root = synthetic_data(args, cache)
    by_id = {r["id"]: r for r in train_recs}
    cfg = rollout_cfg(args, tiny)
    run_stages = ["sft", "rl"] if args.stage == "all" else [args.stage]
    stage0, step0 = (state["stage"], state["step"]) if state else (run_stages[0], 0)
    if state and rank == 0:
        truncate_metrics(metrics_path, stage0, step0)
        print0(rank, f"resumed from {ckpt} ({stage0} step {step0})")
    summary = {}
    if args.stage == "all" and not state:
        summary["before"] = evaluate_split(model, processor, held, video_root, cfg)
        print0(rank, "before:", json.dumps(summary["before"]))
    counters = {"skipped_steps": 0, "bad_samples": 0, **(state.get("counters", {}) if state else {})}  # kept across resumes

    def optimizer_step(optimizer, step, loss, stage, sample_ids) -> float | None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            msg = f"non-finite loss/grad at {stage} step {step} (samples {sample_ids[:8]})"
            if args.strict:
                raise FloatingPointError(msg)
            print0(rank, "skipped:", msg)
            counters["skipped_steps"] += 1
            optimizer.zero_grad(set_to_none=True)
            return None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)                      # .item() sync, once per step

    # ----- SFT warm start
    if "sft" in run_stages and not (state and stage0 == "rl"):
        sft_items, sft_bad = sft_examples(args, train_recs, processor, video_root, cfg, rank)
        counters["bad_samples"] += 0 if state else sft_bad    # a resumed run counted them before
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
        start = step0 if state and stage0 == "sft" else 0
        if state and stage0 == "sft" and state["optimizer"]:
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng_torch"])
            random.setstate(state["rng_random"])
        model.train()
        for step in tqdm(range(start + 1, args.sft_steps + 1), desc="sft", disable=rank != 0, initial=start,
                         total=args.sft_steps):
            t0 = time.time()
            lr = get_lr(step - 1, args.sft_steps, args.sft_lr, warmup_steps=min(10, args.sft_steps // 10))
            for g in optimizer.param_groups:
                g["lr"] = lr
            rng = random.Random(f"sft:{args.seed}:{step}:{rank}")   # string seeds: draws independent across steps
            items = [sft_items[rng.randrange(len(sft_items))] for _ in range(args.sft_batch)]
            tdam = rng.random() < args.tdam_ratio
            loss, n_tok = sft_backward(model, items, args.sft_micro_batch, pad_id, args.logprob_chunk,
                                       ids if tdam else None, use_compile)
            gn = optimizer_step(optimizer, step, loss.detach(), "sft", [t.record_id for t in items])
            row = all_mean({"loss": float(loss.detach()), "grad_norm": gn if gn is not None else float("nan"), "lr": lr,
                            "tokens_per_s": n_tok / (time.time() - t0), "step_time": time.time() - t0,
                            "tdam": float(tdam)}, world)
            if rank == 0:
                append_metrics(metrics_path, {"stage": "sft", "step": step, **row, **counters})
                if step % 25 == 0 or step == args.sft_steps:
                    tqdm.write(f"sft {step}/{args.sft_steps} | loss {row['loss']:.4f} | lr {lr:.2e} | "
                               f"{row['step_time']:.2f}s")
            if step % args.save_every == 0 or step == args.sft_steps:
                save0(rank, world, args.run_dir, step, model, processor, optimizer, {"stage": "sft", "counters": counters})
        model.eval()
        if args.stage == "all":
            summary["sft"] = evaluate_split(model, processor, held, video_root, cfg)
            print0(rank, "after SFT:", json.dumps(summary["sft"]))

    # ----- RL (PARA-GRPO / VTGR / combined / vanilla)
    if "rl" in run_stages:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        ref_model = None
        if args.kl_coef > 0:    # the frozen reference = the policy as RL began: the SFT result, else --model
            sft_ckpts = sorted(glob.glob(os.path.join(args.run_dir, "ckpt-sft-*[0-9]")))
            src = sft_ckpts[-1] if "sft" in run_stages and sft_ckpts else args.model
            ref_model, _ = model_lib.load_model(src, device=device, seed=args.seed, tiny_corpus=rollout.prompt_corpus())
            ref_model.requires_grad_(False)
        start = step0 if state and stage0 == "rl" else 0
        if state and stage0 == "rl" and state["optimizer"]:
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng_torch"])
            random.setstate(state["rng_random"])
        close_ids = [ids[t] for t in ("</think>", "</tool_call>", "</answer>") if ids.get(t) is not None]
        warned, rl_bad = set(), 0                     # record ids whose video failed (warn once each), failed samples
        video_id = model.config.video_token_id
        for step in tqdm(range(start + 1, args.rl_steps + 1), desc="rl", disable=rank != 0, initial=start,
                         total=args.rl_steps):
            t0 = time.time()
            lr = get_lr(step - 1, args.rl_steps, args.lr, args.warmup_steps)
            for g in optimizer.param_groups:
                g["lr"] = lr
            # ----- rollouts: each rank its own prompts, K gated per prompt (same K for its group)
            rng = random.Random(f"rl:{args.seed}:{step}:{rank}")
            recs = [train_recs[rng.randrange(len(train_recs))] for _ in range(args.prompts_per_step)]
            ks = [rewards.gate_nframes(r["id"], step, args.gating_choices, seed=args.seed) if args.gating else None for r in recs]
            model.eval()
            with full_weights(model):
                trajs = rollout.run_agent(model, processor, recs, video_root, cfg,
                                          seed=args.seed * 1_000_003 + step * 101 + rank, nframes=ks)
            # ----- rewards and advantages
            scored = [score_trajectory(t, recs[i // args.group_size], args.recipe, args.anchoring, args.released_scoring)
                      for i, t in enumerate(trajs)]
            R = torch.tensor([s for s, _ in scored])
            adv = rewards.group_advantages(R, args.group_size, shaping=args.shaping)
            zero_var = rewards.zero_variance_groups(R, args.group_size)
            keep = torch.tensor([t.error is None and t.token_ids != [] and trainable(t, video_id) for t in trajs])
            if args.mask_truncated:
                keep &= torch.tensor([not (t.truncated or t.hit_turn_limit) for t in trajs])
            if args.dynamic_sampling:
                keep &= ~zero_var.repeat_interleave(args.group_size)
            n_failed = sum(t.error is not None for t in trajs)
            rl_bad += n_failed
            counters["bad_samples"] += n_failed
            for t in trajs[::args.group_size]:
                if t.error is not None and t.record_id not in warned:
                    warned.add(t.record_id)
                    print(f"skipped sample {t.record_id} (rl step {step}, rank {rank}): {t.error}", flush=True)
            if rl_bad > args.max_bad_fraction * (step - start) * len(trajs) and step - start > 5:   # this run's RL samples
                raise RuntimeError(f"more than {args.max_bad_fraction:.0%} of samples failed by step {step}: "
                                   f"see the skipped-sample messages above")
            items = [(t, float(adv[i]), comps) for i, (t, (_, comps)) in enumerate(zip(trajs, scored)) if keep[i]]
            if args.train_subagents:
                items += [(s, a, c) for t, a, c in list(items) for s in t.subagents if trainable(s, video_id)]
            stats = {"clip_frac": 0.0, "kl": 0.0, "loss": 0.0}   # no kept sample: no update this step
            gn = None
            model.train()
            if (len(items) if world == 1 else all_min(len(items))) > 0:   # FSDP: every rank updates, or none
                gn, stats = policy_update(model, ref_model, optimizer, items, args, pad_id, close_ids, step, rank,
                                          optimizer_step)
            # ----- log
            m = rollout_metrics(trajs, [c for _, c in scored])
            m.update(reward=float(R.mean()), zero_var_frac=float(zero_var.float().mean()), kept=len(items),
                     grad_norm=gn if gn is not None else float("nan"), lr=lr, step_time=time.time() - t0,
                     tokens_per_s=sum(len(t.token_ids) for t in trajs) / (time.time() - t0), **stats)
            m = all_mean(m, world)
            if rank == 0:
                append_metrics(metrics_path, {"stage": "rl", "step": step, **m, **counters})
                tqdm.write(f"rl {step}/{args.rl_steps} | R {m['reward']:.3f} | acc {m['accuracy']:.2f} | "
                           f"fmt {m['format_compliance']:.2f} | tool {m['tool_call_ratio']:.2f} | "
                           f"turns {m['turns']:.2f} | K {m['mean_k']:.1f} | zero-var {m['zero_var_frac']:.2f} | "
                           f"clip {m['clip_frac']:.3f} | kl {m['kl']:.4f} | {m['step_time']:.1f}s")
            if args.eval_every and step % args.eval_every == 0:   # every rank (FSDP gathers), rank 0 prints
                print0(rank, "eval:", json.dumps(evaluate_split(model, processor, held, video_root, cfg)))
            if step % args.save_every == 0 or step == args.rl_steps:
                save0(rank, world, args.run_dir, step, model, processor, optimizer, {"stage": "rl", "counters": counters})
        model.eval()
    # ----- summary
    if args.stage == "all" or args.final_eval:
        summary["after"] = evaluate_split(model, processor, held, video_root, cfg)
        summary["seconds"] = round(time.time() - t_start, 1)
        if rank == 0:
            png = plot_run(args.run_dir) if "rl" in run_stages else None
            cols = [s for s in ("before", "sft", "after") if s in summary]
            print(f"{'':18s}" + "".join(f"{ {'sft': 'SFT', 'after': 'final'}.get(s, s):>10s}" for s in cols))
            for k in summary["after"]:
                print(f"{k:18s}" + "".join(f"{summary[s][k]:10.3f}" for s in cols))
            print(f"curves: {png}")
            print(json.dumps(summary))
    if os.environ.get("PARAVT_DUMP_PARAMS"):         # tests: a digest of each full weight as this rank sees it
        digests = {n: hashlib.sha256((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                                     .numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}
        with open(f"{os.environ['PARAVT_DUMP_PARAMS']}.rank{rank}.json", "w") as f:
            json.dump(digests, f)
    if world > 1:
        dist.destroy_process_group()
    return summary


def sft_examples(args, records, processor, video_root, cfg, rank) -> tuple[list, int]:
    """(encoded SFT trajectories, number skipped): bad records are skipped and counted, never fatal unless most are bad."""
    errors, pairs = [], []
    if args.sft_data:                    # trajectory records: {"id", "video", "prompt" | prompt fields, "messages"}
        with open(args.sft_data) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    pairs.append((r.get("prompt") or r, r["messages"], f"{args.sft_data}:{n}", None))
                except (json.JSONDecodeError, KeyError, AttributeError) as e:
                    errors.append(f"{args.sft_data}:{n}: not a trajectory record ({type(e).__name__}: {e})")
    else:  # oracle trajectories of the synthetic task: each record with the evaluation overview, and with
        # --sft-gated-overviews once more with a K drawn from the gating choices (RL's gated overviews)
        rng = np.random.default_rng(args.seed)
        k_eval = cfg.overview_nframes or 8
        choices = args.gating_choices if args.sft_gated_overviews else []
        for r in records:
            for k in [k_eval] + ([int(rng.choice(choices))] if choices else []):
                try:
                    msgs = data.oracle_turns(r, rng, always_call=args.always_call, nframes=k,
                                             direct_crop=args.direct_crop)
                    pairs.append((r, msgs, r["id"], k))
                except (ValueError, KeyError) as e:
                    errors.append(f"{r.get('id')}: no oracle trajectory ({e}); pass --sft-data for real data")
    items = []
    for rec, msgs, where, k in pairs:        # k: the overview's frame count (None: the rollout's own rule)
        try:
            items.append(rollout.encode_messages(processor, rec, msgs, video_root, cfg, nframes=k))
        except (ValueError, KeyError, OSError) as e:
            errors.append(f"{where}: {e}")
    for e in errors[:5]:
        print0(rank, f"skipped SFT record: {e}")
    if not items or len(errors) > args.max_bad_fraction * (len(items) + len(errors)):
        raise ValueError(f"{len(errors)} of {len(items) + len(errors)} SFT records are bad; first: {errors[:3]}")
    return items, len(errors)


def policy_update(model, ref_model, optimizer, items, args, pad_id, close_ids, step, rank, optimizer_step):
    """GRPO update on the kept trajectories: ppo_epochs passes of micro-batches; with several epochs the old
    log-probs are recomputed first by a no-grad forward (with one, they equal the current ones)."""
    chunks = [items[i:i + args.micro_batch] for i in range(0, len(items), args.micro_batch)]
    batches = [rollout.collate([t for t, _, _ in c], model, pad_id) for c in chunks]
    advs = []
    for c, b in zip(chunks, batches):
        a = torch.tensor([x for _, x, _ in c])[:, None].expand(-1, b["input_ids"].shape[1] - 1).clone()
        if args.anchoring == "token":       # anchor credit on the closing-tag tokens only (SPEC 4.1)
            tags = rewards.anchor_token_mask(b["input_ids"][:, 1:], close_ids)
            a += 0.5 * torch.tensor([cm["anchor"] for _, _, cm in c])[:, None] * tags
        advs.append(a)
    with torch.no_grad(), full_weights(model):
        old = [forward_logprobs(model, b, args.logprob_chunk, compile=bool(args.compile)) if args.ppo_epochs > 1
               else None for b in batches]
        ref = [forward_logprobs(ref_model, b, args.logprob_chunk, compile=bool(args.compile)) if ref_model is not None else None for b in batches]
    n_total = sum(int((b["roles"][:, 1:] == 1).sum()) for b in batches)
    # FSDP: every rank must run as many forward/backward passes (each all-gathers and reduce-scatters)
    pad = -all_min(-len(batches)) - len(batches) if dist.is_initialized() else 0
    gn, stats_sum = None, {"clip_frac": 0.0, "kl": 0.0}
    for epoch in range(args.ppo_epochs):
        total = torch.zeros(())
        for b, o, a, r in zip(batches, old, advs, ref):
            loss, st = grpo_step_loss(model, b, o, a, r, args)
            n = int((b["roles"][:, 1:] == 1).sum())
            (loss * n / max(1, n_total)).backward()     # token-mean over the whole batch, across micro-batches
            total = total + loss.detach() * n / max(1, n_total)
            for k in stats_sum:
                stats_sum[k] += float(st.get(k, 0.0)) * n / max(1, n_total) / args.ppo_epochs
        for _ in range(pad):                           # zero-weight passes: no gradient, matching collectives
            (grpo_step_loss(model, batches[-1], old[-1], advs[-1], ref[-1], args)[0] * 0.0).backward()
        gn = optimizer_step(optimizer, step, total, "rl", [t.record_id for t, _, _ in items])
        stats_sum["loss"] = float(total)             # the last epoch's token-mean loss
    return gn, stats_sum


def save0(rank, world, run_dir, step, model, processor, optimizer, extra) -> None:
    """Checkpoint from rank 0 (FSDP: the full state dict gathered first, on every rank)."""
    state_dict = None
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_checkpoint(run_dir, step, model, processor, optimizer if world == 1 else None,
                        {**extra, "step": step}, state_dict)
    if world > 1:
        dist.barrier()


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


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


def launch(args) -> None:
    """The launcher: torchrun's environment, `--gpus N` processes spawned here, or one process.
    A bad device request, or a --run-dir holding another run, is a ValueError before anything starts."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible (use --device cpu, or leave --device auto)")
    if args.gpus is None:   # default: every visible CUDA device, or one CPU process
        args.gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 1
    spawn = "RANK" not in os.environ and (args.gpus or 1) > 1
    if spawn and args.device != "cpu" and args.gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {args.gpus} but only {torch.cuda.device_count()} CUDA devices are visible "
                         f"(use --device cpu for a gloo run on CPU)")
    first = os.environ.get("RANK", "0") == "0"       # under torchrun, rank 0 checks (before any rank writes)
    if first and not args.plot and (why := stale_run(args.run_dir, args.stage, args.resume)):
        raise ValueError(why)
    if args.plot:
        print(plot_run(args.plot))
    elif "RANK" in os.environ:                        # started by torchrun (multi-node, or habit)
        main(int(os.environ.get("LOCAL_RANK", 0)), args)
    elif spawn:                                       # python train.py --gpus 8
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        torch.multiprocessing.spawn(main, args=(args,), nprocs=args.gpus)
    else:                                             # one GPU or CPU: no process group
        main(0, args)


if __name__ == "__main__":
    launch(parse_args())
