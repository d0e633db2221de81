"""
The agent's rollout engine: a batched multi-turn decoding loop on the model's own K/V cache, with parallel
`crop_video` calls executed either by sub-agents (ParaVT, arXiv 2605.20342) or as clips interleaved into the
same context (Video-o3, arXiv 2601.23224). The file reads in the order a rollout runs:

    1. settings      RolloutConfig, PRESETS (the papers' recipes), Trajectory
    2. sampling      sample_tokens: temperature, top-p, Gumbel-max with counter-hashed noise (one (B, V) op)
    3. the prompt    system + Hermes tools block + overview video + question -> a kvcache.Chunk
    4. one turn      decode_turn: a batched decode step for the rows still writing
    5. tools         run_calls (parallel crop_video calls -> clips), run_subagents (a turn's calls batched)
    6. the rollout   run_agent -> _turn_loop: prefill, decode, execute the calls, feed the responses, repeat
    7. training I/O  collate, forward_hidden (whole trajectories), encode_messages (recorded SFT trajectories)

Everything works on token sequences. A trajectory is the prompt followed by turns; every token carries a role:
    ENV    prompt, the forced "<think>\n" prefix, tool responses, inserted frames, forced-answer text
    POLICY the model's own sampled tokens (the only ones training ever updates)

How nothing is computed or stored twice (the released code re-templates and re-encodes every frame each turn;
a plain KV cache copies the prompt G times): each record's prompt is prefilled ONCE and its K/V stored ONCE,
the G samples of its group share it, and each row owns only its suffix (kvcache.GroupKV, cascade attention).
Each turn only the new chunk (tool responses, new clips, the next "<think>\n") is prefilled on top of the
row's suffix; M-RoPE positions of a chunk are computed for the chunk alone and shifted by the row's next
position (Qwen-VL positions restart from max+1 after every text or vision span), so a continued turn gives the
same logits as a full recompute (tests/test_rollout.py checks it). Decoding is one batched forward per step and
one host sync (the tokens, for the stop check); rows that finish stop being fed. Training (`forward_hidden`)
runs the vision tower once per distinct overview, not once per sample.

Shapes: positions (3, B, L) for (t, h, w); logits (B, V); the cache's shapes: kvcache.py.
"""
import json
import re
import time
from dataclasses import dataclass, field

import torch

import video
from data import INSTRUCTIONS, content_text, format_question, message_text, resolve_video
from kvcache import Chunk, GroupKV
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
    """Knobs of one rollout; the papers' presets are `PRESETS` below (train.py and eval.py read them)."""
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
    crop_max_frames: int = video.CLIP_MAX_FRAMES   # frames of one crop at most (a long window is sampled sparser)
    crop_max_pixels: int | None = None   # per-frame cap on top of the level quota (tiny default: 64*64)
    min_window: float = 1.0              # interleaved mode: windows shorter than this are errors (docs/method.md §2)
    subagent_fps: float = 1.0
    subagent_max_frames: int = 16
    subagent_max_pixels: int = 224 * 224
    subagent_max_new_tokens: int = 512
    max_context: int = 32768             # a row that would exceed this is cut and flagged
    tools_block: bool = True             # Hermes tools block in the system prompt (real checkpoints expect it)


# Each paper's protocol (docs/method.md §5, §7), shared by train.py and eval.py: `rollout` holds RolloutConfig
# fields, `eval_max_turns` the tool rounds of its evaluation (Video-o3 trains with 6 and evaluates with 8), `train`
# the training flags of train.py (recipe, group, learning rates, clip range, KL, temperature, sampling).
PRESETS = {
    "paravt": dict(
        rollout=dict(tool_mode="subagent", overview_nframes=64, max_turns=3, max_calls_per_turn=5, max_new_tokens=2048),
        eval_max_turns=3,
        train=dict(recipe="para_grpo", group_size=8, prompts_per_step=7, lr=2e-6, sft_lr=1e-5, clip_low=0.2,
                   clip_high=0.2, kl_coef=0.01, kl_estimator="k1", kl_in_reward=1, temperature=0.7, shaping=1,
                   gating=1, dynamic_sampling=0, mask_truncated=0)),
    "videoo3": dict(
        rollout=dict(tool_mode="interleaved", overview_nframes=None, overview_fps=2.0, overview_max_frames=768,
                     max_turns=6, max_calls_per_turn=5, max_new_tokens=2048),
        eval_max_turns=8,
        train=dict(recipe="vtgr", group_size=16, prompts_per_step=32, lr=1e-6, sft_lr=1e-5, clip_low=0.2,
                   clip_high=0.3, kl_coef=0.0, kl_estimator="k3", kl_in_reward=0, temperature=1.0, shaping=0,
                   gating=0, dynamic_sampling=1, mask_truncated=1, anchoring="none")),
}

# The embedded tiny default: small frames and a short prompt, so a 2-core CPU trains it in minutes.
# Without the tools block the system prompt still names the tool; the SFT warm start teaches the format.
TINY_ROLLOUT = dict(overview_nframes=8, overview_max_pixels=64 * 64, crop_fps=1.0, crop_max_frames=16, crop_max_pixels=64 * 64,
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
# sampling: one (B, V) operation per step, on the logits' device

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "hash32" finaliser: xor-shift, multiply by 0x45d9f3b, twice) on int64
    tensors holding values < 2^32; the constant is < 2^27, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1) from a counter-based hash of (row seed, draw index, token id), computed
    on the seeds' device: row b's numbers depend on (seeds[b], counters[b]) only, never on which other
    rows share the batch, and no torch.Generator is involved (a CPU generator cannot drive CUDA draws).
    u = (k + 0.5) / 2**23 with k the hash's top 23 bits: k + 0.5 has at most 24 significant bits, so every
    value is exact in fp32 and u lies in [2**-24, 1 - 2**-24], strictly inside (0, 1); the Gumbel term
    -log(-log u) is then finite (in about [-2.81, 16.64]). With 24 bits, (2**24 - 0.5) / 2**24 rounded up to 1.0."""
    s = seeds.long()
    key = _mix32(_mix32(_mix32(s & _M32) ^ ((s >> 32) & _M32)) ^ (counters.long() & _M32))      # (B,)
    tok = _mix32((torch.arange(vocab, device=seeds.device) * 0x9E3779B1 + 0x7F4A7C15) & _M32)   # (V,)
    x = _mix32(_mix32(key[:, None] ^ tok[None]) ^ key[:, None])                                 # (B, V)
    return ((x >> 9).float() + 0.5) / 2.0 ** 23


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, temperature: float,
                  top_p: float) -> torch.Tensor:
    """(B,) tokens from (B, V) logits, all rows in one operation on the logits' device. Greedy when
    temperature == 0; else softmax(logits / T) restricted to the nucleus (the smallest set of top
    tokens whose mass reaches top_p; the top token always stays), drawn by Gumbel-max:
        token = argmax_v (logits_v / T + g_v),  g_v = -log(-log u_v),  u = uniform_noise(seed, counter)
    which is an exact draw from that distribution (Gumbel 1954; the trick of Maddison et al. 2014).
    A banned token (logit -inf, or outside the nucleus) keeps score -inf whatever its noise, so it is never
    drawn: the noise is finite by construction, and the where() below holds even if it were not (-inf + inf
    would be NaN, which argmax picks)."""
    if temperature <= 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_s, order = scores.sort(-1, descending=True)
        p = torch.softmax(sorted_s, -1)
        drop = p.cumsum(-1) - p >= top_p                   # mass before this token already reaches top_p
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_s.masked_fill(drop, float("-inf")))
    u = uniform_noise(seeds.to(logits.device), counters.to(logits.device), logits.shape[-1])
    noisy = scores - torch.log(-torch.log(u))
    return torch.where(scores == float("-inf"), scores, noisy).argmax(-1)


def row_seed(seed: int, record_index: int, sample: int) -> int:
    """Explicit per-trajectory seed from (seed, prompt, sample): same inputs => same trajectory."""
    return (seed * 1_000_003 + record_index * 9_176 + sample * 7_919) % (2 ** 62)


# -----------------------------------------------------------------------------
# the prompt: a record's text and overview video as a Chunk (kvcache.Chunk)


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


def overview_kwargs(duration: float, cfg: RolloutConfig, factor: int, nframes: int | None) -> dict:
    """`video.sample_overview` arguments of an overview: exactly `nframes` frames (gating) or the fps rule, each
    frame sized so the whole overview costs about 16k visual tokens (Video-o3's budget) unless
    cfg.overview_max_pixels is set."""
    n = nframes or video.even_count(max(1, round(duration * cfg.overview_fps)), cfg.overview_max_frames)
    max_pixels = cfg.overview_max_pixels or min(768, 16384 // max(1, n // 2)) * factor * factor
    return dict(fps=cfg.overview_fps, max_frames=cfg.overview_max_frames, nframes=nframes, max_pixels=max_pixels,
                factor=factor)


def load_overview(path: str, duration: float, cfg: RolloutConfig, factor: int, nframes: int | None,
                  pool: video.DecodePool | None = None) -> video.Clip:
    """The overview clip (overview_kwargs), decoded here or by `pool` (its worker threads and frame cache)."""
    kw = overview_kwargs(duration, cfg, factor, nframes)
    return pool.result(pool.submit_overview(path, **kw)) if pool is not None else video.sample_overview(path, **kw)


def prefetch(pool: video.DecodePool | None, records: list[dict], video_root: str, cfg: RolloutConfig, factor: int,
             nframes: list[int | None] | None = None) -> None:
    """Start decoding the records' overviews into the pool's frame cache in worker threads, so they overlap the
    model (the next step's prompts while this step trains; a step's prompts with each other). A bad record is
    left for the rollout to report."""
    if pool is None or pool.cache is None:
        return
    jobs = []
    for i, rec in enumerate(records):
        try:
            path = resolve_video(video_root, rec["video"])
            k = (nframes[i] if nframes else None) or cfg.overview_nframes
            jobs.append((path, overview_kwargs(video.probe(path).duration, cfg, factor, k)))
        except (ValueError, OSError, KeyError, video.VideoError):
            pass
    pool.prefetch_overviews(jobs)


def encode_prompt(processor, record: dict, video_root: str, cfg: RolloutConfig, nframes: int | None = None,
                  pool: video.DecodePool | None = None) -> tuple[str, float, Chunk, int]:
    """(video path, duration, prompt chunk, overview frame count) of a record: the path checked to stay
    inside video_root, the video probed once. Raises ValueError/OSError/VideoError on a bad record or video."""
    path = resolve_video(video_root, record["video"])
    duration = video.probe(path).duration
    overview = load_overview(path, duration, cfg, video_factor(processor), nframes or cfg.overview_nframes, pool)
    c = encode_chunk(processor, prompt_text(processor, record, cfg.tools_block), [overview])
    return path, duration, c, len(overview.times)


# -----------------------------------------------------------------------------
# one assistant turn for a set of rows (the K/V cache it feeds: kvcache.py)

STATS = {"decode_steps": 0, "host_syncs": 0}   # counted by decode_turn: the bench reports syncs per step

@dataclass
class _Row:
    """Mutable state of one trajectory during a rollout (the engine's bookkeeping)."""
    traj: Trajectory
    path: str
    seed: int = 0                        # this trajectory's seed (row_seed of seed, record, sample)
    index: int = 0                       # which record
    duration: float = 0.0
    pending: list[int] = field(default_factory=list)    # sampled tokens not yet in the cache
    turn_tokens: list[int] = field(default_factory=list)
    forced: bool = False                 # the forced-answer message has been sent


def decode_turn(model, kv: GroupKV, rows: list[_Row], kv_rows: list[int], cfg: RolloutConfig, max_new_tokens: int,
                stop_id: int, banned: list[int] = ()) -> None:
    """Sample until every row emits <|im_end|> or hits max_new_tokens; rows[i] lives in kv row kv_rows[i].
    Each step is one batched forward and one (B, V) sampling op on the device, and ONE host sync (the
    tokens, for the stop check); finished rows leave the step (their cache stays where it is). `banned`
    ids (vision placeholders: only the processor may write them) are never sampled; the recorded
    log-probs are those of the unmasked logits (T = 1), the numbers a training forward computes."""
    device = kv.device
    for r in rows:
        r.turn_tokens = []
    active = list(range(len(rows)))
    seeds = torch.tensor([r.seed for r in rows], device=device)
    draws = torch.tensor([len(r.traj.logprobs) for r in rows], device=device)   # the counter of each row's stream
    ban = torch.tensor(list(banned), dtype=torch.long, device=device) if banned else None
    sel = torch.arange(len(rows), device=device)          # positions in `rows` of the active rows
    idx = kv.index([kv_rows[i] for i in active])
    recorded = []                                         # (active rows, (n,) log-probs on the device) per step
    for step in range(max_new_tokens):
        logits = kv.last_logits if idx.all_rows else kv.last_logits[idx.rows]       # (n, V)
        masked = logits.index_fill(1, ban, float("-inf")) if ban is not None else logits
        tok = sample_tokens(masked, seeds[sel], draws[sel] + step, cfg.temperature, cfg.top_p)
        recorded.append((active, torch.log_softmax(logits.float(), -1).gather(1, tok[:, None])[:, 0]))
        toks = tok.tolist()                                                          # the step's host sync
        STATS["decode_steps"] += 1
        STATS["host_syncs"] += 1
        keep = []
        for j, (i, t) in enumerate(zip(active, toks)):
            r = rows[i]
            r.turn_tokens.append(t)
            r.traj.token_ids.append(t)
            r.traj.roles.append(POLICY)
            if t == stop_id or step == max_new_tokens - 1 or len(r.traj.token_ids) >= cfg.max_context:
                r.pending = [t]
                r.traj.truncated |= t != stop_id
            else:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(active):                      # rows left: new index tensors (no cache moves)
            active = [active[j] for j in keep]
            kj = torch.tensor(keep, device=device)
            sel, tok = sel[kj], tok[kj]
            idx = kv.index([kv_rows[i] for i in active])
        kv.step(model, idx, tok)
    if recorded:                                         # the turn's log-probs: one transfer
        flat = torch.cat([lp for _, lp in recorded]).tolist()
        k = 0
        for act, lp in recorded:
            for i in act:
                rows[i].traj.logprobs.append(flat[k])
                k += 1


def vision_ids(ids: dict) -> list[int]:
    """Ids of the vision markers and placeholders in `ids` (special_token_ids): the tokens decoding never samples."""
    return [ids[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>") if ids.get(t) is not None]


# -----------------------------------------------------------------------------
# tools

def run_calls(calls: list[ToolCall], path: str, duration: float, cfg: RolloutConfig, factor: int,
              pool: video.DecodePool | None = None):
    """Execute one turn's calls. Returns, per call, (window or None, clip or None, error text or None).
    With a pool the turn's parallel calls decode at once in its worker threads. The model-written
    `video_path` argument (ParaVT's schema has one) is ignored: always the sample's video."""
    jobs = []                                   # (window, pending crop: a future or crop kwargs) or an error
    for call in calls:
        if call.error is None and call.name != "crop_video":
            call = ToolCall(call.name, call.arguments, f"unknown tool {call.name!r}; the only tool is crop_video", call.syntax)
        if call.error is not None:
            jobs.append((None, None, call.error))
            continue
        start, end = call_window(call)
        try:
            s, e = video.check_window(start, end, duration, cfg.min_window if cfg.tool_mode == "interleaved" else 0.0)
        except ValueError as err:               # a bad window is an observation, not a crash
            jobs.append((None, None, str(err).replace(path, "the video")))
            continue
        if cfg.tool_mode == "subagent":
            kw = dict(level=None, fps=cfg.subagent_fps, max_frames=cfg.subagent_max_frames,
                      max_pixels=cfg.subagent_max_pixels, tokens_per_pixel_area=factor * factor)
        else:
            kw = dict(level=call.arguments.get("resolution", "medium"), fps=cfg.crop_fps, max_frames=cfg.crop_max_frames,
                      max_pixels=cfg.crop_max_pixels,
                      min_length=cfg.min_window, tokens_per_pixel_area=factor * factor)
        jobs.append(((s, e), pool.submit_crop(path, s, e, **kw) if pool is not None else kw, None))
    results = []
    for w, job, err in jobs:
        if err is not None:
            results.append((None, None, err))
            continue
        try:
            clip = pool.result(job) if pool is not None else video.crop(path, *w, **job)
            results.append((w, clip, None))
        except (ValueError, video.VideoError) as err:
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
    kv = GroupKV(model, list(range(len(jobs))), device)    # each sub-agent is its own prompt
    kv.extend(model, list(range(len(jobs))), chunks, ids["<|endoftext|>"], prefix=True)
    kv.fork()
    rows = []
    for (caller, k, clip), c, seed in zip(jobs, chunks, seeds):
        t = Trajectory(record_id="", sample=0, token_ids=c.ids.tolist(), roles=[ENV] * len(c.ids),
                       prompt_len=len(c.ids), videos=[(c.pixels, c.grid)], parent=(caller, k))
        rows.append(_Row(t, "", seed))
    decode_turn(model, kv, rows, list(range(len(rows))), cfg, cfg.subagent_max_new_tokens, ids["<|im_end|>"],
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
              nframes: list[int | None] | None = None, pool: video.DecodePool | None = None,
              on_turn=None) -> list[Trajectory]:
    """Roll out `cfg.group_size` samples of each record; returns len(records) * G trajectories, grouped
    by record (record 0's samples first). `nframes[i]` overrides the overview frame count of record i
    (nFrames gating: the same K for the whole group). A record whose video fails to decode gives G
    trajectories with `error` set (counted by the caller), never an exception. `pool`: overviews and crops
    decode in its worker threads (every overview of the call at once, through its frame cache).
    `on_turn(traj, responses)`: called as each assistant turn completes (a listener, e.g. eval.py --video
    printing the turns): `traj.turns[-1]` is the turn, `responses` the tool response texts it got (call
    order), or None when the turn ended the trajectory."""
    t0 = time.time()
    device = next(model.parameters()).device
    ids = special_token_ids(processor)
    stop_id, pad_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    factor = video_factor(processor)
    G = cfg.group_size
    prompts, rows, failed = [], [], []
    prefetch(pool, records, video_root, cfg, factor, nframes)
    for i, rec in enumerate(records):
        try:
            path, duration, c, n = encode_prompt(processor, rec, video_root, cfg, nframes[i] if nframes else None, pool)
        except (ValueError, OSError, video.VideoError) as err:
            failed.append((i, f"{type(err).__name__}: {err}"))
            continue
        prompts.append((i, rec, path, duration, c, n))
    out: dict[int, list[Trajectory]] = {i: [Trajectory(str(records[i].get("id", i)), s, [], [], 0, [], error=msg, done=True)
                                            for s in range(G)] for i, msg in failed}
    if prompts:
        # prefill each prompt and the forced "<think>\n" once (its overview through the vision tower once,
        # its K/V stored once), then fork G rows that share it
        kv = GroupKV(model, [p for p in range(len(prompts)) for _ in range(G)], device)
        prefix = encode_chunk(processor, THINK_PREFIX)
        kv.extend(model, list(range(len(prompts))), [Chunk(torch.cat([c.ids, prefix.ids]), torch.cat([c.mm_types, prefix.mm_types]),
                                                           c.pixels, c.grid) for *_, c, _ in prompts], pad_id, prefix=True)
        kv.fork()
        for i, rec, path, duration, c, n in prompts:
            for s in range(G):
                t = Trajectory(str(rec.get("id", i)), s, c.ids.tolist() + prefix.ids.tolist(),
                               [ENV] * (len(c.ids) + len(prefix.ids)), len(c.ids), [(c.pixels, c.grid)], nframes=n)
                rows.append(_Row(t, path, row_seed(seed, i, s), index=i, duration=duration))
        _turn_loop(model, processor, kv, rows, cfg, ids, factor, pool, on_turn)
        for r in rows:
            out.setdefault(r.index, []).append(r.traj)
    trajs = [t for i in sorted(out) for t in out[i]]
    for t in trajs:
        _finish(t, processor, ids)
        t.latency = (time.time() - t0) / max(1, len(trajs))
    return trajs


def _turn_loop(model, processor, kv: GroupKV, rows: list[_Row], cfg: RolloutConfig, ids: dict, factor: int,
               pool: video.DecodePool | None = None, on_turn=None) -> None:
    """Alternate decode_turn and tool execution until every row has answered or hit a limit.

    The tool-turn budget: calls are executed in at most cfg.max_turns turns; the response to the last of them
    carries the forced-answer message. Calls made once the budget is spent are not executed: with a budget of 0
    the first turn's calls get the forced-answer message alone (one more turn to answer from the overview),
    and calls after the forced-answer message end the trajectory (hit_turn_limit)."""
    stop_id, pad_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    live = list(range(len(rows)))
    for turn in range(cfg.max_turns + 2):
        decode_turn(model, kv, [rows[i] for i in live], live, cfg, cfg.max_new_tokens, stop_id, vision_ids(ids))
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
            if r.traj.n_tool_turns >= cfg.max_turns:   # the budget is spent: calls are not executed
                if r.forced:
                    r.traj.hit_turn_limit = True
                    r.traj.done = True
                    continue
                results[i] = []                          # budget 0: the forced-answer message alone
                next_live.append((j, i))
                continue
            r.traj.n_tool_turns += 1
            r.traj.n_calls += len(calls)
            res = run_calls(calls, r.path, r.duration, cfg, factor, pool)
            if len(calls_all) > len(calls):    # beyond the per-turn cap: one error observation, counted
                res.append((None, None, f"only {cfg.max_calls_per_turn} calls per turn are executed; "
                                         f"{len(calls_all) - len(calls)} were dropped"))
            results[i] = res
            r.traj.tool_failures += sum(err is not None for _, _, err in res)
            r.traj.windows += [w for w, _, err in res if err is None]
            if cfg.tool_mode == "subagent":
                sub_jobs += [(i, k, clip) for k, (w, clip, err) in enumerate(res) if err is None]
            next_live.append((j, i))
        for i in live if on_turn is not None else ():      # the listener: turns that ended their trajectory
            if rows[i].traj.done:
                on_turn(rows[i].traj, None)
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
            forced = r.forced = r.traj.n_tool_turns >= cfg.max_turns
            parts, clips = [], []
            for k, (w, clip, err) in enumerate(results[i]):
                if err is not None:
                    parts.append(f"Error: {err}")
                elif cfg.tool_mode == "subagent":
                    parts.append(summaries.get((i, k), ""))
                else:
                    parts.append(clip_part(w))
                    clips.append(clip)
            if on_turn is not None:                          # the listener: a turn and its tool responses
                on_turn(r.traj, parts)
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
        live = [live[j] for j in keep]
        kv.extend(model, live, [chunks[j] for j in keep], pad_id)


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

def collate(trajs: list[Trajectory], model, pad_id: int, share_videos: bool = False) -> dict:
    """Right-padded model inputs for whole trajectories: input_ids / attention_mask / mm_token_type_ids
    (B, L), position_ids (3, B, L) from get_rope_index over each full sequence, the videos of all rows
    concatenated in row order, and `roles` (B, L) (ENV, POLICY; pads are ENV).
    share_videos=True (for `forward_hidden`): pixel_values_videos / video_grid_thw hold each distinct
    video ONCE (the G samples of a prompt share its overview tensor) and `video_index` (n_videos,) gives,
    for every video in row order (one per grid row: a turn's parallel clips are one entry of several
    videos), its index among the distinct ones."""
    B, L = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    roles = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(3, B, L, dtype=torch.long)
    pixels, grids, index, seen, n_videos = [], [], [], {}, 0
    video_id = model.config.video_token_id
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        roles[i, :n] = torch.tensor(t.roles)
        mask[i, :n] = 1
        for p, g in t.videos:
            key = (p.data_ptr(), tuple(p.shape), tuple(p.stride()), tuple(g.flatten().tolist())) if share_videos else len(pixels)
            if key not in seen:              # an entry holds one video per grid row (a turn's parallel clips)
                seen[key] = n_videos
                pixels.append(p)
                grids.append(g)
                n_videos += len(g)
            index += range(seen[key], seen[key] + len(g))
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
        if share_videos:
            out["video_index"] = torch.tensor(index, dtype=torch.long)
    return out


def forward_hidden(model, batch: dict) -> torch.Tensor:
    """(B, L, D) last hidden states of a `collate(..., share_videos=True)` batch (without `roles`): the
    vision tower runs once per DISTINCT video (once per prompt, not G times), and its features (and
    deepstack features) are handed to every row that shows that video. The same numbers as
    `model.model(**batch).last_hidden_state` on the unshared batch; gradients of a shared video sum
    over its rows, as they would for G separate copies."""
    kw = dict(batch)
    index = kw.pop("video_index", None)
    if index is None or "pixel_values_videos" not in kw:
        return model.model(**kw, use_cache=False).last_hidden_state
    order = index.tolist()
    inner = model.model.get_video_features

    def shared(pixel_values_videos, video_grid_thw=None, **k):     # runs inside model.model's forward (FSDP hooks)
        feats = inner(pixel_values_videos, video_grid_thw, **k)
        feats.pooler_output = tuple(feats.pooler_output[j] for j in order)
        feats.deepstack_features = [tuple(layer[j] for j in order) for layer in feats.deepstack_features]
        return feats

    model.model.get_video_features = shared
    try:
        return model.model(**kw, use_cache=False).last_hidden_state
    finally:
        del model.model.get_video_features


# -----------------------------------------------------------------------------
# SFT: a recorded trajectory encoded through the same machinery as a rollout


def _tool_results(message: dict) -> list | None:
    """The results a message carries back to the policy: a `tool` message is one result (text, or a video item
    to crop); a `user` message of <tool_response> blocks is one result per block (the papers' data). None: not a
    tool result."""
    content = message.get("content")
    if message["role"] == "tool":
        has_video = isinstance(content, list) and any(isinstance(x, dict) and x.get("type") == "video" for x in content)
        return [None] if has_video else [content_text(content)]
    if message["role"] == "user":
        text = content_text(content)
        blocks = [b.strip("\n") for b in re.findall(r"<tool_response>(.*?)</tool_response>", text, re.S)]
        return blocks or None
    return None


def encode_messages(processor, record: dict, messages: list[dict], video_root: str, cfg: RolloutConfig,
                    nframes: int | None = None) -> Trajectory:
    """Token ids + roles + videos of a recorded trajectory (docs/method.md §9 trajectory record, messages after the
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
    while i < len(messages) and messages[i]["role"] in ("system", "user") and _tool_results(messages[i]) is None:
        i += 1                             # a recorded prompt: the record's own fields rebuild it
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant":
            raise ValueError(f"{record.get('id')}: expected an assistant message at position {i}, got {m['role']!r}")
        text = message_text(m)
        body = text[len(THINK_PREFIX):] if text.startswith(THINK_PREFIX) else text
        add(tok(body + "<|im_end|>", add_special_tokens=False)["input_ids"], POLICY)
        turn = THINK_PREFIX + body
        t.turns.append(turn)
        calls = parse_tool_calls(turn)
        t.calls.append(calls)
        j, results = i + 1, []
        while j < len(messages) and (r := _tool_results(messages[j])) is not None:
            results += r
            j += 1
        if results:
            t.n_tool_turns += 1
            t.n_calls += len(calls)
            if all(isinstance(r, str) for r in results):
                parts, clips = results, []
            else:
                parts, clips = [], []
                for w, clip, err in run_calls(calls, path, duration, cfg, factor):
                    parts.append(f"Error: {err}" if err else clip_part(w))
                    t.tool_failures += err is not None
                    if err is None:
                        clips.append(clip)
                        t.windows.append(w)
            # the forced-answer request only where a rollout would send it: the limit reached and the recording
            # ends with the next turn (a longer recorded trajectory, e.g. Video-o3's 8 turns, goes on as recorded)
            goes_on = any(_tool_results(x) is not None for x in messages[j:])
            forced = t.n_tool_turns >= cfg.max_turns and not goes_on
            rc = encode_chunk(processor, response_chunk_text(parts, forced), clips)
            add(rc.ids.tolist(), ENV)
            if rc.pixels is not None:
                t.videos.append((rc.pixels, rc.grid))
        elif calls and j < len(messages) and t.n_tool_turns >= cfg.max_turns:
            # calls with the budget spent and an answer recorded after them: the rollout's forced-answer message
            add(encode_chunk(processor, response_chunk_text([], True)).ids.tolist(), ENV)
        i = j
    t.text = tok.decode(t.token_ids[t.prompt_len:], skip_special_tokens=False)
    t.answer = extract_answer(t.turns[-1]) if t.turns else None
    t.done = True
    return t
