"""
The rollout's K/V cache: one copy of each prompt, a preallocated suffix per row, cascade attention.
(gpt-fast keeps its cache beside the model the same way; rollout.py holds the turn loop that feeds it.)

- `Chunk`: a piece of token sequence with its videos (ids (l,), mm_types (l,), pixels, grid).
- `KVStore`: preallocated K/V for N sequences, per layer (N, kv_heads, capacity, head_dim), written in place at
  each row's own index and grown by large steps (GROW), never concatenated per token.
- `GroupKV`: P prompts, each prefilled ONCE and stored ONCE (`prefix`), and B rows (the G samples of each prompt,
  `group[b]` = row b's prompt), each owning only its suffix (`suffix`). It is what the model gets as its
  `cache` (the `update` hook the attention layers call) and as the `rollout_cache` keyword.
- `cascade_attention`: registered with transformers' AttentionInterface as "paravt_cascade" and used only while
  the engine runs: the rows of a prompt are batched as queries against the one prompt K/V, each row attends to
  its own suffix causally, and the two partial softmaxes are merged by their log-sum-exp (`_attend`, `_merge`).
  No copy of the prompt cache is ever made.

Shapes: prompt K/V per layer (P, kv_heads, Lp, head_dim); suffix K/V per layer (B, kv_heads, C, head_dim) with C
the store's capacity; group (B,) row -> prompt; positions (3, n, l) for (t, h, w); logits (n, V).
Sizes that choose a path (shrunk in tests: tests/conftest.py): GROW (the store's growth step), SCORES_BUDGET
(elements of one block of fp32 scores, or of its mask, in `_attend`).
Precision: scores, softmax and the weighted sum run in fp32 whatever the model's dtype; the output is rounded to it.
Departure: cascade attention in plain PyTorch, by query blocks with masks built per block from positions, where a
GPU deployment would use a fused kernel that returns the LSE (FlexAttention, FlashInfer).
"""
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

@dataclass
class Chunk:
    ids: torch.Tensor                    # (l,) long
    mm_types: torch.Tensor               # (l,) int: 0 text, 2 video
    pixels: torch.Tensor | None = None   # (n_patches, patch_dim)
    grid: torch.Tensor | None = None     # (n_videos, 3)

def chunk_positions(model, c: Chunk) -> torch.Tensor:
    """(3, l) M-RoPE positions of a chunk as if it started at position 0."""
    l = len(c.ids)
    if c.grid is None:
        return torch.arange(l).view(1, -1).expand(3, -1)
    pos, _ = model.model.get_rope_index(c.ids[None], mm_token_type_ids=c.mm_types[None], video_grid_thw=c.grid)
    return pos[:, 0]

GROW = 256                           # the suffix store grows by at least this many tokens (or by half) at a time

SCORES_BUDGET = 2 ** 24              # attention scores computed per block of queries (elements), to bound memory

class KVStore:
    """Preallocated K/V for N sequences (gpt-fast style): per layer a (N, kv_heads, capacity, head_dim)
    buffer written in place at each row's own index `length[n]`; allocated at the first write (dtype and
    heads from the model's keys) and grown by large steps, never concatenated per token."""

    def __init__(self, n: int, device):
        self.k, self.v = [], []
        self.length = [0] * n                              # host mirror: capacity checks cost no sync
        self.capacity, self.reserved, self.device = 0, 0, device

    def reserve(self, need: int) -> None:
        if need > self.capacity:
            self.reserved = max(need, self.capacity + max(GROW, self.capacity // 2))

    def write(self, layer: int, rows: torch.Tensor, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, kv_heads, l, head_dim) at positions start[i] .. start[i] + l - 1 of rows[i]."""
        if layer == len(self.k):
            shape = (len(self.length), k.shape[1], self.reserved, k.shape[3])
            self.k.append(k.new_zeros(shape))
            self.v.append(v.new_zeros(shape))
        elif self.k[layer].shape[2] < self.reserved:       # grow (rare): one copy per large step
            pad = [0, 0, 0, self.reserved - self.k[layer].shape[2]]
            self.k[layer] = torch.nn.functional.pad(self.k[layer], pad)
            self.v[layer] = torch.nn.functional.pad(self.v[layer], pad)
        if layer == 0:
            self.capacity = self.reserved
        if k.shape[2] == 1:                                # decode: one token per row
            self.k[layer][rows, :, start] = k[:, :, 0]
            self.v[layer][rows, :, start] = v[:, :, 0]
            return
        pos = start[:, None] + torch.arange(k.shape[2], device=k.device)                   # (n, l)
        r = rows[:, None].expand_as(pos)
        self.k[layer][r, :, pos] = k.transpose(1, 2)       # advanced indices first: (n, l, kv_heads, head_dim)
        self.v[layer][r, :, pos] = v.transpose(1, 2)

def _attend(q, k, v, scale, qpos=None, kend=None):
    """Softmax attention of q (n, h, m, d) over k, v (n, h, c, d), computed in fp32 whatever the inputs' dtype;
    returns (out (n, h, m, d) fp32, lse (n, h, m, 1)): the log-sum-exp lets two partial attentions be merged
    exactly. Key j is seen by query i of row b iff j <= qpos[b, i] (causal; None: no causal limit) and
    j < kend[b] (None: every key). Queries go in blocks, and each block's mask is built from these positions,
    so no scores or mask tensor exceeds SCORES_BUDGET elements whatever the chunk and span."""
    n, h, m, _ = q.shape
    c = k.shape[2]
    block = max(1, SCORES_BUDGET // max(1, n * h * c))
    kt, vf = k.float().transpose(-1, -2), v.float()
    kpos = torch.arange(c, device=q.device)
    outs, lses = [], []
    for a in range(0, m, block):
        s = torch.matmul(q[:, :, a:a + block].float(), kt).mul_(scale)                   # (n, h, b, c) fp32
        if qpos is not None or kend is not None:
            seen = True
            if qpos is not None:
                seen = kpos <= qpos[:, None, a:a + block, None]                           # (n, 1, b, c)
            if kend is not None:
                seen = (kpos < kend[:, None, None, None]) & seen
            s.masked_fill_(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        outs.append(torch.matmul(s.sub_(lse).exp_(), vf))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)

def _merge(o1, lse1, o2, lse2):
    """Cascade merge in fp32: softmax over [A; B] = (e^lse_A o_A + e^lse_B o_B) / (e^lse_A + e^lse_B)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (w1 * o1 + w2 * o2) / (w1 + w2)

@dataclass
class _Index:
    """Device index tensors of the rows in one forward, built once per set of rows (host -> device)."""
    rows: torch.Tensor                   # (n,) rows of the store written
    slot_p: torch.Tensor                 # (n,) the row's prompt
    slot_s: torch.Tensor                 # (n,) the row's rank among this forward's rows of that prompt
    slots: int                           # max rows of one prompt in this forward
    host: list[int]
    one_per_prompt: bool = False         # row i is prompt i's only row here: queries need no slotting
    all_rows: bool = False               # the rows are 0 .. B-1 in order: the suffix store is read as is

class GroupKV:
    """The rollout's cache: P prompts (each prefilled ONCE, its K/V stored ONCE in `prefix`) and B rows
    (the G samples of each prompt: `group[b]` is row b's prompt), each owning only its suffix (its
    turns, tool responses, clips) in `suffix`. A row attends to [its prompt ; its own suffix] by cascade
    attention: the rows of a prompt are batched as queries against the one prompt K/V, then each row
    against its own suffix, the two merged by log-sum-exp. Rows that finish simply stop being fed: no
    cache is copied, selected or merged. Passed to the model as its `cache` (it has the `update` the
    attention layers call) and as the `rollout_cache` keyword that `cascade_attention` reads.
    `next_pos` (B,) each row's next M-RoPE position; `last_logits` (B, V) after each row's last token."""

    def __init__(self, model, group: list[int], device):
        P, B = max(group) + 1, len(group)
        V = model.get_output_embeddings().weight.shape[0]
        self.prefix, self.suffix = KVStore(P, device), KVStore(B, device)
        self.group = torch.tensor(group, device=device)
        self.group_host = list(group)
        self.prompt_pos = [0] * P
        self.prompt_logits = torch.zeros(P, V, device=device)
        self.next_pos_host = [0] * B
        self.last_logits = torch.zeros(B, V, device=device)
        self.device, self.mode, self.idx, self.start = device, None, None, None
        self._indices = {}

    def __len__(self):
        return len(self.group_host)

    def index(self, rows: list[int], prefix: bool = False) -> _Index:
        key = (prefix, tuple(rows))
        if key not in self._indices:
            ranks, seen = [], {}
            for r in rows:
                p = r if prefix else self.group_host[r]
                ranks.append(seen.get(p, 0))
                seen[p] = ranks[-1] + 1
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
            if len(self._indices) > 256:
                self._indices.clear()
            prompts = [r if prefix else self.group_host[r] for r in rows]
            self._indices[key] = _Index(t(rows), t(prompts), t(ranks), max(seen.values()), list(rows),
                                        prompts == list(range(len(self.prompt_pos))),
                                        list(rows) == list(range(len(self.group_host))))
        return self._indices[key]

    # -- the two hooks the model calls
    def update(self, k, v, layer_idx, kwargs=None, **_):
        store = self.prefix if self.mode == "prefix" else self.suffix
        store.write(layer_idx, self.idx.rows, self.start, k, v)
        return k, v

    def attend(self, layer: int, q: torch.Tensor, scale: float, key=None, value=None, module=None) -> torch.Tensor:
        """q (n, heads, l, d) of this forward's rows -> (n, l, heads, d)."""
        n, H, l, d = q.shape
        Hkv = self.prefix.k[layer].shape[1]
        g = H // Hkv                                       # query heads per KV head (GQA)
        qg = q.reshape(n, Hkv, g * l, d)
        if self.mode == "prefix" and self.fresh:          # whole prompts from position 0: plain causal SDPA
            return sdpa_attention_forward(module, q, key, value, None, scaling=scale, is_causal=True)[0]
        # each query's position in its row's own store (the (g, l) order of qg), for masks built per query block
        qpos = self.start[:, None] + torch.arange(g * l, device=q.device) % l                     # (n, g*l)
        if self.mode == "prefix":                          # a prompt's own causal attention
            rows = self.idx.rows
            K = self.prefix.k[layer][:, :, :self.span].index_select(0, rows)
            V = self.prefix.v[layer][:, :, :self.span].index_select(0, rows)
            out = _attend(qg, K, V, scale, qpos)[0].to(q.dtype)
        else:
            idx = self.idx
            Pk, Pv = self.prefix.k[layer][:, :, :self.prefix_span], self.prefix.v[layer][:, :, :self.prefix_span]
            P = Pk.shape[0]
            K, V = self.suffix.k[layer][:, :, :self.span], self.suffix.v[layer][:, :, :self.span]
            if not idx.all_rows:
                K, V = K.index_select(0, idx.rows), V.index_select(0, idx.rows)
            gl, S = g * l, idx.slots

            def to_slots(t):                               # (n, Hkv, gl, x) -> (P, Hkv, S * gl, x)
                if idx.one_per_prompt:
                    return t
                z = t.new_zeros(P, S, Hkv, gl, t.shape[-1])
                z[idx.slot_p, idx.slot_s] = t
                return z.permute(0, 2, 1, 3, 4).reshape(P, Hkv, S * gl, t.shape[-1])

            def from_slots(t):                             # (P, Hkv, S * gl, x) -> (n, Hkv, gl, x)
                if idx.one_per_prompt:
                    return t
                return t.reshape(P, Hkv, S, gl, -1).permute(0, 2, 1, 3, 4)[idx.slot_p, idx.slot_s]

            # the prompt part (rows of a prompt batched as queries against its ONE K/V, keys < the prompt's
            # length) and the own-suffix part (causal), merged by their log-sum-exp
            o1, l1 = _attend(to_slots(qg), Pk, Pv, scale, kend=self.prefix_len)
            o2, l2 = _attend(qg, K, V, scale, qpos)
            out = _merge(from_slots(o1), from_slots(l1), o2, l2).to(q.dtype)
        return out.reshape(n, H, l, d).transpose(1, 2)

    # -- feeding tokens
    @torch.no_grad()
    def _forward(self, model, mode: str, idx: _Index, ids, pos, types=None, vision=None, last=None,
                 start=None) -> torch.Tensor:
        """One forward of ids (n, l) at positions (3, n, l) for rows idx; returns (n, V) float logits
        after each row's token `last[i]` (default: the last column)."""
        store = self.prefix if mode == "prefix" else self.suffix
        l = ids.shape[1]
        self.span = max(store.length[r] for r in idx.host) + l    # keys any row of this forward can see
        self.prefix_span = max(self.prefix.length)
        self.fresh = all(store.length[r] == 0 for r in idx.host)    # right-padded, so causal alone is exact
        store.reserve(self.span)
        self.mode, self.idx = mode, idx
        if start is None:
            start = torch.tensor([store.length[r] for r in idx.host], device=self.device)
        self.start = start
        lm = model.model.language_model.config
        impl, lm._attn_implementation = lm._attn_implementation, "paravt_cascade"
        try:
            out = model.model(input_ids=ids, position_ids=pos, cache=self, mm_token_type_ids=types, use_cache=True,
                              rollout_cache=self, **(vision or {}))
        finally:
            lm._attn_implementation = impl
            self.mode = self.idx = self.start = None
        h = out.last_hidden_state
        h = h[:, -1] if last is None else h[torch.arange(len(idx.host), device=h.device), last]
        return model.lm_head(h).float()

    def extend(self, model, rows: list[int], chunks: list[Chunk], pad_id: int, prefix: bool = False) -> None:
        """Prefill chunk i on top of row rows[i] (prefix=True: of prompt rows[i]); updates last logits."""
        store = self.prefix if prefix else self.suffix
        nxt = self.prompt_pos if prefix else self.next_pos_host
        lengths = [len(c.ids) for c in chunks]
        L, n = max(lengths), len(rows)
        ids = torch.full((n, L), pad_id, dtype=torch.long)
        types = torch.zeros(n, L, dtype=torch.int32)
        pos = torch.zeros(3, n, L, dtype=torch.long)
        pixels, grids = [], []
        for i, (r, c) in enumerate(zip(rows, chunks)):
            ids[i, :lengths[i]] = c.ids
            types[i, :lengths[i]] = c.mm_types
            p = chunk_positions(model, c) + nxt[r]
            pos[:, i, :lengths[i]] = p
            pos[:, i, lengths[i]:] = p[:, -1:] + 1 + torch.arange(L - lengths[i])   # pads: never attended
            nxt[r] = int(p.max()) + 1
            if c.pixels is not None:
                pixels.append(c.pixels)
                grids.append(c.grid)
        vision = {}
        if pixels:
            dtype = next(model.parameters()).dtype
            vision = dict(pixel_values_videos=torch.cat(pixels).to(self.device, dtype),
                          video_grid_thw=torch.cat(grids).to(self.device))
        idx = self.index(rows, prefix)
        logits = self._forward(model, "prefix" if prefix else "suffix", idx, ids.to(self.device), pos.to(self.device),
                               types.to(self.device), vision, torch.tensor(lengths, device=self.device) - 1)
        for r, ln in zip(rows, lengths):
            store.length[r] += ln
        if not prefix:
            self.next_pos = torch.tensor(self.next_pos_host, device=self.device)
        self.suffix_len = torch.tensor(self.suffix.length, device=self.device)
        (self.prompt_logits if prefix else self.last_logits)[idx.rows] = logits

    def fork(self) -> None:
        """After the prompts: every row starts from its prompt's last logits and next position."""
        self.last_logits = self.prompt_logits[self.group].clone()
        self.next_pos_host = [self.prompt_pos[p] for p in self.group_host]
        self.next_pos = torch.tensor(self.next_pos_host, device=self.device)
        self.prefix_len = torch.tensor(self.prefix.length, device=self.device)

    def step(self, model, idx: _Index, tokens: torch.Tensor) -> None:
        """Decode: feed tokens (n,) (on the device; no host sync) to rows idx; updates their last logits."""
        if idx.all_rows:                                   # every row: views, no gathers
            pos = self.next_pos.view(1, -1, 1).expand(3, -1, 1)
            self.last_logits = self._forward(model, "suffix", idx, tokens[:, None], pos, start=self.suffix_len)
            self.next_pos += 1
            self.suffix_len += 1
        else:
            pos = self.next_pos[idx.rows].view(1, -1, 1).expand(3, -1, 1)
            self.last_logits[idx.rows] = self._forward(model, "suffix", idx, tokens[:, None], pos,
                                                       start=self.suffix_len[idx.rows])
            self.next_pos[idx.rows] += 1
            self.suffix_len[idx.rows] += 1
        for r in idx.host:
            self.suffix.length[r] += 1
            self.next_pos_host[r] += 1

def cascade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as "paravt_cascade": with a `rollout_cache` keyword (a GroupKV)
    it ignores the key/value it is handed (already written into the cache by `update`) and attends
    over [the row's prompt ; the row's suffix] (GroupKV.attend); without one it is plain SDPA."""
    cache = kwargs.pop("rollout_cache", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return cache.attend(module.layer_idx, query, scaling, key, value, module), None


AttentionInterface.register("paravt_cascade", cascade_attention)
