"""
The agent's rollout engine: batched multi-turn decoding on a paged K/V cache under a memory budget, with parallel
`crop_video` calls executed either by sub-agents (ParaVT, arXiv 2605.20342) or as clips interleaved into the
same context (Video-o3, arXiv 2601.23224). The file reads in the order a rollout runs:

    1. settings      RolloutConfig (the presets are in recipes.py), Trajectory
    2. sampling      sample_tokens: temperature, top-p, Gumbel-max with counter-hashed noise (one (B, V) op); draw:
                     a decode step's tokens (and log-probs), read to the host in one sync
    3. the prompt    system + Hermes tools block + overview video + question -> a kvcache.Chunk
    4. tools         run_calls (a turn's parallel crop_video calls -> clips), tool_response_parts (the tool
                     responses' text, for a rollout and a recorded trajectory alike), turn_outcome (the rules of a
                     turn's end: which calls run, the turn budget, the forced answer; for both too)
    5. memory        row_blocks (a row's worst case, in pool blocks), safe (the banker's rule), split_group; the
                     budget itself: kvcache.memory_budget (--rollout-memory-gb); the engine's: pool_blocks, stays_safe
    6. the engine    ToolEnv (the tool threads' work), Engine: admit -> step -> retire over kvcache.GroupKV;
                     run_subagents; run_agent. Each row records digests of what it fed (Trajectory.digests)
    7. training I/O  collate, behaviour_logprobs (whole trajectories; policy.py runs them; collate checks the
                     digests: the one policy contract, contract.py); a recorded SFT trajectory goes through the
                     same pieces in sft.encode_messages

Everything works on token sequences. A trajectory is the prompt followed by turns; every token carries a role:
    ENV    prompt, the forced "<think>\n" prefix, tool responses, inserted frames, forced-answer text
    POLICY the model's own sampled tokens (the only ones training ever updates)

How nothing is computed or stored twice (the released code re-templates and re-encodes every frame each turn;
a plain KV cache copies the prompt G times): each record's prompt is prefilled ONCE and its K/V stored ONCE,
the G samples of its group share it, and each row owns only its suffix (kvcache.GroupKV, cascade attention).
Each turn only the new chunk (tool responses, new clips, the next "<think>\n") is prefilled on top of the
row's suffix; M-RoPE positions of a chunk are computed for the chunk alone and shifted by the row's next
position (Qwen-VL positions restart from max+1 after every text or vision span), so a continued turn gives the
same logits as a full recompute (tests/test_rollout.py checks it). Training (`policy.shared_video_hidden_states`)
runs the vision tower once per distinct overview, not once per sample.

The scheduler (continuous batching, as vLLM's, with a banker's rule): a row is granted the blocks its current
turn may take only while every admitted group could still reach its worst case (its prompt + `row_blocks` per
row) in some order (`safe`); the rest waits. Each decode step is one batched forward and one read of the sampled
tokens to the host, for the stop check (runtime.HostSyncCounter measures it). A row whose turn ends leaves the step at once; its tools run in the
engine's tool threads while the other rows decode, and its response chunk joins a later step (as do sub-agents and
newly admitted groups), instead of the batch waiting for its longest row or its slowest crop; a finished row
returns its pool blocks at once. A row's tokens depend only on its seed
and draw counter, so the budget changes when a row runs, never what it samples.

Shapes: positions (3, B, L) for (t, h, w); logits (B, V); the cache's shapes: kvcache.py.
"""
import dataclasses
import json
import time
import warnings
from collections import deque
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

import contract
import kvcache
import recipes
import video
from data import INSTRUCTIONS, format_question, resolve_video
from kvcache import Chunk, GroupKV, assistant_turns, blocks_for, kv_bytes_per_token, row_blocks, safe, split_group
from model import TOOLS_INTRO, TOOLS_OUTRO, special_token_ids
from ops import sample_tokens
from rewards import ToolCall, call_window, extract_answer, parse_tool_calls

ENV, POLICY = 0, 1
THINK_PREFIX = "<think>\n"
SYSTEM_PROMPT = ("You answer questions about a long video. You see a sparse overview of it; to look closer at a "
                 "time window, call crop_video (several calls in one turn run in parallel). Think inside "
                 "<think></think>, then either call tools or give the final answer inside <answer></answer>.")
SUBAGENT_PROMPT = "Describe briefly what this video segment shows: objects, their colours, and when they appear."
FORCED_ANSWER = "You have used all your tool turns. Give your final answer now inside <answer></answer>, without tool calls."


P = recipes.TINY_PROTOCOL


@dataclass
class RolloutConfig:
    """Knobs of one rollout. Defaults: the tiny preset's protocol (recipes.TINY_PROTOCOL, what `python train.py`
    runs; the tiny model's 64 x 64 frames, recipes.TINY_FRAMES, come on top where the model is tiny); each preset
    sets every field (recipes.PRESETS, read by train.py and eval.py)."""
    tool_mode: str = P["tool_mode"]                  # "interleaved" (Video-o3) | "subagent" (ParaVT)
    max_turns: int = P["max_turns"]                  # tool rounds before the forced answer
    max_calls_per_turn: int = P["max_calls_per_turn"]
    max_new_tokens: int = P["max_new_tokens"]        # per assistant turn
    temperature: float = P["temperature"]            # 0 = greedy
    top_p: float = P["top_p"]
    group_size: int = P["group_size"]
    overview_fps: float = P["overview_fps"]
    overview_max_frames: int = P["overview_max_frames"]
    overview_nframes: int | None = P["overview_nframes"]        # exactly K frames (nFrames gating); None = fps rule
    overview_max_pixels: int | None = P["overview_max_pixels"]  # per frame; None = overview_tokens over the overview
    overview_tokens: int = P["overview_tokens"]      # visual tokens of the whole overview without a per-frame cap
    crop_fps: float = P["crop_fps"]
    crop_max_frames: int = P["crop_max_frames"]      # frames of one crop at most (a long window is sampled sparser)
    crop_max_pixels: int | None = P["crop_max_pixels"]   # per-frame cap on top of the level quota
    min_window: float = P["min_window"]              # interleaved mode: shorter windows are errors (docs/method.md §2)
    subagent_fps: float = P["subagent_fps"]
    subagent_max_frames: int = P["subagent_max_frames"]
    subagent_max_pixels: int = P["subagent_max_pixels"]
    subagent_max_new_tokens: int = P["subagent_max_new_tokens"]
    max_context: int = P["max_context"]              # tokens a row may hold; one that reaches it is cut and flagged
    tools_block: bool = P["tools_block"]             # Hermes tools block in the system prompt (real checkpoints)
    record_logprobs: bool = P["record_logprobs"]     # Trajectory.logprobs at sampling time (the decoupled loss,
                                                     # the mismatch figures, tis / mis): a logsumexp a decode step
    memory_budget_bytes: int | None = None           # K/V the engine may hold (--rollout-memory-gb); None: memory_budget()
    exact_policy: bool = P["exact_policy"]           # the exact mode: log-probs the trainer's bit for bit (ops.py §4)

    @classmethod
    def of(cls, values: dict, **overrides) -> "RolloutConfig":
        """The config of a settings dict (recipes.preset_values, a resolved run's vars) with `overrides`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"RolloutConfig has no field {unknown}")
        return cls(**{**{k: v for k, v in values.items() if k in names}, **overrides})


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
    draws: int = 0                       # tokens sampled (the sampler's draw counter: POLICY tokens, in order)
    logprobs: list[float] = field(default_factory=list)   # cfg.record_logprobs: log p_T of each POLICY token at
                                                          # sampling time; else empty
    versions: list[int] = field(default_factory=list)     # async_rl.py: the policy version of each assistant turn
    parent: tuple[int, int] | None = None   # sub-agents: (caller row, call index)
    subagents: list["Trajectory"] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)      # one per fed segment (turn), contract.py; collate checks them


# -----------------------------------------------------------------------------
# sampling (the kernel, one (B, V) operation a step: ops.sample_tokens) and the seeds

def row_seed(seed: int, record_index: int, sample: int) -> int:
    """Explicit per-trajectory seed from (seed, prompt, sample): same inputs => same trajectory."""
    return (seed * 1_000_003 + record_index * 9_176 + sample * 7_919) % (2 ** 62)


def sampled_logprobs(logits: torch.Tensor, tok: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) fp32 log p_T(tok) of (n, V) logits, as a training forward takes it (T = 1 when 0, greedy):
        z = logits / T,   log p_T(tok) = z_tok - logsumexp_v z_v        (no (n, V) log_softmax written)"""
    z = logits.float() / (temperature or 1.0)
    return z.gather(1, tok[:, None])[:, 0] - torch.logsumexp(z, -1)


def draw(logits: torch.Tensor, ban: torch.Tensor | None, seeds: torch.Tensor, counters: torch.Tensor,
         cfg: "RolloutConfig") -> tuple[torch.Tensor, list, list | None]:
    """A decode step's draw from logits (n, V), the `ban` ids never drawn: (tokens (n,), their values, their
    log-probs or None), read to the host in one sync. The log-probs (cfg.record_logprobs): `sampled_logprobs` of
    the unmasked logits."""
    masked = logits.index_fill(1, ban, float("-inf")) if ban is not None else logits
    tok = sample_tokens(masked, seeds, counters, cfg.temperature, cfg.top_p)
    if not cfg.record_logprobs:
        return tok, tok.tolist(), None                                      # the step's one host sync
    lp = sampled_logprobs(logits, tok, cfg.temperature)
    return tok, *torch.stack([tok.double(), lp.double()]).tolist()         # the step's one host sync


# -----------------------------------------------------------------------------
# the prompt: a record's text and overview video as a Chunk (kvcache.Chunk)


def clip_metadata(clip: video.Clip) -> dict:
    """Processor metadata for the frames' true times: timestamps = frames_indices / fps, with fps 1 and the times."""
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


def prompt_text(processor, record: dict, tools_block: bool) -> str:
    """System + Hermes tools block + the overview video + the question, ending with the assistant tag."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "video", "video": record["video"]},
                                             {"type": "text", "text": format_question(record)}]}]
    return processor.tokenizer.apply_chat_template(messages, tools=[video.CROP_VIDEO_TOOL] if tools_block else None,
                                                   tokenize=False, add_generation_prompt=True)


def overview_kwargs(duration: float, cfg: RolloutConfig, factor: int, nframes: int | None) -> dict:
    """`video.sample_overview` arguments of an overview: exactly `nframes` frames (gating) or the fps rule, each
    frame sized so the whole overview costs at most cfg.overview_tokens visual tokens (Video-o3's 16k; its preset
    12,288) unless cfg.overview_max_pixels is set."""
    n = nframes or video.even_count(max(1, round(duration * cfg.overview_fps)), cfg.overview_max_frames)
    max_pixels = cfg.overview_max_pixels or min(768, cfg.overview_tokens // max(1, n // 2)) * factor * factor
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


def tool_response_parts(results: list, summaries: dict[int, str] | None = None) -> tuple[list[str], list]:
    """(parts, clips) of a turn's tool responses, from run_calls' results (window, clip, error) in call order:
    each part is "Error: <error>" for a failed call, else the sub-agent's summary text where `summaries` is given
    (subagent mode: summaries by call index, "" for a missing one), else the clip's part (clip_part); `clips`
    the clips those parts show, in order. The rollout (Engine.respond) and a recorded trajectory
    (sft.encode_messages) both build their responses here; response_chunk_text wraps the parts."""
    parts, clips = [], []
    for k, (w, clip, err) in enumerate(results):
        if err is not None:
            parts.append(f"Error: {err}")
        elif summaries is not None:
            parts.append(summaries.get(k, ""))
        else:
            parts.append(clip_part(w))
            clips.append(clip)
    return parts, clips


# -----------------------------------------------------------------------------
# a turn's end: the tool protocol's rules (docs/method.md §2, "Turn budget")

@dataclass(frozen=True)
class TurnOutcome:
    """What the end of an assistant turn does (turn_outcome)."""
    calls: list[ToolCall]        # the turn's calls up to max_calls_per_turn (recorded with the turn)
    dropped: int                 # calls past that cap: not run, one error observation says how many
    executes: bool               # `calls` run: a tool turn (counted in n_tool_turns)
    forced: bool                 # the response carries the forced-answer message
    done: bool                   # the trajectory ends with this turn
    hit_turn_limit: bool         # it ends calling tools after the forced-answer message


def turn_outcome(calls: list[ToolCall], tool_turns: int, forced_sent: bool, truncated: bool, max_turns: int,
                 max_calls_per_turn: int) -> TurnOutcome:
    """What the end of an assistant turn does, from its parsed `calls`, the `tool_turns` executed before it, whether
    the forced-answer message was sent already and whether the turn was cut (max_new_tokens, max_context):
      1. a cut turn, or one without calls, ends the trajectory;
      2. at most max_calls_per_turn calls of a turn run; the rest are dropped (one error observation counts them);
      3. calls run in at most max_turns turns, and the response to the last of them carries the forced-answer message;
      4. calls made once the budget is spent do not run: the forced-answer message answers them alone (budget 0:
         one more turn, to answer from the overview); calls after that message end the trajectory (hit_turn_limit).
    The rollout (Engine.end_turn) and a recorded trajectory (sft.encode_messages) both follow it."""
    kept = calls[:max_calls_per_turn]
    if truncated or not calls:
        return TurnOutcome(kept, 0, executes=False, forced=False, done=True, hit_turn_limit=False)
    if tool_turns >= max_turns:
        return TurnOutcome(kept, 0, executes=False, forced=not forced_sent, done=forced_sent, hit_turn_limit=forced_sent)
    return TurnOutcome(kept, len(calls) - len(kept), executes=True, forced=tool_turns + 1 >= max_turns, done=False,
                       hit_turn_limit=False)


# -----------------------------------------------------------------------------
# the engine: a scheduler over the paged cache (kvcache.GroupKV)

class ToolEnv:
    """The environment's side of a turn, done in the engine's tool threads (it reads no engine state): a turn's calls
    run (run_calls) and what the environment says encoded by the processor (tool responses, sub-agents' prompts),
    pixels in the model's dtype."""

    def __init__(self, processor, cfg: RolloutConfig, factor: int, dtype: torch.dtype, pool: video.DecodePool | None):
        self.processor, self.cfg, self.factor, self.dtype, self.pool = processor, cfg, factor, dtype, pool
        self.hashes = {} if contract.RECORD else None   # pixel digests by tensor (contract.pixel_digest)
        self.sub_text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video", "video": "clip"}, {"type": "text", "text": SUBAGENT_PROMPT}]}],
            tokenize=False, add_generation_prompt=True)

    def stored(self, c: Chunk) -> Chunk:
        """c with its pixels in the model's dtype: the values the model sees, kept by the trajectory once (their
        digest taken here, in the tool threads, when the engine records: contract.pixel_digest)."""
        if c.pixels is not None and c.pixels.dtype != self.dtype:
            c = Chunk(c.ids, c.mm_types, c.pixels.to(self.dtype), c.grid)
        if self.hashes is not None:
            contract.pixel_digest(c.pixels, self.hashes)
        return c

    def subagent_chunk(self, clip: video.Clip) -> Chunk:
        return self.stored(encode_chunk(self.processor, self.sub_text, [clip]))

    def response_chunk(self, parts: list[str], clips: list, forced: bool) -> Chunk:
        return self.stored(encode_chunk(self.processor, response_chunk_text(parts, forced), clips))

    def run(self, calls: list[ToolCall], dropped: int, path: str, duration: float, forced: bool) -> tuple:
        """One turn's tool work: (results, made). results: run_calls' (window, clip, error) per call in call order, +
        one error observation on the `dropped` calls past the cap. made: interleaved mode, the response chunk;
        sub-agent mode, the sub-agents' prompt chunks {call index: chunk} of the calls that gave a clip."""
        results = run_calls(calls, path, duration, self.cfg, self.factor, self.pool)
        if dropped:
            results.append((None, None, f"only {self.cfg.max_calls_per_turn} calls per turn are executed; "
                                        f"{dropped} were dropped"))
        if self.cfg.tool_mode == "subagent":
            return results, {k: self.subagent_chunk(clip) for k, (_, clip, err) in enumerate(results) if err is None}
        return results, self.response_chunk(*tool_response_parts(results), forced)


TOOL_WORKERS = 4   # threads of an engine's tool work (its own: a job waits on its crops in the DecodePool's threads)


@dataclass(eq=False)
class _Row:
    """Mutable state of one trajectory during a rollout (the engine's bookkeeping)."""
    traj: Trajectory
    path: str
    seed: int = 0                        # this trajectory's seed (row_seed of seed, record, sample)
    index: int = 0                       # which record
    duration: float = 0.0
    order: int = 0                       # its place among the rollout's rows (its sub-agents' `parent`)
    max_new: int = 0                     # tokens one turn may write
    tools: bool = True                   # False: one turn, no tools (a sub-agent, a plain generation)
    caller: "_Row | None" = None         # a sub-agent's caller, and which of its calls this is
    call: int = 0
    reserve: int = 0                     # pool blocks this row may come to hold (its worst case, row_blocks)
    grant: int = 0                       # pool blocks it may hold now (to its turn's end)
    left: int = 0                        # assistant turns still to write, once a turn has ended
    kv: int = 0                          # its row and its prompt in the GroupKV
    prompt: int = 0
    pending: list[int] = field(default_factory=list)    # sampled tokens not yet in the cache
    turn_tokens: list[int] = field(default_factory=list)
    forced: bool = False                 # its last turn's response carries the forced-answer message
    results: list = field(default_factory=list)         # this turn's tool results, while its sub-agents run
    subs: dict = field(default_factory=dict)            # call index -> finished sub-agent trajectory
    waiting: int = 0                     # sub-agents still running
    fed: contract.Digest | None = None   # the digest of the segment being fed (contract.py), when recording

    def sampled(self, t: int, logprob: float | None, stop: int, max_context: int) -> bool:
        """Token t (and its log-prob, if recorded) onto the trajectory; whether it ends the turn: the stop token, or
        max_new tokens or max_context, which cut the turn (`truncated`)."""
        self.turn_tokens.append(t)
        self.traj.token_ids.append(t)
        self.traj.roles.append(POLICY)
        self.traj.draws += 1
        if logprob is not None:
            self.traj.logprobs.append(logprob)
        if t == stop or len(self.turn_tokens) == self.max_new or len(self.traj.token_ids) >= max_context:
            self.pending = [t]                           # fed with the next chunk
            if self.fed is not None:                     # the turn's segment is complete
                self.traj.digests.append(self.fed.hexdigest())
            self.traj.truncated |= t != stop
            return True
        return False

    def text_tokens(self, stop: int) -> list[int]:
        """This turn's tokens but the stop token."""
        return [t for t in self.turn_tokens if t != stop]

    def responded(self, c: Chunk) -> Chunk:
        """The response chunk c onto the trajectory (ENV tokens, its clips), and a new turn begins; returns what the
        cache reads next: the last turn's last token, then c."""
        self.turn_tokens = []
        c = Chunk(torch.cat([torch.tensor(self.pending), c.ids]),
                  torch.cat([torch.zeros(len(self.pending), dtype=torch.int32), c.mm_types]), c.pixels, c.grid)
        self.traj.token_ids += c.ids[len(self.pending):].tolist()
        self.traj.roles += [ENV] * (len(c.ids) - len(self.pending))
        if c.pixels is not None:
            self.traj.videos.append((c.pixels, c.grid))
        return c


def pool_blocks(queued, subs: list, budget: int) -> tuple[int, int]:
    """(blocks the engine's pool holds, the worst case of all the queued work): the budget's blocks, or that worst
    case if it is less, and at least the largest single group's worst case (with a warning when that is more)."""
    need = [blocks_for(len(c.ids)) + sum(r.reserve for r in rows) for c, rows, _ in queued]
    need += [blocks_for(len(c.ids)) + blocks_for(s.max_new) for c, s in subs]
    if need and max(need) > budget:
        warnings.warn(f"rollout memory budget ({budget} blocks of {kvcache.BLOCK} tokens) is below one prompt group's "
                      f"worst case ({max(need)} blocks): the pool holds that instead", stacklevel=3)
    return max(max(need, default=1), min(budget, sum(need))), sum(need)


def stays_safe(groups: dict, who: tuple, blocks: int, free: int) -> bool:
    """Whether granting `blocks` more of the `free` ones keeps every group able to reach its worst case (`safe`, the
    banker's rule, over each group's (blocks held, worst case)). groups: the admitted {prompt id: (rows, prompt
    blocks)}; who: (prompt id,) for a row of an admitted group, or the queued (chunk, rows, prompt blocks) being
    admitted, the last of them the one asking."""
    ledger = lambda rows, b: (b + sum(r.grant for r in rows), b + sum(r.reserve for r in rows))  # (held, worst)
    state = {p: ledger(rows, b) for p, (rows, b) in groups.items() if b}  # sub-agents: none
    if isinstance(who[0], int):                         # a row of an admitted group: its group holds more
        held, worst = state[who[0]]
        state[who[0]] = (held + blocks, worst)
    else:                                               # queued groups, admitted in this round or asking
        state.update({("queued", i): ledger(rows, b) for i, (_, rows, b) in enumerate(who)})
    return safe(list(state.values()), free - blocks)


class Engine:
    """The rollout's scheduler over one paged cache (kvcache.GroupKV). A row goes

        queued --admit--> active --step: its turn ends--> end_turn --> away --collect--> ready --admit--> active ...
                                                                    \\--> retire (its blocks back at once)

    admit     ready rows, queued prompt groups (prefilled once, forked into their rows), sub-agents; a row is granted
              the blocks its turn may take only while the engine stays safe (`stays_safe`), else it waits.
    step      one forward, one (n, V) sampling op, one host sync; a row whose turn ends leaves the batch at once.
    end_turn  the turn's rules (turn_outcome); its calls go to the tool threads (ToolEnv.run) while the rest decode.
    collect   rows back from the tool threads (`called`): their responses go to ready (`respond`); sub-agents join.
    A row's tokens depend only on its seed and draw counter (Trajectory.draws), so no schedule changes them."""

    def __init__(self, model, processor, cfg: RolloutConfig, ids: dict, pool: video.DecodePool | None = None,
                 on_turn=None):
        self.model, self.processor, self.cfg, self.ids = model, processor, cfg, ids
        self.on_turn = on_turn           # listener: (trajectory, tool responses or None) as each turn completes
        self.factor = video_factor(processor)
        self.device = next(model.parameters()).device
        self.env = ToolEnv(processor, cfg, self.factor, next(model.parameters()).dtype, pool)   # the tool threads' work
        self.stop, self.pad = ids["<|im_end|>"], ids["<|endoftext|>"]
        banned = vision_ids(ids)         # never sampled: only the processor writes them
        self.ban = torch.tensor(banned, dtype=torch.long, device=self.device) if banned else None
        self.queued: deque = deque()     # (prompt chunk, rows, prompt blocks) not admitted yet
        self.subs, self.ready = [], []   # (chunk, row): sub-agent prompts, next-turn chunks
        self.away = []                   # (row, future of its tool work's result, what follows: `called`, `respond`)
        self.tools = None                # the tool threads while `run` runs
        self.active, self.logits, self.seeds, self.counters = [], None, None, None
        self.groups = {}                 # prompt id -> (its rows not retired, its prompt's blocks)
        self.kv, self.need = None, 0

    # -- work in
    def add_group(self, chunk: Chunk, rows: list[_Row]) -> None:
        """Queue a prompt and its rows (they share its K/V); each row's `reserve` is its worst case in blocks."""
        self.queued.append((chunk, rows, blocks_for(len(chunk.ids))))

    def add_subagent(self, parent: tuple[int, int], clip: video.Clip, seed: int, caller: _Row | None = None,
                     chunk: Chunk | None = None) -> _Row:
        """A sub-agent on `clip` (a one-row prompt, `chunk` if encoded already; one turn): joins at the next admit."""
        c = chunk if chunk is not None else self.env.subagent_chunk(clip)
        t = Trajectory("", 0, c.ids.tolist(), [ENV] * len(c.ids), len(c.ids), [(c.pixels, c.grid)], parent=parent)
        sub = _Row(t, "", seed, max_new=self.cfg.subagent_max_new_tokens, tools=False, caller=caller, call=parent[1])
        self.subs.append((c, sub))
        return sub

    # -- the loop
    @torch.no_grad()
    def run(self) -> None:
        """Roll out everything queued, in a pool of `pool_blocks` (the budget's, cfg.memory_budget_bytes)."""
        budget = kvcache.memory_budget(self.cfg.memory_budget_bytes, self.device, self.model) // (kvcache.BLOCK * kv_bytes_per_token(self.model))
        self.queued = deque(part for group in self.queued for part in split_group(group, budget))
        blocks, self.need = pool_blocks(self.queued, self.subs, budget)
        self.kv = GroupKV(self.model, self.device, blocks, exact=self.cfg.exact_policy)
        self.tools = ThreadPoolExecutor(TOOL_WORKERS, thread_name_prefix="tools")
        try:
            while self.queued or self.subs or self.ready or self.active or self.away:
                self.collect()
                self.admit()
                if not self.active:                         # (a collect may have retired the last row)
                    if self.away:
                        self.collect(wait=True)             # nothing to decode until some tool work ends
                    elif self.queued or self.subs or self.ready:
                        raise RuntimeError("rollout engine stalled: work is queued but nothing can be admitted")
                    continue
                for r in self.step():
                    self.end_turn(r)
        finally:
            self.tools.shutdown(wait=True, cancel_futures=True)
            self.tools = None

    def send(self, r: _Row, work, then) -> None:
        """Row r goes away while `work()` runs in a tool thread; `then(r, result)` runs here at a later `collect`."""
        self.away.append((r, self.tools.submit(work), then))

    def collect(self, wait: bool = False) -> None:
        """The rows whose tool work is done come back, in the order they went away (wait: once one is). A job's
        exception is raised here: a tool call's own errors are data (run_calls), so one is a bug."""
        if wait:
            futures.wait([job for _, job, _ in self.away], return_when=futures.FIRST_COMPLETED)
        done = [job.done() for _, job, _ in self.away]
        back, self.away = [a for a, d in zip(self.away, done) if d], [a for a, d in zip(self.away, done) if not d]
        for r, job, then in back:
            then(r, job.result())

    def admit(self) -> None:
        """Ready chunks, queued groups that fit, sub-agents -> the active batch (see the class docstring)."""
        ready, waiting = [], []
        for r, c in self.ready:                             # the next turn of rows whose response is ready
            grant = self.turn_grant(r, self.kv.prompts[r.prompt].length, self.kv.rows[r.kv].length + len(c.ids), r.left)
            if self.grant((r.prompt,), grant - r.grant):
                r.grant = grant
                ready.append((r, c))
            else:
                waiting.append((r, c))
        self.ready = waiting
        groups = []
        while self.queued:
            chunk, rows, prompt_blocks = self.queued[0]
            for r in rows:
                r.grant = self.turn_grant(r, len(chunk.ids), 0, assistant_turns(self.cfg))
            if not self.grant(groups + [self.queued[0]], prompt_blocks + sum(r.grant for r in rows)):
                break
            groups.append(self.queued.popleft())
        new = groups + [(c, [s], 0) for c, s in self.subs]
        self.subs = []
        if new:
            prompts, logits = self.kv.add_prompts(self.model, [c for c, _, _ in new], self.pad)
            for (c, rows, b), p, pos in zip(new, prompts, self.kv.fed):
                d = self.digest(c, pos)                     # the group's prompt hashed once, copied to its rows
                for r, k in zip(rows, self.kv.fork(p, len(rows))):
                    r.kv, r.prompt, r.fed = k, p, None if d is None else d.copy()
                self.groups[p] = (list(rows), b)
            self.join([r for _, rows, _ in new for r in rows],
                      torch.cat([lg.expand(len(rows), -1) for (_, rows, _), lg in zip(new, logits)]))
        if ready:
            rows = [r for r, _ in ready]
            self.join(rows, self.kv.extend(self.model, [r.kv for r in rows], [c for _, c in ready], self.pad))
            for (r, c), pos in zip(ready, self.kv.fed):
                r.fed = self.digest(c, pos)

    def digest(self, c: Chunk, positions: torch.Tensor) -> contract.Digest | None:
        """The digest of chunk c as the cache fed it, at positions (3, l) (contract.py); None when not recording."""
        if self.env.hashes is None:
            return None
        pixels = contract.pixel_digest(c.pixels, self.env.hashes)     # most hashed in the tool threads (ToolEnv.stored)
        return contract.Digest().chunk(c.ids, c.mm_types, positions, c.grid, pixels)

    def turn_grant(self, r: _Row, prompt_len: int, held: int, turns: int) -> int:
        """Blocks row r may hold by its next turn's end: `held` tokens in its suffix, `turns` assistant turns left."""
        return min(r.reserve, row_blocks(self.cfg, prompt_len, self.factor, held, turns, this_turn=True))

    def grant(self, who: tuple, blocks: int) -> bool:
        """Grant `who` (as in `stays_safe`) `blocks` more if the engine stays safe; always into an empty engine (the
        pool holds at least any one group's worst case, so a group alone is always safe)."""
        if self.kv.reserved and blocks > 0 and not stays_safe(self.groups, who, blocks,
                                                               self.kv.pool.n_blocks - self.kv.reserved):
            return False
        return self.kv.reserve(blocks, force=True)

    def join(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Rows (with their next-token logits (k, V)) into the active batch, kept ordered by prompt so that the
        rows of a prompt go together as queries against its K/V."""
        seeds = kvcache._on(self.device, [r.seed for r in rows])
        counters = kvcache._on(self.device, [r.traj.draws for r in rows])   # each row's draw index
        if self.active:
            logits, seeds, counters = (torch.cat(p) for p in ((self.logits, logits), (self.seeds, seeds),
                                                             (self.counters, counters)))
        rows = self.active + rows
        order = sorted(range(len(rows)), key=lambda j: rows[j].prompt)
        if order != list(range(len(rows))):
            o = kvcache._on(self.device, order)
            logits, seeds, counters, rows = logits[o], seeds[o], counters[o], [rows[j] for j in order]
        self.active, self.logits, self.seeds, self.counters = rows, logits, seeds, counters

    def step(self) -> list[_Row]:
        """One decode step of the active rows (`draw`, then the next forward); returns the rows whose turn ended
        (they have left the batch)."""
        tok, toks, lps = draw(self.logits, self.ban, self.seeds, self.counters, self.cfg)
        ends = [r.sampled(int(t), lps[j] if lps is not None else None, self.stop, self.cfg.max_context)
                for j, (r, t) in enumerate(zip(self.active, toks))]
        ended, keep = [r for r, e in zip(self.active, ends) if e], [j for j, e in enumerate(ends) if not e]
        if ended:                                           # rows leave: their blocks stay where they are
            k = kvcache._on(self.device, keep)              # pinned, non-blocking: no second sync
            self.active = [self.active[j] for j in keep]
            tok, self.logits, self.seeds, self.counters = tok[k], self.logits[k], self.seeds[k], self.counters[k]
        if self.active:
            self.counters = self.counters + 1
            self.logits = self.kv.step(self.model, [r.kv for r in self.active], tok)
            if self.env.hashes is not None:                 # host ints: the tokens read above, the fed positions
                for j, r, p in zip(keep, self.active, self.kv.fed):
                    r.fed.step(int(toks[j]), p)
        return ended

    # -- a turn's end: tools (in the tool threads), sub-agents, the next chunk
    def end_turn(self, r: _Row) -> None:
        """A row's turn has ended: turn_outcome says what follows. Calls that run go to the tool threads with the
        row (ToolEnv.run, then `called`); calls past the budget get the forced-answer message alone (`reply`)."""
        if not r.tools:
            return self.end_subagent(r)
        text = THINK_PREFIX + self.processor.tokenizer.decode(r.text_tokens(self.stop), skip_special_tokens=False)
        out = turn_outcome(parse_tool_calls(text), r.traj.n_tool_turns, r.forced, r.traj.truncated,
                           self.cfg.max_turns, self.cfg.max_calls_per_turn)
        r.traj.turns.append(text)
        r.traj.calls.append(out.calls)
        r.forced = out.forced
        if out.done:
            r.traj.hit_turn_limit = out.hit_turn_limit
            return self.retire(r, last_turn=True)
        if not out.executes:
            return self.reply(r, [])
        r.traj.n_tool_turns += 1
        r.traj.n_calls += len(out.calls)
        self.send(r, partial(self.env.run, out.calls, out.dropped, r.path, r.duration, out.forced), self.called)

    def called(self, r: _Row, out: tuple) -> None:
        """A turn's tool work is done (ToolEnv.run's (results, made)), on the engine's thread: counted; interleaved
        mode, its responses; sub-agent mode, its sub-agents join (their caller responds once they end)."""
        results, made = out
        r.traj.tool_failures += sum(err is not None for _, _, err in results)
        r.traj.windows += [w for w, _, err in results if err is None]
        if self.cfg.tool_mode != "subagent":
            return self.reply(r, results, chunk=made)
        # each sub-agent's seed comes from its caller's seed, the turn and the call index, so a trajectory
        # does not depend on which other records share its batch
        turn = len(r.traj.turns) - 1
        r.results, r.waiting = results, len(made)
        for k, c in made.items():
            self.add_subagent((r.order, k), results[k][1], row_seed(r.seed, 10_000 + turn, k), caller=r, chunk=c)
        if not r.waiting:                                   # no call gave a clip: its errors at once
            self.reply(r, results, {})

    def end_subagent(self, s: _Row) -> None:
        s.traj.text = self.processor.tokenizer.decode(s.text_tokens(self.stop), skip_special_tokens=True).strip()
        self.retire(s)
        c = s.caller
        if c is not None:
            c.subs[s.call], c.waiting = s.traj, c.waiting - 1
            if not c.waiting:                               # its caller's response, the summaries in call order
                c.traj.subagents += [c.subs[k] for k in sorted(c.subs)]
                self.reply(c, c.results, {k: t.text for k, t in c.subs.items()})

    def reply(self, r: _Row, results: list, summaries: dict[int, str] | None = None, chunk: Chunk | None = None) -> None:
        """The turn's tool responses (tool_response_parts) to the listener, then their chunk (`chunk`, or encoded in
        the tool threads) to `respond`."""
        parts, clips = tool_response_parts(results, summaries)
        r.results, r.subs = [], {}
        if self.on_turn is not None:                        # the listener: a turn and its tool responses
            self.on_turn(r.traj, parts)
        if chunk is not None:
            return self.respond(r, chunk)
        self.send(r, partial(self.env.response_chunk, parts, clips, r.forced), self.respond)

    def respond(self, r: _Row, c: Chunk) -> None:
        """The encoded tool responses -> ready (a row past max_context ends truncated). Its worst case tightens, and
        its grant comes down to the blocks it holds: the next turn's is asked for at admit."""
        c = r.responded(c)
        if len(r.traj.token_ids) >= self.cfg.max_context:
            r.traj.truncated = True
            return self.retire(r)
        r.left = 1 if r.forced else assistant_turns(self.cfg) - len(r.traj.turns)
        r.reserve = min(r.reserve, row_blocks(self.cfg, self.kv.prompts[r.prompt].length, self.factor,
                                              self.kv.rows[r.kv].length + len(c.ids), r.left))
        hold = len(self.kv.rows[r.kv].blocks)
        self.kv.release(r.grant - hold)
        r.grant = hold
        self.ready.append((r, c))

    def retire(self, r: _Row, last_turn: bool = False) -> None:
        """r is done: its blocks go back to the pool at once, and its prompt's with the prompt's last row.
        last_turn: its turn just ended the trajectory (the listener hears of it)."""
        r.traj.done = True
        if last_turn and self.on_turn is not None:
            self.on_turn(r.traj, None)
        self.kv.free_row(r.kv)
        self.kv.release(r.grant)
        r.grant = 0
        rows, prompt_blocks = self.groups[r.prompt]
        rows.remove(r)
        if not rows:
            self.kv.free_prompt(r.prompt)
            self.kv.release(prompt_blocks)
            del self.groups[r.prompt]


def vision_ids(ids: dict) -> list[int]:
    """Ids of the vision markers and placeholders in `ids` (special_token_ids): the tokens decoding never samples."""
    return [ids[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>") if ids.get(t) is not None]


def run_subagents(model, processor, jobs: list[tuple[int, int, video.Clip]], cfg: RolloutConfig,
                  seeds: list[int], ids: dict) -> list[Trajectory]:
    """Sub-agents on their own (prompt = crop + summary instruction), all in one engine: jobs (caller, call, clip)."""
    engine = Engine(model, processor, cfg, ids)
    subs = [engine.add_subagent((caller, k), clip, seed) for (caller, k, clip), seed in zip(jobs, seeds)]
    engine.run()
    return [s.traj for s in subs]


# -----------------------------------------------------------------------------
# the rollout

@torch.no_grad()
def run_agent(model, processor, records: list[dict], video_root: str, cfg: RolloutConfig, seed: int = 0,
              nframes: list[int | None] | None = None, pool: video.DecodePool | None = None,
              on_turn=None, seed_index: list[int] | None = None) -> list[Trajectory]:
    """Roll out `cfg.group_size` samples of each record; returns len(records) * G trajectories, grouped
    by record (record 0's samples first). `nframes[i]` overrides the overview frame count of record i
    (nFrames gating: the same K for the whole group). A record whose video fails to decode gives G
    trajectories with `error` set (counted by the caller), never an exception. `pool`: overviews and crops
    decode in its worker threads (every overview of the call at once, through its frame cache). The engine
    (`Engine`) admits the groups as its memory budget allows (cfg.memory_budget_bytes).
    `on_turn(traj, responses)`: called as each assistant turn completes (a listener, e.g. eval.py --video
    printing the turns): `traj.turns[-1]` is the turn, `responses` the tool response texts it got (call
    order), or None when the turn ended the trajectory. `seed_index[i]`: record i's index in row_seed (default
    i; RL passes each prompt's place in the step's global draw, so a rank rolls out the rows one rank would)."""
    t0 = time.time()
    ids = special_token_ids(processor)
    factor = video_factor(processor)
    G = cfg.group_size
    prompts, failed = [], []
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
        # each prompt and the forced "<think>\n" are prefilled once (the overview through the vision tower once,
        # the K/V stored once), then forked into G rows that share it
        engine = Engine(model, processor, cfg, ids, pool, on_turn)
        prefix = encode_chunk(processor, THINK_PREFIX)
        rows = []
        for i, rec, path, duration, c, n in prompts:
            c = engine.env.stored(Chunk(torch.cat([c.ids, prefix.ids]), torch.cat([c.mm_types, prefix.mm_types]),
                                    c.pixels, c.grid))
            reserve = row_blocks(cfg, len(c.ids), factor)
            group = [_Row(Trajectory(str(rec.get("id", i)), s, c.ids.tolist(), [ENV] * len(c.ids),
                                     len(c.ids) - len(prefix.ids), [(c.pixels, c.grid)], nframes=n),
                          path, row_seed(seed, seed_index[i] if seed_index else i, s), index=i, duration=duration, order=len(rows) + s,
                          max_new=cfg.max_new_tokens, reserve=reserve) for s in range(G)]
            engine.add_group(c, group)
            rows += group
        engine.run()
        for r in rows:
            out.setdefault(r.index, []).append(r.traj)
    trajs = [t for i in sorted(out) for t in out[i]]
    for t in trajs:
        _finish(t, processor, ids)
        t.latency = (time.time() - t0) / max(1, len(trajs))
    return trajs


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

def collate(trajs: list[Trajectory], model, pad_id: int, share_videos: bool = False, check: bool = True) -> dict:
    """Right-padded model inputs for whole trajectories: input_ids / attention_mask / mm_token_type_ids
    (B, L), position_ids (3, B, L) from get_rope_index over each full sequence, the videos of all rows
    concatenated in row order, and `roles` (B, L) (ENV, POLICY; pads are ENV).
    check: a rollout's trajectory (with Trajectory.digests) must be what the engine fed, by these inputs' digests
    (contract.check_row: the one policy contract); a difference raises contract.ContractError.
    share_videos=True (for `policy.shared_video_hidden_states`): pixel_values_videos / video_grid_thw hold each distinct
    video ONCE (the G samples of a prompt share its overview tensor) and `video_index` (n_videos,) gives,
    for every video in row order (one per grid row: a turn's parallel clips are one entry of several
    videos), its index among the distinct ones, and `video_chunks` (n_entries,) the grid rows of each distinct entry
    (one fed chunk: the exact mode calls the vision tower once per chunk, as the engine did)."""
    B, L = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    roles = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(3, B, L, dtype=torch.long)
    pixels, grids, index, seen, n_videos, hashes = [], [], [], {}, 0, {}
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
        if check and t.digests:
            contract.check_row(t, ids[i, :n], types[0], pos[:, i, :n], roles[i, :n] == POLICY, hashes)
    out = dict(input_ids=ids, attention_mask=mask, position_ids=pos, roles=roles,
               mm_token_type_ids=(ids == video_id).int() * 2)
    if pixels:
        out.update(pixel_values_videos=torch.cat(pixels), video_grid_thw=torch.cat(grids))
        if share_videos:
            out["video_index"] = torch.tensor(index, dtype=torch.long)
            out["video_chunks"] = torch.tensor([len(g) for g in grids])    # grid rows of each entry (a fed chunk)
    return out


def behaviour_logprobs(trajs: list[Trajectory], batch: dict) -> torch.Tensor:
    """(B, L-1) the log-probs the rollout recorded for each row's policy tokens (Trajectory.logprobs, at the
    sampling temperature) at the positions that predict them in `collate`'s batch; 0 elsewhere. The behaviour
    policy's log-probs of the decoupled loss (grpo.grpo_token_terms, async_rl.py)."""
    mask = batch["roles"][:, 1:] == POLICY
    out = torch.zeros(mask.shape)
    for i, t in enumerate(trajs):
        if int(mask[i].sum()) != len(t.logprobs):
            raise ValueError(f"behaviour_logprobs: trajectory {t.record_id} holds {len(t.logprobs)} recorded log-probs "
                             f"for {int(mask[i].sum())} policy tokens (was it sampled with record_logprobs?)")
        out[i][mask[i]] = torch.tensor(t.logprobs, dtype=torch.float32)
    return out


