"""Tests of policy.py: the optimizer's vision rate, bf16 compute on fp32 master weights (and its checkpoint), the
training forward's pixels, micro-batches by rows and padded tokens, the learning-rate schedule, and packed prompts
(one row holding each shared prompt once) against one row per sample.
"""
import json
import os
from unittest import mock

import pytest
import torch
from conftest import assert_flex_close
from safetensors.torch import load_file

import model as model_lib
import ops
import rollout
import recipes
import runtime
import sft
import grpo
import train
import policy
from policy import get_lr


def weights(ckpt_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckpt_dir, "model.safetensors"))


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# -----------------------------------------------------------------------------
# the optimizer; bf16 compute on fp32 master weights

@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_vision_lr_scale(scale):
    """make_optimizer: the vision tower at scale x lr (the merger included), every other parameter at lr; 0 freezes
    the tower (no gradient, no optimizer state) and one step moves every other parameter."""
    model = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    opt = policy.make_optimizer(model, 1e-3, scale)
    policy.set_lr(opt, 2e-3)
    vision = {id(p) for n, p in model.named_parameters() if n.startswith("model.visual.")}
    assert vision and any("merger" in n for n, _ in model.named_parameters() if n.startswith("model.visual."))
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert all(lrs[id(p)] == 2e-3 for p in model.parameters() if id(p) not in vision)
    if scale == 0:
        assert not (vision & set(lrs)) and not any(p.requires_grad for p in model.parameters() if id(p) in vision)
    else:
        assert all(lrs[i] == pytest.approx(2e-3 * scale) for i in vision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert "lm_head.weight" in moved and "model.language_model.embed_tokens.weight" in moved


def one_step(model, optimizer, items: list, pad_id: int, precision: str) -> tuple[float, set]:
    """One SFT step (sft_backward + optimizer.step): the fraction of the weights with a nonzero gradient that the
    step changed, and the dtypes the first decoder layer's MLP computed in."""
    seen = set()
    hook = model.model.language_model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    model.train()
    sft.sft_backward(model, items, sft.SFTSettings(micro_batch=2, precision=precision), pad_id)
    hook.remove()
    has_grad = {n: p.grad != 0 for n, p in model.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    moved = sum(int((before[n] != p.detach())[has_grad[n]].sum()) for n, p in model.named_parameters() if n in has_grad)
    return moved / sum(int(g.sum()) for g in has_grad.values()), seen


@pytest.mark.slow
def test_bf16_step_moves_the_fp32_master_weights(tdam_batch):
    """--precision bf16 as a GPU runs it, here on CPU: parameters and AdamW state stay fp32 (master weights), the
    forward computes in bf16 (autocast), and one AdamW step at lr 1e-6 moves more than 99 % of the weights that
    have a gradient. The control: pure-bf16 parameters under a bf16 AdamW (the model loaded bf16, as CUDA runs
    trained before) move a few percent, since an update of 1e-6 is below half a bf16 ulp of almost every weight."""
    trajs, _ = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    pad_id = processor.tokenizer.pad_token_id
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    optimizer = policy.make_optimizer(model, 1e-6, vision_lr_scale=1.0)
    moved, dtypes = one_step(model, optimizer, trajs, pad_id, "bf16")
    assert dtypes == {torch.bfloat16} and moved > 0.99, (dtypes, moved)
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    pure = model_lib.load_model("tiny", device="cpu", dtype=torch.bfloat16, seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    moved_pure, _ = one_step(pure, torch.optim.AdamW(pure.parameters(), lr=1e-6, weight_decay=0.0), trajs, pad_id, "bf16")
    assert moved_pure < 0.1, moved_pure
    with pytest.raises(ValueError, match="fp32"):            # never an AdamW step on bf16 parameters
        policy.make_optimizer(pure, 1e-6, vision_lr_scale=1.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_forward_hands_the_model_pixels_in_the_compute_dtype(tdam_batch, precision):
    """The training forward hands the model its pixels in the dtype it computes in: bf16 under --precision bf16
    (whose parameters are fp32 master weights, FSDP2 shards or not), fp32 otherwise. Cast to the parameters'
    dtype, a bf16 run's (patches, 1536) pixels went to the device in fp32, twice their size. The hidden states
    are the same as with fp32 pixels, bit for bit: the tower's first matmul rounds them to bf16 under autocast."""
    _, batch = tdam_batch
    model, _ = policy.policy_model("tiny", torch.device("cpu"), precision, world=1, seed=0)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["pixel_values_videos"].dtype),
                                                 with_kwargs=True)
    with torch.no_grad(), policy.autocast(precision, model):
        hidden = policy.hidden_and_targets(model, batch)[0]
    hook.remove()
    assert seen == [{"fp32": torch.float32, "bf16": torch.bfloat16}[precision]]
    with torch.no_grad(), policy.autocast(precision, model), \
            mock.patch.object(model_lib, "compute_dtype", lambda m: torch.float32):
        assert torch.equal(policy.hidden_and_targets(model, batch)[0], hidden)


def test_bf16_checkpoint_exports_bf16_and_resumes_the_fp32_master_weights(tmp_path, tdam_batch):
    """Trained in bf16, a checkpoint's Hugging Face export (model.safetensors, config dtype) is bf16, what a
    serving stack loads; its train_state keeps the fp32 master weights and fp32 AdamW moments, and a resumed run
    takes its weights from there (exactly), not from the bf16 export."""
    trajs, _ = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    optimizer = policy.make_optimizer(model, 1e-3, vision_lr_scale=1.0)
    one_step(model, optimizer, trajs, processor.tokenizer.pad_token_id, "bf16")
    run_ = runtime.Run(str(tmp_path), 0, 1, 0, 50, 3, False, 0.2, export_dtype=torch.bfloat16)
    run_.processor = processor
    ckpt = run_.save("sft", 1, model, optimizer)
    export = weights(ckpt)
    assert {t.dtype for t in export.values()} == {torch.bfloat16}
    assert json.load(open(os.path.join(ckpt, "config.json")))["dtype"] == "bfloat16"
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(master[n], export[n].float()) for n in master)   # the export is rounded
    fresh, _ = policy.policy_model(ckpt, torch.device("cpu"), "bf16", world=1, seed=0)
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}
    runtime.Run(str(tmp_path), 0, 1, 0, 50, 3, False, 0.2).resume(ckpt, fresh)
    assert all(torch.equal(p.detach(), master[n]) for n, p in fresh.named_parameters())
    opt2 = policy.make_optimizer(fresh, 1e-3, vision_lr_scale=1.0)
    runtime.load_train_state(ckpt, fresh, opt2)
    assert {s["exp_avg"].dtype for s in opt2.state.values()} == {torch.float32}


# -----------------------------------------------------------------------------
# micro-batches by rows and padded tokens; the learning-rate schedule

@pytest.mark.parametrize("lengths, rows, tokens, expected", [
    ([10] * 5, 2, 100, [(0, 2), (2, 4), (4, 5)]),           # rows alone decide: 2 x 10 <= 100
    ([10] * 5, 8, 30, [(0, 3), (3, 5)]),                    # tokens decide: 3 x 10 <= 30 < 4 x 10
    ([10, 30, 200, 5, 5, 5], 8, 100, [(0, 2), (2, 3), (3, 6)]),   # 200 > 100 goes alone, in its place
    ([60, 40, 30], 8, 100, [(0, 1), (1, 3)]),               # 2 x 60 > 100; then 2 x 40 <= 100 < 3 x 40
    ([40, 60], 8, 100, [(0, 1), (1, 2)]),                   # the longest so far counts: 2 x 60 > 100
    ([50, 50, 50], 8, 100, [(0, 2), (2, 3)]),               # (items + 1) x longest == tokens still joins
    ([30, 5, 30, 5], 8, 10 ** 6, [(0, 4)]),                 # never sorted: one batch in the given order
    ([], 8, 100, []),
])
def test_micro_batches_are_consecutive_within_rows_and_padded_tokens(lengths, rows, tokens, expected):
    """policy.micro_batches: consecutive items in their order, at most `rows` a micro-batch and items x its longest
    <= `tokens`; an item longer than `tokens` alone (the update's micro-batches and sequence_kl's)."""
    got = policy.micro_batches(lengths, rows, tokens)
    assert [(s.start, s.stop) for s in got] == expected
    assert [i for s in got for i in range(len(lengths))[s]] == list(range(len(lengths)))


def test_micro_batch_tokens_flag_is_the_settings_default_and_one_row_at_video_o3_lengths():
    """--micro-batch-tokens (default 16,384, the GRPOSettings default) reaches the settings; at Video-o3's and
    ParaVT's row lengths (17k-32k tokens) the default budget makes every micro-batch one row, at the tiny
    default's (a few hundred tokens, eight rows of its longest oracle rows in 6k) the fixed chunks of
    --micro-batch are unchanged (the embedded default computes what it did)."""
    args = recipes.parse_train_args([])
    assert args.micro_batch_tokens == grpo.GRPOSettings().micro_batch_tokens == 16384
    assert train.grpo_settings(recipes.parse_train_args(["--micro-batch-tokens", "4096"])).micro_batch_tokens == 4096
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--micro-batch-tokens", "0"])
    s = train.grpo_settings(recipes.parse_train_args(["--preset", "videoo3"]))
    assert [sl.stop - sl.start for sl in policy.micro_batches([27000, 31000, 26500, 32000], s.micro_batch,
                                                             s.micro_batch_tokens)] == [1, 1, 1, 1]
    tiny = [400, 560, 812, 386] * 16                      # a step of the default: 4 prompts x 16 rows
    assert policy.micro_batches(tiny, 8, args.micro_batch_tokens) == [slice(i, i + 8) for i in range(0, 64, 8)]


@pytest.mark.parametrize("step, warmup, expected", [
    (0, 0, 1.0),          # no warmup: starts at the peak
    (0, 10, 0.1),         # first warmup step: lr / warmup
    (9, 10, 1.0),         # last warmup step reaches the peak
    (10, 10, 1.0),        # cosine starts at the peak
    (55, 10, 0.55),       # half way through the cosine: (lr + min_lr) / 2
    (100, 10, 0.1),       # the end: min_lr = 0.1 * lr
    (250, 10, 0.1),       # past the end: stays at min_lr
])
def test_get_lr_endpoints(step, warmup, expected):
    assert get_lr(step, total_steps=100, lr=1.0, warmup_steps=warmup, min_lr_ratio=0.1) == pytest.approx(expected)


def test_get_lr_decreases_after_warmup():
    lrs = [get_lr(s, 50, 3e-6, warmup_steps=5, min_lr_ratio=0.1) for s in range(5, 60)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[0] > lrs[-1]


@pytest.mark.parametrize("total, warmup", [
    (0, 0),     # no steps at all
    (10, 11),   # warmup longer than the run
])
def test_get_lr_rejects_bad_schedule(total, warmup):
    with pytest.raises(ValueError, match="get_lr"):
        get_lr(0, total, 1.0, warmup_steps=warmup, min_lr_ratio=0.1)


# -----------------------------------------------------------------------------
# packed prompts: each shared prompt once in the update's forward

def test_packed_prompts_equal_one_row_per_sample(tiny, packed_rows):
    """hidden_and_targets on pack_prompts' one row equals the plain rows at every policy position (hidden states
    to 1e-5), and every parameter's gradient of the GRPO loss matches: three prompts in one row, each once (the
    row holds 3 prompts + 6 suffixes, no more), suffixes with crops of their own, keys interleaved (A A B A B C)."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    packed = policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)
    size = sum(len(t.token_ids) - t.prompt_len for t in trajs) + sum(trajs[i].prompt_len for i in (0, 2, 5))
    assert packed["input_ids"].shape == (1, size) and packed["tdam"].lengths.tolist() == [size]
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(b):
        hidden, weight, targets, mask = policy.policy_head(model, b, "fp32")
        adv = torch.linspace(-1, 1, len(trajs))
        loss, _ = grpo.grpo_loss(hidden, weight, targets, None, adv, mask, clip_low=0.2, clip_high=0.3,
                                 compile=False, kl_coef=0.0, kl_estimator="k3", temperature=1.0, behav_cap=5.0)
        return hidden[mask].detach(), loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    h_plain, _, g_plain = loss_and_grads(batch)       # (the on-policy loss is -mean A whatever the forward: not
    h_pack, _, g_pack = loss_and_grads({**batch, "packed": packed})   # compared; its gradient is)
    torch.testing.assert_close(h_pack, h_plain, atol=1e-5, rtol=0)
    for (name, _), gp, gq in zip([x for x in model.named_parameters() if x[1].requires_grad], g_plain, g_pack):
        assert (gp is None) == (gq is None), name
        if gp is not None:
            torch.testing.assert_close(gq, gp, atol=1e-5 * float(gp.abs().max()) + 1e-9, rtol=1e-4, msg=name)


def test_packed_prompts_in_bf16_add_no_error_of_their_own(tiny, packed_rows):
    """Under --precision bf16 (autocast on the fp32 weights, as on a GPU) the packed row's hidden states are as
    close to the fp32 ones as the plain rows' are (each within bf16's rounding, neither further than twice the
    other's error)."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    packed = {**batch, "packed": policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)}
    with torch.no_grad():
        ref, _, _, mask = policy.policy_head(model, batch, "fp32")
        plain = policy.policy_head(model, batch, "bf16")[0]
        pack = policy.policy_head(model, packed, "bf16")[0]
    assert pack.dtype == plain.dtype == torch.bfloat16
    err = lambda h: float((h[mask].float() - ref[mask]).abs().max())
    scale = float(ref[mask].abs().max())
    assert 0 < err(plain) < 0.05 * scale and err(pack) <= 2 * err(plain), (err(plain), err(pack), scale)


@pytest.mark.slow
def test_packed_spec_plan_and_rectangles_are_one_mask(tiny, packed_rows):
    """The packed row's attention four ways on random q, k, v: TdamSpec.plan's exact runs (the CPU kernel), the
    rectangles through the tile plan, and dense SDPA under TdamSpec.allowed: equal values and gradients; and the
    flex kernel CUDA runs, on the same rectangles, equal in value (forward: no CPU backward). And the mask is the
    segments': a suffix sees its prompt and itself, causally, nothing else."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    spec = policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)["tdam"]
    L = int(spec.lengths[0])
    allowed = spec.allowed(0, L, L, "cpu")[0, 0]
    from_plan = torch.zeros(L, L, dtype=torch.bool)
    for _, q0, q1, runs in spec.plan:
        for k0, k1, kind in runs:
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            from_plan[q0:q1, k0:k1] = block.tril() if kind == ops.CAUSAL else block
    assert torch.equal(allowed, from_plan)
    assert int(allowed.sum()) < L * (L + 1) // 2 // 2        # most of the causal triangle is cut away
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, L, 2, 16, generator=g)

    def run(attend):
        out = attend(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    dense = run(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=0.25).transpose(1, 2))
    plan = run(lambda q, k, v: ops.tdam_attention(q, k, v, spec, 0.25))
    tiles = run(lambda q, k, v: ops.tdam_attention(q, k, v, ops.TdamSpec(spec.lengths, spec.rects, block=64), 0.25))
    for a, b, c in zip(dense, plan, tiles):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    # the CUDA kernel's block mask from the same rectangles (forward: CPU flex has no backward): eager, and compiled
    # where torch's CPU template agrees with its eager kernel at these shapes
    flex_spec = ops.TdamSpec(spec.lengths, spec.rects, kernel="flex")
    assert_flex_close(lambda: ops.tdam_attention(q.detach(), k.detach(), v.detach(), flex_spec, 0.25), dense[0])


@pytest.mark.parametrize("lengths, prompts, rows, tokens, expected", [
    ([100, 120, 110], "AAA", 8, 150, [(0, 3)]),              # 90 + 10 + 30 + 20 = 150: one prompt, three suffixes
    ([100, 120, 110], "AAA", 8, 149, [(0, 2), (2, 3)]),      # 150 > 149
    ([100, 120, 110], "AAA", 2, 10 ** 6, [(0, 2), (2, 3)]),  # rows still count items
    ([100, 120, 100, 110], "ABAB", 8, 250, [(0, 4)]),        # 90 + 10 + 90 + 30 + 10 + 20 = 250: each prompt once
    ([100, 120, 100, 110], "ABAB", 8, 249, [(0, 3), (3, 4)]),
    ([100, 300, 100], "A-A", 8, 250, [(0, 1), (1, 2), (2, 3)]),   # an unpacked row counts whole; 300 alone
    ([], "", 8, 100, []),
])
def test_micro_batches_count_each_packed_prompt_once(lengths, prompts, rows, tokens, expected):
    """policy.micro_batches with shared_prompts' keys: a micro-batch is one packed row, its size each distinct
    prompt (90 tokens here) once plus every item's suffix, at most `tokens`; at most `rows` items."""
    keys = [((k, ()), 90, 1) if k != "-" else None for k in prompts]
    got = policy.micro_batches(lengths, rows, tokens, keys)
    assert [(s.start, s.stop) for s in got] == expected
