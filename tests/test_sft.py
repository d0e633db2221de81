"""Tests of sft.py: the SFT examples (oracle overview sizes, threads, the pixel budget), TDAM on real encoded
trajectories (the spans, the rules, the blocked attention against the dense mask, the keyword path, gradient
checkpointing), the SFT micro-batches and their gradient, and a bf16 SFT step with TDAM.
"""
import math
import os

import pytest
import torch
from conftest import SFT_MIX, metrics, run, smoke_argv

import data
import model as model_lib
import layers
import ops
import rollout
import recipes
import runtime
import sft
import train
import policy


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# -----------------------------------------------------------------------------
# the SFT examples

@pytest.mark.parametrize("extra, ks", [(["--set", "sft_gated_overviews=0", "--gating", "0"], {8}), ([], {4, 8})])
def test_sft_examples_overview_sizes(tmp_path, tiny, extra, ks):
    """Synthetic SFT: every record once with the evaluation overview (K = 8) and, by default (RL gates), once more
    with a K drawn from the gating choices; sft_gated_overviews=0 (with --gating 0) leaves the second copy out."""
    model, processor = tiny
    args = recipes.parse_train_args(smoke_argv(tmp_path, "--gating-choices", "4", *extra))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    items, bad = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), sft_data=None, seed=args.seed,
                                    gated_choices=args.gating_choices if args.sft_gated_overviews else [], **SFT_MIX)
    assert bad == 0 and len(items) == len(records) * len(ks)
    assert {t.nframes for t in items} == ks and [t.record_id for t in items[::len(ks)]] == [r["id"] for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_sft_examples_in_threads_are_the_serial_ones(tmp_path, tiny, name):
    """`sft_examples(workers=2)` (train.py: a thread per core) encodes the very trajectories of the serial loop, in
    its order: the same token ids, roles and pixels; with the tiny tokenizer and with the real Qwen tokenizer (the
    threads share one processor)."""
    model, processor = tiny if name == "tiny" else model_lib.load_model(name, device="cpu", seed=0,
                                                                        tiny_corpus=rollout.prompt_corpus())
    args = recipes.parse_train_args(smoke_argv(tmp_path))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    kw = dict(SFT_MIX, sft_data=None, seed=0, gated_choices=args.gating_choices, direct_crop=0.5, budget_fraction=0.5)
    one, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), workers=1, **kw)
    two, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), workers=2, **kw)
    assert len(one) == len(two) > len(records)
    for a, b in zip(one, two):
        assert (a.record_id, a.token_ids, a.roles, a.nframes) == (b.record_id, b.token_ids, b.roles, b.nframes)
        assert len(a.videos) == len(b.videos) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                                      for x, y in zip(a.videos, b.videos))


@pytest.mark.slow
def test_sft_items_keep_at_most_their_budget_of_pixels_and_train_the_same(tmp_path, tiny):
    """--sft-cache-gb shrunk to two trajectories' pixels: sft_examples encodes every record to check it but keeps
    at most that budget (a 1,000-record cold start at Qwen's sizes held whole: 352 GiB a rank), a step draws the
    rest encoded again (the next step's batch by a thread meanwhile), each comes back as it was (ids, roles,
    pixels), and SFT steps give the weights of the unbounded run, bit for bit."""
    model, processor = tiny
    args = recipes.parse_train_args(smoke_argv(tmp_path))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    kw = dict(SFT_MIX, sft_data=None, seed=0, gated_choices=[])
    whole, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), **kw)
    budget = 2 * max(sft.SFTItems._size(t) for t in whole) + 1
    held, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), cache_bytes=budget, **kw)
    assert len(held) == len(whole) > 4 and held.held <= budget and len(held.cache) <= 2
    for i in range(len(whole)):
        a, b = whole[i], held[i]
        assert (a.record_id, a.token_ids, a.roles) == (b.record_id, b.token_ids, b.roles)
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a.videos, b.videos))
        assert held.held <= budget
    assert held.encodes >= len(whole) - 2 and whole.encodes == 0          # re-encoded when drawn; never, unbounded
    s = sft.SFTSettings(steps=3, batch=4, micro_batch=2, lr=1e-3, tdam_ratio=0.0)
    out = {}
    for name, items in (("whole", whole), ("held", held)):
        m = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
        run_ = runtime.Run(str(tmp_path / name), 0, 1, 0, 100, 0, False, 1.0)
        run_.processor = processor
        sft.run_sft(run_, m, items, policy.make_optimizer(m, s.lr, 0.0), s, processor.tokenizer)
        out[name] = {n: p.detach().clone() for n, p in m.named_parameters()}
        assert items.held <= (budget if name == "held" else float("inf")) and not items.pending
    assert all(torch.equal(out["whole"][n], out["held"][n]) for n in out["whole"])


# -----------------------------------------------------------------------------
# TDAM on real encoded trajectories

def _positions(ids: list[int], tok: int) -> list[int]:
    return [j for j, t in enumerate(ids) if t == tok]


def expected_tdam(traj, special: dict, video_id: int) -> torch.Tensor:
    """(n, n) allowed-mask worked out from the trajectory's own bookkeeping: prompt_len, and the tags the
    environment wrote. A video's columns run from its first to its last video token (the frame
    timestamps between them included). The prompt itself mentions <think> and <answer>."""
    ids, n, start = traj.token_ids, len(traj.token_ids), traj.prompt_len
    after = lambda tok: [j for j in _positions(ids, special[tok]) if j >= start]
    block = lambda js: list(range(js[0], js[-1] + 1))
    videos = _positions(ids, video_id)
    overview = block([j for j in videos if j < start])
    obs = [block([j for j in videos if o < j < c]) for o, c in zip(after("<tool_response>"), after("</tool_response>"))]
    calls = list(zip(after("<tool_call>"), after("</tool_call>")))
    answer = after("<answer>")[-1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[answer + 1:, overview] = False                     # (1) the answer cannot look at the overview
    for c0, c1 in calls[1:]:                                   # (2) later calls cannot look at earlier crops
        for cols in obs:
            if cols[-1] < c0:
                allowed[c0:c1 + 1, cols] = False
    return allowed


def test_tdam_batch_mask_on_encoded_trajectories(tiny, tdam_batch):
    model, processor = tiny
    trajs, batch = tdam_batch
    special = model_lib.special_token_ids(processor)
    video_id = model.config.video_token_id
    mask = sft.tdam_batch_mask(batch, processor.tokenizer, video_id)
    B, L = batch["input_ids"].shape
    assert mask.shape == (B, 1, L, L)
    allowed = mask[:, 0] == 0
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        want = expected_tdam(t, special, video_id)
        assert torch.equal(allowed[i, :n, :n], want), f"row {i}: {(allowed[i, :n, :n] != want).nonzero()[:5]}"
        assert not allowed[i, :n, n:].any()                    # real tokens never see pads
        assert torch.equal(allowed[i, n:, :], torch.eye(L, dtype=torch.bool)[n:])   # pads see only themselves
    # the rules really cut something in both rows: the answer loses the overview, call 2 loses crop 1
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    assert all(int((causal[:len(t.token_ids), :len(t.token_ids)] & ~allowed[i, :len(t.token_ids), :len(t.token_ids)])
                   .sum()) > 0 for i, t in enumerate(trajs))
    ids1 = trajs[1].token_ids
    second_call = _positions(ids1, special["<tool_call>"])[1]
    first_obs = [j for j in _positions(ids1, video_id) if j > trajs[1].prompt_len][0]
    assert not allowed[1, second_call, first_obs] and allowed[1, second_call, 0]


def test_tdam_mask_reaches_attention(tiny, tdam_batch):
    """The 4-D mask path: a causal 4-D mask reproduces the 2-D loss, the TDAM mask changes it, both finite."""
    model, processor = tiny
    trajs, batch = tdam_batch
    L = batch["input_ids"].shape[1]
    with torch.no_grad():
        s = sft.SFTSettings(loss_chunk=1024)
        plain, _ = sft.sft_loss(model, batch, s)
        causal = torch.zeros(len(trajs), L, L, dtype=torch.bool)
        for i, t in enumerate(trajs):
            n = len(t.token_ids)
            causal[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            causal[i, range(n, L), range(n, L)] = True
        same, _ = sft.sft_loss(model, dict(batch, attention_mask=ops.to_additive_mask(causal)), s)   # a 4-D mask
        tdam, _ = sft.sft_loss(model, dict(batch, attention_mask=sft.tdam_batch_mask(
            batch, processor.tokenizer, model.config.video_token_id)), s)
    assert math.isfinite(float(tdam))
    assert abs(float(same) - float(plain)) < 1e-5
    assert abs(float(tdam) - float(plain)) > 1e-6


def test_blocked_tdam_attention_equals_the_dense_mask(tiny, tdam_batch):
    """tdam_attention in the model (block-sparse tiles from the rectangles, the CPU's blocked kernel) gives the loss
    and gradients of the dense (B, 1, L, L) mask, with tiles that split the rows; and the rules cut something."""
    model, processor = tiny
    trajs, batch = tdam_batch
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    spec.block = 16                                              # several blocks per row
    assert spec.rects.shape[1] >= 1 and (spec.rects[:, :, 1] > spec.rects[:, :, 0]).any()
    dense = sft.tdam_batch_mask(batch, processor.tokenizer, model.config.video_token_id)
    losses, grads = [], []
    for b, spec_ in ((dict(batch, attention_mask=dense), None), (batch, spec)):
        model.zero_grad(set_to_none=True)
        loss, _ = sft.sft_loss(model, b, sft.SFTSettings(), spec_)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.model.language_model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    assert abs(losses[0] - losses[1]) < 1e-5
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-4


def test_tdam_attention_is_reached_by_keyword_in_plain_calls(tiny, tdam_batch, monkeypatch):
    """The `tdam` keyword alone picks TDAM's attention in every decoder layer (layers.attention calls
    ops.tdam_attention: no registry, the model's attention implementation untouched), and a forward without it is
    SDPA's, padding mask included, the same loss as before the TDAM forward."""
    model, processor = tiny
    _, batch = tdam_batch
    lm = model.model.language_model
    impl = lm.config._attn_implementation
    calls = []
    tdam = layers.tdam_attention
    monkeypatch.setattr(layers, "tdam_attention", lambda *a: (calls.append(a[3]), tdam(*a))[1])
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    with torch.no_grad():
        before = sft.sft_loss(model, batch, sft.SFTSettings())[0]
        assert not calls
        sft.sft_loss(model, batch, sft.SFTSettings(), tdam=spec)
        after = sft.sft_loss(model, batch, sft.SFTSettings())[0]
    assert len(calls) == len(lm.layers) and all(c is spec for c in calls)
    assert lm.config._attn_implementation == impl and torch.equal(before, after)


def test_tdam_gradients_equal_with_gradient_checkpointing(tiny, tdam_batch):
    """`--grad-checkpointing` recomputes each decoder layer in backward: a TDAM forward must be recomputed with
    the same attention and spec, so every parameter's gradient equals the one without checkpointing (fp32)."""
    model, processor = tiny
    _, batch = tdam_batch
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    spec.block = 16
    grads = []
    model.train()
    try:
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable()                  # as train.main does
            model.zero_grad(set_to_none=True)
            loss, _ = sft.sft_loss(model, batch, sft.SFTSettings(), tdam=spec)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)
    assert len(grads[0]) > 10 and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-5), name


@pytest.mark.slow
def test_sft_step_with_tdam_on_every_batch(tmp_path):
    """`--tdam-ratio 1.0`: the SFT step trains through the 4-D mask with a finite loss."""
    run(smoke_argv(tmp_path, "--stage", "sft", "--sft-steps", "1", "--sft-batch", "2", "--tdam-ratio", "1.0",
                   "--n-train", "4"))
    (row,) = metrics(tmp_path)
    assert row["tdam"] == 1.0 and math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


# -----------------------------------------------------------------------------
# the SFT step: micro-batches, bf16

@pytest.mark.slow
@pytest.mark.parametrize("tdam", [False, True])
def test_sft_micro_batches_give_the_batch_gradient(tiny, tdam_batch, tdam, small_thresholds, monkeypatch):
    """sft_backward over length-sorted micro-batches: the loss and gradients of one forward over the
    whole batch (token mean), with fewer padded tokens; TDAM masks included; and through token_logprobs' fused
    chunks (loss_chunk 64, boundaries inside the rows) the same as through its plain path (the default here at
    the shipped sizes; with the thresholds shrunk the default takes the fused chunks too, 3 of them)."""
    model, processor = tiny
    trajs, _ = tdam_batch
    items, pad_id = [trajs[1], trajs[0], trajs[1], trajs[0]], processor.tokenizer.pad_token_id
    tdam_tok = processor.tokenizer if tdam else None
    chunks, real_apply = [], ops._TokenLogprobs.apply                      # the fused path's chunk sizes
    monkeypatch.setattr(ops._TokenLogprobs, "apply", lambda *a: (chunks.append(a[3]) if torch.is_grad_enabled() else None) or real_apply(*a))

    def grads(rows, loss_chunk=None):
        model.zero_grad(set_to_none=True)
        loss, n = sft.sft_backward(model, items, sft.SFTSettings(micro_batch=rows, loss_chunk=loss_chunk or 0), pad_id,
                                   tdam_tok)
        return float(loss), n, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    (l4, n4, g4), (l2, n2, g2), (l1, n1, g1) = grads(4), grads(2), grads(1)
    assert bool(chunks) == bool(small_thresholds), chunks            # the default rule: plain, or fused when shrunk
    lf, nf, gf = grads(2, 64)
    model.zero_grad(set_to_none=True)
    assert n4 == n2 == n1 == nf == sum(sum(r == 1 for r in t.roles[1:]) for t in items)
    assert abs(l2 - l4) < 1e-5 and abs(l1 - l4) < 1e-5 and abs(lf - l4) < 1e-5 and g4.norm() > 0
    for g in (g2, g1, gf):
        assert float((g - g4).norm() / g4.norm()) < 1e-5
    shapes = [b["input_ids"].shape for b in sft.sft_micro_batches(items, model, pad_id, sft.SFTSettings(micro_batch=2))]
    short, long_ = sorted(len(t.token_ids) for t in trajs)
    assert shapes == [(2, short), (2, long_)]            # like lengths together: the short pair pads to `short`


def test_sft_micro_batches_keep_the_token_budget(tiny, tdam_batch, monkeypatch):
    """SFT micro-batches take the RL update's padded-token budget (--micro-batch-tokens, shrunk here to the rows'
    lengths): two unequal rows whose padded pair exceeds it go one at a time, and no decoder layer then receives a
    (B, 1, L, L) mask (before: sft_micro_batch rows whatever their length, 2 rows of 32k tokens a 2 GiB mask a
    layer call); within the budget they share a micro-batch and its mask, as before."""
    model, processor = tiny
    trajs, _ = tdam_batch
    pad_id = processor.tokenizer.pad_token_id
    short, long_ = sorted(len(t.token_ids) for t in trajs)
    masks, cls = [], type(model.model.language_model.layers[0])           # the decoder layer the model runs
    real = cls.forward

    def spy(self, hidden_states, attention_mask=None, **kw):
        masks.append(None if attention_mask is None else tuple(attention_mask.shape))
        return real(self, hidden_states, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(cls, "forward", spy)
    for tokens, want in ((2 * long_, [(2, 1, long_, long_)]), (2 * long_ - 1, [None, None])):
        masks.clear()
        s = sft.SFTSettings(micro_batch=2, micro_batch_tokens=tokens)
        batches = list(sft.sft_micro_batches(trajs, model, pad_id, s))
        assert [b["input_ids"].shape[0] for b in batches] == ([2] if want[0] else [1, 1])
        model.zero_grad(set_to_none=True)
        sft.sft_backward(model, trajs, s, pad_id)
        n_layers = len(model.model.language_model.layers)
        assert masks == [w for w in want for _ in range(n_layers)]
    model.zero_grad(set_to_none=True)
    args = recipes.parse_train_args(["--micro-batch-tokens", "4096"])
    assert train.sft_settings(args).micro_batch_tokens == 4096


def test_bf16_tdam_sft_step_on_one_process(tdam_batch):
    """--precision bf16 on one process (no FSDP: fp32 weights under autocast) with TDAM on, as a single-GPU SFT run
    does with --tdam-ratio: Qwen3-VL's q / k norms hand the attention fp32 queries and keys beside bf16 values, which
    the TDAM kernel takes in autocast's dtype as SDPA does; the loss is finite, every decoder weight gets a gradient,
    and it equals the dense-mask SDPA run's (the same TDAM mask as a 4-D tensor) to bf16 rounding."""
    trajs, batch = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    pad_id, tok = processor.tokenizer.pad_token_id, processor.tokenizer
    model.train()
    loss, n = sft.sft_backward(model, trajs, sft.SFTSettings(micro_batch=2, precision="bf16"), pad_id, tdam_tokenizer=tok)
    assert torch.isfinite(loss) and n > 0
    layer = model.model.language_model.layers[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    mask = sft.tdam_batch_mask(batch, tok, model.config.video_token_id)
    fresh, _ = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    with torch.no_grad():
        dense, _ = sft.sft_loss(fresh, dict(batch, attention_mask=mask), sft.SFTSettings(precision="bf16"))
    assert float(loss) == pytest.approx(float(dense), rel=2e-2)
