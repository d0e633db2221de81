"""
The rollout's K/V cache: paged K/V in one pool under a memory budget, one copy of each prompt, cascade attention.
(The pages follow vLLM's PagedAttention and nano-vllm's block manager; gpt-fast keeps its cache beside the model
the same way; rollout.py holds the scheduler that feeds it: admit, step, retire.)

- `Chunk`: a piece of token sequence with its videos (ids (l,), mm_types (l,), pixels, grid).
- `BlockPool`: per layer ONE preallocated pool of n_blocks x BLOCK token slots, k[layer] and v[layer] of shape
  (n_blocks * BLOCK, kv_heads, head_dim), and a free list of block ids. A sequence holds a list of blocks (its
  block table): its token t lives in slot table[t // BLOCK] * BLOCK + t % BLOCK of every layer's pool.
- `GroupKV`: the sequences in the pool. Prompts: each prefilled ONCE, its K/V stored ONCE (a run of consecutive
  blocks where the pool has one: then read in place). Rows: the samples of a prompt, each holding only the blocks
  of its own suffix (its turns, tool responses, clips), one block more each time it crosses a block boundary.
  Sequences come and go: a finished row returns its blocks at once, a prompt when its last row has. `reserve`
  and `release` count the blocks the scheduler has promised to admitted work (each row its current turn's), so
  that it grants blocks only while every admitted group could still reach its worst case (`safe`). GroupKV is what
  the model gets as the `rollout_cache` keyword: each decoder layer (layers.PlainLayer) hands it the forward's new
  keys and values (`write`) and its queries (`attend`), in plain calls.
- The cascade attention (`GroupKV.attend`): a row's queries attend to [its prompt ; its own suffix], in at most TWO
  attention calls per layer
  whatever the number of rows, groups and turns (no Python loop over rows or groups on the per-step path; the
  host builds each forward's indices once, as a fixed number of tensors):
  1. the rows' own blocks: every row's keys ([small prompt ;] own suffix) gathered through its block table into
     ONE slab padded to the longest row (`_key_slots`; -inf on the keys past a row's end), causal within a chunk;
  2. the large prompts: ONE slab of all of them (`_PromptSlab`: their K/V gathered, padded to the longest; a
     prompt alone in consecutive blocks read in place), each prompt's rows batched as its queries.
  The two partial softmaxes are merged by their log-sum-exp (`_attend`, `_merge`; a row with no large prompt
  gets weight 0 on the second). A prompt whose copies for its rows in the forward are small (JOIN_PROMPT) is
  read with each row's suffix instead, as one causal sequence [prompt ; suffix]: the copies cost less than an
  attention call for the prompt alone (a single row's prompt, e.g. a sub-agent's clip). A decode step with no
  large prompt is one fused SDPA call (nothing to merge, no LSE). No decode step touches the K/V of a row that is
  not in it. The prefill of next-turn chunks (`extend`) takes the same two parts (the chunk's own part causal:
  its limit a mask of the fused CPU kernel, or in query blocks of SCORES_BUDGET scores). `runtime.OpCounter` /
  `runtime.step_ops` measure the calls and ops per layer of a step (tests/test_kvcache.py: equal at 4 and 32 rows).

- The memory side (at the end of the file): `memory_budget` (the K/V a rollout may hold) and the scheduler's worst
  cases over a rollout.RolloutConfig: `row_blocks` (the blocks a row may come to hold), `safe` (the banker's rule
  every grant keeps), `split_group` (a group larger than the budget in parts).
Shapes: pool per layer (n_blocks * BLOCK, kv_heads, head_dim); a forward's queries (n, heads, l, head_dim) for
n rows of l tokens (right-padded), positions (3, n, l) for (t, h, w); logits (n, V).
Sizes that choose a path (shrunk in tests: tests/conftest.py `SMALL_THRESHOLDS`; docs/method.md §8): BLOCK (tokens
per block), SCORES_BUDGET (elements of a block of fp32 scores and its mask in the hand-written attention: its
queries go in blocks; the fused CPU kernel holds its scores in tiles, and takes a causal chunk whose mask is within
it), GATHER_BUDGET (K elements, keys x kv_heads x head_dim, of one slab gathered for the attention, rows x longest
row or prompts x longest prompt: past it the slab splits into several, one call each, a loop over slabs; one row's
or one prompt's keys are the least a slab holds; 2^28, 256 M elements, 1 GiB in fp32 a gathered K, is not reached at
64 rows of 4,096 keys of Qwen3-VL-8B's 8 x 128 K/V, nor by the tiny and bench sizes), JOIN_PROMPT (K elements, rows
x tokens x kv_heads x head_dim, of a prompt's copies read with its rows rather than the prompt once in place: about
where a copy and an attention call cost the same on this project's CPU; 128 tokens of Qwen3-VL-8B, one row),
PREFILL_TOKENS (tokens of one prefill forward, padding included: the chunks of an admission go in several forwards,
so that their activations stay bounded beside the budget).
Precision: scores, softmax, the LSE and the merge run in fp32 whatever the model's dtype and the ambient autocast
(autocast is off inside the attention: the RL step's --precision bf16); the output is rounded to the compute dtype.
Departures: plain PyTorch. The rows' keys and the prompts' are gathered (copied) from their blocks into slabs
padded to the longest row or prompt for each forward (at most GATHER_BUDGET elements each: the split above is
the one departure from a fixed number of calls), and bf16 K/V are upcast to fp32 for the attention, where a GPU
deployment would read the block table inside a fused varlen kernel without padding that keeps fp32 accumulators
and returns the LSE (FlashInfer's cascade and paged attention, vLLM; flex_attention). The padding costs compute on
the CPU where rows' lengths differ much (the step pads every row to the longest), the price of one call. On CUDA
the LSE path is the hand-written form (not run here).
"""
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import video
from layers import rope_tables, vision_per_chunk
from ops import EXACT_KEYS, autocast_dtype, exact_attention, tiled_linear

BLOCK = 256                          # tokens per block of the pool
SCORES_BUDGET = 2 ** 24              # elements of one working tensor of the attention (scores block, mask, K/V slab)
JOIN_PROMPT = 2 ** 17                # K elements of a prompt's copies (rows x tokens x heads x dim) read with its rows
PREFILL_TOKENS = 2 ** 15             # tokens (padding included) of one prefill forward, at most (a longer chunk: alone)
GATHER_BUDGET = 2 ** 28              # K elements (keys x kv_heads x head_dim) of one slab gathered for the attention
FUSED_CPU = True                     # on the CPU, attention in one fused kernel (`_attend`)


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


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // BLOCK)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one token costs over all text layers, from the config and the dtype the pool stores
    (autocast's when it is on, e.g. bf16 on fp32 master weights; else the parameters')."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    p = next(model.parameters())
    dtype = autocast_dtype(p.device.type)
    size = dtype.itemsize if dtype is not None else p.element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * size


def _on(device, xs) -> torch.Tensor:
    """xs (a host tensor, or a list: long) on `device`; to an accelerator from pinned memory, without a host sync."""
    t = xs if isinstance(xs, torch.Tensor) else torch.tensor(xs, dtype=torch.long)
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _on_together(device, *parts: list) -> list[torch.Tensor]:
    """Several host lists (each flat, or rows of equal length: a table) on `device` as ONE host tensor and one copy
    (`_on`), handed back as views of it in their shapes: a forward's indices cost one transfer, not one each."""
    flat, sizes, widths = [], [], []
    for xs in parts:
        rows = bool(xs) and isinstance(xs[0], list)
        flat += [v for row in xs for v in row] if rows else xs
        sizes.append(len(xs) * len(xs[0]) if rows else len(xs))
        widths.append(len(xs[0]) if rows else None)
    pieces = _on(device, flat).split(sizes)
    return [t if w is None else t.view(-1, w) for t, w in zip(pieces, widths)]


class BlockPool:
    """Paged K/V: per layer one (n_blocks * BLOCK, kv_heads, head_dim) pool, allocated at the layer's first
    write (dtype and heads from the model's keys), and a free list of block ids (kept sorted). Prompts take a
    run of consecutive blocks from the bottom where there is one (read in place), rows single blocks from the
    top. Past its size the pool grows (one copy, and a warning: the scheduler's estimate was exceeded)."""

    def __init__(self, n_blocks: int, device):
        self.n_blocks, self.device = max(1, n_blocks), device
        self.free = list(range(self.n_blocks))
        self.k, self.v = [], []
        self.peak = 0                                      # the most blocks in use at once

    def alloc(self, n: int, run: bool = False) -> list[int]:
        if n > len(self.free):
            self._grow(n - len(self.free))
        f, out = self.free, None
        if run:
            for i in range(len(f) - n + 1):                 # first fit
                if f[i + n - 1] - f[i] == n - 1:
                    out = f[i:i + n]
                    del f[i:i + n]
                    break
        if out is None:
            out = f[len(f) - n:]
            del f[len(f) - n:]
        self.peak = max(self.peak, self.n_blocks - len(f))
        return out

    def release(self, blocks: list[int]) -> None:
        self.free += blocks
        self.free.sort()

    def _grow(self, n: int) -> None:
        n = max(n, self.n_blocks // 4)
        warnings.warn(f"rollout K/V pool grew from {self.n_blocks} to {self.n_blocks + n} blocks of {BLOCK} tokens: "
                      "a sequence outgrew the scheduler's estimate (kvcache.row_blocks)", stacklevel=3)
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                kv[i] = torch.cat([t, t.new_zeros(n * BLOCK, *t.shape[1:])])
        self.free += range(self.n_blocks, self.n_blocks + n)
        self.n_blocks += n

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, kv_heads, head_dim) into `slots` (N,) of layer `layer`. Both are stored in the values' dtype:
        under autocast on fp32 weights Qwen3-VL's k-norm returns fp32 keys beside bf16 values, which would make the
        pool 1.5 times its bf16 size (training's attention reads the keys in bf16 there too, as SDPA casts them)."""
        if layer == len(self.k):
            self.k.append(v.new_zeros(self.n_blocks * BLOCK, *k.shape[1:]))
            self.v.append(v.new_zeros(self.n_blocks * BLOCK, *v.shape[1:]))
        self.k[layer].index_copy_(0, slots, k if k.dtype == v.dtype else k.to(v.dtype))
        self.v[layer].index_copy_(0, slots, v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class _Seq:
    """A prompt or a row in the pool: its block table, tokens stored, next M-RoPE position, (a row's) prompt."""
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    next_pos: int = 0
    prompt: int = -1
    keys: torch.Tensor | None = None     # a prompt's slots on the device, made once (a prompt never grows)

    def slots(self, start: int, n: int) -> list[int]:
        """Pool slots of this sequence's tokens start .. start + n - 1 (host ints: a decode step's one slot per row
        costs no tensor op)."""
        b = self.blocks
        return [b[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, start + n)]

    def run(self) -> int | None:
        """The first slot if the blocks are consecutive (the K/V is then a view of the pool), else None."""
        b = self.blocks
        return b[0] * BLOCK if b and b[-1] - b[0] == len(b) - 1 else None


@dataclass
class _PromptSlab:
    """The large prompts of a forward read in one attention call, with the rows of each as its queries: p prompts
    padded to the longest (L keys), r places of queries each (r: the most rows of one prompt in the forward)."""
    p: int
    r: int
    L: int
    first: int | None                    # one prompt in consecutive blocks: its first slot (K/V a view of the pool)
    keys: torch.Tensor | None            # else (p * L,) pool slots of each prompt's keys (0-padded; hidden by `bias`)
    pick: torch.Tensor | None            # (p * r,) the row whose queries fill each place (a pad: a row of its prompt;
                                         # None: the forward's rows in their order)
    bias: torch.Tensor | None            # (p, 1, 1, L) fp32 added to the scores: -inf past each prompt's length
                                         # (None: all of one length)


@dataclass
class _Forward:
    """What the hooks need during one forward: where the tokens go, what each row's queries may see."""
    prompt_mode: bool                    # fresh prompts from position 0 (plain causal attention)
    slots: torch.Tensor                  # (N,) pool slots of the forward's real tokens, row-major
    take: torch.Tensor | None            # (N,) their indices among the n * l tokens (None: all of them)
    tables: torch.Tensor | None = None   # (n, nb) each row's suffix blocks (0-padded; masked by `end`)
    start: torch.Tensor | None = None    # (n,) keys of each row before this forward ([small prompt ;] suffix)
    end: torch.Tensor | None = None      # (n,) after it
    end_host: list[int] = field(default_factory=list)
    off: torch.Tensor | None = None      # (n,) where each row's suffix starts among its keys (a small prompt's length)
    ptables: torch.Tensor | None = None  # (n, nbp) the blocks of each row's small prompt (0-padded)
    slabs: list = field(default_factory=list)   # _PromptSlab: the large prompts (one, unless GATHER_BUDGET splits)
    place: torch.Tensor | None = None    # (n,) each row's place among the slabs' p * r places (None: its own index)
    alone: torch.Tensor | None = None    # (n, 1, 1) bool: rows with no large prompt (None: every row has one)
    qpos: torch.Tensor | None = None     # (n, g * l) each query's position among its row's keys (first layer;
                                         # the exact mode: (n, l), and its one cut (span, key slots))
    rope: tuple | None = None            # layers.rope_tables of the forward's positions (first layer)
    autocast: bool = False               # autocast is on around the forward (turned off inside the attention)
    shape: tuple = ()                    # (n, l): rows, tokens per row (right-padded)
    chunks: list = field(default_factory=list)  # grid rows of each chunk's videos (the exact mode's vision calls)
    cuts: list = field(default_factory=list)    # the slabs of rows (first layer): (a, b, span, the rows' key slots
                                                # ((b - a) * span,), their mask (b - a, 1, 1, span) or None, a
                                                # chunk's causal mask for the fused kernel (`_fused_causal`) or
                                                # None); one, unless GATHER_BUDGET splits them (`_pack`)


class GroupKV:
    """The rollout's cache: prompts and rows in one paged pool (see the module docstring). Ids are ints:
    `add_prompts` returns prompt ids and the logits after each prompt's last token, `fork` rows of a prompt,
    `extend` prefills a chunk on top of rows, `step` feeds one token to rows (decode); both return the logits
    after each row's last token, (n, V) fp32. `free_row` / `free_prompt` return the blocks at once."""

    def __init__(self, model, device, n_blocks: int, exact: bool = False):
        self.exact = exact                 # the exact mode: every row reads [prompt ; suffix] by ops.exact_attention
        self.pool = BlockPool(n_blocks, device)
        self.prompts: dict[int, _Seq] = {}
        self.rows: dict[int, _Seq] = {}
        self.reserved, self.device, self.fwd, self._ids = 0, device, None, 0
        self.fed = []                      # the M-RoPE positions the last feed gave: a (3, l) host tensor per chunk
                                           # (add_prompts, extend), a host int per row (step); contract.py hashes them

    # -- blocks promised to admitted work (the scheduler's worst case), and sequences
    def reserve(self, n_blocks: int, force: bool = False) -> bool:
        """Promise n_blocks of the pool; False (nothing promised) if they do not fit, unless `force`."""
        if self.reserved + n_blocks > self.pool.n_blocks and not force:
            return False
        self.reserved += n_blocks
        return True

    def release(self, n_blocks: int) -> None:
        self.reserved -= n_blocks

    def _new(self, table: dict, seq: _Seq) -> int:
        self._ids += 1
        table[self._ids] = seq
        return self._ids

    def fork(self, prompt: int, n: int) -> list[int]:
        """n rows of a prompt: each starts after the prompt's last token, with an empty suffix."""
        return [self._new(self.rows, _Seq(next_pos=self.prompts[prompt].next_pos, prompt=prompt)) for _ in range(n)]

    def free_row(self, row: int) -> None:
        self.pool.release(self.rows.pop(row).blocks)

    def free_prompt(self, prompt: int) -> None:
        self.pool.release(self.prompts.pop(prompt).blocks)

    # -- feeding tokens
    def add_prompts(self, model, chunks: list[Chunk], pad_id: int) -> tuple[list[int], torch.Tensor]:
        """Prefill each chunk as a new prompt; returns (prompt ids, (P, V) logits)."""
        ids = [self._new(self.prompts, _Seq(self.pool.alloc(blocks_for(len(c.ids)), run=True))) for c in chunks]
        return ids, self._prefills(model, [self.prompts[i] for i in ids], chunks, pad_id, prompt_mode=True)

    def extend(self, model, rows: list[int], chunks: list[Chunk], pad_id: int) -> torch.Tensor:
        """Prefill chunk i on top of row rows[i]; returns (n, V) logits."""
        seqs = [self.rows[r] for r in rows]
        for s, c in zip(seqs, chunks):
            s.blocks += self.pool.alloc(blocks_for(s.length + len(c.ids)) - len(s.blocks))
        return self._prefills(model, seqs, chunks, pad_id, prompt_mode=False)

    def step(self, model, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Decode: feed tokens (n,) (on the device; no host sync) to rows; returns (n, V) logits."""
        seqs = [self.rows[r] for r in rows]
        for s in seqs:
            if s.length == len(s.blocks) * BLOCK:
                s.blocks += self.pool.alloc(1)
        self.fed = [s.next_pos for s in seqs]
        fwd, (pos,) = self._rows_forward(seqs, [1] * len(seqs), self.fed)
        logits = self._run(model, fwd, tokens[:, None], pos.view(1, -1, 1).expand(3, -1, 1))
        for s in seqs:
            s.length += 1
            s.next_pos += 1
        return logits

    def _prefills(self, model, seqs: list[_Seq], chunks: list[Chunk], pad_id: int, prompt_mode: bool) -> torch.Tensor:
        """The chunks in as few forwards as hold at most PREFILL_TOKENS tokens each, padding included (a chunk
        longer than that alone), so that the activations of a prefill stay bounded; (n, V) logits."""
        self.fed = []
        return torch.cat([self._prefill(model, seqs[a:b], chunks[a:b], pad_id, prompt_mode)
                          for a, b, _ in _pack([len(c.ids) for c in chunks], PREFILL_TOKENS)])

    def _prefill(self, model, seqs: list[_Seq], chunks: list[Chunk], pad_id: int, prompt_mode: bool) -> torch.Tensor:
        lengths = [len(c.ids) for c in chunks]
        L, n = max(lengths), len(seqs)
        ids = torch.full((n, L), pad_id, dtype=torch.long)
        types = torch.zeros(n, L, dtype=torch.int32)
        pos = torch.zeros(3, n, L, dtype=torch.long)
        pixels, grids = [], []
        for i, (s, c) in enumerate(zip(seqs, chunks)):
            ids[i, :lengths[i]] = c.ids
            types[i, :lengths[i]] = c.mm_types
            p = chunk_positions(model, c) + s.next_pos
            pos[:, i, :lengths[i]] = p
            self.fed.append(p)
            pos[:, i, lengths[i]:] = p[:, -1:] + 1 + torch.arange(L - lengths[i])   # pads: never attended
            s.next_pos = int(p.max()) + 1
            if c.pixels is not None:
                pixels.append(c.pixels)
                grids.append(c.grid)
        vision = {}
        if pixels:
            dtype = next(model.parameters()).dtype
            vision = dict(pixel_values_videos=torch.cat(pixels).to(self.device, dtype),
                          video_grid_thw=torch.cat(grids).to(self.device))
        if prompt_mode:
            fwd = _Forward(True, _on(self.device, [t for s, ln in zip(seqs, lengths) for t in s.slots(0, ln)]),
                           self._take(lengths, L))
        else:
            fwd, _ = self._rows_forward(seqs, lengths)
        fwd.chunks = [len(g) for g in grids]
        logits = self._run(model, fwd, _on(self.device, ids), _on(self.device, pos), _on(self.device, types), vision,
                           _on(self.device, [ln - 1 for ln in lengths]))
        for s, ln in zip(seqs, lengths):
            s.length += ln
        return logits

    def _take(self, lengths: list[int], L: int) -> torch.Tensor | None:
        if all(ln == L for ln in lengths):
            return None
        return _on(self.device, [i * L + j for i, ln in enumerate(lengths) for j in range(ln)])

    def _rows_forward(self, seqs: list[_Seq], lengths: list[int], *more: list) -> tuple[_Forward, list]:
        """The forward of rows `seqs`, lengths[i] new tokens on top of each, built on the host and sent at once:
        the tokens' slots, each row's block tables, and where its keys start. A row's keys are its own suffix, or
        [its prompt ; its suffix] where the copies of the prompt for its rows here are small (JOIN_PROMPT), so that
        no call is spent on it alone; the larger prompts go in one slab (`_PromptSlab`) whose queries are the rows
        of each. Host work over the rows (lists); a fixed number of tensors whatever the rows and groups, sent to the
        device in one copy with `more` (further lists the caller needs there, handed back beside the forward)."""
        per_token = self.pool.k[0][0].numel()              # kv_heads * head_dim
        count: dict[int, int] = {}
        for s in seqs:
            count[s.prompt] = count.get(s.prompt, 0) + 1
        off, ptables, members = [], [], {}                 # members: the rows of each large prompt, in order seen
        for i, s in enumerate(seqs):
            prompt = self.prompts[s.prompt]
            joined = self.exact or count[s.prompt] * prompt.length * per_token <= JOIN_PROMPT   # copies cost little
            off.append(prompt.length if joined else 0)
            ptables.append(prompt.blocks if joined else [])
            if not joined:
                members.setdefault(s.prompt, []).append(i)
        pad = lambda rows: [r + [0] * (max(map(len, rows)) - len(r)) for r in rows]
        n = len(seqs)
        end = [o + s.length + ln for o, s, ln in zip(off, seqs, lengths)]
        slots, tables, start, fwd_end, fwd_off, ptab, *more = _on_together(
            self.device, [t for s, ln in zip(seqs, lengths) for t in s.slots(s.length, ln)],
            pad([s.blocks for s in seqs]), [o + s.length for o, s in zip(off, seqs)], end, off,
            pad(ptables) if any(ptables) else [[0]] * n, *more)
        fwd = _Forward(False, slots, self._take(lengths, max(lengths)), tables, start, fwd_end, end, fwd_off, ptab)
        if not members:
            return fwd, more
        # the large prompts in one slab; several only where their padded K/V would pass GATHER_BUDGET
        large = list(members)
        place = [0] * n
        for a, b, _ in _pack([self.prompts[p].length for p in large], GATHER_BUDGET // per_token):
            mem = [members[p] for p in large[a:b]]
            sb = self._slab([self.prompts[p] for p in large[a:b]], mem, n)
            base = sum(s.p * s.r for s in fwd.slabs)
            for i, m in enumerate(mem):
                for j, row in enumerate(m):
                    place[row] = base + i * sb.r + j
            fwd.slabs.append(sb)
        if place != list(range(n)) or sum(sb.p * sb.r for sb in fwd.slabs) != n:
            fwd.place = _on(self.device, place)
        if sum(map(len, members.values())) < n:            # some rows read their (small) prompt with their suffix
            fwd.alone = _on(self.device, torch.tensor([o > 0 for o in off]).view(n, 1, 1))
        return fwd, more

    def _prompt_keys(self, prompt: _Seq) -> torch.Tensor:
        """(length,) the pool slots of a prompt's keys, on the device (made at its first read)."""
        if prompt.keys is None:
            prompt.keys = _on(self.device, prompt.slots(0, prompt.length))
        return prompt.keys

    def _slab(self, prompts: list[_Seq], members: list[list[int]], n: int) -> _PromptSlab:
        """The host-built indices of one read of `prompts` (members[i]: the rows of prompts[i] among the forward's
        n): one prompt in consecutive blocks is read in place, else their keys are gathered through the block
        tables, padded to the longest."""
        p, L, r = len(prompts), max(q.length for q in prompts), max(map(len, members))
        first, keys, bias = prompts[0].run() if p == 1 else None, None, None
        if p == 1 and first is None:
            keys = self._prompt_keys(prompts[0])
        elif p > 1:
            tables = _on(self.device, [q.blocks + [0] * (blocks_for(L) - len(q.blocks)) for q in prompts])
            keys = _table_slots(tables, L).view(-1)
        lens = [q.length for q in prompts]
        if min(lens) < L:
            bias = _hidden(torch.arange(L, device=self.device) >= _on(self.device, lens)[:, None])[:, None, None]
        pick = [m[j] if j < len(m) else m[0] for m in members for j in range(r)]
        return _PromptSlab(p, r, L, first, keys, None if pick == list(range(n)) else _on(self.device, pick), bias)

    @torch.no_grad()
    def _run(self, model, fwd: _Forward, ids, pos, types=None, vision=None, last=None) -> torch.Tensor:
        """One forward through the model, its decoder layers attending through this cache (`rollout_cache`); (n, V)
        float logits after token `last[i]` of each row (default: the last column)."""
        self.fwd = fwd
        fwd.autocast, fwd.shape = autocast_dtype(ids.device.type) is not None, tuple(ids.shape)
        try:
            if self.exact and vision:                      # the tower once per chunk, as the trainer calls it
                with vision_per_chunk(model, fwd.chunks):
                    out = model.model(input_ids=ids, position_ids=pos, mm_token_type_ids=types, use_cache=False,
                                      rollout_cache=self, **vision)
            else:
                out = model.model(input_ids=ids, position_ids=pos, mm_token_type_ids=types, use_cache=False,
                                  rollout_cache=self, **(vision or {}))
        finally:
            self.fwd = None
        h = out.last_hidden_state
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
        return (tiled_linear(h, model.lm_head.weight) if self.exact else model.lm_head(h)).float()

    @staticmethod
    def _key_slots(fwd: _Forward, span: int) -> torch.Tensor:
        """(n, span): the pool slot of each row's key j, j < off: its prompt's token j, else its suffix's token
        j - off (past a row's end: any slot of its tables, masked)."""
        pos = torch.arange(span, device=fwd.off.device)
        own = (pos - fwd.off[:, None]).clamp(min=0)
        suffix = fwd.tables.gather(1, (own // BLOCK).clamp(max=fwd.tables.shape[1] - 1)) * BLOCK + own % BLOCK
        prompt = fwd.ptables.gather(1, (pos // BLOCK).clamp(max=fwd.ptables.shape[1] - 1).expand(len(own), -1))
        return torch.where(pos < fwd.off[:, None], prompt * BLOCK + pos % BLOCK, suffix)

    # -- what each decoder layer calls (layers.attention)
    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """layers.rope_tables of this forward's (cos, sin), made at the first layer for all of them."""
        if self.fwd.rope is None:
            self.fwd.rope = rope_tables(cos, sin, rows_of_tokens=True)
        return self.fwd.rope

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n l, kv_heads, head_dim) of this forward's tokens (row-major) -> their slots in the pool."""
        kk, vv = k, v
        if self.fwd.take is not None:                      # right-padding: pads are never stored
            kk, vv = kk[self.fwd.take], vv[self.fwd.take]
        self.pool.write(layer, self.fwd.slots, kk, vv)

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q (n l, heads, d) of this forward's n rows of l tokens (row-major) -> (n, l, heads * d), in the compute
        dtype (autocast's where it is on, else q's). key / value (n l, kv_heads, d): this forward's own, read only by
        a prompt forward (the rest reads the pool). The attention runs with autocast off, in fp32: under the RL
        step's autocast (--precision bf16) its matmuls would otherwise round the scores and the LSE to bf16
        (tests/test_engine_precision.py)."""
        if not self.fwd.autocast:
            out = self._attend_rows(layer, q, scale, key, value)
            return out if out.dtype == q.dtype else out.to(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            out = self._attend_rows(layer, q, scale, key, value)
        dtype = torch.get_autocast_dtype(q.device.type)
        return out if out.dtype == dtype else out.to(dtype)

    def _attend_rows(self, layer: int, q: torch.Tensor, scale: float, key, value) -> torch.Tensor:
        """At most two attention calls, whatever the rows and groups (GATHER_BUDGET apart): every row's [small
        prompt ;] own suffix, gathered through the block tables into one slab padded to the longest row; and the
        large prompts, one slab with each prompt's rows as its queries. Their softmaxes are merged by the LSE."""
        fwd = self.fwd
        (n, l), (_, H, d) = fwd.shape, q.shape
        if self.exact:
            return self._attend_exact(layer, q, scale, key, value)
        if fwd.prompt_mode:                                # whole prompts from position 0: plain causal SDPA, fp32
            q, key, value = (t.view(n, l, -1, d).transpose(1, 2).float() for t in (q, key, value))
            return _prompt_attention(q, key, value, scale).transpose(1, 2).flatten(2)
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
        Hkv = pool_k.shape[1]
        g = H // Hkv                                       # query heads per KV head (GQA)
        gl = g * l
        qg = q.view(n, Hkv, g, d) if l == 1 else q.view(n, l, H, d).transpose(1, 2).reshape(n, Hkv, gl, d)
        fused = l == 1 and not fwd.slabs                   # decode, nothing to merge: one SDPA call, no LSE
        if not fwd.cuts:                                   # made at the first layer, for every layer
            if l > 1:                                      # each query's position: a chunk's causal limit
                fwd.qpos = fwd.start[:, None] + torch.arange(gl, device=q.device) % l      # the (g, l) order of qg
            span = max(fwd.end_host)
            keys = self._key_slots(fwd, span)
            bias = _hidden(torch.arange(span, device=q.device) >= fwd.end[:, None])      # (n, span): past a row's end
            for a, b, w in _pack(fwd.end_host, GATHER_BUDGET // (Hkv * d)):
                mask = None if min(fwd.end_host[a:b]) == w else bias[a:b, None, None, :w]
                causal = _fused_causal(fwd.qpos[a:b], w, mask) if l > 1 else None     # once, for every layer
                fwd.cuts.append((a, b, w, (keys if b - a == n else keys[a:b])[:, :w].reshape(-1), mask, causal))
        # [small prompt ;] own suffix, causal, read through the block tables: (rows, Hkv, span, d)
        own = []
        for a, b, span, keys, mask, causal in fwd.cuts:   # one slab, unless GATHER_BUDGET splits the rows
            K, V = (_gather(pool, keys, b - a, span).transpose(1, 2) for pool in (pool_k, pool_v))
            qa = qg if b - a == n else qg[a:b]
            if fused:                                      # mask: -inf on the keys past a row's end
                own.append(F.scaled_dot_product_attention(_f32(qa), _f32(K), _f32(V), attn_mask=mask, scale=scale))
            elif causal is not None:                       # a chunk: its causal limit as the fused kernel's mask
                own.append(_attend(qa, K, V, scale, bias=causal))
            else:                                          # a decode query sees every key before its row's end
                own.append(_attend(qa, K, V, scale, fwd.qpos[a:b] if l > 1 else None, mask))
        if fused:                     # (n, Hkv, g, d) -> (n, 1, H d): a view where the kernel's output is contiguous
            return (own[0] if len(own) == 1 else torch.cat(own)).reshape(n, 1, H * d)
        o_s, l_s = own[0] if len(own) == 1 else [torch.cat(t) for t in zip(*own)]
        if not fwd.slabs:                                  # a chunk, every prompt read with its rows
            return o_s.reshape(n, H, l, d).transpose(1, 2).reshape(n, l, H * d)
        # the large prompts: each prompt's rows are its queries (r places a prompt, pads included), (p, Hkv, r gl, d)
        o_p, l_p = [], []
        for sb in fwd.slabs:                               # one slab, unless GATHER_BUDGET splits the prompts
            p, r = sb.p, sb.r
            qs = qg if sb.pick is None else qg.index_select(0, sb.pick)
            qs = qs.view(p, r, Hkv, gl, d).transpose(1, 2).reshape(p, Hkv, r * gl, d)
            if sb.first is not None:                       # in place: a view of the pool
                K, V = (pool[sb.first:sb.first + sb.L].transpose(0, 1)[None] for pool in (pool_k, pool_v))
            else:
                K, V = (_gather(pool, sb.keys, p, sb.L).transpose(1, 2) for pool in (pool_k, pool_v))
            o, lse = _attend(qs, K, V, scale, bias=sb.bias)
            back = lambda t: t.unflatten(2, (r, gl)).transpose(1, 2).flatten(0, 1)    # (p r, Hkv, gl[, d])
            o_p.append(back(o))
            l_p.append(back(lse))
        o_p, l_p = (o_p[0], l_p[0]) if len(o_p) == 1 else (torch.cat(o_p), torch.cat(l_p))
        if fwd.place is not None:                          # each row's place among the slabs'
            o_p, l_p = o_p.index_select(0, fwd.place), l_p.index_select(0, fwd.place)
        if fwd.alone is not None:                          # no large prompt: weight 0 in the merge
            l_p = l_p.masked_fill(fwd.alone, float("-inf"))
        out = _merge(o_p, l_p, o_s, l_s)                   # (n, Hkv, g l, d)
        return out.reshape(n, 1, H * d) if l == 1 else out.reshape(n, H, l, d).transpose(1, 2).reshape(n, l, H * d)

    def _attend_exact(self, layer: int, q: torch.Tensor, scale: float, key, value) -> torch.Tensor:
        """The exact mode: each row's queries over its tokens' keys in order ([prompt ; suffix], gathered through the
        block tables, or a prompt forward's own), by ops.exact_attention, the training forward's routine."""
        fwd = self.fwd
        (n, l), (_, H, d) = fwd.shape, q.shape
        q = q.view(n, l, H, d).transpose(1, 2)
        if fwd.qpos is None:                               # made at the first layer, for every layer
            start = torch.zeros(n, dtype=torch.long, device=q.device) if fwd.prompt_mode else fwd.start
            fwd.qpos = start[:, None] + torch.arange(l, device=q.device)
            if not fwd.prompt_mode:                        # whole key blocks (past a row's end: masked)
                span = -(-max(fwd.end_host) // EXACT_KEYS) * EXACT_KEYS
                fwd.cuts = [(span, self._key_slots(fwd, span).reshape(-1))]
        if fwd.prompt_mode:
            K, V = (t.view(n, l, -1, d).transpose(1, 2) for t in (key, value))
        else:
            (span, slots), = fwd.cuts
            K, V = (_gather(pool[layer], slots, n, span).transpose(1, 2) for pool in (self.pool.k, self.pool.v))
        out = exact_attention(q, K, V, fwd.qpos, scale)
        return out.transpose(1, 2).reshape(n, l, H * d)


def _prompt_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal fp32 attention of whole prompts, q (n, H, L, d), key / value (n, H_kv, L, d) -> (n, H, L, d), the K/V
    heads repeated to H: fp32 grouped-query SDPA falls to CUDA's math kernel and its (n, H, L, L) scores."""
    if key.shape[1] != q.shape[1]:
        key, value = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale)


def _pack(lengths: list[int], limit: int) -> list[tuple[int, int, int]]:
    """Consecutive items in groups (a, b, longest): each as many items as keep (b - a) x longest <= limit (one item
    at least), the padded size of the group. Prefill forwards (chunks, PREFILL_TOKENS) and the attention's slabs of
    rows and of prompts (keys, GATHER_BUDGET / (kv_heads x head_dim): one slab unless it would pass the budget)."""
    groups, a = [], 0
    while a < len(lengths):
        b, longest = a + 1, lengths[a]
        while b < len(lengths) and (b + 1 - a) * max(longest, lengths[b]) <= limit:
            longest = max(longest, lengths[b])
            b += 1
        groups.append((a, b, longest))
        a = b
    return groups


def _gather(pool: torch.Tensor, slots: torch.Tensor, *shape: int) -> torch.Tensor:
    """pool rows at the flat `slots` (k,) -> shape + pool.shape[1:], by index_select (faster on the CPU)."""
    return pool.index_select(0, slots).view(*shape, *pool.shape[1:])


def _table_slots(tables: torch.Tensor, span: int) -> torch.Tensor:
    """tables (m, nb) block tables (nb >= span / BLOCK) -> (m, span) the pool slot of each sequence's token j."""
    j = torch.arange(span, device=tables.device)
    return tables.index_select(1, j // BLOCK) * BLOCK + j % BLOCK


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32 (t itself where it is: no op)."""
    return t if t.dtype == torch.float32 else t.float()


def _hidden(hide: torch.Tensor) -> torch.Tensor:
    """The additive fp32 mask of a boolean `hide`: 0 where a key is seen, -inf where hidden."""
    return torch.zeros(hide.shape, device=hide.device).masked_fill_(hide, float("-inf"))


def _attend(q, k, v, scale, qpos=None, bias=None):
    """Softmax attention of q (n, h, m, d) over k, v (n, h, c, d) in fp32 -> (out (n, h, m, d), lse (n, h, m)),
    the log-sum-exp so that two partial attentions merge exactly (`_merge`). bias (n, 1, 1, c) or (n, 1, m, c) fp32
    is added to the scores; key j is hidden from query i of row b where j > qpos[b, i] (None: no causal limit). On
    the CPU, PyTorch's fused flash kernel, which returns the LSE, while a causal mask is within SCORES_BUDGET;
    elsewhere the hand-written form in query blocks (docs/method.md §8). Autocast is off inside."""
    with torch.autocast(q.device.type, enabled=False):
        return _attend_fp32(q, k, v, scale, qpos, bias)


def _fused_causal(qpos: torch.Tensor, c: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The causal limit of queries at positions qpos (n, m) over c keys (key j hidden where j > qpos) as the fused CPU
    kernel's additive mask (n, 1, m, c) fp32, bias (n, 1, 1, c) added; None where that kernel does not take it (off
    the CPU, FUSED_CPU off, or past SCORES_BUDGET elements): the hand-written form applies qpos itself. A forward
    builds it once for all its layers (`GroupKV._attend_rows`' cuts)."""
    n, m = qpos.shape
    if not (FUSED_CPU and qpos.device.type == "cpu" and n * m * c <= SCORES_BUDGET):
        return None
    mask = _hidden(torch.arange(c, device=qpos.device) > qpos[:, None, :, None])
    return mask if bias is None else mask.add_(bias)


def _attend_fp32(q, k, v, scale, qpos, bias):
    n, h, m, d = q.shape
    c = k.shape[2]
    mask = bias if qpos is None else _fused_causal(qpos, c, bias)
    if FUSED_CPU and q.device.type == "cpu" and (qpos is None or mask is not None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _f32(q), _f32(k), _f32(v), attn_mask=mask, scale=scale)
        return out, lse
    block = max(1, SCORES_BUDGET // max(1, n * h * c))
    q3 = q.float().reshape(n * h, m, d)                                                  # (n h) batches for bmm
    kt, vf = k.float().transpose(-1, -2).reshape(n * h, d, c), v.float().reshape(n * h, c, d)
    outs, lses = [], []
    for a in range(0, m, block):
        s = torch.bmm((q3 if block >= m else q3[:, a:a + block]) * scale, kt)            # (n h, b, c) fp32
        if bias is not None:
            s.view(n, h, -1, c).add_(bias)
        if qpos is not None:                                                              # (n, 1, b, c)
            s.view(n, h, -1, c).masked_fill_(torch.arange(c, device=q.device) > qpos[:, None, a:a + block, None],
                                             float("-inf"))
        top = s.amax(-1, keepdim=True)
        p = s.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        outs.append(torch.bmm(p, vf).div_(total))
        lses.append(total.log_().add_(top))
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 1), torch.cat(lses, 1))
    return out.view(n, h, m, d), lse.view(n, h, m)


def _merge(o1, lse1, o2, lse2):
    """Cascade merge in fp32: softmax over [A; B] = (e^lse_A o_A + e^lse_B o_B) / (e^lse_A + e^lse_B)
    = o_B + w (o_A - o_B), w = e^lse_A / (e^lse_A + e^lse_B) = sigmoid(lse_A - lse_B) (A empty: lse_A = -inf, w = 0).
    o (..., d), lse (...): the weight is taken per query and spread over its d."""
    return torch.lerp(o2, o1, torch.sigmoid(lse1 - lse2).unsqueeze(-1))


# -----------------------------------------------------------------------------
# the budget: how many bytes of K/V the engine may hold

CPU_BUDGET_GB = 4.0      # the memory budget's default on CPU


def memory_budget(budget_bytes: int | None, device, model=None) -> int:
    """Bytes of K/V a rollout may hold: `budget_bytes` (--rollout-memory-gb), else on CUDA
    `default_budget` of the memory not allocated now (free + cached by the allocator: beside the weights) and of
    the weight copies autocast will keep (`autocast_copies` of `model`), else CPU_BUDGET_GB."""
    if budget_bytes:
        return int(budget_bytes)
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return default_budget(free, autocast_copies(model) if model is not None else 0, autocast_dtype("cuda"))
    return int(CPU_BUDGET_GB * 2 ** 30)


def default_budget(free: int, cast_params: int, autocast: torch.dtype | None) -> int:
    """The default K/V budget on a GPU: 80 % of the `free` bytes left after autocast's weight copies (cast_params x
    its dtype's bytes; `autocast_copies` counts them)."""
    copies = cast_params * autocast.itemsize if autocast is not None else 0
    return max(0, int(0.8 * (free - copies)))


def autocast_copies(model) -> int:
    """Parameters autocast casts and keeps (its weight cache holds casts of leaf fp32 tensors that require grad):
    the fp32 weights and biases of the linear and convolution layers that require grad, unsharded (FSDP2's DTensor
    shards are all-gathered in bf16 for the forward, which autocast leaves alone; a frozen vision tower's are cast
    per call and freed; embeddings and norms are not cast). tests/test_rollout.py measures it."""
    from torch.distributed.tensor import DTensor
    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    params = {id(p): p for m in model.modules() if isinstance(m, layers) for p in m.parameters(recurse=False)
              if p.dtype == torch.float32 and p.requires_grad and not isinstance(p, DTensor)}
    return sum(p.numel() for p in params.values())


# -----------------------------------------------------------------------------
# the engine's memory: the pool blocks a row may come to hold (the budget: memory_budget above); cfg is a
# rollout.RolloutConfig

TEXT_PER_CALL = 64       # tokens around one call's result: tags, "Clip s-e s:", an error message
TEXT_PER_TURN = 96       # tokens of a response's fixed text: the user turn, the forced-answer message, "<think>"
TEXT_PER_PATCH = 16      # tokens of the timestamp Qwen3-VL writes before each temporal patch of a clip


def clip_tokens(max_frames: int, max_pixels: int | None, factor: int) -> int:
    """Most tokens one clip of at most `max_frames` frames costs: each temporal patch (2 frames) at most
    max_pixels / factor^2 visual tokens; without a pixel cap the crop levels' quota, at most the finest level's
    (video.LEVEL_TOKENS, at least one token a patch); plus each patch's timestamp text."""
    n = max(1, max_frames // 2)
    visual = n * max(1, max_pixels // factor ** 2) if max_pixels else max(max(video.LEVEL_TOKENS.values()), n)
    return visual + n * TEXT_PER_PATCH


def assistant_turns(cfg) -> int:
    """The most assistant turns a row writes: max(max_turns, 1) tool turns, then the answer."""
    return max(cfg.max_turns, 1) + 1


def row_blocks(cfg, prompt_len: int, factor: int, held: int = 0, turns: int | None = None,
               this_turn: bool = False) -> int:
    """Pool blocks one row may come to hold: the scheduler's worst case (docs/method.md §8). Its own suffix
        own = min(held + T * max_new_tokens + (T - 1) * (TEXT_PER_TURN + C * (per_call + TEXT_PER_CALL) + TEXT_PER_CALL),
                  max_context - prompt_len)
    with T = `turns` assistant turns still to write (at the start `assistant_turns(cfg)`), `held` tokens already in
    its suffix (0 at the start; at a turn's end what it wrote and the response it is about to read, when the bound
    is tightened), and a response of C = max_calls_per_turn results, per_call a clip (`clip_tokens`) in interleaved
    mode or a summary (at most subagent_max_new_tokens) in sub-agent mode, each with TEXT_PER_CALL, one
    TEXT_PER_CALL more for the note on calls past the cap; plus, in sub-agent mode while a tool turn may still come
    (T > 1), the sub-agents of one turn (they live while their caller waits): C x (a clip prompt +
    subagent_max_new_tokens), each two sequences of its own. A sequence of n tokens holds ceil(n / BLOCK) blocks.
    The bound is loose (real turns are shorter than max_new_tokens): a larger --rollout-memory-gb admits more at
    once, and each turn's end tightens it (Engine.respond). `this_turn`: only what the row may hold by the end of
    its current turn (T = 1 in `own`; the sub-agents still counted while T > 1): the grant continuous batching
    makes at a turn's start (Engine.admit)."""
    turns = assistant_turns(cfg) if turns is None else turns
    if cfg.tool_mode == "subagent":
        per_call = cfg.subagent_max_new_tokens
        sub_prompt = clip_tokens(cfg.subagent_max_frames, cfg.subagent_max_pixels, factor) + TEXT_PER_TURN
        subs = cfg.max_calls_per_turn * (blocks_for(sub_prompt) + blocks_for(cfg.subagent_max_new_tokens))
    else:
        per_call, subs = clip_tokens(cfg.crop_max_frames, cfg.crop_max_pixels, factor), 0
    response = TEXT_PER_TURN + cfg.max_calls_per_turn * (per_call + TEXT_PER_CALL) + TEXT_PER_CALL
    t = 1 if this_turn else turns
    own = min(held + t * cfg.max_new_tokens + (t - 1) * response, max(1, cfg.max_context - prompt_len))
    return blocks_for(own) + (subs if turns > 1 else 0)


def safe(groups: list[tuple[int, int]], free: int) -> bool:
    """The banker's algorithm (Dijkstra), for one resource: can every group, holding `held` blocks and promised
    at most `need` in all ((held, need) pairs), reach its worst case in some order, if each in turn takes what it
    still may need from `free` and returns everything it holds at its end? With one resource the order to try is
    the one by what each still may need, smallest first. Continuous batching keeps the engine in such a state at
    every grant, so some row can always go on (no deadlock) and the pool never outgrows the budget."""
    for held, need in sorted(groups, key=lambda g: g[1] - g[0]):
        if need - held > free:
            return False
        free += held
    return True


def split_group(group: tuple, budget: int) -> list[tuple]:
    """A queued (prompt chunk, rows, prompt blocks) whose worst case (the prompt once + every row's reserve)
    exceeds the budget, as consecutive parts of its rows that each fit (at least one row a part), each with its
    own copy of the prompt's K/V: a Video-o3 group of 16 rows of ~200k tokens at 8B is ~400 GiB of worst case,
    one row ~30 GiB. A row samples from its own seed and draw counter, so the parts sample what the whole group
    would (the prompt is prefilled once per part)."""
    chunk, rows, prompt = group
    parts, part = [], []
    for r in rows:
        if part and prompt + sum(x.reserve for x in part) + r.reserve > budget:
            parts.append(part)
            part = []
        part.append(r)
    return [(chunk, p, prompt) for p in parts + [part]]
