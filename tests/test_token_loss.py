"""
Tests for train.token_loss (the fused linear loss: gradients formed in the forward) and its two entry points,
grpo_token_loss and sft_token_loss, against the naive path log_softmax(h W^T / T).gather then the loss.

    python -m pytest tests/test_token_loss.py -q          # CPU, well under a minute
    python -m pytest tests/test_token_loss.py -q -m gpu   # the bf16 check, on a CUDA machine
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import train
from train import grpo_loss, grpo_token_loss, sft_token_loss, token_loss


def make_batch(B=3, L=7, dim=16, vocab=500, seed=0, scale=0.4, per_token_adv=False):
    """hidden (B, L, D), lm_head (V, D), targets, a policy mask with holes, old/ref log-probs near the truth."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * scale
    targets = torch.randint(0, vocab, (B, L), generator=gen)
    mask = torch.rand(B, L, generator=gen) > 0.3
    mask[0, 0] = True
    with torch.no_grad():
        truth = F.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old = truth + 0.3 * torch.randn(B, L, generator=gen)           # ratios spread on both sides of the clip
    ref = truth + 0.2 * torch.randn(B, L, generator=gen)
    adv = torch.randn((B, L) if per_token_adv else (B,), generator=gen)
    return hidden, weight, targets, mask, old, ref, adv


def naive_logprobs(hidden, weight, targets, temperature):
    """The reference: full logits in float64, log_softmax at temperature T, gather."""
    logits = hidden.double() @ weight.double().T / temperature
    return F.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def value_and_grads(fn, hidden, weight):
    """fn(h, w) -> (loss, extra) on fresh leaves; returns (loss, grad h, grad W, extra)."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss, extra = fn(h, w)
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    return loss, grad_h, grad_w, extra


def assert_rel_close(ours, ref, rel=1e-5):
    """max |ours - ref| <= rel * max |ref| (relative to the tensor's scale, fp32 against float64)."""
    ours, ref = ours.double(), ref.double()
    assert ours.shape == ref.shape
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"max error {err:.3e} vs scale {scale:.3e}"


GRPO_CASES = [
    # chunk 4 on 3 x 7 masked rows: chunk boundaries fall inside sequences, last chunk ragged
    dict(chunk_size=4, temperature=1.0, kl_coef=0.05, kl_estimator="k3", per_token_adv=False, old=True),
    # temperature 0.7 (the RL sampling T) with per-token advantages and the k1 estimator
    dict(chunk_size=8, temperature=0.7, kl_coef=0.1, kl_estimator="k1", per_token_adv=True, old=True),
    # N (the policy tokens, ~15) smaller than one chunk: the chunk shrinks to the next power of two
    dict(chunk_size=1024, temperature=1.5, kl_coef=0.0, kl_estimator="k3", per_token_adv=False, old=True),
    # the single on-policy epoch: no old log-probs, ratio 1 with the current ones detached
    dict(chunk_size=4, temperature=0.7, kl_coef=0.02, kl_estimator="k3", per_token_adv=True, old=False),
    # chunk_size None: N x V this small takes the plain (unchunked) path
    dict(chunk_size=None, temperature=0.7, kl_coef=0.05, kl_estimator="k3", per_token_adv=False, old=True),
]


@pytest.mark.parametrize("case", GRPO_CASES)
def test_grpo_token_loss_matches_naive(case):
    hidden, weight, targets, mask, old, ref, adv = make_batch(per_token_adv=case["per_token_adv"], seed=1)
    old = old if case["old"] else None
    kw = dict(clip_low=0.2, clip_high=0.3, kl_coef=case["kl_coef"], ref_logprobs=ref,
              kl_estimator=case["kl_estimator"])
    T = case["temperature"]

    def naive(h, w):
        lp = naive_logprobs(h, w, targets, T)
        return grpo_loss(lp, lp.detach() if old is None else old.double(), adv.double(), mask,
                         **{**kw, "ref_logprobs": ref.double()})

    def ours(h, w):
        return grpo_token_loss(h, w, targets, old, adv, mask, temperature=T, chunk_size=case["chunk_size"],
                               compile=False, **kw)

    ref_loss, ref_gh, ref_gw, ref_stats = value_and_grads(naive, hidden, weight)
    loss, gh, gw, stats = value_and_grads(ours, hidden, weight)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_rel_close(loss, ref_loss)
    assert_rel_close(gh, ref_gh)
    assert_rel_close(gw, ref_gw)
    assert gh[~mask].abs().sum() == 0 and gh[mask].abs().sum() > 0   # only policy rows get a gradient
    assert stats["n_tokens"] == ref_stats["n_tokens"] == int(mask.sum())
    for key in ("clip_frac", "kl", "ratio_mean"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-7), key
    if case["old"]:
        assert 0 < stats["clip_frac"] < 1       # the case really exercises the clip


def test_grpo_token_loss_global_normaliser_adds_up():
    """Two micro-batches with num_tokens = the whole batch's count sum to one call over the whole batch."""
    hidden, weight, targets, mask, old, ref, adv = make_batch(B=4, seed=2)
    kw = dict(clip_low=0.2, clip_high=0.2, temperature=0.7, chunk_size=4, compile=False)
    full, _ = grpo_token_loss(hidden, weight, targets, old, adv, mask, **kw)
    total = int(mask.sum())
    parts = [grpo_token_loss(hidden[s], weight, targets[s], old[s], adv[s], mask[s], num_tokens=total, **kw)[0]
             for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-6)


@pytest.mark.parametrize("temperature, chunk_size", [
    (1.0, 4),       # SFT at T = 1, chunks split the sequences
    (0.7, 1024),    # a temperature, N smaller than the chunk
])
def test_sft_token_loss_matches_naive(temperature, chunk_size):
    hidden, weight, targets, mask, *_ = make_batch(seed=3)
    n_total = int(mask.sum()) + 5     # a micro-batch of a bigger batch: the caller's normaliser

    def naive(h, w):
        lp = naive_logprobs(h, w, targets, temperature)
        return -(lp * mask).sum() / n_total, int(mask.sum())

    def ours(h, w):
        return sft_token_loss(h, w, targets, mask, num_tokens=n_total, temperature=temperature,
                              chunk_size=chunk_size, compile=False)

    ref_loss, ref_gh, ref_gw, ref_n = value_and_grads(naive, hidden, weight)
    loss, gh, gw, n = value_and_grads(ours, hidden, weight)
    assert n == ref_n
    assert_rel_close(loss, ref_loss)
    assert_rel_close(gh, ref_gh)
    assert_rel_close(gw, ref_gw)


def test_token_loss_compiled_matches_naive():
    """The torch.compile(dynamic=False) chunk kernels, at a temperature, on a ragged last chunk."""
    hidden, weight, targets, mask, *_ = make_batch(B=2, L=9, vocab=3000, seed=4)
    h2, t2 = hidden.reshape(-1, 16), targets.reshape(-1)
    coef = torch.randn(18, generator=torch.Generator().manual_seed(0))   # any per-token weights

    def naive(h, w):
        return (coef.double() * naive_logprobs(h, w, t2, 0.7)).sum(), None

    def ours(h, w):
        return token_loss(h, w, t2, lambda lp, rows: (coef[rows] * lp).sum(), chunk_size=8, temperature=0.7,
                          compile=True), None

    for a, b in zip(value_and_grads(ours, h2, weight)[:3], value_and_grads(naive, h2, weight)[:3]):
        assert_rel_close(a, b)
    assert train._chunk_grad_logits_ in train._compiled_kernels   # the compiled path really ran


def test_token_loss_auto_chunk_takes_the_fused_path(monkeypatch):
    """chunk_size None above the small-logits limit: Liger's chunk, the fused Function, the same values."""
    hidden, weight, targets, *_ = make_batch(B=1, L=40, vocab=1000, seed=5)
    h2, t2 = hidden[0], targets[0]
    loss_fn = lambda lp, rows: -lp.sum() / 40   # noqa: E731
    plain = value_and_grads(lambda h, w: (token_loss(h, w, t2, loss_fn, compile=False), None), h2, weight)
    assert "TokenLoss" not in type(plain[0].grad_fn).__name__      # 40 x 1000 logits: the plain path
    monkeypatch.setattr(train, "_MIN_CHUNK_LOGITS", 4000)            # chunks of 8 rows: 5 of them (at most 8)
    assert train._liger_chunk(40, 16, 1000) == 4 and train._auto_chunk(40, 16, 1000) == 8
    fused = value_and_grads(lambda h, w: (token_loss(h, w, t2, loss_fn, compile=False), None), h2, weight)
    assert "TokenLoss" in type(fused[0].grad_fn).__name__
    for a, b in zip(fused[:3], plain[:3]):
        assert_rel_close(a, b)


@pytest.mark.parametrize("n, dim, vocab, liger, expected", [
    (4096, 4096, 151_936, 128, 512),     # Liger: next_pow2(4096 / ceil(151936 / 4096) = 110.7) = 128; ours: N / 8
    (16384, 4096, 151_936, 512, 2048),   # 4x the tokens, 4x the chunk, under both rules
    (2000, 64, 151_936, 64, 256),        # tiny D would give 1 row: the 32 MB floor (55 rows) rounds up to 64
    (300, 4096, 151_936, 64, 64),        # few tokens: the floor, one chunk
    (1 << 20, 8192, 32_000, 1 << 18, 1 << 18),   # Liger's rule already gives <= 8 chunks: unchanged
])
def test_auto_chunk(n, dim, vocab, liger, expected):
    assert train._liger_chunk(n, dim, vocab) == liger
    assert train._auto_chunk(n, dim, vocab) == expected
    assert -(-n // expected) <= train.MAX_CHUNKS


class CountGemms(TorchDispatchMode):
    """Counts matrix multiplies (aten mm / addmm / bmm, any overload) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_token_loss_three_gemms_and_a_backward_without_any():
    """3 GEMMs per chunk in the forward (logits, grad_h, grad_W) and none in the backward, which only scales."""
    hidden, weight, targets, *_ = make_batch(B=1, L=20, vocab=300, seed=6)
    h, w = hidden[0].clone().requires_grad_(), weight.clone().requires_grad_()
    with CountGemms() as fwd:
        loss = token_loss(h, w, targets[0], lambda lp, rows: -lp.sum(), chunk_size=8, compile=False)
    with CountGemms() as bwd:
        (2.5 * loss).backward()
    assert fwd.count == 3 * 3 and bwd.count == 0      # 20 rows in chunks of 8: 3 chunks
    ref_h, ref_w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (-2.5 * naive_logprobs(ref_h, ref_w, targets[0], 1.0).sum()).backward()
    assert_rel_close(h.grad, ref_h.grad)      # the upstream 2.5 reached both gradients
    assert_rel_close(w.grad, ref_w.grad)


def test_token_loss_no_grad_runs_only_the_logits_gemm():
    hidden, weight, targets, *_ = make_batch(B=1, L=20, vocab=300, seed=6)
    h, w = hidden[0].requires_grad_(), weight.requires_grad_()
    with torch.no_grad(), CountGemms() as fwd:
        loss = token_loss(h, w, targets[0], lambda lp, rows: -lp.sum(), chunk_size=8, compile=False)
    assert fwd.count == 3 and not loss.requires_grad
    assert loss.item() == pytest.approx(-naive_logprobs(h, w, targets[0], 1.0).sum().item(), rel=1e-6)


def test_token_loss_backward_twice_is_refused():
    hidden, weight, targets, *_ = make_batch(B=1, L=6, vocab=300, seed=7)
    h = hidden[0].requires_grad_()
    loss = token_loss(h, weight, targets[0], lambda lp, rows: -lp.sum(), chunk_size=4, compile=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        loss.backward()


def test_token_loss_rejects_a_non_scalar_loss_fn():
    hidden, weight, targets, *_ = make_batch(B=1, L=6, vocab=300, seed=7)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        token_loss(hidden[0], weight, targets[0], lambda lp, rows: -lp, chunk_size=4, compile=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(advantages=torch.zeros(4)), "advantages"),             # B = 3 sequences
    (dict(mask=torch.ones(3, 6, dtype=torch.bool)), r"\(B, L\)"),  # mask shorter than the sequences
    (dict(kl_coef=0.1, ref_logprobs=None), "needs ref_logprobs"),  # KL asked for without a reference
    (dict(temperature=0.0), "temperature must be > 0"),           # greedy has no log-probs
])
def test_grpo_token_loss_rejects_bad_input(kwargs, message):
    hidden, weight, targets, mask, old, ref, adv = make_batch(seed=8)
    args = dict(hidden=hidden, lm_head_weight=weight, targets=targets, old_logprobs=old, advantages=adv, mask=mask,
                clip_low=0.2, clip_high=0.2, ref_logprobs=ref, compile=False)
    with pytest.raises(ValueError, match=message):
        grpo_token_loss(**{**args, **kwargs})


def test_grpo_token_loss_no_policy_tokens():
    """An empty mask (a rank with nothing to learn): loss 0, zero gradients that still reach W, no NaN."""
    hidden, weight, targets, mask, old, ref, adv = make_batch(seed=9)
    w = weight.clone().requires_grad_()
    loss, stats = grpo_token_loss(hidden, w, targets, old, adv, torch.zeros_like(mask), clip_low=0.2,
                                  clip_high=0.2, chunk_size=4, compile=False)
    loss.backward()
    assert loss.item() == 0.0 and stats["n_tokens"] == 0 and stats["clip_frac"] == 0.0
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_token_loss_under_gradient_checkpointing(use_reentrant):
    """The hidden states come out of a checkpointed block: its recompute in backward sees token_loss's grad_h."""
    torch.manual_seed(10)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    head = torch.nn.Linear(16, 400, bias=False)
    x = torch.randn(3, 7, 16, requires_grad=True)
    _, _, targets, mask, old, ref, adv = make_batch(seed=10, vocab=400)
    kw = dict(clip_low=0.2, clip_high=0.3, kl_coef=0.05, ref_logprobs=ref)

    def run(fused: bool):
        for p in (*block.parameters(), *head.parameters(), x):
            p.grad = None
        hidden = checkpoint(block, x, use_reentrant=use_reentrant)
        if fused:
            loss, _ = grpo_token_loss(hidden, head.weight, targets, old, adv, mask, temperature=0.7,
                                      chunk_size=4, compile=False, **kw)
        else:
            lp = F.log_softmax(head(hidden) / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
            loss, _ = grpo_loss(lp, old, adv, mask, **kw)
        loss.backward()
        return [p.grad.clone() for p in (*block.parameters(), head.weight, x)]

    ref_grads, grads = run(fused=False), run(fused=True)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)     # fp32 against fp32 here
    assert all(g.abs().sum() > 0 for g in grads)


def test_token_loss_weight_gradient_as_a_plain_autograd_input():
    """
    FSDP's view of the lm_head weight: a Parameter whose gradient arrives through autograd's own
    accumulation (adding to an existing .grad, firing post-accumulate hooks once per backward), and
    whose storage FSDP may free right after the forward (reshard_after_forward): token_loss keeps
    no reference to W for its backward, so the backward still runs after the storage is gone.
    """
    hidden, weight, targets, *_ = make_batch(B=1, L=12, vocab=300, seed=11)
    h, t = hidden[0], targets[0]
    ref_w = weight.double().requires_grad_()
    (-naive_logprobs(h, ref_w, t, 0.7).sum()).backward()

    param = torch.nn.Parameter(weight.clone())
    param.grad = torch.ones_like(param)                   # a gradient from an earlier micro-batch
    fired = []
    param.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    loss = token_loss(h, param, t, lambda lp, rows: -lp.sum(), chunk_size=4, temperature=0.7, compile=False)
    param.untyped_storage().resize_(0)                    # what FSDP2 does to the unsharded weight
    loss.backward()
    assert len(fired) == 1
    assert_rel_close(param.grad - 1.0, ref_w.grad)         # accumulated onto the earlier gradient


def check_bf16(device: str, use_compile: bool) -> None:
    """bf16 inputs: bf16 GEMMs (about 3 significant digits), fp32 softmax math and grad_W sum, bf16 gradients.
    The old log-probs put every token's ratio either near 1 or well past a clip bound: a bf16-rounded logit
    moves log p by ~1e-2, which near a bound would switch a token's gradient on or off (17 % apart here)."""
    hidden, weight, targets, mask, _, ref, adv = (x.to(device) for x in make_batch(B=4, L=75, dim=64, vocab=5000,
                                                                                scale=64 ** -0.5, seed=12))
    h32, w32 = hidden.bfloat16().float(), weight.bfloat16().float()
    lp32 = F.log_softmax(h32 @ w32.T / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    gen = torch.Generator().manual_seed(3)
    near, sign = torch.rand(lp32.shape, generator=gen) < 0.5, torch.randn(lp32.shape, generator=gen).sign()
    log_ratio = torch.where(near, 0.02 * sign, 0.6 * sign).to(device)     # |log r| 0.02, or 0.6 past the clip
    old = lp32 - log_ratio
    kw = dict(clip_low=0.2, clip_high=0.3, kl_coef=0.05, ref_logprobs=ref)

    def naive(h, w):   # fp32 on the bf16-rounded inputs
        lp = F.log_softmax(h.float() @ w.float().T / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
        return grpo_loss(lp, old, adv, mask, **kw)

    def ours(h, w):
        return grpo_token_loss(h, w, targets, old, adv, mask, temperature=0.7, chunk_size=64,
                               compile=use_compile, **kw)

    ref_loss, ref_gh, ref_gw, _ = value_and_grads(naive, hidden.bfloat16(), weight.bfloat16())
    loss, gh, gw, _ = value_and_grads(ours, hidden.bfloat16(), weight.bfloat16())
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2, abs=1e-3)
    for a, b in ((gh, ref_gh), (gw, ref_gw)):
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2


def test_grpo_token_loss_bf16_cpu():
    """The bf16 path (bf16 GEMMs into the fp32 grad_W sum, `_accumulate_grad_weight`) on the CPU, eager kernels."""
    check_bf16("cpu", use_compile=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_compile", [False, True])
def test_grpo_token_loss_bf16_cuda(use_compile):
    check_bf16("cuda", use_compile)
