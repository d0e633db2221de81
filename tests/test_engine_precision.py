"""The rollout engine's attention is fp32 under the RL step's autocast (--precision bf16: grpo.collect_groups runs
rollout.run_agent inside torch.autocast(bf16) on fp32 weights). kvcache.py documents its scores, softmax, log-sum-exp
and merge as fp32; under autocast the hand-written cascade (CUDA's every path) ran them in bf16 (its matmuls are
autocast ops), so the sampler drew from another policy than the one the loss trains. Checked two ways: the kernels
(`_attend`, `_merge`) under autocast against a float64 reference, and every attention call of the engine on a
trajectory under autocast against the same call, same inputs, with autocast off, on each path a size picks.
"""
import pytest
import torch

import kvcache
import model as model_lib
import rollout


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """conftest's one intra-op thread (token-by-token decoding is latency-bound)."""


def _reference(q, k, v, scale, hide):
    """Softmax attention in float64: q (n, h, m, d) over k, v (n, h, c, d), hide (n, 1 or h, m, c) True where a key
    is not seen."""
    s = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(hide, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernel", "hand_written"])
@pytest.mark.parametrize("scores", [2 ** 24, 64], ids=["one_block", "query_blocks"])
def test_attend_and_merge_fp32_under_autocast(monkeypatch, fused, scores):
    """A prompt part (keys hidden past each row's length by the bias) and a causal suffix part, each `_attend`ed
    under CPU bf16 autocast and merged by their LSE (`_merge`), equal float64 softmax attention over [prompt ;
    suffix] to 1e-4, from bf16 K/V and scores of tens (q scaled x8). Autocast made the hand-written form's scores
    and LSE bf16: off by 0.03-0.2 here."""
    monkeypatch.setattr(kvcache, "FUSED_CPU", fused)
    monkeypatch.setattr(kvcache, "SCORES_BUDGET", scores)
    gen = torch.Generator().manual_seed(0)
    n, h, m, d, c = 3, 2, 6, 16, 30
    q = torch.randn(n, h, m, d, generator=gen) * 8
    kp, vp, ks, vs = (torch.randn(n, h, c if i < 2 else m + 4, d, generator=gen).to(torch.bfloat16) for i in range(4))
    ends = torch.tensor([30, 11, 1])                                     # each row's prompt length
    bias = kvcache._hidden(torch.arange(c) >= ends[:, None])[:, None, None]
    qpos = torch.tensor([4, 0, 2])[:, None] + torch.arange(m)            # each query's position among the suffix
    with torch.autocast("cpu", torch.bfloat16):
        op, lp = kvcache._attend(q, kp, vp, 0.25, bias=bias)
        os_, ls = kvcache._attend(q, ks, vs, 0.25, qpos=qpos)
        out = kvcache._merge(op, lp, os_, ls)
    assert {t.dtype for t in (op, lp, os_, ls, out)} == {torch.float32}
    hide_p = (torch.arange(c) >= ends[:, None])[:, None, None].expand(n, 1, m, c)
    hide_s = (torch.arange(m + 4) > qpos[:, :, None])[:, None]
    ref = _reference(q, torch.cat([kp, ks], 2), torch.cat([vp, vs], 2), 0.25, torch.cat([hide_p, hide_s], -1))
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(os_.double(), _reference(q, ks, vs, 0.25, hide_s), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def sharp():
    """The tiny model with every layer's q_norm scaled x8: attention scores of tens, as in real models."""
    model, processor = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_norm.weight.mul_(8.0)
    return model, processor


# the sizes that pick the engine's attention paths, and the paths each setting must reach
SETTINGS = {
    "shipped": ({}, {"prompt", "chunk", "decode_sdpa", "causal"}),     # causal: fused_causal, or hand_written (off)
    "each_prompt_in_place": ({"BLOCK": 4, "JOIN_PROMPT": 0, "SCORES_BUDGET": 0, "GATHER_BUDGET": 0},
                             {"prompt", "chunk", "in_place", "fragmented", "merge", "query_blocks", "row_slabs"}),
    "prompts_together": ({"BLOCK": 4, "JOIN_PROMPT": 0}, {"prompt", "chunk", "slabs", "merge"}),
    "some_prompts_joined": ({"BLOCK": 4, "JOIN_PROMPT": 1024}, {"prompt", "chunk", "slabs", "merge", "joined"}),
    "small": ({"BLOCK": 4, "SCORES_BUDGET": 512, "JOIN_PROMPT": 0, "PREFILL_TOKENS": 64, "GATHER_BUDGET": 2048},
              {"prompt", "chunk", "in_place", "merge", "query_blocks", "row_slabs"}),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernel", "hand_written"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_attention_fp32_under_autocast(sharp, monkeypatch, setting, fused):
    """Three prompts (one fragmented) with 2, 3 and 1 rows: prefill, a chunk on every row, three decode steps,
    all under CPU bf16 autocast. Every GroupKV.attend call (prompts, chunks, decode steps; prompts with their rows
    or in place, alone or together; slabs of rows; query blocks) gives, to 1e-3, what the same call with the same
    q / K / V gives with autocast off (fp32 throughout: the module docstring's claim), rounded to bf16 (autocast's
    compute dtype) as the engine returns it. The paths each size setting reaches are checked too."""
    sizes, paths = SETTINGS[setting]
    for name, value in sizes.items():
        monkeypatch.setattr(kvcache, name, value)
    monkeypatch.setattr(kvcache, "FUSED_CPU", fused)
    model, processor = sharp
    V = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(3)
    text = lambda n: kvcache.Chunk(torch.randint(300, V, (n,), generator=gen), torch.zeros(n, dtype=torch.int32))
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    seen, diffs = set(), []
    attend, inner = kvcache.GroupKV.attend, kvcache._attend

    def recorded_attend(q, k, v, scale, qpos=None, bias=None):
        n, h, m, _ = q.shape
        fused_kernel = kvcache.FUSED_CPU and (qpos is None or n * m * k.shape[2] <= kvcache.SCORES_BUDGET)
        causal = qpos is not None or (bias is not None and bias.shape[2] > 1)   # the limit, or its mask (_fused_causal)
        seen.add(("fused_causal" if causal else "fused_kernel") if fused_kernel else "hand_written")
        if not fused_kernel and max(1, kvcache.SCORES_BUDGET // max(1, n * h * k.shape[2])) < m:
            seen.add("query_blocks")
        return inner(q, k, v, scale, qpos, bias)

    def compared(self, layer, q, key, value, scale):
        fwd = self.fwd
        out = attend(self, layer, q, key, value, scale)                  # under the ambient autocast
        with torch.autocast("cpu", enabled=False):
            ref = attend(self, layer, q, key, value, scale)
        diffs.append(((out.float() - ref.to(out.dtype).float()).abs().max().item(), out.dtype))
        if fwd.prompt_mode:
            seen.add("prompt")
        else:
            seen.add("chunk" if fwd.shape[1] > 1 else "decode_sdpa" if not fwd.slabs else "decode")
            seen.update({"in_place"} if any(sb.first is not None for sb in fwd.slabs) else set())
            seen.update({"fragmented"} if any(sb.p == 1 and sb.first is None for sb in fwd.slabs) else set())
            seen.update({"slabs"} if any(sb.p > 1 for sb in fwd.slabs) else set())
            seen.update({"merge"} if fwd.slabs else set())
            seen.update({"joined"} if fwd.alone is not None else set())
            seen.update({"row_slabs"} if len(fwd.cuts) > 1 else set())
        return out

    monkeypatch.setattr(kvcache.GroupKV, "attend", compared)
    monkeypatch.setattr(kvcache, "_attend", recorded_attend)
    with torch.autocast("cpu", torch.bfloat16):
        kv = kvcache.GroupKV(model, "cpu", 200)
        if kvcache.BLOCK == 4:
            kv.pool.release([b for b in kv.pool.alloc(200) if b % 2 or 180 <= b < 186])   # runs of 6 free blocks
        ids, _ = kv.add_prompts(model, [text(20), text(30), text(9)], pad)
        if kvcache.BLOCK == 4:
            assert kv.prompts[ids[0]].run() is not None and kv.prompts[ids[1]].run() is None
        rows = kv.fork(ids[0], 2) + kv.fork(ids[1], 3) + kv.fork(ids[2], 1)
        kv.extend(model, rows, [text(n) for n in (3, 24, 2, 7, 4, 5)], pad)
        for t in range(3):
            kv.step(model, rows, torch.tensor([500 + t + i for i in range(len(rows))]))
    if "causal" in paths:                  # a chunk's causal part: the fused kernel's mask within SCORES_BUDGET
        paths = paths - {"causal"} | {"fused_causal" if fused else "hand_written"}
    assert paths <= seen, paths - seen
    assert {dt for _, dt in diffs} == {torch.bfloat16}                  # the compute dtype, as SDPA returns it
    assert max(x for x, _ in diffs) <= 1e-3, max(diffs)
