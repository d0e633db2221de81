"""
The kernels: the fused linear log-prob gather and loss, TDAM's attention without an L x L mask, and the rollout's
sampler.
Plain PyTorch plus `torch.compile` on the per-chunk softmax math; train.py holds the equations that use them.
(Named ops.py, not kernels.py: transformers imports a top-level `kernels` module if one is importable.)

1. Hidden states x lm_head -> per-token log-probs, never the (N, V) logits (V = 151,936 for Qwen):
     token_logprobs(hidden (..., D), W (V, D), targets (...)) -> log p(target) (...)     4 GEMMs with its backward
   the fused log-prob gather (chunks of the logits in one (V, C) buffer, the softmax math compiled, a
   hand-written backward; Liger-Kernel's fused linear cross-entropy, arXiv 2410.10989, returning per-token
   log-probs): the old and reference log-probs, and the log p that train.py's GRPO and SFT losses take.
   `policy_rows` gathers the policy tokens of (B, L) batches into the (N, ...) rows the kernels take.
2. TDAM (Video-o3, arXiv 2601.23224), the tensor side: `tdam_rects` states the two masking rules as rectangles
   of (query, key) ranges; `tdam_mask` / `to_additive_mask` build the dense (L, L) form from them (tests, small
   inputs); `TdamSpec` + `tdam_attention` (which a decoder layer calls when its forward has the `tdam` keyword,
   layers.attention) attend block-sparse:
   `tdam_tiles` sorts (query tile, key tile) pairs into skipped / unmasked / causal / masked from the rectangles,
   and one of two kernels attends the rest, flex_attention (CUDA) or a blocked CPU flash kernel; no L x L tensor
   ever exists. Which spans of a trajectory the rules apply to is found from its text in sft.py (`tdam_spans`).
     tdam_attention(q (B, H, L, d), k / v (B, H_kv, L, d), TdamSpec, scaling) -> (B, L, H, d)
3. Sampling, one (B, V) operation a decode step on the logits' device (rollout.Engine.step calls it):
     sample_tokens(logits (B, V), seeds (B,), counters (B,), T, top_p) -> tokens (B,)
   Gumbel-max over a counter-based hash (`uniform_noise`): a row's draw depends on its seed and draw index only.

Sizes and devices that choose a path (each path runs in tests, sizes shrunk): _MIN_CHUNK_LOGITS (token_logprobs'
plain path below it, chunk_size None), MAX_CHUNKS (the default chunk rule), the chunk size itself (padding of the last chunk);
TdamSpec.block (the tile side: how many tiles, which ones a rectangle's edge crosses), `tdam_kernel` (flex on
FLEX_DEVICES, blocked elsewhere, or TdamSpec.kernel).
"""
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# -----------------------------------------------------------------------------
# 1. Chunked log-probabilities: hidden states x lm_head -> log p(token), never the (N, V) matrix

# `TOKEN_LOGPROBS_COMPILE=0` runs the chunk kernels of token_logprobs eagerly everywhere
# (for debugging and pdb). `TORCH_COMPILE_DISABLE=1` does the same for every torch.compile in the process.
_compiled_kernels: dict = {}
_MIN_CHUNK_LOGITS = 1 << 23   # the losses' smallest chunk buffer, in elements (32 MB fp32); below it, no chunks
MAX_CHUNKS = 8                  # the default chunk rule splits a loss into at most this many chunks (_auto_chunk)

# Layout: a chunk of C tokens has its logits vocab-major, logits^T = W h_c^T of shape (V, C), in one reused buffer,
# so the GEMMs are (V, D) x (D, C), (D, V) x (V, C) and (V, C) x (C, D) (why vocab-major: docs/method.md §8).


def _kernel(fn, use_compile: bool):
    """The chunk kernel `fn`, compiled on first use (`_CompiledKernel`), or `fn` itself when compile is off."""
    if not use_compile or os.environ.get("TOKEN_LOGPROBS_COMPILE", "1") == "0":
        return fn
    if fn not in _compiled_kernels:
        _compiled_kernels[fn] = _CompiledKernel(fn)
    return _compiled_kernels[fn]


class _CompiledKernel:
    """
    A chunk kernel under torch.compile(dynamic=False, fullgraph=True), called so that one graph serves a whole
    run: the two values that change within a run are graph inputs, not constants (as constants, SFT's widths at
    T = 1 then RL's at T = 0.7 would pass Dynamo's recompile limit and run eagerly).
      - the chunk width C, the last dim of every tensor argument (the (V, C) buffer, the (C,) vectors), is marked
        dynamic: one symbol; V, the dtypes and the device stay static (fixed within a run);
      - a float argument (the temperature) is passed as a 0-dim fp32 tensor on the buffer's device.
    So each kernel compiles once per (V, dtype, device): 8 such in one process before the limit. Widths of 1 would
    specialise (Dynamo's 0/1 rule), so the callers pad chunks to at least 2 rows (_MIN_WIDTH). Past the limit,
    fullgraph=True raises FailOnRecompileLimitHit (as it raises on a graph break) instead of falling back to eager.
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def __call__(self, *args):
        device = args[0].device
        call = []
        for a in args:
            if isinstance(a, float):
                a = torch.full((), a, dtype=torch.float32, device=device)   # an input: any T, one graph
            elif a.dim():
                torch._dynamo.mark_dynamic(a, a.dim() - 1)                    # the chunk width C
            call.append(a)
        return self.compiled(*call)


_MIN_WIDTH = 2   # the narrowest chunk: a width of 1 would compile a graph of its own (see _CompiledKernel)


def _chunk_logprobs(logits_t, targets, temperature: float):
    """One chunk forward: logits^T (V, C) -> log p(target) (C,) and logsumexp (C,) of logits / T, both fp32."""
    z = logits_t.float()                                          # the upcast fuses into the reductions
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:   # eager T = 1 skips it; compiled T is a
        z = z / temperature                                       # tensor (z / 1 is exact: the plain model)
    if torch.compiler.is_compiling():
        # compiled, the sum over the vocab (the buffer's outer axis) runs serially per column: in fp32 it is off
        # by ~1.6e-5 at V = 151,936, summed in fp64 by ~1.2e-6, at the same speed
        m = z.amax(dim=0)                                         # (C,)
        lse = m + torch.log(torch.exp(z - m).sum(dim=0, dtype=torch.float64)).float()
    else:
        lse = torch.logsumexp(z, dim=0)                           # (C,); eager ATen's sum: ~1.1e-6 in fp32
    target_logit = z.gather(0, targets[None, :]).squeeze(0)       # (C,)
    return target_logit - lse, lse


def _chunk_grad_logits_(logits_t, targets, lse, grad_out, temperature: float):
    """One chunk backward, in place: logits^T (V, C) <- (g / T) (onehot(t) - softmax(logits / T)), vocab-major."""
    z = logits_t.float()
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:   # as in _chunk_logprobs
        z = z / temperature
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
        grad_out = grad_out.float().contiguous()     # an expanded upstream (the grad of a sum) has stride 0
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
                   chunk_size: int | None = 1024, *, compile: bool, temperature: float) -> torch.Tensor:
    """
    log p(target) per token from final hidden states at temperature T, without the (N, V) logits:

        logp_i = z_i[t_i] - logsumexp_v z_i[v],   z_i = h_i W^T / T
        grad z_i = (g_i / T) (onehot(t_i) - softmax(z_i))      (the backward recomputes each chunk's logits)

    Shapes: hidden (..., D), lm_head_weight (V, D), targets (...) int64 -> (...) fp32. Chunks of C tokens share
    one (V, C) buffer (O(C V) memory, not O(N V)); chunk_size None: plain log_softmax when the logits are small,
    else `_auto_chunk`. The chunks' softmax math runs under torch.compile (`_CompiledKernel`) unless compile is off
    or TOKEN_LOGPROBS_COMPILE=0. Call it outside any compiled region. Source: Liger-Kernel's fused linear +
    cross-entropy (arXiv 2410.10989), returning per-token log-probs; design and measurements: docs/method.md §8.
    """
    _check_head("token_logprobs", hidden, lm_head_weight, targets)
    _check_temperature("token_logprobs", temperature)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1 or None, got {chunk_size}")
    lead_shape, (vocab, dim) = targets.shape, lm_head_weight.shape
    hidden, targets = hidden.reshape(-1, dim), targets.reshape(-1).long()  # (N, D), (N,)
    n = targets.shape[0]
    if chunk_size is None and n * vocab <= _MIN_CHUNK_LOGITS:     # small logits: plain autograd, no chunks
        logits = (hidden @ lm_head_weight.T).float() / temperature
        return F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1).reshape(lead_shape)
    if chunk_size is None:
        chunk_size = _auto_chunk(n, dim, vocab)
    chunk = max(min(chunk_size, 1 << max(n - 1, 0).bit_length()), _MIN_WIDTH)  # N < C: next power of two >= N
    return _TokenLogprobs.apply(hidden, lm_head_weight, targets, chunk, float(temperature),
                                compile).reshape(lead_shape)


def _liger_chunk(n: int, dim: int, vocab: int) -> int:
    """Liger-Kernel's chunk (arXiv 2410.10989): C = next_pow2(ceil(N / ceil(V / D))), a (C, V) buffer the size of
    the (N, D) hidden states; at least _MIN_CHUNK_LOGITS / V rows."""
    chunk = -(-n // -(-vocab // dim))                              # ceil(N / ceil(V / D))
    chunk = max(chunk, -(-_MIN_CHUNK_LOGITS // vocab), 1)
    return 1 << (chunk - 1).bit_length()                           # the next power of two


def _auto_chunk(n: int, dim: int, vocab: int) -> int:
    """token_logprobs' default chunk (chunk_size None): Liger's, at most MAX_CHUNKS chunks,
    C = next_pow2(max(ceil(N / ceil(V / D)), ceil(N / MAX_CHUNKS))) (the departure: docs/method.md §8)."""
    chunk = max(_liger_chunk(n, dim, vocab), -(-n // MAX_CHUNKS))
    return 1 << (chunk - 1).bit_length()


def policy_rows(name: str, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, **per_token):
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


# -----------------------------------------------------------------------------
# 2. TDAM: Task-Decoupled Attention Masking (Video-o3 SFT), the tensor side


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


@dataclass
class TdamSpec:
    """TDAM for a batch without an L x L mask: each row's length (B,) and its masked rectangles (B, M, 4) =
    (q0, q1, k0, k1), empty ones (0, 0, 0, 0) padding M. Passed to the model as the `tdam` keyword, read by
    `tdam_attention`. `block`: the side of the square tiles the kernels skip or attend (query rows = key columns;
    memory O(block x L) per head at most, never O(L x L)); `kernel`: "auto" (`tdam_kernel`), "flex" or "blocked".
    `plan`: for the blocked kernel, runs that need no mask at all, [(row, q0, q1, [(k0, k1, FULL or CAUSAL)])]
    covering every (row, query) once, where the spec's maker knows its segments; None: the tile plan."""
    lengths: torch.Tensor
    rects: torch.Tensor
    block: int = 256
    kernel: str = "auto"
    plan: list | None = None      # the blocked kernel's exact runs, when the maker knows them (policy.pack_prompts)

    def allowed(self, q0: int, q1: int, kv_len: int, device, k0: int = 0) -> torch.Tensor:
        """(B, 1, q1 - q0, kv_len - k0) bool, queries [q0, q1) x keys [k0, kv_len): causal, padding (a pad row sees
        only itself), minus the rectangles."""
        q = torch.arange(q0, q1, device=device)[None, :, None]
        k = torch.arange(k0, kv_len, device=device)[None, None, :]
        n = self.lengths.to(device)[:, None, None]
        ok = torch.where(q < n, k <= q, k == q)                  # causal; a pad row sees itself only
        for r in self.rects.to(device).unbind(1):                # (B, 4) each
            ok &= ~((q >= r[:, 0, None, None]) & (q < r[:, 1, None, None]) &
                    (k >= r[:, 2, None, None]) & (k < r[:, 3, None, None]))
        return ok[:, None]


EMPTY, MASKED, FULL, CAUSAL = 0, 1, 2, 3   # tile kinds: skipped, own small mask, no mask, is_causal (the diagonal)


def tdam_tiles(spec: TdamSpec, seq_len: int) -> torch.Tensor:
    """
    (B, T, T) int8: the kind of each (query tile, key tile) pair, tiles of `spec.block` positions, T = ceil(L / block),
    from the lengths and rectangles alone (O(B T^2 M) work, never L x L). Row b of length n, query tile [qs, qe),
    key tile [ks, ke), real rows [qs, min(qe, n)):
      EMPTY   no query of the tile may see a key of it: all keys after every real row, or one rectangle covers the
              real rows x keys; and no pad row (which sees only itself) has its own key there
      FULL    every query sees every key: ke - 1 <= qs, no rectangle meets the tile, no pad row
      CAUSAL  a diagonal tile (ks = qs) that only the causal rule cuts: attended with is_causal, no mask
      MASKED  the rest (rectangle edges, pad rows): attended with the tile's own mask from `TdamSpec.allowed`
    Only FULL and EMPTY claim anything, and each is exact; MASKED is always correct, just slower.
    """
    b = spec.block
    starts = torch.arange(0, seq_len, b)
    ends = (starts + b).clamp(max=seq_len)
    qs, qe = starts[None, :, None], ends[None, :, None]                   # (1, T, 1)
    ks, ke = starts[None, None, :], ends[None, None, :]                   # (1, 1, T)
    n = spec.lengths.cpu()[:, None, None]                                 # (B, 1, 1)
    real_end, has_pad = torch.minimum(qe, n), qe > n                      # (B, T, 1)
    r0, r1, r2, r3 = spec.rects.cpu()[:, None, None].unbind(-1)          # (B, 1, 1, M) each
    meets = ((r0 < real_end[..., None]) & (r1 > qs[..., None]) & (r2 < ke[..., None]) & (r3 > ks[..., None])).any(-1)
    covers = ((r0 <= qs[..., None]) & (r1 >= real_end[..., None]) & (r2 <= ks[..., None]) &
              (r3 >= ke[..., None])).any(-1)                              # (B, T, T)
    sees = ks < real_end                                                  # a real row sees a key causally
    pad_self = has_pad & (torch.maximum(qs, n) < ke) & (ks < qe)          # a pad row's own key is in the tile
    clean = ~meets & ~has_pad
    kind = torch.full(meets.shape, MASKED, dtype=torch.int8)
    kind[clean & (ke - 1 <= qs)] = FULL
    kind[clean & (ks == qs)] = CAUSAL
    kind[(~sees | covers) & ~pad_self] = EMPTY
    return kind


# where "auto" runs flex_attention: CUDA. Not the CPU: torch 2.14 has no CPU backward for it, and its compiled CPU
# template differs from its eager kernel at some shapes on AVX2 (tests/test_ops.py)
FLEX_DEVICES = ("cuda",)


def tdam_kernel(spec: TdamSpec, device) -> str:
    """The kernel `tdam_attention` runs: spec.kernel, or for "auto" "flex" on FLEX_DEVICES, "blocked" elsewhere."""
    if spec.kernel not in ("auto", "flex", "blocked"):
        raise ValueError(f"TdamSpec.kernel must be 'auto', 'flex' or 'blocked', got {spec.kernel!r}")
    if spec.kernel != "auto":
        return spec.kernel
    return "flex" if torch.device(device).type in FLEX_DEVICES else "blocked"


# The blocked kernel (CPU): per query tile, ATen's CPU flash attention over each run of key tiles (no mask on FULL
# runs, is_causal on the diagonal, a (block x width) mask on MASKED runs, EMPTY skipped), merged by log-sum-exp.
# Backward: each run through the flash backward given the MERGED output and log-sum-exp, which makes its
# probabilities exp(s - lse) those of the whole row, so the per-run gradients add up. Saved: q, k, v, out, lse.
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _runs(kinds: list[int], block: int, seq_len: int) -> list[tuple[int, int, int]]:
    """One query tile's key tiles [0, i] -> (k0, k1, kind) runs: EMPTY dropped, neighbouring FULL or MASKED joined."""
    runs = []
    for j, kind in enumerate(kinds):
        k0, k1 = j * block, min((j + 1) * block, seq_len)
        if kind == EMPTY:
            continue
        if runs and runs[-1][2] == kind != CAUSAL and runs[-1][1] == k0:
            runs[-1] = (runs[-1][0], k1, kind)
        else:
            runs.append((k0, k1, kind))
    return runs


def _run_mask(spec: TdamSpec, q0: int, q1: int, k0: int, k1: int, kind: int, dtype, device):
    """The additive (B, 1, q1 - q0, k1 - k0) mask of a MASKED run (finfo.min, so a row that sees nothing in the
    run gets a log-sum-exp near finfo.min and weight 0 in the merge), None otherwise."""
    if kind != MASKED:
        return None
    ok = spec.allowed(q0, q1, k1, device, k0)
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, torch.finfo(dtype).min)


class _TdamBlocked(torch.autograd.Function):
    """Block-sparse TDAM attention on the CPU; see `tdam_attention`. q (B, H, L, d), k / v (B, H_kv, L, d)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, plan, scale):
        out = torch.empty_like(q)                                                    # (B, H, L, d)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)         # (B, H, L)
        for b, q0, q1, runs in plan:                                                 # b: a row or all rows
            outs, lses = [], []
            for k0, k1, kind in runs:
                mask = _run_mask(spec, q0, q1, k0, k1, kind, q.dtype, q.device)
                o, s = _flash(q[b, :, q0:q1], k[b, :, k0:k1], v[b, :, k0:k1], 0.0, kind == CAUSAL,
                              attn_mask=mask, scale=scale)
                outs.append(o)
                lses.append(s)
            if len(runs) == 1:
                out[b, :, q0:q1], lse[b, :, q0:q1] = outs[0], lses[0]
                continue
            s = torch.stack(lses)                                                    # (R, B, H, b)
            total = torch.logsumexp(s, dim=0)                                        # (B, H, b)
            w = torch.exp(s - total)[..., None]                                      # (R, B, H, b, 1)
            out[b, :, q0:q1] = sum(w[r] * o.float() for r, o in enumerate(outs))
            lse[b, :, q0:q1] = total
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.plan, ctx.scale = spec, plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        spec, scale = ctx.spec, ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
        for b, q0, q1, runs in ctx.plan:
            rows = (grad_out[b, :, q0:q1], q[b, :, q0:q1])
            saved = (out[b, :, q0:q1], lse[b, :, q0:q1].contiguous())
            for k0, k1, kind in runs:
                mask = _run_mask(spec, q0, q1, k0, k1, kind, q.dtype, q.device)
                gq, gk, gv = _flash_backward(*rows, k[b, :, k0:k1], v[b, :, k0:k1], *saved, 0.0, kind == CAUSAL,
                                             attn_mask=mask, scale=scale)
                dq[b, :, q0:q1] += gq
                dk[b, :, k0:k1] += gk
                dv[b, :, k0:k1] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _tdam_blocked(query, key, value, spec: TdamSpec, scaling: float) -> torch.Tensor:
    if query.device.type != "cpu":
        raise ValueError(f"TDAM's blocked kernel runs on the CPU (ATen's CPU flash attention); on "
                         f"{query.device.type} use TdamSpec.kernel='flex'")
    if spec.plan is not None:           # exact runs (rows one at a time: slices keep the batch dimension)
        plan = [(slice(b, b + 1), q0, q1, runs) for b, q0, q1, runs in spec.plan]
        return _TdamBlocked.apply(query, key, value, spec, plan, scaling)
    L, block = query.shape[2], spec.block
    tiles = tdam_tiles(spec, L)                                           # (B, T, T)
    kinds = torch.where((tiles == tiles[:1]).all(0), tiles[0], MASKED)    # one kind for the batch, else MASKED
    plan = [(slice(None), q0, min(q0 + block, L), _runs(row[:i + 1], block, L))
            for i, (q0, row) in enumerate(zip(range(0, L, block), kinds.tolist()))]
    return _TdamBlocked.apply(query, key, value, spec, plan, scaling)


# The flex kernel: torch's flex_attention (compiled; block-sparse in forward and backward) with a BlockMask whose
# block lists come from `tdam_tiles` (FULL tiles skip the mask function, MASKED and CAUSAL ones apply it, EMPTY ones
# are absent), so neither the mask nor its block lists are built by evaluating L x L positions (as
# create_block_mask would).


def _rect_table(spec: TdamSpec, seq_len: int, device):
    """The rectangles as one lookup per (q, k), whatever their number M: each position's segment between the
    rectangles' query edges, qseg (B, L), and key edges, kseg (B, L), and cut (B, S, S), S = 2M + 2: True where a
    rectangle covers the (query segment, key segment) pair. O(L + M^2) memory."""
    S, pos = 2 * spec.rects.shape[1] + 2, torch.arange(seq_len)
    qseg, kseg = (torch.zeros(len(spec.lengths), seq_len, dtype=torch.int32) for _ in range(2))
    cut = torch.zeros(len(spec.lengths), S, S, dtype=torch.bool)
    for b, row in enumerate(spec.rects.tolist()):
        row = [r for r in row if r[1] > r[0] and r[3] > r[2]]
        q_edges = sorted({0, *(x for r in row for x in r[:2])})
        k_edges = sorted({0, *(x for r in row for x in r[2:])})
        qseg[b] = torch.searchsorted(torch.tensor(q_edges), pos, right=True) - 1
        kseg[b] = torch.searchsorted(torch.tensor(k_edges), pos, right=True) - 1
        for q0, q1, k0, k1 in row:
            cut[b, q_edges.index(q0):q_edges.index(q1), k_edges.index(k0):k_edges.index(k1)] = True
    return qseg.to(device), kseg.to(device), cut.to(device)


def tdam_block_mask(spec: TdamSpec, seq_len: int, device) -> BlockMask:
    """flex_attention's BlockMask of the spec: mask_mod(b, h, q, k) = causal & no rectangle holds (q, k) (a table
    lookup, `_rect_table`), and a pad row sees only itself; its partial and full block lists from `tdam_tiles`
    (spec.block on both sides)."""
    tiles = tdam_tiles(spec, seq_len)                                     # (B, T, T)

    def block_lists(sel):      # (B, T, T) bool -> counts (B, 1, T), indices (B, 1, T, T), selected tiles first
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)
        return sel.sum(-1)[:, None].to(device, torch.int32), order[:, None].to(device, torch.int32)

    lengths, (qseg, kseg, cut) = spec.lengths.to(device), _rect_table(spec, seq_len, device)

    def mask_mod(b, h, q, k):
        return torch.where(q < lengths[b], (k <= q) & ~cut[b, qseg[b, q], kseg[b, k]], k == q)

    return BlockMask.from_kv_blocks(*block_lists((tiles == MASKED) | (tiles == CAUSAL)), *block_lists(tiles == FULL),
                                    BLOCK_SIZE=spec.block, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)          # compiled on first use; a new length recompiles once, then dynamic


def _tdam_flex(query, key, value, spec: TdamSpec, scaling: float) -> torch.Tensor:
    mask = tdam_block_mask(spec, query.shape[2], query.device)
    return _compiled_flex()(query, key, value, block_mask=mask, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])


def tdam_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tdam: TdamSpec,
                   scaling: float) -> torch.Tensor:
    """TDAM's masked attention, out_i = sum_j softmax_j(q_i k_j / sqrt(d)) v_j over the keys row i may see
    (TdamSpec.allowed), tile by tile (`tdam_tiles`), never L x L: flex_attention on CUDA, ATen's CPU flash
    attention merged by log-sum-exp on the CPU (`tdam_kernel`; docs/method.md §6). query (B, H, L, d),
    key / value (B, H_kv, L, d) -> (B, L, H, d), all three in autocast's dtype as SDPA."""
    kernel = _tdam_flex if tdam_kernel(tdam, query.device) == "flex" else _tdam_blocked
    # as SDPA under autocast: all three in its dtype (Qwen3-VL's q / k norms return fp32 beside bf16 values)
    dtype = autocast_dtype(query.device.type)
    if dtype is not None:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return kernel(query, key, value, tdam, scaling).transpose(1, 2).contiguous()


def autocast_dtype(device: str) -> torch.dtype | None:
    """The dtype autocast computes in on `device` ("cpu" / "cuda": --precision bf16 on fp32 master weights), or
    None where autocast is off."""
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


# -----------------------------------------------------------------------------
# sampling: one (B, V) operation per decode step, on the logits' device (rollout.Engine.step)

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "hash32" finaliser: xor-shift, multiply by 0x45d9f3b, twice) on int64
    tensors holding values < 2^32; the constant is < 2^27, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) uniforms u = (k + 0.5) / 2^23 in (0, 1), k the top 23 bits of a counter-based hash of (row seed, draw
    index, token id): row b's depend on (seeds[b], counters[b]) only, on any device, with no torch.Generator; exact
    in fp32 and inside [2^-24, 1 - 2^-24], so the Gumbel term -log(-log u) is finite."""
    s = seeds.long()
    key = _mix32(_mix32(_mix32(s & _M32) ^ ((s >> 32) & _M32)) ^ (counters.long() & _M32))      # (B,)
    tok = _mix32((torch.arange(vocab, device=seeds.device) * 0x9E3779B1 + 0x7F4A7C15) & _M32)   # (V,)
    x = _mix32(_mix32(key[:, None] ^ tok[None]) ^ key[:, None])                                 # (B, V)
    return ((x >> 9).float() + 0.5) / 2.0 ** 23


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, temperature: float,
                  top_p: float) -> torch.Tensor:
    """(B,) tokens from (B, V) logits, all rows in one operation on the logits' device. Greedy when
    temperature == 0; else softmax(logits / T) restricted to the nucleus (the smallest set of top
    tokens whose mass reaches top_p; the top token always stays), drawn by Gumbel-max:
        token = argmax_v (logits_v / T + g_v),  g_v = -log(-log u_v),  u = uniform_noise(seed, counter)
    which is an exact draw from that distribution (Gumbel 1954; the trick of Maddison et al. 2014).
    A banned token (logit -inf, or outside the nucleus) keeps score -inf whatever its noise, so it is never
    drawn: the noise is finite by construction, and the where() below holds even if it were not (-inf + inf
    would be NaN, which argmax picks)."""
    if temperature <= 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_s, order = scores.sort(-1, descending=True)
        p = torch.softmax(sorted_s, -1)
        drop = p.cumsum(-1) - p >= top_p                   # mass before this token already reaches top_p
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_s.masked_fill(drop, float("-inf")))
    u = uniform_noise(seeds.to(logits.device), counters.to(logits.device), logits.shape[-1])
    noisy = scores - torch.log(-torch.log(u))
    return torch.where(scores == float("-inf"), scores, noisy).argmax(-1)


# -----------------------------------------------------------------------------
# 4. The exact mode (--set exact_policy=1): the engine's numbers and the trainer's, the same bytes

EXACT_ROWS = 32           # rows of every matmul's tile: each row meets one GEMM shape, (EXACT_ROWS, D) x (D, O)
EXACT_KEYS = 64           # keys of each block of `exact_attention`, blocks aligned at a row's first token
EXACT_QUERIES = 16        # query positions of each pass of `exact_attention` (bounds its scores; no effect on values)


class _Tiles(torch.autograd.Function):
    """rows (t R, D) @ weight (O, D)^T (+ bias) as t products of one shape (R, D) x (D, O), R = EXACT_ROWS, in one
    batched call (the weight broadcast, not copied); the backward is the plain linear's (a gradient need not be
    batch-invariant)."""

    @staticmethod
    def forward(ctx, rows, weight, bias):
        ctx.save_for_backward(rows, weight)
        ctx.bias = bias is not None
        out = torch.bmm(rows.reshape(-1, EXACT_ROWS, rows.shape[1]), weight.t().expand(rows.shape[0] // EXACT_ROWS, -1, -1))
        out = out.view(rows.shape[0], -1)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ rows, grad.sum(0) if ctx.bias else None


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x (..., D), weight (O, D)) on tiles of EXACT_ROWS rows, the last one zero-padded. A BLAS library picks
    its kernel and its summation order by the shape (a GEMV for one row, another blocking for 40 rows), so one
    token's row comes out different in a decode step of 3 rows and in a training forward of 3,000; on a fixed tile
    the row's result depends on its own values alone (tests/test_exact.py). Under autocast the operands are cast to
    its dtype first, as F.linear's are."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n % EXACT_ROWS:
        rows = torch.cat([rows, rows.new_zeros(EXACT_ROWS - n % EXACT_ROWS, rows.shape[1])])
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        rows, weight, bias = rows.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return _Tiles.apply(rows, weight, bias)[:n].view(*x.shape[:-1], -1)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """Causal attention whose every output depends on its query and its keys alone, whoever shares the call: the one
    routine of the exact mode for the engine's prefill and decode (kvcache.GroupKV) and the training forward
    (layers.attention). q (n, H, m, d); k / v (n, H_kv, c, d), key j of a row its token j; qpos (n, m) each query's
    token index (key j seen where j <= qpos) -> (n, H, m, d) fp32.
        s_j = scale (q . k_j),  M = max_j s_j,  p_j = e^(s_j - M),
        out = (sum_b sum_(j in b) p_j v_j) / (sum_b sum_(j in b) p_j)      b: blocks of EXACT_KEYS keys, from token 0
    Every matmul has one shape whatever the batch: a query position's g = H / H_kv heads against one key block,
    (g, d) x (d, EXACT_KEYS), then (g, EXACT_KEYS) x (EXACT_KEYS, d); a block sums its keys in one fixed-length
    reduction, and the blocks are summed left to right (cumsum). A key past the query weighs e^-inf = 0, so the keys
    and blocks after it add exact zeros: a decode step over its row's keys and a training forward over the whole row
    give the same bits. Keys are read in the values' dtype, as the engine's pool stores them (kvcache.BlockPool.write);
    the math is fp32 with autocast off. The cost: the (m, c) scores of EXACT_QUERIES positions at a time, no fused
    kernel."""
    with torch.autocast(q.device.type, enabled=False):
        n, H, m, d = q.shape
        k = k.to(v.dtype)
        q, k, v = q.float(), k.float(), v.float()
        kv, c, B = k.shape[1], k.shape[2], EXACT_KEYS
        g = H // kv
        if c % B:
            k, v = (F.pad(t, (0, 0, 0, B - c % B)) for t in (k, v))
        nb = k.shape[2] // B
        kblocks, vblocks = k.reshape(n * kv, nb, B, d), v.reshape(n * kv, nb, B, d)  # each (row, K/V head, block)
        qg = q.reshape(n * kv, g, m, d)
        keys = torch.arange(nb * B, device=q.device).view(nb, 1, B)
        outs = []
        for a in range(0, m, EXACT_QUERIES):
            pos = qpos[:, a:a + EXACT_QUERIES]                                  # (n, mq)
            mq = pos.shape[1]
            # the blocks after the last query's add exact zeros: left out where that is known without a device sync
            b = nb if pos.device.type != "cpu" else min(nb, int(pos.max()) // B + 1)
            kt, vt = (x if b == nb else x[:, :b].contiguous() for x in (kblocks, vblocks))
            kt, vt = kt.view(-1, B, d).transpose(1, 2), vt.view(-1, B, d)      # (n kv b, d, B), (n kv b, B, d)
            # one (g, d) x (d, B) product a query position, row, K/V head and block: the same shape in any call
            qs = qg[:, :, a:a + mq].permute(2, 0, 1, 3)[:, :, None].expand(-1, -1, b, -1, -1).reshape(mq, -1, g, d)
            s = torch.stack([torch.bmm(qs[i], kt) for i in range(mq)]).view(mq, n, kv, b, g, B) * scale
            s = s.masked_fill(keys[:b] > pos.t()[:, :, None, None, None, None], float("-inf"))
            p = torch.exp(s - s.amax((3, 5), keepdim=True))
            total = p.sum(-1).cumsum(3)[:, :, :, -1]                            # (mq, n, kv, g)
            acc = torch.stack([torch.bmm(p[i].view(-1, g, B), vt) for i in range(mq)])
            acc = acc.view(mq, n, kv, b, g, d).cumsum(3)[:, :, :, -1]           # (mq, n, kv, g, d)
            outs.append((acc / total[..., None]).permute(1, 2, 3, 0, 4).reshape(n, H, mq, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)
