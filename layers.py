"""
The text decoder's layer in plain calls: Qwen3-VL's pre-norm block (Qwen2.5-VL's is the same without the per-head
q / k norms, with q / k / v biases), and the attention it runs picked by its forward's keywords, not looked up in
transformers' attention registry.

    n = RMSNorm(x)                                      RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
    q, k, v = W_q n, W_k n, W_v n                       Qwen3-VL: q, k RMS-normed per head
    q, k = rope(q), rope(k)                             rope(x) = x cos + rotate_half(x) sin   (M-RoPE's cos, sin)
    h = x + W_o attention(q, k, v)
    y = h + W_down (silu(W_gate m) * W_up m),           m = RMSNorm(h)

`use_plain_layers(model)` gives every decoder layer of a loaded model `PlainLayer.forward`: the same modules,
parameters and names (a checkpoint saves and loads unchanged, FSDP2 wraps the layers as before, gradient
checkpointing is the layer base class's, which replays this forward with the same keywords). The attention:
    rollout_cache=GroupKV   the engine's paged cascade attention: the new keys / values into the cache's pool
                            (kvcache.GroupKV.write), then the queries over [prompt ; own suffix] (GroupKV.attend)
    tdam=TdamSpec           TDAM's block-sparse attention (ops.tdam_attention; SFT with --tdam)
    neither                 SDPA with the mask the text model built (training, evaluation, plain forwards), over
                            the keys / values of transformers' `cache` where the text model passes one
                            (`model.generate`, a forward with use_cache=True: cache.update appends this forward's
                            and returns all, as transformers' attention does)
The text model around the layers (embedding, M-RoPE's cos / sin, deepstack, the final norm) stays transformers'.

Why our own forward: the same numbers in fewer launched ops, which is what a GPU decode step is bound by (the host
launches ~5-10 us an op; bench/rollout_bench.py's gpu_shape counts them). RMSNorm is one fused `rms_norm` call
(transformers' writes it as 8 ops: to, pow, mean, add, rsqrt, mul, to, mul); in the engine q, k and v stay rows of
tokens (n l, heads, d), the layout the projections give and the pool stores, so nothing is transposed back and
forth; rotate_half is one `roll` (cat(-x2, x1) = roll(x, d/2) with the sign of the first half moved onto sin, once
per forward). In fp32 and bf16 the outputs equal transformers' layer bit for bit on the CPU, and in fp32 the
gradients too (tests/test_layers.py: a training run is the same run); a CUDA build's fused `rms_norm` may round
bf16 once where transformers rounds twice.
Shapes: hidden (n, l, D); the engine's q (n l, H, d), k / v (n l, H_kv, d) (rows of tokens); training's
(n, H, l, d) and (n, H_kv, l, d); cos / sin (n, l, d).
"""
import contextlib
import functools

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ops import exact_attention, tdam_attention, tiled_linear


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """Qwen's RMSNorm (`norm`: transformers' module, its weight and variance_epsilon): w * x / sqrt(mean(x^2) + eps),
    in fp32. One fused call where x and the weight share a dtype: in fp32 bit for bit transformers' result; in bf16
    rounded once where transformers rounds twice (x / rms to bf16, then the product) (the departure: the rollout
    and the training forward both run this, so they agree). Mixed (autocast's bf16 activations on fp32 weights):
    transformers' form exactly, the product promoted to fp32 as there."""
    if x.dtype == norm.weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, rows_of_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The text model's M-RoPE (cos, sin) (n, l, d) -> their shapes for q / k (`rows_of_tokens`: (n l, 1, d) for
    (n l, heads, d), the engine's; else (n, 1, l, d) for (n, heads, l, d), training's), the sign of rotate_half
    folded into sin: rotate_half(x) sin = roll(x, d/2) * (sin with its first half negated)."""
    half, d = sin.shape[-1] // 2, sin.shape[-1]
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
    if rows_of_tokens:
        return cos.reshape(-1, 1, d), signed.view(-1, 1, d)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rotate_half(x) = cat(-x2, x1), written x cos + roll(x, d/2) signed_sin
    (`rope_tables`): the same products and sum, bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def linear(module, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """module(x) for a torch.nn.Linear; in the exact mode on fixed row tiles (ops.tiled_linear)."""
    return tiled_linear(x, module.weight, module.bias) if exact else module(x)


def attention(attn, x: torch.Tensor, tables, mask, rollout_cache=None, tdam=None, cache=None,
              exact: bool = False) -> torch.Tensor:
    """The attention block of `attn` (transformers' attention module: its projections, norms, layer_idx, scaling)
    on the normed hidden x (n, l, D) -> (n, l, H d), before W_o. `tables`: rope_tables' (cos, signed sin) in the
    layout of the path (rows of tokens for the engine, heads first for training). `rollout_cache`: the engine's
    GroupKV; `cache`: transformers' Cache (generate's), the keys / values of earlier forwards. `exact`: the exact
    mode's calls (tiled projections, ops.exact_attention over the row's tokens; the engine's GroupKV picks its own)."""
    n, l, _ = x.shape
    d = attn.head_dim
    # the engine: rows of tokens (n l, heads, d), the pool's layout; training and plain forwards: transformers'
    # (n, l, heads, d), transposed before the rotary as there, so that every gradient sums in its order too
    shape = (n * l, -1, d) if rollout_cache is not None else (n, l, -1, d)
    q, k, v = (linear(p, x, exact).view(shape) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):                                       # Qwen3-VL: RMSNorm over each head's d
        q, k = rms_norm(q, attn.q_norm), rms_norm(k, attn.k_norm)
    if rollout_cache is not None:                                     # the pool, then cascade attention
        q, k = rope(q, *tables), rope(k, *tables)
        rollout_cache.write(attn.layer_idx, k, v)
        return rollout_cache.attend(attn.layer_idx, q, k, v, attn.scaling)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)      # (n, heads, l, d)
    q, k = rope(q, *tables), rope(k, *tables)
    if cache is not None:                                             # transformers' Cache: earlier keys + these
        k, v = cache.update(k, v, attn.layer_idx)
    if exact:                                                         # token j of each row is key j
        out = exact_attention(q, k, v, torch.arange(l, device=q.device).expand(n, l), attn.scaling)
        out = out.to(torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type)
                     else q.dtype).transpose(1, 2)
    elif tdam is not None:
        out = tdam_attention(q, k, v, tdam, attn.scaling)
    else:
        out = sdpa_attention_forward(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training else 0.0,
                                     scaling=attn.scaling)[0]
    return out.reshape(n, l, -1)


class PlainNorm:
    """The forward `use_plain_layers` gives the text model's final RMSNorm (a mixin before its own class)."""

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self)


class PlainLayer:
    """The forward `use_plain_layers` gives a decoder layer (a mixin before the layer's own class)."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, rollout_cache=None, tdam=None,
                cache=None, exact=False, **_):
        x = hidden_states
        tables = rollout_cache.rope(*position_embeddings) if rollout_cache is not None else \
            rope_tables(*position_embeddings, rows_of_tokens=False)  # the engine makes them once per forward
        exact = exact or getattr(rollout_cache, "exact", False)
        a = attention(self.self_attn, rms_norm(x, self.input_layernorm), tables, attention_mask, rollout_cache, tdam,
                      cache, exact)
        x = x + linear(self.self_attn.o_proj, a, exact)
        m = rms_norm(x, self.post_attention_layernorm)
        up = self.mlp.act_fn(linear(self.mlp.gate_proj, m, exact)) * linear(self.mlp.up_proj, m, exact)
        return x + linear(self.mlp.down_proj, up, exact)


@contextlib.contextmanager
def vision_per_chunk(model, chunks: list[int]):
    """The exact mode's vision calls: inside, `model.model.get_video_features` runs the tower once per chunk of
    videos (chunks[i]: the grid rows of chunk i, in order), the calls the engine makes whatever it batches, so that
    each chunk's features are the same bits in the engine and the trainer (the tower's matmuls would otherwise take
    shapes from the batch). Outputs are concatenated in order, as one call's would be."""
    inner = model.model.get_video_features

    def per_chunk(pixel_values_videos, video_grid_thw=None, **kw):
        feats, p, r = [], 0, 0
        for n in chunks:
            grid = video_grid_thw[r:r + n]
            size = int(grid.prod(-1).sum())
            feats.append(inner(pixel_values_videos[p:p + size], grid, **kw))
            p, r = p + size, r + n
        out = feats[0]
        out.pooler_output = tuple(x for f in feats for x in f.pooler_output)
        if getattr(out, "deepstack_features", None) is not None:          # Qwen3-VL's; Qwen2.5-VL has none
            out.deepstack_features = [tuple(x for f in feats for x in f.deepstack_features[i])
                                      for i in range(len(out.deepstack_features))]
        return out

    with replaced_video_features(model, per_chunk):
        yield


@contextlib.contextmanager
def replaced_video_features(model, fn):
    """Inside, `model.model.get_video_features` is `fn` (which may call the one it replaces); restored after."""
    before = vars(model.model).get("get_video_features")
    model.model.get_video_features = fn
    try:
        yield
    finally:
        if before is None:
            del model.model.get_video_features
        else:
            model.model.get_video_features = before


SUPPORTED = ("Qwen3VLTextDecoderLayer", "Qwen2_5_VLDecoderLayer")   # the layers PlainLayer.forward is written for


@functools.cache
def plain_class(mixin: type, cls: type) -> type:
    """`cls` (transformers' decoder layer or RMSNorm class) with the forward of `mixin`."""
    return type(f"Plain{cls.__name__}", (mixin, cls), {})


def use_plain_layers(model):
    """Every decoder layer of `model` (a Qwen3-VL / Qwen2.5-VL ForConditionalGeneration) runs PlainLayer.forward
    from now on, and its final norm PlainNorm.forward: each module's class becomes a subclass of its own with our
    forward (nothing else changes: modules, parameters, hooks); returns the model. Done at load (model.load_model
    and the builders), before any FSDP2 wrapping."""
    text = model.model.language_model
    for layer in text.layers:
        if not isinstance(layer, PlainLayer) and (name := type(layer).__name__) not in SUPPORTED:
            raise ValueError(f"use_plain_layers: decoder layer {name} is not one of {SUPPORTED} (layers.py writes "
                             f"the forward of Qwen3-VL's and Qwen2.5-VL's; another architecture needs its own)")
    for module, mixin in [(layer, PlainLayer) for layer in text.layers] + [(text.norm, PlainNorm)]:
        if not isinstance(module, mixin):
            module.__class__ = plain_class(mixin, type(module))
    return model
