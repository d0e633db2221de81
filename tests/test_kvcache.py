"""Tests for the rollout engine's machinery: the paged, shared-prompt cache (kvcache.py: BlockPool, GroupKV, one
K/V copy per prompt, each row holding only its suffix's blocks, cascade attention in fp32 with bounded working
tensors), the decode step and batched on-device sampling (rollout.Engine.step, rollout.sample_tokens), and the
training forward that runs the vision tower once per distinct video (policy.shared_video_hidden_states).

The end-to-end exactness of rollouts (recorded log-probs == full recompute) is in tests/test_rollout.py.
"""
import pytest
import torch

import data
import kvcache
import layers
import ops
import policy
import rollout
import sft
import runtime
import video
from conftest import TEST_ROLLOUT, oracle_turns


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """conftest's `tiny` model, decoded on one thread (token-by-token decoding is latency-bound)."""


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("engine"))
    return root, data.make_split(root, 2, seed=0, duration=64.0)


def draw(logits, seeds, counters, t=1.0, top_p=1.0):
    return rollout.sample_tokens(logits, torch.tensor(seeds), torch.tensor(counters), t, top_p)


# ----------------------------------------------------------------------------- sampling

def test_sampler_random_source_on_logits_device():
    """Issue 15 item 2: the random source lives on the logits' device (no CPU torch.Generator): on the
    "meta" device, every tensor of the draw (noise and tokens) stays on "meta", for CPU seeds too."""
    logits = torch.empty(3, 50, device="meta")
    seeds, counters = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 5])
    noise = ops.uniform_noise(seeds.to("meta"), counters.to("meta"), 50)
    assert noise.device.type == "meta" and noise.shape == (3, 50) and noise.dtype == torch.float32
    for top_p in (1.0, 0.9):
        tok = rollout.sample_tokens(logits, seeds, counters, 0.7, top_p)
        assert tok.device.type == "meta" and tok.shape == (3,)


def test_sample_greedy_is_argmax():
    logits = torch.randn(50, 300, generator=torch.Generator().manual_seed(0))
    assert draw(logits, list(range(50)), [0] * 50, t=0.0).tolist() == logits.argmax(-1).tolist()


def test_sample_small_top_p_keeps_only_top_token():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1)).expand(200, -1)
    assert set(draw(logits, [7] * 200, list(range(200)), top_p=0.01).tolist()) == {int(logits[0].argmax())}
    # control: without the nucleus the same logits draw many tokens
    assert len(set(draw(logits, [7] * 200, list(range(200))).tolist())) > 20


def test_sample_matches_softmax_distribution():
    """Gumbel-max over the hash noise is a draw from softmax(logits / T): 20k draws over 5 tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(20_000, -1)
    tok = draw(logits, [3] * 20_000, list(range(20_000)), t=0.7)
    freq = torch.bincount(tok, minlength=5).float() / 20_000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015, rtol=0)


def test_sample_reproducible_and_independent_of_batch():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    a = draw(logits, [11, 12, 13, 14], [5, 5, 9, 0], top_p=0.9)
    assert a.tolist() == draw(logits, [11, 12, 13, 14], [5, 5, 9, 0], top_p=0.9).tolist()
    # each row alone, or the rows in another order: the same token per (seed, counter)
    alone = [int(draw(logits[i:i + 1], [s], [c], top_p=0.9)) for i, (s, c) in enumerate(zip([11, 12, 13, 14], [5, 5, 9, 0]))]
    assert a.tolist() == alone
    rev = draw(logits.flip(0), [14, 13, 12, 11], [0, 9, 5, 5], top_p=0.9)
    assert rev.flip(0).tolist() == a.tolist()
    # other seeds / other counters: other streams
    many = logits[:1].expand(64, -1)
    by_seed = draw(many, list(range(64)), [0] * 64).tolist()
    by_counter = draw(many, [0] * 64, list(range(64))).tolist()
    assert len(set(by_seed)) > 20 and len(set(by_counter)) > 20


QWEN_V = 151_936    # the real vocabulary: the old noise hit u == 1.0 on ~0.9 % of rows (V / 2**24)


def _qwen_rows(counters):
    """(seeds, counters) batches of 64 rows at each counter: the sweep over (row seed, draw index)."""
    for c in counters:
        yield torch.arange(64), torch.full((64,), c)


@pytest.mark.slow
def test_uniform_noise_open_interval_at_qwen_vocab():
    """Noise lies strictly inside (0, 1) in fp32 and its Gumbel term is finite, on 1,024 rows of 151,936:
    the old 24-bit form rounded (2**24 - 0.5) / 2**24 up to 1.0 (5 of these rows), making -log(-log u) = +inf."""
    for seeds, counters in _qwen_rows(range(16)):
        u = ops.uniform_noise(seeds, counters, QWEN_V)
        assert u.dtype == torch.float32 and float(u.min()) > 0 and float(u.max()) < 1
        assert torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.slow
def test_sample_near_certain_token_always_drawn_at_qwen_vocab():
    """A token 30 nats above every other (miss probability ~ V e^-30 ~ 1e-8 per draw) is drawn on every one
    of 256 rows at the real vocabulary: an infinite Gumbel term on another token must never outbid it."""
    logits = torch.zeros(64, QWEN_V)
    logits[:, 1234] = 30.0
    for seeds, counters in _qwen_rows(range(4)):
        assert rollout.sample_tokens(logits, seeds, counters, 1.0, 1.0).tolist() == [1234] * 64


@pytest.mark.slow
def test_sample_never_draws_banned_token_at_qwen_vocab():
    """A banned token (logit -inf, or outside the top-p nucleus) is never drawn, on 256 rows at the real
    vocabulary: -inf + noise stays -inf (with u == 1.0 it was -inf + inf = NaN, and argmax picks NaN)."""
    allowed = torch.tensor([7, 70_000, 151_000])
    banned = torch.full((64, QWEN_V), float("-inf"))
    banned[:, allowed] = torch.tensor([0.0, 1.0, -1.0])
    nucleus = torch.zeros(64, QWEN_V)
    nucleus[:, 4321] = 20.0          # holds all but ~1e-3 of the mass: top_p 0.9 keeps it alone
    for seeds, counters in _qwen_rows(range(4)):
        tok = rollout.sample_tokens(banned, seeds, counters, 1.0, 1.0)
        assert torch.isin(tok, allowed).all(), tok[~torch.isin(tok, allowed)]
        assert rollout.sample_tokens(nucleus, seeds, counters, 1.0, 0.9).tolist() == [4321] * 64


def test_host_sync_counter_counts_reads():
    """HostSyncCounter counts the host reads it sees, one per call: 3 item + 1 tolist -> 4; bool / int / float /
    index of a tensor, nonzero, a bool-mask index: one each; ops that stay on the device and a copy to where the
    tensor already is: none. Toward a GPU device ("meta" stands in: no CPU tensor is on it) a copy from the host
    counts when it blocks (no non_blocking; torch.tensor with the device), and a host tensor's item does not."""
    t = torch.arange(4.0)
    with runtime.HostSyncCounter("cpu") as c:
        for i in range(3):
            t[i].item()
        t.tolist()
    assert c.count == 4 and sorted(c.sites.values()) == [1, 3] and all("test_kvcache.py" in k for k in c.sites)
    with runtime.HostSyncCounter("cpu") as c:
        bool(t[1]), int(t[1]), float(t[1]), [0, 1, 2][t.long()[1]], t.nonzero(), t[t > 1]
        (t * 2).sum(), t.index_select(0, torch.tensor([1])), t.to("cpu"), t.cpu()
    assert c.count == 6, c.sites
    with runtime.HostSyncCounter("meta") as c:
        t.to("meta"), t.to("meta", non_blocking=True), torch.tensor([1, 2], device="meta"), t[0].item()
    assert c.count == 2, c.sites


def test_decode_step_one_host_sync(tiny, split, monkeypatch, decode_steps):
    """Measured, not counted by construction: HostSyncCounter over a rollout sees one host sync per decode step
    inside Engine.step (the sampled tokens and log-probs, read for the stop check), the prefills' reads apart; a
    sampler that also reads a value (a deliberate .item()) makes it two per step."""
    model, processor = tiny
    root, recs = split
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_turns": 0, "max_new_tokens": 6, "group_size": 3,
                                   "temperature": 1.0})

    def measured():
        before = decode_steps()
        with runtime.HostSyncCounter("cpu") as syncs:
            rollout.run_agent(model, processor, recs[:1], root, cfg, seed=0)
        return decode_steps() - before, syncs

    steps, syncs = measured()
    assert steps >= 1 and syncs.in_steps == steps, syncs.sites
    assert syncs.count > syncs.in_steps                      # the prefill's (the vision tower's grid, ...)
    sample = rollout.sample_tokens
    monkeypatch.setattr(rollout, "sample_tokens", lambda logits, *a: (logits.amax().item(), sample(logits, *a))[1])
    again, more = measured()
    assert again == steps and more.in_steps == 2 * steps, more.sites


# ----------------------------------------------------------------------------- the paged, shared-prompt cache

def _chunks(model, processor, root, rec):
    cfg = rollout.RolloutConfig(**TEST_ROLLOUT)
    path = f"{root}/{rec['video']}"
    overview = rollout.load_overview(path, video.probe(path).duration, cfg, rollout.video_factor(processor),
                                     cfg.overview_nframes)
    a = rollout.encode_chunk(processor, rollout.prompt_text(processor, rec, False), [overview])
    b = rollout.encode_chunk(processor, "<|im_start|>user\nA short text-only prompt.<|im_end|>\n")
    suffixes = [rollout.encode_chunk(processor, s) for s in
                ["<|im_start|>assistant\nfirst", "<|im_start|>assistant\na longer second suffix here", "x"]]
    return a, b, suffixes


def _alone(model, chunks):
    """Last-token logits of the concatenation of `chunks`, by one plain forward (sdpa, no cache)."""
    ids = torch.cat([c.ids for c in chunks])[None]
    types = torch.cat([c.mm_types for c in chunks])[None]
    grids = [c.grid for c in chunks if c.grid is not None]
    pixels = [c.pixels for c in chunks if c.pixels is not None]
    kw = dict(video_grid_thw=torch.cat(grids), pixel_values_videos=torch.cat(pixels)) if grids else {}
    if grids:
        pos = model.model.get_rope_index(ids, mm_token_type_ids=types, video_grid_thw=torch.cat(grids))[0]
    else:
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        h = model.model(input_ids=ids, position_ids=pos, mm_token_type_ids=types, attention_mask=torch.ones_like(ids),
                        **kw).last_hidden_state
    return model.lm_head(h[:, -1]).float()[0]


def _text(model, seed):
    """Random text chunks of a given length: text(n)."""
    V = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    return lambda n: kvcache.Chunk(torch.randint(300, V, (n,), generator=gen), torch.zeros(n, dtype=torch.int32))


def _used(kv) -> int:
    return kv.pool.n_blocks - len(kv.pool.free)


def test_groupkv_shared_prompt_equals_separate_sequences(tiny, split, small_thresholds):
    model, processor = tiny
    root, recs = split
    a, b, sfx = _chunks(model, processor, root, recs[0])
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(2000))
    (pa, pb), first = kv.add_prompts(model, [a, b], pad)
    rows = kv.fork(pa, 3) + kv.fork(pb, 2)                 # prompt a: 3 rows, prompt b: 2 rows
    torch.testing.assert_close(first[0], _alone(model, [a]), atol=1e-4, rtol=0)
    torch.testing.assert_close(first[1], _alone(model, [b]), atol=1e-4, rtol=0)
    pool_k = kv.pool.k[0]
    a_first = kv.prompts[pa].run()
    a_kv = pool_k[a_first:a_first + len(a.ids)].clone()   # prompt a lies in one run of blocks: read in place
    # ragged suffixes, some rows skipped; then a second extend on a subset, then one decode step
    logits = dict(zip([rows[i] for i in (0, 2, 3)], kv.extend(model, [rows[i] for i in (0, 2, 3)], sfx, pad)))
    logits.update(zip([rows[2], rows[4]], kv.extend(model, [rows[2], rows[4]], sfx[:2], pad)))
    seqs = {0: [a, sfx[0]], 2: [a, sfx[1], sfx[0]], 3: [b, sfx[2]], 4: [b, sfx[1]]}
    for i, chunks in seqs.items():
        torch.testing.assert_close(logits[rows[i]], _alone(model, chunks), atol=1e-4, rtol=0)
    tok = torch.tensor([5, 9])
    stepped = kv.step(model, [rows[1], rows[3]], tok)
    for j, (i, t) in enumerate(zip([1, 3], tok.tolist())):
        ref = _alone(model, seqs.get(i, [a]) + [kvcache.Chunk(torch.tensor([t]), torch.zeros(1, dtype=torch.int32))])
        torch.testing.assert_close(stepped[j], ref, atol=1e-4, rtol=0)
    # ONE copy per prompt, each row holding only its own suffix's blocks; the prompt's K/V never moved
    assert len(kv.prompts) == 2 and all(len(kv.rows[r].blocks) == kvcache.blocks_for(kv.rows[r].length) for r in rows)
    assert _used(kv) == sum(len(s.blocks) for s in [*kv.prompts.values(), *kv.rows.values()])
    assert pool_k.data_ptr() == kv.pool.k[0].data_ptr()
    torch.testing.assert_close(kv.pool.k[0][a_first:a_first + len(a.ids)], a_kv, atol=0, rtol=0)


def test_paged_rows_cross_blocks_and_return_them(tiny, monkeypatch):
    """BLOCK = 4: rows cross block boundaries inside a chunk and while decoding, hold only their blocks, and give
    them back at once when freed (a prompt's with it); the logits stay those of a plain forward."""
    monkeypatch.setattr(kvcache, "BLOCK", 4)
    model, processor = tiny
    text = _text(model, 2)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", 64)
    prompt = text(10)
    (p,), _ = kv.add_prompts(model, [prompt], pad)
    r0, r1, r2 = kv.fork(p, 3)
    chunks = [text(7), text(3), text(9)]
    kv.extend(model, [r0, r1, r2], chunks, pad)
    seqs = {r: [prompt, c] for r, c in zip((r0, r1, r2), chunks)}
    for t in range(6):                                     # r1 crosses from 3 to 9 tokens, r0 from 7 to 13
        toks = torch.tensor([100 + t, 200 + t])
        out = kv.step(model, [r0, r1], toks)
        for j, r in enumerate((r0, r1)):
            seqs[r].append(kvcache.Chunk(toks[j:j + 1], torch.zeros(1, dtype=torch.int32)))
            torch.testing.assert_close(out[j], _alone(model, seqs[r]), atol=1e-4, rtol=0)
    assert [len(kv.rows[r].blocks) for r in (r0, r1, r2)] == [4, 3, 3] and _used(kv) == 3 + 10
    free = len(kv.pool.free)
    kv.free_row(r0)
    assert len(kv.pool.free) == free + 4                   # a finished row's blocks, at once
    kv.free_row(r1), kv.free_row(r2), kv.free_prompt(p)
    assert _used(kv) == 0 and kv.pool.free == list(range(64))


@pytest.mark.parametrize("join", [0, kvcache.JOIN_PROMPT], ids=["prompt_in_place", "prompt_with_rows"])
def test_fragmented_prompt_equals_plain_forward(tiny, monkeypatch, join):
    """A prompt whose blocks are not consecutive (a fragmented pool: no run of 3 free blocks) is read through its
    slots, once per group or with each row, and gives the logits of a plain forward."""
    monkeypatch.setattr(kvcache, "BLOCK", 4)
    monkeypatch.setattr(kvcache, "JOIN_PROMPT", join)
    model, processor = tiny
    text = _text(model, 4)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", 40)
    kv.pool.release([b for b in kv.pool.alloc(40) if b % 2])             # free: the odd blocks only
    prompt, chunks = text(10), [text(5), text(7)]
    (p,), _ = kv.add_prompts(model, [prompt], pad)
    assert kv.prompts[p].run() is None
    rows = kv.fork(p, 2)
    out = kv.extend(model, rows, chunks, pad)
    for j, c in enumerate(chunks):
        torch.testing.assert_close(out[j], _alone(model, [prompt, c]), atol=1e-4, rtol=0)
    out = kv.step(model, rows, torch.tensor([300, 301]))
    for j, c in enumerate(chunks):
        nxt = kvcache.Chunk(torch.tensor([300 + j]), torch.zeros(1, dtype=torch.int32))
        torch.testing.assert_close(out[j], _alone(model, [prompt, c, nxt]), atol=1e-4, rtol=0)


def test_pack_splits_only_past_the_memory_limit():
    """Slabs of rows (or prompts) in their order: one group while the padded size (items x longest) fits the limit,
    the next group where it would not; an item longer than the limit alone."""
    ends = [24] * 4 + [52] * 4 + [74] * 3 + [90] * 2 + [143, 154, 223, 268]
    assert kvcache._pack(ends, 17 * 268) == [(0, 17, 268)]                   # fits: one slab
    assert kvcache._pack(ends, 2048) == [(0, 14, 143), (14, 17, 268)]
    assert kvcache._pack([268, 24, 24], 2048) == [(0, 3, 268)]
    assert kvcache._pack([300, 24], 100) == [(0, 1, 300), (1, 2, 24)]       # one item at least


def _decode_shape(model, pad, groups: list[int], seed: int = 0):
    """Rows after a first turn: prompts of different lengths (one per group, `groups` rows each), then a chunk of
    a different length on each row; (cache, rows, text)."""
    text = _text(model, seed)
    kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(20000))
    prompts, _ = kv.add_prompts(model, [text(40 + 9 * i) for i in range(len(groups))], pad)
    rows = [r for p, g in zip(prompts, groups) for r in kv.fork(p, g)]
    kv.extend(model, rows, [text(3 + (7 * i) % 20) for i in range(len(rows))], pad)
    return kv, rows, text


def test_decode_step_attention_calls_do_not_grow_with_rows(tiny, monkeypatch):
    """Measured (runtime.OpCounter over GroupKV.step): a decode step of 4 rows from 2 groups and of 32 rows from 5
    groups (uneven groups, prompts and suffixes of different lengths, after a first turn) makes the same number
    of attention calls per layer, 2 (the rows' own blocks, the large prompts), and the same number of torch ops
    per layer, in the attention hook and in the whole step; the prefill of a next-turn chunk on them, the same
    attention ops.
    Before: the rows' slabs split by padding and a prompt per call (each row its own call at real widths)."""
    monkeypatch.setattr(kvcache, "JOIN_PROMPT", 0)        # every prompt read once per group, as a video prompt is
    model, processor = tiny
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    steps, chunks = {}, {}
    for groups in ([3, 1], [8, 8, 8, 5, 3]):
        kv, rows, text = _decode_shape(model, pad, groups)
        n = len(rows)
        steps[n] = runtime.step_ops(model, kv, rows, torch.arange(n) + 400)[0]
        chunks[n] = runtime.forward_ops(model, kv, lambda: kv.extend(model, rows, [text(2 + i % 5) for i in range(n)], pad))
    assert steps[4] == steps[32], steps
    assert steps[4]["attention_calls_per_layer_step"] == 2, steps
    # a chunk: the same attention ops (its own part hand-written, causal: matmuls, not a kernel call); the host's
    # preparation of the chunks (ids, positions) grows with them
    assert chunks[4]["attention_ops"] == chunks[32]["attention_ops"] and chunks[4]["attention_calls"] <= 2, chunks


def test_decode_step_one_fused_call_without_large_prompts(tiny):
    """Every prompt small enough to be read with its rows (as shipped, the tiny model's): one attention call per
    layer, the fused SDPA, at 4 and at 32 rows, and ops that do not grow with the rows."""
    model, processor = tiny
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    steps = {}
    for groups in ([1, 1, 1, 1], [1] * 32):
        kv, rows, _ = _decode_shape(model, pad, groups)
        steps[len(rows)] = runtime.step_ops(model, kv, rows, torch.arange(len(rows)) + 400)[0]
    assert steps[4] == steps[32] and steps[4]["attention_calls_per_layer_step"] == 1, steps


def test_op_counter_counts_ops_not_metadata():
    """OpCounter: each torch call once (views included), reads of shape / dtype / size none; the SDPA kernels
    (public and the CPU flash one) as attention calls."""
    x = torch.randn(2, 3, 4, 8)
    with runtime.OpCounter() as ops:
        x.shape, x.dtype, x.size(0), x.dim(), len(x)
        x.view(-1).add(1)
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(x, x, x, scale=1.0)
    assert ops.count == 4 and ops.attention == 2 and ops.names["view"] == 1, ops.names


@pytest.mark.parametrize("scores", [2 ** 24, 512], ids=["one_block", "query_blocks"])
def test_attend_fused_kernel_equals_hand_written(monkeypatch, scores):
    """`_attend` without a causal limit: the fused CPU kernel and the hand-written form (CUDA's; in query blocks
    when SCORES_BUDGET is small) give the same output and log-sum-exp, keys hidden by the -inf bias included (at
    1,500 keys whole tiles of the kernel hidden from a row), in fp32 from bf16 inputs; and the LSE is the log of
    the softmax's denominator."""
    monkeypatch.setattr(kvcache, "SCORES_BUDGET", scores)
    gen = torch.Generator().manual_seed(0)
    for c, ends in ((40, [40, 17, 1]), (1500, [100, 1500, 1])):                 # row 2 sees one key
        q, k, v = (torch.randn(3, 2, n, 16, generator=gen).to(torch.bfloat16) for n in (5, c, c))
        bias = kvcache._hidden(torch.arange(c) >= torch.tensor(ends)[:, None])[:, None, None]
        out, lse = {}, {}
        for fused in (True, False):
            monkeypatch.setattr(kvcache, "FUSED_CPU", fused)
            out[fused], lse[fused] = kvcache._attend(q, k, v, 0.25, bias=bias)
        assert out[True].dtype == torch.float32 and lse[True].shape == (3, 2, 5)
        torch.testing.assert_close(out[True], out[False], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[True], lse[False], atol=1e-5, rtol=0)
        s = (q.float() @ k.float().transpose(-1, -2)) * 0.25 + bias
        torch.testing.assert_close(lse[True], s.logsumexp(-1), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[True][2], v.float()[2, :, :1].expand(2, 5, 16), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scores", [2 ** 24, 512], ids=["fused_mask_within_budget", "past_budget_hand_written"])
def test_attend_causal_fused_equals_hand_written(monkeypatch, scores):
    """`_attend` with a causal limit (a next-turn chunk's own part): the fused CPU kernel with the limit as a mask
    (taken while the (n, 1, m, c) mask is within SCORES_BUDGET) and the hand-written form give the same output and
    log-sum-exp as float64 softmax attention, the -inf bias past each row's end included; past the budget the
    hand-written form runs (the kernel is never called)."""
    monkeypatch.setattr(kvcache, "SCORES_BUDGET", scores)
    gen = torch.Generator().manual_seed(1)
    n, h, m, d, c = 3, 2, 8, 16, 40
    q, k, v = (torch.randn(n, h, x, d, generator=gen).to(torch.bfloat16) for x in (m, c, c))
    qpos = torch.tensor([20, 3, 31])[:, None] + torch.arange(m)                    # query i of row b sees j <= qpos
    bias = kvcache._hidden(torch.arange(c) >= torch.tensor([40, 11, 39])[:, None])[:, None, None]
    kernel, calls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, []
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw), raising=False)
    out, lse = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(kvcache, "FUSED_CPU", fused)
        out[fused], lse[fused] = kvcache._attend(q, k, v, 0.25, qpos, bias)
    assert len(calls) == (1 if scores >= n * m * c else 0)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + bias.double()
    s = s.masked_fill(torch.arange(c) > qpos[:, None, :, None], float("-inf"))
    for fused in (True, False):
        torch.testing.assert_close(out[fused], (torch.softmax(s, -1) @ v.double()).float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[fused], s.logsumexp(-1).float(), atol=1e-5, rtol=0)


def test_block_pool_runs_free_list_and_growth():
    pool = kvcache.BlockPool(8, "cpu")
    assert pool.alloc(3, run=True) == [0, 1, 2] and pool.alloc(1) == [7] and pool.alloc(2) == [5, 6]  # prompts low, rows high
    pool.release([1])                                      # free: 1, 3, 4
    assert pool.alloc(2, run=True) == [3, 4]               # first fit skips the lone block 1
    pool.release([6, 3, 5])                                # free: 1, 3, 5, 6
    assert pool.alloc(3, run=True) == [3, 5, 6]            # no run of 3: the highest free blocks
    k = torch.randn(3, 2, 4)
    slots = torch.tensor([0, 5, 8 * kvcache.BLOCK - 1])
    pool.write(0, slots, k, k)
    with pytest.warns(UserWarning, match="pool grew"):
        more = pool.alloc(4)                               # 1 block free: past the pool's end
    assert pool.n_blocks > 8 and len(more) == 4 and pool.k[0].shape == (pool.n_blocks * kvcache.BLOCK, 2, 4)
    torch.testing.assert_close(pool.k[0][slots], k, atol=0, rtol=0)


def _fp32_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The reference's attention: causal softmax attention with scores, softmax and weighted sum in fp32, the
    output rounded to the model's dtype (what the engine documents)."""
    g = query.shape[1] // key.shape[1]
    k, v = key.float().repeat_interleave(g, 1), value.float().repeat_interleave(g, 1)
    s = query.float() @ k.transpose(-1, -2) * scaling
    m, c = query.shape[2], k.shape[2]
    s = s.masked_fill(torch.ones(m, c, dtype=torch.bool).triu(c - m + 1), float("-inf"))
    return (torch.softmax(s, -1) @ v).to(query.dtype).transpose(1, 2), None


def test_cascade_attention_in_fp32_under_bf16(one_thread, small_thresholds, monkeypatch):
    """A bf16 model's engine logits equal a full recompute of the same bf16 model whose attention runs in fp32:
    one layer (the logits of a chunk's tokens then depend on the engine's attention alone: the prompt's K/V are
    the same either way) and q_norm scaled x8, so scores are large as in real models. Scores from a bf16 matmul
    (rounded to 2^-9 relative before the fp32 softmax) moved these logits by 0.008-0.014."""
    from model import ModelConfig, load_model
    model, processor = load_model("tiny", device="cpu", dtype=torch.bfloat16, tiny_corpus=rollout.prompt_corpus(),
                                  tiny_config=ModelConfig(layers=1))
    with torch.no_grad():
        model.model.language_model.layers[0].self_attn.q_norm.weight.mul_(8.0)
    text = _text(model, 0)
    prompt, sfx = text(70), [text(40), text(25)]
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(70) + 2 * kvcache.blocks_for(41))
    (p,), _ = kv.add_prompts(model, [prompt], pad)
    rows = kv.fork(p, 2)
    chunk = kv.extend(model, rows, sfx, pad)                 # a chunk on each row
    step = kv.step(model, rows, torch.tensor([500, 501]))     # one decode step
    monkeypatch.setattr(layers, "sdpa_attention_forward", _fp32_attention)
    for r, tok in enumerate([500, 501]):
        with torch.no_grad():
            ref = model(input_ids=torch.cat([prompt.ids, sfx[r].ids, torch.tensor([tok])])[None]).logits[0].float()
        torch.testing.assert_close(chunk[r], ref[-2], atol=2e-3, rtol=0)
        torch.testing.assert_close(step[r], ref[-1], atol=2e-3, rtol=0)


class _Allocs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the tensors operations allocate while active (elements): the largest, with its op, and the total.
    A view or an in-place result shares an input's storage and allocates nothing."""

    def __init__(self):
        super().__init__()
        self.numel, self.op, self.total = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda x: [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        for t in tensors(out):
            if t.untyped_storage().data_ptr() not in inputs:
                self.total += t.numel()
                if t.numel() > self.numel:
                    self.numel, self.op = t.numel(), str(func)
        return out


def test_attention_working_tensors_bounded(tiny, shrunk_thresholds, monkeypatch):
    """No tensor the engine's attention allocates grows with chunk x span past the scores budget: a 120-token
    chunk on 3 rows of a 110-token prompt, and decode steps after it, with SCORES_BUDGET and GATHER_BUDGET shrunk
    (512 and 2,048 elements). Every allocation inside GroupKV.attend stays within the largest of: the budgets, the
    queries themselves (the output has their size), the K/V of one row's keys (prompt + own suffix, whole blocks). The
    whole masks (rows x chunk x span) broke it (and a multi-block chunk crashed first)."""
    model, processor = tiny
    text = _text(model, 1)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(2000))
    (p,), _ = kv.add_prompts(model, [text(110)], pad)
    rows = kv.fork(p, 3)
    seen = []
    attend = kvcache.GroupKV.attend

    def recorded(self, layer, q, key, value, scale):
        with _Allocs() as big:
            out = attend(self, layer, q, key, value, scale)
        hkv, d = key.shape[1], key.shape[2]
        keys = kvcache.blocks_for(110) * kvcache.BLOCK + kvcache.blocks_for(max(self.fwd.end_host)) * kvcache.BLOCK
        seen.append((big.numel, big.op, max(kvcache.SCORES_BUDGET, kvcache.GATHER_BUDGET, q.numel(), keys * hkv * d)))
        return out

    monkeypatch.setattr(kvcache.GroupKV, "attend", recorded)
    kv.extend(model, rows, [text(120), text(90), text(60)], pad)
    for t in range(3):
        kv.step(model, rows, torch.tensor([400 + t] * 3))
    assert len(seen) >= 4 * len(model.model.language_model.layers)     # (the chunks in 1 or, shrunk, 3 forwards)
    for numel, op, bound in seen:
        assert numel <= bound, (numel, op, bound)


def test_finished_rows_cost_nothing_per_step(tiny, monkeypatch):
    """A decode step of one row allocates exactly as much with five long finished rows (of its prompt and of
    another) beside it as with that row alone: it reads only its own blocks and its own prompt."""
    model, processor = tiny
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    allocs = []
    attend = kvcache.GroupKV.attend

    def recorded(self, layer, q, key, value, scale):
        with _Allocs() as a:
            out = attend(self, layer, q, key, value, scale)
        allocs.append(a.total)
        return out

    def one_step(crowded: bool) -> tuple[list[int], torch.Tensor]:
        text = _text(model, 3)
        kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(4000))
        prompts, _ = kv.add_prompts(model, [text(60), text(80)], pad)
        mine = kv.fork(prompts[0], 1)
        others = kv.fork(prompts[0], 2) + kv.fork(prompts[1], 3) if crowded else []
        chunks = [text(30)] + [text(400) for _ in others]
        kv.extend(model, mine + others, chunks, pad)
        allocs.clear()
        with monkeypatch.context() as m:
            m.setattr(kvcache.GroupKV, "attend", recorded)
            out = kv.step(model, mine, torch.tensor([77]))
        return list(allocs), out

    alone, out_alone = one_step(False)
    crowded, out_crowded = one_step(True)
    assert crowded == alone and len(alone) == len(model.model.language_model.layers)
    torch.testing.assert_close(out_crowded, out_alone, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- vision once per prompt

def test_shared_video_hidden_states_shares_videos_and_matches_plain_forward(tiny, split, monkeypatch):
    model, processor = tiny
    root, recs = split
    a, b, sfx = _chunks(model, processor, root, recs[0])
    proto = rollout.Trajectory("r", 0, a.ids.tolist(), [rollout.ENV] * len(a.ids), len(a.ids), [(a.pixels, a.grid)])
    trajs = []
    for s, extra in enumerate([sfx[0], sfx[1], sfx[2]]):       # G = 3 rows sharing the overview, ragged
        trajs.append(rollout.Trajectory("r", s, proto.token_ids + extra.ids.tolist(),
                                        proto.roles + [rollout.POLICY] * len(extra.ids), proto.prompt_len, list(proto.videos)))
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    plain = rollout.collate(trajs, model, pad)
    shared = rollout.collate(trajs, model, pad, share_videos=True)
    assert shared["video_index"].tolist() == [0, 0, 0] and len(shared["video_grid_thw"]) == 1
    calls = []
    inner = model.model.visual.forward
    monkeypatch.setattr(model.model.visual, "forward", lambda *x, **k: (calls.append(len(x[0])), inner(*x, **k))[1])
    plain.pop("roles"), shared.pop("roles")
    with torch.no_grad():
        ref = model.model(**plain, use_cache=False).last_hidden_state
        n_plain = len(calls)
        out = policy.shared_video_hidden_states(model, shared)
    assert n_plain == 1 and calls == [3 * len(a.pixels), len(a.pixels)]   # the vision tower sees the overview once, not G times
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_shared_video_hidden_states_with_parallel_clips_in_one_turn(tiny, split):
    """A turn's parallel crops are one video entry of several videos (one grid row each): sharing still maps
    every video to its features (regression: the RL step of the default run failed with 'Video features and
    video tokens do not match' once the model cropped twice in one turn)."""
    model, processor = tiny
    root, recs = split
    rec = next(r for r in recs if len(r.get("clues") or []) >= 2)
    cfg = rollout.RolloutConfig(**TEST_ROLLOUT)
    msgs = oracle_turns(rec, __import__("numpy").random.default_rng(0), always_call=True, nframes=8)
    t = sft.encode_messages(processor, rec, msgs, root, cfg, nframes=8)
    assert any(len(g) >= 2 for _, g in t.videos)                   # one entry holds two clips
    twin = rollout.Trajectory(t.record_id, 1, list(t.token_ids), list(t.roles), t.prompt_len, list(t.videos))
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    plain, shared = rollout.collate([t, twin], model, pad), rollout.collate([t, twin], model, pad, share_videos=True)
    n = sum(len(g) for _, g in t.videos)
    assert shared["video_index"].tolist() == list(range(n)) * 2 and len(shared["video_grid_thw"]) == n
    plain.pop("roles"), shared.pop("roles")
    with torch.no_grad():
        ref = model.model(**plain, use_cache=False).last_hidden_state
        out = policy.shared_video_hidden_states(model, shared)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_autocast_pool_stores_keys_in_the_values_dtype(tiny):
    """One process runs bf16 by autocast on fp32 weights, where Qwen3-VL's k-norm returns fp32 keys beside bf16
    values: the pool stores both in bf16 (it held fp32 keys: 1.5x the bytes), the budget's bytes per token are
    bf16's, and the logits still match a plain autocast forward."""
    model, processor = tiny
    text = _text(model, 5)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    fp32 = kvcache.kv_bytes_per_token(model)
    with torch.autocast("cpu", torch.bfloat16):
        assert kvcache.kv_bytes_per_token(model) * 2 == fp32
        kv = kvcache.GroupKV(model, "cpu", 8)
        prompt = text(12)
        (p,), logits = kv.add_prompts(model, [prompt], pad)
        assert {t.dtype for t in kv.pool.k + kv.pool.v} == {torch.bfloat16}
        rows = kv.fork(p, 2)
        chunks = [text(3), text(5)]
        out = kv.extend(model, rows, chunks, pad)
        for j, c in enumerate(chunks):
            torch.testing.assert_close(out[j].float(), _alone(model, [prompt, c]).float(), atol=0.1, rtol=0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernel", "hand_written"])
@pytest.mark.parametrize("gather,join", [(kvcache.GATHER_BUDGET, 0), (0, 0), (kvcache.GATHER_BUDGET, 64 * 5)],
                         ids=["prompts_together", "each_prompt_alone", "one_prompt_joined"])
def test_several_prompts_in_one_step_equal_plain_forwards(tiny, monkeypatch, gather, join, fused):
    """Rows of three prompts of different lengths (one fragmented) in one forward: as shipped the large prompts
    are one attention call (their K/V gathered, padded to the longest; queries of an uneven number of rows each),
    with GATHER_BUDGET 0 each prompt alone (in place, or gathered when fragmented) and each row its own slab, and
    with JOIN_PROMPT at 5 keys the one-row 5-token prompt read with its row (weight 0 on the large prompts' part).
    Either way every row's logits are a plain forward's, in an extend and in decode steps; with the fused CPU
    kernel and with the hand-written attention that CUDA runs (`FUSED_CPU` off)."""
    monkeypatch.setattr(kvcache, "FUSED_CPU", fused)
    monkeypatch.setattr(kvcache, "BLOCK", 4)
    monkeypatch.setattr(kvcache, "JOIN_PROMPT", join)
    monkeypatch.setattr(kvcache, "GATHER_BUDGET", gather)
    model, processor = tiny
    text = _text(model, 5)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kv = kvcache.GroupKV(model, "cpu", 80)
    kv.pool.release([b for b in kv.pool.alloc(80) if b % 2 or 60 <= b < 63])   # one run of 3 free blocks
    prompts = [text(9), text(14), text(5)]
    ids, _ = kv.add_prompts(model, prompts, pad)
    assert kv.prompts[ids[0]].run() is not None and kv.prompts[ids[1]].run() is None
    rows = kv.fork(ids[0], 2) + kv.fork(ids[1], 3) + kv.fork(ids[2], 1)
    owner = [0, 0, 1, 1, 1, 2]
    slabs = []
    rows_forward = kvcache.GroupKV._rows_forward

    def recorded(self, seqs, lengths, *more):
        fwd, more = rows_forward(self, seqs, lengths, *more)
        slabs.append((len(fwd.slabs), sum(sb.first is not None for sb in fwd.slabs), fwd.alone is not None))
        return fwd, more

    monkeypatch.setattr(kvcache.GroupKV, "_rows_forward", recorded)
    causal, built = kvcache._fused_causal, []
    monkeypatch.setattr(kvcache, "_fused_causal", lambda *a: built.append(causal(*a)) or built[-1])
    chunks = [text(n) for n in (3, 6, 2, 7, 4, 5)]
    seqs = {r: [prompts[o], c] for r, o, c in zip(rows, owner, chunks)}
    out = kv.extend(model, rows, chunks, pad)
    for j, r in enumerate(rows):
        torch.testing.assert_close(out[j], _alone(model, seqs[r]), atol=1e-4, rtol=0)
    # the chunk's causal mask for the fused kernel: built once per slab of rows in the forward, not once per layer
    assert model.config.text_config.num_hidden_layers > 1
    assert sum(m is not None for m in built) == ((1 if gather else 6) if fused else 0), len(built)
    for t in range(3):                                     # decode, the rows in a shuffled order
        order = [rows[i] for i in (3, 0, 5, 1, 4, 2)]
        toks = torch.tensor([500 + t + i for i in range(len(order))])
        out = kv.step(model, order, toks)
        for j, r in enumerate(order):
            seqs[r].append(kvcache.Chunk(toks[j:j + 1], torch.zeros(1, dtype=torch.int32)))
            torch.testing.assert_close(out[j], _alone(model, seqs[r]), atol=1e-4, rtol=0)
    assert set(slabs) == {(1, 0, bool(join))} if gather else {(3, 1, False)}, slabs


def test_decode_step_takes_a_strided_kernel_output(monkeypatch):
    """CUDA's SDPA kernels may return their output as a transposed view ((B, L, H, d) in memory): a decode step
    reads it as well as the CPU's contiguous one (the same logits; a `view` of it would raise). Grouped heads
    (2 KV heads of 2 queries each), so that the layouts differ."""
    from model import ModelConfig, load_model
    model, processor = load_model("tiny", device="cpu", tiny_config=ModelConfig(layers=1, heads=4, kv_heads=2))
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    logits = []
    for strided in (False, True):
        if strided:
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                                lambda *a, **k: sdpa(*a, **k).transpose(1, 2).contiguous().transpose(1, 2))
        kv, rows, _ = _decode_shape(model, pad, [3, 1])
        logits.append(kv.step(model, rows, torch.arange(len(rows)) + 400))
    assert torch.equal(logits[0], logits[1])
