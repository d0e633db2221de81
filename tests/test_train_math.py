"""
Tests for the pure math at the top of train.py: chunked token log-probs, the GRPO loss, the KL
estimators, the learning-rate schedule and the TDAM attention mask.

    python -m pytest tests/test_train_math.py -q          # CPU, well under a minute
    python -m pytest tests/test_train_math.py -q -m gpu   # the bf16 check, on a CUDA machine
"""
import math

import pytest
import torch
import torch.nn.functional as F

import train
from train import get_lr, grpo_loss, kl_penalty, tdam_mask, to_additive_mask, token_logprobs

QWEN_VOCAB = 151_936


# -----------------------------------------------------------------------------
# token_logprobs

def naive_logprobs(hidden, weight, targets):
    """The reference: full (N, V) logits, log_softmax, gather."""
    return F.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def make_problem(n, dim=32, vocab=QWEN_VOCAB, seed=0, scale=0.5):
    """Random hidden (n, dim), lm_head (vocab, dim), targets and an upstream gradient; logits std ~ 3."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * scale
    targets = torch.randint(0, vocab, (n,), generator=gen)
    grad_out = torch.randn(n, generator=gen)
    return hidden, weight, targets, grad_out


def value_and_grads(fn, hidden, weight, targets, grad_out, dtype):
    h = hidden.detach().to(dtype).requires_grad_()  # detach first: never flip the caller's tensor
    w = weight.detach().to(dtype).requires_grad_()
    out = fn(h, w, targets)
    grad_h, grad_w = torch.autograd.grad(out, (h, w), grad_out.to(out.dtype))
    return out, grad_h, grad_w


@pytest.fixture(scope="module")
def qwen_vocab_problem():
    """40 tokens at Qwen's vocab; chunk 16 gives chunks of 16, 16 and a ragged 8 (padded)."""
    hidden, weight, targets, grad_out = make_problem(40)
    # the truth in float64: at this logit scale fp32 log_softmax itself is off by ~1.4e-5
    ref = value_and_grads(naive_logprobs, hidden, weight, targets, grad_out, torch.float64)
    return hidden, weight, targets, grad_out, ref


@pytest.mark.parametrize("use_compile", [
    False,  # eager chunk kernels: the math itself
    True,   # torch.compile(dynamic=False) kernels on the padded chunk shape
])
def test_token_logprobs_matches_naive(qwen_vocab_problem, use_compile):
    hidden, weight, targets, grad_out, (ref, ref_gh, ref_gw) = qwen_vocab_problem
    out, grad_h, grad_w = value_and_grads(
        lambda h, w, t: token_logprobs(h, w, t, chunk_size=16, compile=use_compile),
        hidden, weight, targets, grad_out, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (40,)
    # log-probs near -15: fp32 holds them to ~1e-6, and the compiled logsumexp's summation order follows the
    # thread count (with OMP_NUM_THREADS=1 one value was 1.07e-5 off), hence rtol 1e-6 beside atol 1e-5
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad_h.double(), ref_gh, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_w.double(), ref_gw, atol=1e-5, rtol=0)
    if use_compile:
        assert train._chunk_logprobs in train._compiled_kernels  # the compiled path really ran


def test_token_logprobs_fp32_agrees_with_fp32_naive():
    """At a unit logit scale the fp32 naive path is itself accurate, so the two agree within 1e-5."""
    hidden, weight, targets, grad_out = make_problem(40, scale=32 ** -0.5, seed=1)
    ref = value_and_grads(naive_logprobs, hidden, weight, targets, grad_out, torch.float32)
    ours = value_and_grads(lambda h, w, t: token_logprobs(h, w, t, chunk_size=16, compile=False),
                           hidden, weight, targets, grad_out, torch.float32)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape, chunk_size", [
    ((5,), 1024),      # fewer tokens than a chunk: the chunk shrinks to 8 and is padded
    ((3, 7), 4),       # (B, L) leading dims, 21 tokens in chunks of 4 with a ragged last one
    ((16,), 16),       # exactly one full chunk, no padding
    ((0,), 16),        # empty batch: empty output, zero gradients
])
def test_token_logprobs_shapes(shape, chunk_size):
    n = math.prod(shape)
    hidden, weight, targets, grad_out = make_problem(n, vocab=1000, seed=2)
    hidden, targets, grad_out = hidden.reshape(*shape, 32), targets.reshape(shape), grad_out.reshape(shape)
    ref = value_and_grads(naive_logprobs, hidden, weight, targets, grad_out, torch.float64)
    ours = value_and_grads(lambda h, w, t: token_logprobs(h, w, t, chunk_size=chunk_size, compile=False),
                           hidden, weight, targets, grad_out, torch.float32)
    assert ours[0].shape == shape
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)


def test_token_logprobs_frozen_head():
    """Only the hidden states need a gradient (frozen or tied lm_head): no weight gradient is made."""
    hidden, weight, targets, grad_out = make_problem(20, vocab=500, seed=3)
    h = hidden.clone().requires_grad_()
    token_logprobs(h, weight, targets, chunk_size=8, compile=False).backward(grad_out)
    h_ref = hidden.double().requires_grad_()
    naive_logprobs(h_ref, weight.double(), targets).backward(grad_out.double())
    assert weight.grad is None
    torch.testing.assert_close(h.grad.double(), h_ref.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad_target", [
    -100,   # the usual ignore_index: pads must carry a valid id, the mask drops them
    500,    # == vocab, one past the end
])
def test_token_logprobs_rejects_out_of_range_targets(bad_target):
    hidden, weight, targets, _ = make_problem(6, vocab=500, seed=4)
    targets[2] = bad_target
    with pytest.raises(ValueError, match="targets must lie in"):
        token_logprobs(hidden, weight, targets, compile=False)


def test_token_logprobs_env_disables_compile(monkeypatch):
    monkeypatch.setenv("TOKEN_LOGPROBS_COMPILE", "0")
    assert train._kernel(train._chunk_logprobs, True) is train._chunk_logprobs
    monkeypatch.setenv("TOKEN_LOGPROBS_COMPILE", "1")
    assert train._kernel(train._chunk_logprobs, False) is train._chunk_logprobs
    assert train._kernel(train._chunk_logprobs, True) is not train._chunk_logprobs


@pytest.mark.parametrize("temperature", [
    0.7,   # the RL sampling temperature: old, reference and current log-probs must all use it
    2.0,   # a flattening temperature, the gradient's 1/T factor below 1
])
def test_token_logprobs_temperature(temperature):
    """
    Regression: rollouts sample from softmax(logits / T) with T = 0.7, but the loss's
    log-probs were those of softmax(logits), so the policy optimised was not the one that sampled.
    token_logprobs(..., temperature=T) must equal log_softmax(h W^T / T).gather, gradients included.
    """
    hidden, weight, targets, grad_out = make_problem(21, vocab=1000, seed=5)
    ref = value_and_grads(lambda h, w, t: naive_logprobs(h / temperature, w, t),
                          hidden, weight, targets, grad_out, torch.float64)
    ours = value_and_grads(lambda h, w, t: token_logprobs(h, w, t, chunk_size=8, compile=False,
                                                          temperature=temperature),
                           hidden, weight, targets, grad_out, torch.float32)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    at_one = token_logprobs(hidden, weight, targets, chunk_size=8, compile=False)
    assert (ours[0] - at_one).abs().max() > 0.1   # the temperature really changes the log-probs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_compile", [False, True])
def test_token_logprobs_bf16_cuda(use_compile):
    """bf16 on CUDA: logits come out of a bf16 GEMM (about 3 significant digits), the rest is fp32."""
    hidden, weight, targets, grad_out = (x.cuda() for x in make_problem(300, dim=64, scale=64 ** -0.5))
    ref = value_and_grads(naive_logprobs, hidden.bfloat16().float(), weight.bfloat16().float(),
                          targets, grad_out, torch.float32)
    out, grad_h, grad_w = value_and_grads(
        lambda h, w, t: token_logprobs(h, w, t, chunk_size=128, compile=use_compile),
        hidden, weight, targets, grad_out, torch.bfloat16)
    assert out.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref[0], atol=0.05, rtol=0)
    for ours, theirs in ((grad_h, ref[1]), (grad_w, ref[2])):
        assert (ours.float() - theirs).norm() / theirs.norm() < 2e-2


# -----------------------------------------------------------------------------
# grpo_loss and kl_penalty

LN2 = math.log(2.0)


def test_grpo_loss_on_policy_is_minus_mean_advantage():
    """ratio = 1: loss = -sum(mask * A) / sum(mask) = -(1 + 1 - 0.5) / 3."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0, -0.5]), mask)
    assert loss.item() == pytest.approx(-0.5)
    assert stats == {"clip_frac": 0.0, "kl": 0.0, "n_tokens": 3, "ratio_mean": 1.0}
    loss.backward()  # d loss / d logp = -A / 3 on policy tokens (the policy gradient), 0 elsewhere
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_loss_clipped_by_hand():
    """
    eps_low 0.2, eps_high 0.3; old logp 0, so ratio r = exp(logp). Per token -min(rA, clip(r)A):
      seq 0, A = +1: r 1.5 -> clip 1.3 -> -1.3 (clipped)   r 0.5 -> -0.5 (pessimistic side, kept)   r 1.1 -> -1.1
      seq 1, A = -2: r 0.5 -> clip 0.8 -> +1.6 (clipped)   r 1.5 -> +3.0 (kept)                      r 0.9 masked
    loss = (-1.3 - 0.5 - 1.1 + 1.6 + 3.0) / 5 = 0.34, clip_frac 2/5, ratio_mean 5.1/5.
    Gradient -A r / 5 where unclipped, 0 where clipped or masked.
    """
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 0.9]])
    logprobs = ratios.log().requires_grad_()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = grpo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask,
                            clip_low=0.2, clip_high=0.3)
    assert loss.item() == pytest.approx(0.34, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["ratio_mean"] == pytest.approx(1.02, abs=1e-6)
    assert stats["n_tokens"] == 5
    loss.backward()
    expected = torch.tensor([[0.0, -0.5 / 5, -1.1 / 5], [0.0, 2 * 1.5 / 5, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


@pytest.mark.parametrize("logp, ref, estimator, expected", [
    (-1.0, -1.0, "k3", 0.0),                     # identical policies: no divergence
    (-1.0, -1.0 - LN2, "k1", LN2),               # k1 = logp - ref
    (-2.0, -2.0 + LN2, "k1", -LN2),              # k1 goes negative when the reference is likelier
    (-1.0, -1.0 - LN2, "k3", 0.5 + LN2 - 1.0),   # k3 = e^(ref-logp) - (ref-logp) - 1 with ref-logp = -ln 2
    (-2.0, -2.0 + LN2, "k3", 2.0 - LN2 - 1.0),   # ... and with ref-logp = +ln 2; k3 stays >= 0
])
def test_kl_penalty_by_hand(logp, ref, estimator, expected):
    got = kl_penalty(torch.tensor([logp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64), estimator)
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_kl_penalty_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k1' or 'k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k2")


@pytest.mark.parametrize("estimator, ref, expected_kl", [
    ("k3", [-1.0 - LN2, -2.0 + LN2, 7.0], ((0.5 + LN2 - 1.0) + (2.0 - LN2 - 1.0)) / 2),  # = 0.25
    ("k1", [-1.0 - LN2, -2.0 - 3 * LN2, 7.0], (LN2 + 3 * LN2) / 2),                     # = 2 ln 2
])
def test_grpo_loss_kl_term(estimator, ref, expected_kl):
    """On policy with A = 0 the loss is kl_coef * token-mean(KL); the third token is masked."""
    logprobs = torch.tensor([[-1.0, -2.0, -5.0]])
    loss, stats = grpo_loss(logprobs, logprobs, torch.zeros(1), torch.tensor([[1, 1, 0]]),
                            kl_coef=0.1, ref_logprobs=torch.tensor([ref]), kl_estimator=estimator)
    assert stats["kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * expected_kl, abs=1e-6)


def test_grpo_loss_masked_tokens_get_exactly_zero_gradient():
    """Garbage (inf, NaN) at prompt / tool-response / pad positions must not leak into loss or gradient."""
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.randn(2, 5).where(mask, torch.tensor(float("nan"))).requires_grad_()
    old = (logprobs.detach() + 0.4 * torch.randn(2, 5)).where(mask, torch.tensor(float("-inf")))
    ref = (logprobs.detach() - 0.3).where(mask, torch.tensor(float("inf")))
    adv = torch.randn(2, 5)  # per-token advantages
    loss, stats = grpo_loss(logprobs, old, adv, mask, clip_low=0.1, clip_high=0.1,
                            kl_coef=0.05, ref_logprobs=ref, kl_estimator="k3")
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
    assert torch.equal(logprobs.grad[~mask], torch.zeros(int((~mask).sum())))
    assert logprobs.grad[mask].abs().sum() > 0


def test_grpo_loss_per_token_advantage():
    """(B, L) advantages: token-level credit, e.g. anchoring a closing tag, counts only where given."""
    logprobs = torch.zeros(1, 4, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 3.0, 1.0]])  # +2 extra at the closing-tag position
    loss, _ = grpo_loss(logprobs, logprobs.detach(), adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-6.0 / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv / 4)


def test_grpo_loss_micro_batches_add_up_with_global_normaliser():
    """Token-mean over the whole batch: two micro-batches with num_tokens = total sum to the full loss."""
    torch.manual_seed(1)
    logprobs, old, adv = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4)
    mask = torch.rand(4, 6) > 0.3
    full, _ = grpo_loss(logprobs, old, adv, mask)
    total = mask.sum()
    parts = [grpo_loss(logprobs[s], old[s], adv[s], mask[s], num_tokens=total)[0] for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(advantages=torch.zeros(3)), "advantages"),                   # one advantage per sequence, B = 2
    (dict(mask=torch.ones(2, 4)), r"must all be \(B, L\)"),            # mask longer than the sequences
    (dict(kl_coef=0.1), "needs ref_logprobs"),                         # KL asked for without a reference
    (dict(ref_logprobs=torch.zeros(2, 2)), "ref_logprobs"),            # reference of the wrong length
])
def test_grpo_loss_rejects_bad_shapes(kwargs, message):
    args = dict(logprobs=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=message):
        grpo_loss(**{**args, **kwargs})


# -----------------------------------------------------------------------------
# get_lr

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
    lrs = [get_lr(s, 50, 3e-6, warmup_steps=5) for s in range(5, 60)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[0] > lrs[-1]


@pytest.mark.parametrize("total, warmup", [
    (0, 0),     # no steps at all
    (10, 11),   # warmup longer than the run
])
def test_get_lr_rejects_bad_schedule(total, warmup):
    with pytest.raises(ValueError, match="get_lr"):
        get_lr(0, total, 1.0, warmup_steps=warmup)


# -----------------------------------------------------------------------------
# tdam_mask

# L = 20:  0-1 prompt | 2-5 overview video | 6 text | 7-8 call 1 | 9-11 observation video 1 |
#          12-13 call 2 | 14-16 observation video 2 | 17 "<answer>" | 18-19 answer
LAYOUT = dict(seq_len=20, overview_span=(2, 6), answer_span=(18, 20),
              call_spans=[(7, 9), (12, 14)], obs_spans=[(9, 12), (14, 17)])


def rows(text: str) -> torch.Tensor:
    return torch.tensor([c == "1" for c in text])


def test_tdam_mask_by_hand():
    mask = tdam_mask(**LAYOUT)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    edited = {
        # call 2 may not see observation video 1 (cols 9-11); it still sees the overview and call 1
        12: rows("11111111100010000000"),
        13: rows("11111111100011000000"),
        # the answer may not see the overview video (cols 2-5); it sees both observations
        18: rows("11000011111111111110"),
        19: rows("11000011111111111111"),
    }
    for i in range(20):
        assert torch.equal(mask[i], edited.get(i, causal[i])), f"row {i}"


def test_tdam_mask_third_call_loses_both_earlier_observations():
    # 0 prompt | 1-2 overview | 3 call 1 | 4-5 obs 1 | 6 call 2 | 7-8 obs 2 | 9 call 3 | 10-11 obs 3
    mask = tdam_mask(12, (1, 3), None, call_spans=[(9, 10), (3, 4), (6, 7)],  # order given does not matter
                     obs_spans=[(4, 6), (7, 9), (10, 12)])
    assert torch.equal(mask[9], rows("111100100100"))
    assert torch.equal(mask[6], rows("111100100000"))
    assert torch.equal(mask[3], rows("111100000000"))  # the first call is never edited


@pytest.mark.parametrize("obs_spans, call_spans", [
    ([], [(7, 9)]),   # one call, no observation video yet: only the overview video, no edit at all
    ([], []),         # no tool use: a plain answer after the overview
])
def test_tdam_mask_single_video_is_causal(obs_spans, call_spans):
    mask = tdam_mask(20, (2, 6), (18, 20), call_spans, obs_spans)
    assert torch.equal(mask, torch.ones(20, 20, dtype=torch.bool).tril())


@pytest.mark.parametrize("kwargs, message", [
    (dict(answer_span=(4, 8)), "overlaps overview_span"),   # an answer inside the video would mask itself
    (dict(obs_spans=[(9, 25)]), "obs_span"),                # past the end of the sequence
    (dict(call_spans=[(9, 7)]), "call_span"),               # end before start
])
def test_tdam_mask_rejects_bad_spans(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tdam_mask(**{**LAYOUT, **kwargs})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_additive_mask_matches_boolean_attention(dtype):
    mask = tdam_mask(**LAYOUT)
    additive = to_additive_mask(mask, dtype)
    assert additive.shape == (1, 1, 20, 20) and additive.dtype == dtype
    assert torch.equal(additive[0, 0] == 0, mask)
    assert torch.all(additive[0, 0][~mask] == torch.finfo(dtype).min)
    q, k, v = torch.randn(3, 1, 2, 20, 8, dtype=dtype).unbind(0)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_to_additive_mask_batched():
    """(B, L, L) keeps one mask per sequence: (B, 1, L, L), the head dim broadcast."""
    masks = torch.stack([tdam_mask(**LAYOUT), torch.ones(20, 20, dtype=torch.bool).tril()])
    additive = to_additive_mask(masks)
    assert additive.shape == (2, 1, 20, 20)
    assert torch.equal(additive[:, 0] == 0, masks)
    with pytest.raises(ValueError, match="to_additive_mask"):
        to_additive_mask(torch.ones(2, 3, 4, dtype=torch.bool))  # not square

