"""The exact mode (--set exact_policy=1): the rollout's recorded log-probs equal the trainer's bit for bit, in fp32 and
in bf16 autocast, whatever the batch (ops.py §4, docs/method.md "One policy"). One thread, as the mode asks on a CPU."""
import pytest
import torch
import torch.nn.functional as F

import ops
import policy
import rollout
from conftest import metrics, run, smoke_argv
from test_rollout import ANSWER, EXACT_SCRIPTS, Scripted, _record_engines, call, config, turn
from test_rollout import split, tiny  # noqa: F401 (fixtures: the tiny model on one thread, 4 synthetic videos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(41, 192, dtype=dtype), torch.randn(512, 192, dtype=dtype), torch.randn(512, dtype=dtype)
    full = ops.tiled_linear(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b), atol=0.1 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    for rows in (slice(7, 8), slice(3, 6), slice(20, 41)):
        assert torch.equal(ops.tiled_linear(x[rows], w, b), full[rows])
    if dtype == torch.float32:      # what the tiles are for: one row through the plain call takes another kernel
        plain = F.linear(x, w, b)
        assert any(not torch.equal(F.linear(x[i:i + 1], w, b), plain[i:i + 1]) for i in range(41))


def test_exact_attention_is_causal_attention_with_the_same_bits_in_decode_chunks_and_training():
    torch.manual_seed(0)
    n, L, scale = 3, 150, 0.125
    q, k, v = torch.randn(n, 3, L, 64), torch.randn(n, 1, L, 64), torch.randn(n, 1, L, 64)
    full = ops.exact_attention(q, k, v, torch.arange(L).expand(n, L), scale)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                                         scale=scale)
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
    for t in (0, 63, 64, 149):          # a decode query over its row's keys, alone or in a padded batch
        alone = ops.exact_attention(q[1:2, :, t:t + 1], k[1:2, :, :t + 1], v[1:2, :, :t + 1], torch.tensor([[t]]), scale)
        padded = ops.exact_attention(q[:, :, t:t + 1], k, v, torch.full((n, 1), t), scale)
        assert torch.equal(alone[0], full[1, :, t:t + 1]) and torch.equal(padded, full[:, :, t:t + 1])
    chunk = ops.exact_attention(q[:, :, 40:90], k[:, :, :90], v[:, :, :90], torch.arange(40, 90).expand(n, 50), scale)
    assert torch.equal(chunk, full[:, :, 40:90])


def rollout_rows(model, processor, recs, root, precision, **kw):
    """Main rows then their sub-agents, sampled in the exact mode under `precision`."""
    cfg = config(exact_policy=True, **kw)
    with policy.autocast(precision, model):
        trajs = rollout.run_agent(model, processor, recs, root, cfg, seed=0)
    return trajs + [s for t in trajs for s in t.subagents], cfg


def trainer_logprobs(model, processor, rows, cfg, precision, per_batch):
    """Each row's exact-mode log-probs of its policy tokens, from training micro-batches of `per_batch` rows."""
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    out = []
    for a in range(0, len(rows), per_batch):
        b = rollout.collate(rows[a:a + per_batch], model, pad, share_videos=True)
        with torch.no_grad():
            lp, mask = policy.exact_logprobs(model, b, cfg.temperature, precision)
        out += [lp[i][mask[i]] for i in range(len(lp))]
    return out


@pytest.mark.parametrize("mode,precision", [("interleaved", "bf16"),
                                            *[pytest.param(m, p, marks=pytest.mark.slow) for m, p in
                                              (("interleaved", "fp32"), ("subagent", "fp32"), ("subagent", "bf16"))]])
def test_exact_mode_rollout_logprobs_are_the_trainers_bit_for_bit(tiny, split, monkeypatch, shrunk_thresholds, mode,
                                                                  precision):
    """Multi-turn video trajectories (parallel crops, a failed call, sub-agents), shared-prefix decode, continuous
    batching under a budget of one group (thresholds shrunk: 4-token blocks), fp32 and bf16 autocast; the
    trainer's micro-batches of 1, 3 and all rows give the same bytes."""
    model, processor = tiny
    root, recs = split
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, EXACT_SCRIPTS, sub="A blue square."))
    engines = _record_engines(monkeypatch)
    with pytest.warns(UserWarning, match="below one prompt group"):     # the pool holds one group's worst case
        rows, cfg = rollout_rows(model, processor, recs[:2], root, precision, tool_mode=mode, group_size=2,
                                 memory_budget_bytes=1)
    assert engines[0].kv.pool.n_blocks < engines[0].need                # so the second group waited
    assert [t.n_tool_turns for t in rows[:4]] == [2, 0, 1, 2] and (mode == "interleaved") != any(t.parent for t in rows)
    for per_batch in (1, 3, len(rows)):
        got = trainer_logprobs(model, processor, rows, cfg, precision, per_batch)
        for t, lp in zip(rows, got):
            assert torch.equal(lp, torch.tensor(t.logprobs, dtype=torch.float32)), (t.record_id, t.sample, per_batch)


def test_exact_mode_samples_a_row_the_same_whatever_shares_its_batch(tiny, split):
    """Sampled at T = 1: record 0's first sample, rolled out among 1, 3 and 8 rows, gets the same tokens and the same
    log-prob bytes (its draws depend on its seed; its logits, in the exact mode, on its own tokens)."""
    model, processor = tiny
    root, recs = split
    runs = [rollout_rows(model, processor, recs[:n], root, "bf16", group_size=g, max_new_tokens=48)[0][0]
            for n, g in ((1, 1), (3, 1), (4, 2))]
    assert all(t.token_ids == runs[0].token_ids and t.logprobs == runs[0].logprobs for t in runs[1:])
    assert len(runs[0].logprobs) > 10


def test_fast_mode_differs_where_the_exact_mode_does_not(tiny, split, monkeypatch):
    """The check can fail: in the fast mode (paged cascade decode, fused kernels) bf16 log-probs differ from the
    training forward's on the same scripted trajectories."""
    model, processor = tiny
    root, recs = split
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, {(0, 0): [turn("x", call(28.0, 36.0)), ANSWER]}))
    cfg = config(group_size=1)
    with policy.autocast("bf16", model):
        rows = rollout.run_agent(model, processor, recs[:1], root, cfg, seed=0)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    b = rollout.collate(rows, model, pad, share_videos=True)
    with torch.no_grad():
        fast = policy.forward_logprobs(model, b, 1024, cfg.temperature, False, "bf16")
    mask = policy.policy_mask(b["roles"])
    assert not torch.equal(fast[mask], torch.tensor(rows[0].logprobs))


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_an_exact_run_trains_on_the_rollouts_bits(tmp_path, cache_env, one_thread, monkeypatch, precision):
    """train.py --set exact_policy=1 with two PPO epochs: every step's gap is exactly 0 (the loss's first forward against
    the recorded log-probs), the update runs no pi_old forward (the recorded log-probs are pi_old) and takes the
    exact forward, never the fused head."""
    import grpo
    calls = {"fast": 0, "exact": 0}
    fast, exact = policy.forward_logprobs, policy.exact_logprobs
    monkeypatch.setattr(grpo, "forward_logprobs", lambda *a, **k: (calls.__setitem__("fast", calls["fast"] + 1),
                                                                    fast(*a, **k))[1])
    monkeypatch.setattr(policy, "exact_logprobs", lambda *a, **k: (calls.__setitem__("exact", calls["exact"] + 1),
                                                                   exact(*a, **k))[1])
    monkeypatch.setattr(grpo, "policy_head", lambda *a, **k: pytest.fail("the fused head in the exact mode"))
    run(smoke_argv(tmp_path, "--stage", "rl", "--mask-truncated", "0", "--precision", precision, "--set",
                   "exact_policy=1", "--set", "ppo_epochs=2", "--max-new-tokens", "32"))
    rows = [r for r in metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rows] == [1, 2] and all(r["mismatch/tokens"] > 0 for r in rows)
    assert all(r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/k3"] == 0.0 for r in rows)
    assert calls["fast"] == 0 and calls["exact"] >= 4           # two epochs over each step's micro-batches


def test_the_exact_forward_of_qwen25vl_layers_is_batch_invariant():
    """Qwen2.5-VL's decoder (q / k / v biases, no q / k norms) in the exact forward: a row's logits are the same bits
    alone and beside other rows, and close to the plain forward's."""
    import layers
    from test_layers import qwen25vl
    model = layers.use_plain_layers(qwen25vl(vocab_size=320))
    with torch.no_grad():
        ids = torch.randint(0, 320, (5, 70))
        exact = lambda x: ops.tiled_linear(model.model(input_ids=x, exact=True).last_hidden_state, model.lm_head.weight)
        batch, alone = exact(ids), exact(ids[3:4])
        assert torch.equal(batch[3:4], alone)
        torch.testing.assert_close(batch, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
