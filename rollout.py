"""
The agent's rollout engine: a batched multi-turn decoding loop on the model's own KV cache, with
parallel `crop_video` calls executed either by sub-agents (ParaVT, arXiv 2605.20342) or as clips
interleaved into the same context (Video-o3, arXiv 2601.23224).

Everything works on token sequences. A trajectory is the prompt (system + Hermes tools block + the
overview video + the question) followed by turns; every token carries a role:
    ENV    prompt, the forced "<think>\n" prefix, tool responses, inserted frames, forced-answer text
    POLICY the model's own sampled tokens (the only ones training ever updates)

How nothing is computed twice (the released code re-templates and re-encodes every frame each turn):
- The prompt of each record (the long overview video) is prefilled ONCE, then its cache is repeated
  for the G samples of the GRPO group: the vision tower sees each overview once.
- Each turn only the new chunk (tool responses, new clips, the next "<think>\n") is prefilled on
  top of the cache. M-RoPE positions of a chunk are computed for the chunk alone and shifted by the
  row's next position (Qwen-VL positions restart from max+1 after every text or vision span), so a
  continued turn gives the same logits as a full recompute (tests/test_rollout.py checks it).
- Rows live in one batched cache with a 2-D attention mask; chunks of different lengths are right-
  padded and the pads are masked, so holes in the middle of a row are harmless. Rows that finish a
  turn are split off the decoding batch (they stop costing compute) and merged back for the next turn.

Shapes: cache tensors (B, kv_heads, L, head_dim); mask (B, L); positions (3, B, L) for (t, h, w).
"""
import json
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

import video
from data import INSTRUCTIONS, format_question, resolve_video
from model import TOOLS_INTRO, TOOLS_OUTRO, special_token_ids
from rewards import ToolCall, call_window, extract_answer, parse_tool_calls

ENV, POLICY = 0, 1
THINK_PREFIX = "<think>\n"
SYSTEM_PROMPT = ("You answer questions about a long video. You see a sparse overview of it; to look closer at a "
                 "time window, call crop_video (several calls in one turn run in parallel). Think inside "
                 "<think></think>, then either call tools or give the final answer inside <answer></answer>.")
SUBAGENT_PROMPT = "Describe briefly what this video segment shows: objects, their colours, and when they appear."
FORCED_ANSWER = "You have used all your tool turns. Give your final answer now inside <answer></answer>, without tool calls."


@dataclass
class RolloutConfig:
    """Knobs of one rollout; the presets of the papers live in eval.py/train.py as plain dicts."""
    tool_mode: str = "interleaved"       # "interleaved" (Video-o3) | "subagent" (ParaVT)
    max_turns: int = 3                   # tool rounds before the forced answer
    max_calls_per_turn: int = 5
    max_new_tokens: int = 256            # per assistant turn
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    group_size: int = 1
    overview_fps: float = 2.0
    overview_max_frames: int = 768
    overview_nframes: int | None = None  # exactly K frames (nFrames gating); None = fps rule
    overview_max_pixels: int | None = None   # per frame; None = 16k visual tokens over the whole overview
    crop_fps: float = 2.0
    crop_max_pixels: int | None = None   # per-frame cap on top of the level quota (tiny default: 64*64)
    min_window: float = 1.0              # interleaved mode: windows shorter than this are errors (SPEC 2)
    subagent_fps: float = 1.0
    subagent_max_frames: int = 16
    subagent_max_pixels: int = 224 * 224
    subagent_max_new_tokens: int = 512
    max_context: int = 32768             # a row that would exceed this is cut and flagged
    tools_block: bool = True             # Hermes tools block in the system prompt (real checkpoints expect it)


# The embedded tiny default: small frames and a short prompt, so a 2-core CPU trains it in minutes.
# Without the tools block the system prompt still names the tool; the SFT warm start teaches the format.
TINY_ROLLOUT = dict(overview_nframes=8, overview_max_pixels=64 * 64, crop_fps=1.0, crop_max_pixels=64 * 64,
                    subagent_max_pixels=64 * 64, subagent_max_new_tokens=48, tools_block=False)


@dataclass
class Trajectory:
    record_id: str
    sample: int                          # index within the GRPO group
    token_ids: list[int]
    roles: list[int]                     # ENV / POLICY per token
    prompt_len: int                      # tokens before the first forced "<think>\n"
    videos: list[tuple[torch.Tensor, torch.Tensor]]   # (pixel_values_videos, video_grid_thw) in order
    nframes: int = 0                     # overview frames (K under gating)
    turns: list[str] = field(default_factory=list)    # assistant turn texts, forced prefix included
    calls: list[list[ToolCall]] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)   # every executed crop
    n_tool_turns: int = 0
    n_calls: int = 0
    tool_failures: int = 0
    truncated: bool = False              # cut by max_new_tokens / max_context
    hit_turn_limit: bool = False         # still calling tools after the forced-answer message
    done: bool = False
    error: str | None = None
    text: str = ""                       # everything after the prompt, as the model saw it
    policy_text: str = ""                # only the sampled tokens (the released ParaVT reward input)
    answer: str | None = None
    latency: float = 0.0
    logprobs: list[float] = field(default_factory=list)   # log p of each POLICY token at sampling time (T = 1)
    parent: tuple[int, int] | None = None   # sub-agents: (caller row, call index)
    subagents: list["Trajectory"] = field(default_factory=list)


# -----------------------------------------------------------------------------
# sampling

def sample_next_token(logits: torch.Tensor, generator: torch.Generator | None, temperature: float,
                      top_p: float) -> int:
    """One token from (V,) logits: greedy when temperature == 0, else temperature + nucleus (top-p)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p      # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def row_seed(seed: int, record_index: int, sample: int) -> int:
    """Explicit per-trajectory seed from (seed, prompt, sample): same inputs => same trajectory."""
    return (seed * 1_000_003 + record_index * 9_176 + sample * 7_919) % (2 ** 62)


# -----------------------------------------------------------------------------
# chunks: a piece of token sequence with its (optional) videos

@dataclass
class Chunk:
    ids: torch.Tensor                    # (l,) long
    mm_types: torch.Tensor               # (l,) int: 0 text, 2 video
    pixels: torch.Tensor | None = None   # (n_patches, patch_dim)
    grid: torch.Tensor | None = None     # (n_videos, 3)


def clip_metadata(clip: video.Clip) -> dict:
    """Processor metadata giving the frames' absolute times: timestamps = frames_indices / fps, so we
    pass fps = 1 and the times themselves (Qwen3-VL prints them as "<20.2 seconds>" per temporal patch)."""
    return {"fps": 1.0, "total_num_frames": len(clip.times), "frames_indices": [float(t) for t in clip.times]}


def encode_chunk(processor, text: str, clips: list[video.Clip] = ()) -> Chunk:
    """Tokenise `text` whose <|video_pad|> placeholders are filled by `clips` (real processor path)."""
    if not clips:
        ids = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return Chunk(ids, torch.zeros_like(ids, dtype=torch.int32))
    out = processor(text=[text], videos=[c.frames for c in clips], return_tensors="pt",
                    videos_kwargs=dict(do_sample_frames=False, do_resize=False,
                                       video_metadata=[clip_metadata(c) for c in clips]))
    return Chunk(out["input_ids"][0], out["mm_token_type_ids"][0].to(torch.int32),
                 out["pixel_values_videos"], out["video_grid_thw"])


def prompt_corpus() -> tuple[str, ...]:
    """The fixed texts every rollout sends (for training the tiny tokenizer: short prompts, fast CPU runs)."""
    header = f"{TOOLS_INTRO}\n{json.dumps(video.CROP_VIDEO_TOOL)}\n{TOOLS_OUTRO}"
    return (SYSTEM_PROMPT, header, SUBAGENT_PROMPT, FORCED_ANSWER, *INSTRUCTIONS.values())


def video_factor(processor) -> int:
    vp = processor.video_processor
    return vp.patch_size * vp.merge_size


def prompt_text(processor, record: dict, tools_block: bool = True) -> str:
    """System + Hermes tools block + the overview video + the question, ending with the assistant tag."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "video", "video": record["video"]},
                                             {"type": "text", "text": format_question(record)}]}]
    return processor.tokenizer.apply_chat_template(messages, tools=[video.CROP_VIDEO_TOOL] if tools_block else None,
                                                   tokenize=False, add_generation_prompt=True)


def load_overview(path: str, duration: float, cfg: RolloutConfig, factor: int, nframes: int | None) -> video.Clip:
    """The overview clip: exactly `nframes` frames (gating) or the fps rule, each frame sized so the whole
    overview costs about 16k visual tokens (Video-o3's budget) unless cfg.overview_max_pixels is set."""
    n = nframes or video.even_count(max(1, round(duration * cfg.overview_fps)), cfg.overview_max_frames)
    max_pixels = cfg.overview_max_pixels or min(768, 16384 // max(1, n // 2)) * factor * factor
    return video.sample_overview(path, fps=cfg.overview_fps, max_frames=cfg.overview_max_frames,
                                 nframes=nframes, max_pixels=max_pixels, factor=factor)


def encode_prompt(processor, record: dict, video_root: str, cfg: RolloutConfig, nframes: int | None = None
                  ) -> tuple[str, float, Chunk, int]:
    """(video path, duration, prompt chunk, overview frame count) of a record: the path checked to stay
    inside video_root, the video probed once. Raises ValueError/OSError/VideoError on a bad record or video."""
    path = resolve_video(video_root, record["video"])
    duration = video.probe(path).duration
    overview = load_overview(path, duration, cfg, video_factor(processor), nframes or cfg.overview_nframes)
    c = encode_chunk(processor, prompt_text(processor, record, cfg.tools_block), [overview])
    return path, duration, c, len(overview.times)


# -----------------------------------------------------------------------------
# the batched KV cache

class KVBatch:
    """Rows sharing one DynamicCache. `mask` (B, L) marks real tokens; `next_pos` (B,) is each row's
    next M-RoPE position; `last_logits` (B, V) the logits after each row's last cached token."""

    def __init__(self, cache, mask, next_pos, last_logits):
        self.cache, self.mask, self.next_pos, self.last_logits = cache, mask, next_pos, last_logits

    @staticmethod
    def empty(model, batch_size: int, device) -> "KVBatch":
        V = model.get_output_embeddings().weight.shape[0]
        return KVBatch(DynamicCache(config=model.config), torch.zeros(batch_size, 0, dtype=torch.long, device=device),
                       torch.zeros(batch_size, dtype=torch.long, device=device),
                       torch.zeros(batch_size, V, device=device))

    def __len__(self):
        return self.mask.shape[0]

    def select(self, idx: list[int]) -> "KVBatch":
        index = torch.tensor(idx, dtype=torch.long, device=self.mask.device)
        cache = DynamicCache()
        for layer in self.cache.layers:
            cache.update(layer.keys.index_select(0, index), layer.values.index_select(0, index), len(cache.layers))
        return KVBatch(cache, self.mask[index], self.next_pos[index], self.last_logits[index])

    def repeat(self, n: int) -> "KVBatch":
        return self.select([i for i in range(len(self)) for _ in range(n)])

    @staticmethod
    def merge(batches: list["KVBatch"]) -> "KVBatch":
        """Concatenate along the batch; shorter rows get masked padding at the end."""
        batches = [b for b in batches if len(b)]
        L = max(b.mask.shape[1] for b in batches)
        pad = lambda t, dim: torch.nn.functional.pad(t, [0, 0] * (t.dim() - dim - 1) + [0, L - t.shape[dim]])
        cache = DynamicCache()
        for li in range(len(batches[0].cache.layers)):
            ks = torch.cat([pad(b.cache.layers[li].keys, 2) for b in batches])
            vs = torch.cat([pad(b.cache.layers[li].values, 2) for b in batches])
            cache.update(ks, vs, li)
        return KVBatch(cache, torch.cat([pad(b.mask, 1) for b in batches]),
                       torch.cat([b.next_pos for b in batches]), torch.cat([b.last_logits for b in batches]))

    @torch.no_grad()
    def extend(self, model, chunks: list[Chunk | None], pad_id: int) -> None:
        """Prefill each row's chunk (None = nothing new) on top of the cache; update last_logits."""
        B, device = len(self), self.mask.device
        lengths = [0 if c is None else len(c.ids) for c in chunks]
        Lc = max(lengths)
        if Lc == 0:
            return
        ids = torch.full((B, Lc), pad_id, dtype=torch.long, device=device)
        types = torch.zeros(B, Lc, dtype=torch.int32, device=device)
        pos = torch.zeros(3, B, Lc, dtype=torch.long, device=device)
        pixels, grids = [], []
        for i, c in enumerate(chunks):
            if c is None or lengths[i] == 0:
                continue
            ids[i, :lengths[i]] = c.ids.to(device)
            types[i, :lengths[i]] = c.mm_types.to(device)
            p = chunk_positions(model, c).to(device) + self.next_pos[i]
            pos[:, i, :lengths[i]] = p
            self.next_pos[i] = p.max() + 1
            if c.pixels is not None:
                pixels.append(c.pixels)
                grids.append(c.grid)
        new_mask = (torch.arange(Lc, device=device)[None] < torch.tensor(lengths, device=device)[:, None]).long()
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        vision = {}
        if pixels:
            dtype = next(model.parameters()).dtype
            vision = dict(pixel_values_videos=torch.cat(pixels).to(device, dtype), video_grid_thw=torch.cat(grids).to(device))
        out = model.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache,
                          mm_token_type_ids=types, use_cache=True, **vision)
        rows = [i for i in range(B) if lengths[i] > 0]
        last = torch.tensor([lengths[i] - 1 for i in rows], device=device)
        hidden = out.last_hidden_state[torch.tensor(rows, device=device), last]      # (rows, D)
        self.last_logits[rows] = model.lm_head(hidden).float()


def chunk_positions(model, c: Chunk) -> torch.Tensor:
    """(3, l) M-RoPE positions of a chunk as if it started at position 0."""
    l = len(c.ids)
    if c.grid is None:
        return torch.arange(l).view(1, -1).expand(3, -1)
    pos, _ = model.model.get_rope_index(c.ids[None], mm_token_type_ids=c.mm_types[None], video_grid_thw=c.grid)
    return pos[:, 0]


# -----------------------------------------------------------------------------
# one assistant turn for a set of rows

@dataclass
class _Row:
    """Mutable state of one trajectory during a rollout (the engine's bookkeeping)."""
    traj: Trajectory
    path: str
    generator: torch.Generator | None
    index: int = 0                       # which record
    seed: int = 0                        # this trajectory's seed (row_seed of seed, record, sample)
    duration: float = 0.0
    pending: list[int] = field(default_factory=list)    # sampled tokens not yet in the cache
    turn_tokens: list[int] = field(default_factory=list)


def decode_turn(model, batch: KVBatch, rows: list[_Row], cfg: RolloutConfig, max_new_tokens: int,
                stop_id: int, pad_id: int, banned: list[int] = ()) -> KVBatch:
    """Sample until every row emits <|im_end|> or hits max_new_tokens. Finished rows leave the decoding
    batch at once; the returned batch has the rows back in their original order. `banned` ids (vision
    placeholders: only the processor may write them) are never sampled; the recorded log-probs are
    those of the unmasked logits, the same numbers a training forward computes."""
    active = list(range(len(rows)))
    parked: list[tuple[list[int], KVBatch]] = []
    sub = batch
    for r in rows:
        r.turn_tokens = []
    for step in range(max_new_tokens):
        finished = []
        for j, i in enumerate(active):
            r = rows[i]
            logits = sub.last_logits[j]
            if banned:
                logits = logits.index_fill(0, torch.tensor(banned, device=logits.device), float("-inf"))
            tok = sample_next_token(logits, r.generator, cfg.temperature, cfg.top_p)
            r.traj.logprobs.append(float(torch.log_softmax(sub.last_logits[j], -1)[tok]))
            r.turn_tokens.append(tok)
            r.traj.token_ids.append(tok)
            r.traj.roles.append(POLICY)
            if tok == stop_id or step == max_new_tokens - 1 or len(r.traj.token_ids) >= cfg.max_context:
                finished.append(j)
                r.pending = [tok]
                r.traj.truncated |= tok != stop_id
        if finished:
            keep = [j for j in range(len(active)) if j not in finished]
            parked.append(([active[j] for j in finished], sub.select(finished)))
            sub = sub.select(keep) if keep else sub
            active = [active[j] for j in keep]
        if not active:
            break
        sub.extend(model, [Chunk(torch.tensor([rows[i].turn_tokens[-1]]), torch.zeros(1, dtype=torch.int32))
                           for i in active], pad_id)
    order = [i for idx, _ in parked for i in idx]
    merged = KVBatch.merge([b for _, b in parked])
    return merged.select([order.index(i) for i in range(len(rows))])


def vision_ids(ids: dict) -> list[int]:
    """Ids of the vision markers and placeholders in `ids` (special_token_ids): the tokens decoding never samples."""
    return [ids[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>") if ids.get(t) is not None]


# -----------------------------------------------------------------------------
# tools

def run_calls(calls: list[ToolCall], path: str, duration: float, cfg: RolloutConfig, factor: int):
    """Execute one turn's calls. Returns, per call, (window or None, clip or None, error text or None).
    The model-written `video_path` argument (ParaVT's schema has one) is ignored: always the sample's video."""
    results = []
    for call in calls:
        if call.error is None and call.name != "crop_video":
            call = ToolCall(call.name, call.arguments, f"unknown tool {call.name!r}; the only tool is crop_video", call.syntax)
        if call.error is not None:
            results.append((None, None, call.error))
            continue
        start, end = call_window(call)
        try:
            s, e = video.check_window(start, end, duration, cfg.min_window if cfg.tool_mode == "interleaved" else 0.0)
            if cfg.tool_mode == "subagent":
                clip = video.crop(path, s, e, level=None, fps=cfg.subagent_fps, max_frames=cfg.subagent_max_frames,
                                  max_pixels=cfg.subagent_max_pixels, tokens_per_pixel_area=factor * factor)
            else:
                level = call.arguments.get("resolution", "medium")
                clip = video.crop(path, s, e, level=level, fps=cfg.crop_fps, max_pixels=cfg.crop_max_pixels,
                                  min_length=cfg.min_window, tokens_per_pixel_area=factor * factor)
            results.append(((s, e), clip, None))
        except (ValueError, video.VideoError) as err:   # a bad window is an observation, not a crash
            results.append((None, None, str(err).replace(path, "the video")))
    return results


def response_chunk_text(parts: list[str], forced: bool) -> str:
    """The user message of tool responses (one block per call, call order) + the next forced prefix."""
    body = "".join(f"\n<tool_response>\n{p}\n</tool_response>" for p in parts)
    if forced:
        body += "\n" + FORCED_ANSWER
    return f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n{THINK_PREFIX}"


def clip_part(window: tuple[float, float]) -> str:
    return f"Clip {window[0]:.1f}-{window[1]:.1f} s:\n<|vision_start|><|video_pad|><|vision_end|>"


@torch.no_grad()
def run_subagents(model, processor, jobs: list[tuple[int, int, video.Clip]], cfg: RolloutConfig,
                  seeds: list[int], ids: dict) -> list[Trajectory]:
    """All sub-agents of a turn as ONE batched generation: prompt = crop + summary instruction."""
    device = next(model.parameters()).device
    messages = [{"role": "user", "content": [{"type": "video", "video": "clip"},
                                             {"type": "text", "text": SUBAGENT_PROMPT}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chunks = [encode_chunk(processor, text, [clip]) for _, _, clip in jobs]
    batch = KVBatch.empty(model, len(jobs), device)
    batch.extend(model, chunks, ids["<|endoftext|>"])
    rows = []
    for (caller, k, clip), c, seed in zip(jobs, chunks, seeds):
        t = Trajectory(record_id="", sample=0, token_ids=c.ids.tolist(), roles=[ENV] * len(c.ids),
                       prompt_len=len(c.ids), videos=[(c.pixels, c.grid)], parent=(caller, k))
        g = None if cfg.temperature <= 0 else torch.Generator().manual_seed(seed)
        rows.append(_Row(t, "", g))
    decode_turn(model, batch, rows, cfg, cfg.subagent_max_new_tokens, ids["<|im_end|>"], ids["<|endoftext|>"],
                vision_ids(ids))
    for r in rows:
        toks = [t for t in r.turn_tokens if t != ids["<|im_end|>"]]
        r.traj.text = processor.tokenizer.decode(toks, skip_special_tokens=True).strip()
        r.traj.done = True
    return [r.traj for r in rows]


# -----------------------------------------------------------------------------
# the rollout

@torch.no_grad()
def run_agent(model, processor, records: list[dict], video_root: str, cfg: RolloutConfig, seed: int = 0,
              nframes: list[int | None] | None = None) -> list[Trajectory]:
    """Roll out `cfg.group_size` samples of each record; returns len(records) * G trajectories, grouped
    by record (record 0's samples first). `nframes[i]` overrides the overview frame count of record i
    (nFrames gating: the same K for the whole group). A record whose video fails to decode gives G
    trajectories with `error` set (counted by the caller), never an exception."""
    t0 = time.time()
    device = next(model.parameters()).device
    ids = special_token_ids(processor)
    stop_id, pad_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    factor = video_factor(processor)
    G = cfg.group_size
    prompts, rows, failed = [], [], []
    for i, rec in enumerate(records):
        try:
            path, duration, c, n = encode_prompt(processor, rec, video_root, cfg, nframes[i] if nframes else None)
        except (ValueError, OSError, video.VideoError) as err:
            failed.append((i, f"{type(err).__name__}: {err}"))
            continue
        prompts.append((i, rec, path, duration, c, n))
    out: dict[int, list[Trajectory]] = {i: [Trajectory(str(records[i].get("id", i)), s, [], [], 0, [], error=msg, done=True)
                                            for s in range(G)] for i, msg in failed}
    if prompts:
        # prefill each prompt once (its overview through the vision tower once), then fork G rows
        batch = KVBatch.empty(model, len(prompts), device)
        batch.extend(model, [p[4] for p in prompts], pad_id)
        batch = batch.repeat(G)
        prefix = encode_chunk(processor, THINK_PREFIX)
        for i, rec, path, duration, c, n in prompts:
            for s in range(G):
                t = Trajectory(str(rec.get("id", i)), s, c.ids.tolist(), [ENV] * len(c.ids), len(c.ids),
                               [(c.pixels, c.grid)], nframes=n)
                rs = row_seed(seed, i, s)
                g = None if cfg.temperature <= 0 else torch.Generator().manual_seed(rs)
                rows.append(_Row(t, path, g, index=i, seed=rs, duration=duration))
        for r in rows:
            r.traj.token_ids += prefix.ids.tolist()
            r.traj.roles += [ENV] * len(prefix.ids)
        batch.extend(model, [prefix] * len(rows), pad_id)
        _turn_loop(model, processor, batch, rows, cfg, ids, factor, seed)
        for r in rows:
            out.setdefault(r.index, []).append(r.traj)
    trajs = [t for i in sorted(out) for t in out[i]]
    for t in trajs:
        _finish(t, processor, ids)
        t.latency = (time.time() - t0) / max(1, len(trajs))
    return trajs


def _turn_loop(model, processor, batch: KVBatch, rows: list[_Row], cfg: RolloutConfig, ids: dict,
               factor: int, seed: int) -> None:
    """Alternate decode_turn and tool execution until every row has answered or hit a limit."""
    stop_id, pad_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    live = list(range(len(rows)))
    for turn in range(cfg.max_turns + 1):
        sub_rows = [rows[i] for i in live]
        batch = decode_turn(model, batch, sub_rows, cfg, cfg.max_new_tokens, stop_id, pad_id, vision_ids(ids))
        tok = processor.tokenizer
        next_live, chunks, sub_jobs = [], {}, []
        results = {}
        for j, i in enumerate(live):
            r = rows[i]
            turn_text = THINK_PREFIX + tok.decode([t for t in r.turn_tokens if t != stop_id], skip_special_tokens=False)
            r.traj.turns.append(turn_text)
            calls_all = parse_tool_calls(turn_text)
            calls = calls_all[:cfg.max_calls_per_turn]
            r.traj.calls.append(calls)
            if r.traj.truncated or not calls_all:
                r.traj.done = True
                continue
            if turn == cfg.max_turns:          # calls after the forced answer are not executed
                r.traj.hit_turn_limit = True
                r.traj.done = True
                continue
            r.traj.n_tool_turns += 1
            r.traj.n_calls += len(calls)
            res = run_calls(calls, r.path, r.duration, cfg, factor)
            if len(calls_all) > len(calls):    # beyond the per-turn cap: one error observation, counted
                res.append((None, None, f"only {cfg.max_calls_per_turn} calls per turn are executed; "
                                         f"{len(calls_all) - len(calls)} were dropped"))
            results[i] = res
            r.traj.tool_failures += sum(err is not None for _, _, err in res)
            r.traj.windows += [w for w, _, err in res if err is None]
            if cfg.tool_mode == "subagent":
                sub_jobs += [(i, k, clip) for k, (w, clip, err) in enumerate(res) if err is None]
            next_live.append((j, i))
        summaries = {}
        if sub_jobs:
            # each sub-agent's seed comes from its caller's seed, the turn and the call index, so a
            # trajectory does not depend on which other records share its batch
            subs = run_subagents(model, processor, sub_jobs, cfg,
                                 [row_seed(rows[i].seed, 10_000 + turn, k) for i, k, _ in sub_jobs], ids)
            for st in subs:
                rows[st.parent[0]].traj.subagents.append(st)
                summaries[st.parent] = st.text
        for j, i in next_live:
            r = rows[i]
            forced = r.traj.n_tool_turns >= cfg.max_turns
            parts, clips = [], []
            for k, (w, clip, err) in enumerate(results[i]):
                if err is not None:
                    parts.append(f"Error: {err}")
                elif cfg.tool_mode == "subagent":
                    parts.append(summaries.get((i, k), ""))
                else:
                    parts.append(clip_part(w))
                    clips.append(clip)
            c = encode_chunk(processor, response_chunk_text(parts, forced), clips)
            c = Chunk(torch.cat([torch.tensor(r.pending), c.ids]), torch.cat([torch.zeros(len(r.pending), dtype=torch.int32), c.mm_types]),
                      c.pixels, c.grid)
            r.traj.token_ids += c.ids[len(r.pending):].tolist()
            r.traj.roles += [ENV] * (len(c.ids) - len(r.pending))
            if c.pixels is not None:
                r.traj.videos.append((c.pixels, c.grid))
            if len(r.traj.token_ids) >= cfg.max_context:
                r.traj.truncated = r.traj.done = True
                continue
            chunks[j] = c
        keep = [j for j, i in next_live if j in chunks]
        if not keep:
            break
        batch = batch.select(keep)
        batch.extend(model, [chunks[j] for j in keep], pad_id)
        live = [live[j] for j in keep]


def _finish(t: Trajectory, processor, ids: dict) -> None:
    """Fill the text views of a finished trajectory."""
    tok = processor.tokenizer
    if not t.token_ids:
        return
    rest = t.token_ids[t.prompt_len:]
    t.text = tok.decode(rest, skip_special_tokens=False)
    policy = [tid for tid, role in zip(t.token_ids[t.prompt_len:], t.roles[t.prompt_len:]) if role == POLICY]
    t.policy_text = tok.decode(policy, skip_special_tokens=False)
    t.answer = extract_answer(t.turns[-1]) if t.turns else None
    t.done = True


# -----------------------------------------------------------------------------
# full-sequence inputs (training forward, and the exactness check of the cache path)

def collate(trajs: list[Trajectory], model, pad_id: int) -> dict:
    """Right-padded model inputs for whole trajectories: input_ids / attention_mask / mm_token_type_ids
    (B, L), position_ids (3, B, L) from get_rope_index over each full sequence, the videos of all rows
    concatenated in row order, and `roles` (B, L) (ENV, POLICY; pads are ENV)."""
    B, L = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    roles = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(3, B, L, dtype=torch.long)
    pixels, grids = [], []
    video_id = model.config.video_token_id
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        roles[i, :n] = torch.tensor(t.roles)
        mask[i, :n] = 1
        for p, g in t.videos:
            pixels.append(p)
            grids.append(g)
        row_grids = torch.cat([g for _, g in t.videos]) if t.videos else None
        types = (ids[i:i + 1, :n] == video_id).int() * 2
        if row_grids is None:
            pos[:, i, :n] = torch.arange(n)
        else:
            pos[:, i, :n] = model.model.get_rope_index(ids[i:i + 1, :n], mm_token_type_ids=types,
                                                       video_grid_thw=row_grids)[0][:, 0]
    out = dict(input_ids=ids, attention_mask=mask, position_ids=pos, roles=roles,
               mm_token_type_ids=(ids == video_id).int() * 2)
    if pixels:
        out.update(pixel_values_videos=torch.cat(pixels), video_grid_thw=torch.cat(grids))
    return out


# -----------------------------------------------------------------------------
# SFT: a recorded trajectory encoded through the same machinery as a rollout

def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(item.get("text", "") for item in content if isinstance(item, dict))


def encode_messages(processor, record: dict, messages: list[dict], video_root: str, cfg: RolloutConfig,
                    nframes: int | None = None) -> Trajectory:
    """Token ids + roles + videos of a recorded trajectory (SPEC 9 trajectory record, messages after the
    prompt). Assistant text is POLICY except the forced "<think>\\n" prefix; tool results are rebuilt by
    the real tool path: a text result (a sub-agent summary) is used verbatim, a video item is cropped by
    `run_calls` exactly as a rollout would. Raises ValueError/VideoError on a bad record or video."""
    factor = video_factor(processor)
    path, duration, c, n = encode_prompt(processor, record, video_root, cfg, nframes)
    t = Trajectory(str(record.get("id", "")), 0, c.ids.tolist(), [ENV] * len(c.ids), len(c.ids),
                   [(c.pixels, c.grid)], nframes=n)
    tok = processor.tokenizer
    add = lambda ids, role: (t.token_ids.extend(ids), t.roles.extend([role] * len(ids)))
    add(encode_chunk(processor, THINK_PREFIX).ids.tolist(), ENV)
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant":
            raise ValueError(f"{record.get('id')}: expected an assistant message at position {i}, got {m['role']!r}")
        text = _content_text(m["content"])
        body = text[len(THINK_PREFIX):] if text.startswith(THINK_PREFIX) else text
        add(tok(body + "<|im_end|>", add_special_tokens=False)["input_ids"], POLICY)
        turn = THINK_PREFIX + body
        t.turns.append(turn)
        calls = parse_tool_calls(turn)
        t.calls.append(calls)
        j = i + 1
        tool_msgs = []
        while j < len(messages) and messages[j]["role"] == "tool":
            tool_msgs.append(messages[j])
            j += 1
        if tool_msgs:
            t.n_tool_turns += 1
            t.n_calls += len(calls)
            if all(isinstance(tm["content"], str) for tm in tool_msgs):
                parts, clips = [tm["content"] for tm in tool_msgs], []
            else:
                parts, clips = [], []
                for w, clip, err in run_calls(calls, path, duration, cfg, factor):
                    parts.append(f"Error: {err}" if err else clip_part(w))
                    t.tool_failures += err is not None
                    if err is None:
                        clips.append(clip)
                        t.windows.append(w)
            forced = t.n_tool_turns >= cfg.max_turns
            rc = encode_chunk(processor, response_chunk_text(parts, forced), clips)
            add(rc.ids.tolist(), ENV)
            if rc.pixels is not None:
                t.videos.append((rc.pixels, rc.grid))
        i = j
    t.text = tok.decode(t.token_ids[t.prompt_len:], skip_special_tokens=False)
    t.answer = extract_answer(t.turns[-1]) if t.turns else None
    t.done = True
    return t
