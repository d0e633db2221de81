"""
The SFT warm start (docs/method.md §6): the trajectories it trains on, TDAM's rules, and the SFT step.

    1. data        encode_messages (a recorded trajectory -> a rollout.Trajectory, through the rollout's own pieces,
                   so SFT trains on what a rollout sees), sft_examples (recorded or oracle trajectories, bad ones
                   counted and skipped), SFTItems (re-encoded on demand while their pixels fit sft_cache_gb)
    2. TDAM        tdam_rects (Video-o3's two rules, as rectangles a query may not see), tdam_spans (the overview,
                   call, observation and answer spans of a trajectory), tdam_spec (a batch's TdamSpec for
                   ops.tdam_attention); tdam_mask / tdam_batch_mask, their dense forms
    3. the step    sft_token_loss (cross-entropy through ops.token_logprobs), sft_loss, sft_micro_batches,
                   sft_backward (TDAM on a fraction of batches, the token mean over all ranks), sft_draw, run_sft

From run_sft, TDAM's rules are three calls: run_sft -> sft_backward -> tdam_spec -> tdam_rects. Shapes: a batch is
rollout.collate's dict (input_ids, attention_mask, roles (B, L), the vision inputs); a TdamSpec holds lengths (B,)
and rects (B, R, 4).
"""
import dataclasses
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

import data
import model as model_lib
import policy
import recipes
import rollout
import video
from data import content_text, message_text
from model import decode_with_offsets
from ops import TdamSpec, policy_rows, to_additive_mask, token_logprobs
from rewards import extract_answer, parse_tool_calls
from runtime import Run, all_mean, print0, rank_totals

T, CPU = recipes.TINY, recipes.ON_DEVICE["cpu"]     # the settings' defaults: what `python train.py` runs


# -----------------------------------------------------------------------------
# 1. Data: recorded or oracle trajectories, encoded as a rollout would

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


def encode_messages(processor, record: dict, messages: list[dict], video_root: str, cfg: rollout.RolloutConfig,
                    nframes: int | None = None) -> rollout.Trajectory:
    """Token ids + roles + videos of a recorded trajectory (docs/method.md §9 trajectory record, messages after the
    prompt). Assistant text is rollout.POLICY except the forced "<think>\\n" prefix; tool results are rebuilt by
    the real tool path: a text result (a sub-agent summary) is used verbatim, a video item is cropped by
    `rollout.run_calls` exactly as a rollout would. An assistant message with `"target_chars": N` is a target for its first
    N characters only; the rest (and its <|im_end|>) is context, as the environment's tokens are (a recorded guess:
    data.oracle_turns); a token that straddles character N (Qwen's ">C" of "<answer>C") is context. Raises ValueError/VideoError on a bad record or video."""
    factor = rollout.video_factor(processor)
    path, duration, c, n = rollout.encode_prompt(processor, record, video_root, cfg, nframes)
    t = rollout.Trajectory(str(record.get("id", "")), 0, c.ids.tolist(), [rollout.ENV] * len(c.ids), len(c.ids),
                   [(c.pixels, c.grid)], nframes=n)
    tok = processor.tokenizer
    add = lambda ids, role: (t.token_ids.extend(ids), t.roles.extend([role] * len(ids)))
    add(rollout.encode_chunk(processor, rollout.THINK_PREFIX).ids.tolist(), rollout.ENV)
    i, sent = 0, False                     # sent: the forced-answer message is in the trajectory
    while i < len(messages) and messages[i]["role"] in ("system", "user") and _tool_results(messages[i]) is None:
        i += 1                             # a recorded prompt: the record's own fields rebuild it
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant":
            raise ValueError(f"{record.get('id')}: expected an assistant message at position {i}, got {m['role']!r}")
        text = message_text(m)
        body = text[len(rollout.THINK_PREFIX):] if text.startswith(rollout.THINK_PREFIX) else text
        ids = tok(body + "<|im_end|>", add_special_tokens=False)["input_ids"]
        if (chars := m.get("target_chars")) is None:
            add(ids, rollout.POLICY)
        else:                  # the same tokens: targets up to the first that ends past the cut, context from it on
            if not isinstance(chars, int) or isinstance(chars, bool) or not 0 <= chars <= len(text):
                raise ValueError(f"{record.get('id')}: message {i}: target_chars {chars!r} is not a character count "
                                 f"in 0..{len(text)}")
            cut = chars - (len(text) - len(body))
            ends = [end for _, end in decode_with_offsets(tok, ids)[1]]
            k = next((j for j, end in enumerate(ends) if end > cut), len(ids))
            add(ids[:k], rollout.POLICY)
            add(ids[k:], rollout.ENV)
        turn = rollout.THINK_PREFIX + body
        t.turns.append(turn)
        calls = parse_tool_calls(turn)
        t.calls.append(calls)
        out = rollout.turn_outcome(calls, t.n_tool_turns, sent, False, cfg.max_turns, cfg.max_calls_per_turn)
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
                ran = rollout.run_calls(calls, path, duration, cfg, factor)
                parts, clips = rollout.tool_response_parts(ran)
                t.tool_failures += sum(err is not None for _, _, err in ran)
                t.windows += [w for w, _, err in ran if err is None]
            # the forced-answer message where the rollout's rules put it (turn_outcome), unless the recording goes on
            # past it: a longer recorded trajectory (e.g. Video-o3's 8 turns at a budget of 6) goes on as recorded
            goes_on = any(_tool_results(x) is not None for x in messages[j:])
            forced = out.forced and not goes_on
            rc = rollout.encode_chunk(processor, rollout.response_chunk_text(parts, forced), clips)
            add(rc.ids.tolist(), rollout.ENV)
            if rc.pixels is not None:
                t.videos.append((rc.pixels, rc.grid))
            sent |= forced
        elif out.forced and not out.executes and j < len(messages):
            # calls with the budget spent and an answer recorded after them: the forced-answer message alone
            add(rollout.encode_chunk(processor, rollout.response_chunk_text([], True)).ids.tolist(), rollout.ENV)
            sent = True
        i = j
    t.text = tok.decode(t.token_ids[t.prompt_len:], skip_special_tokens=False)
    t.answer = extract_answer(t.turns[-1]) if t.turns else None
    t.done = True
    return t


class SFTItems:
    """The SFT trajectories, each encoded on demand and kept while its pixels fit `cache_bytes`. A trajectory's
    pixels are the processor's fp32 frames (one 64-frame overview at Qwen's settings: 360 MiB), so a cold start of
    1,000 records held whole would be 352 GiB a rank; here what does not fit is dropped (least recently used first)
    and encoded again when a step draws it, the next step's draw encoded by a thread while this one trains
    (`prefetch`). Encoding is deterministic: a dropped item comes back the same, token for token, pixel for
    pixel. The embedded default's trajectories all fit (never encoded twice). items[i] -> a Trajectory."""

    def __init__(self, pairs: list, encode, cache_bytes: float):
        self.pairs, self.encode, self.cache_bytes = pairs, encode, cache_bytes
        self.cache: dict[int, rollout.Trajectory] = {}      # insertion order = least recently used first
        self.held, self.encodes = 0, 0
        self.pending: dict[int, object] = {}
        self.worker = ThreadPoolExecutor(1)

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> rollout.Trajectory:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if i in self.cache:
            self.cache[i] = self.cache.pop(i)               # most recently used
            return self.cache[i]
        pending = self.pending.pop(i, None)
        t = pending.result() if pending is not None else self._encode(i)
        self.keep(i, t)
        return t

    def _encode(self, i: int) -> rollout.Trajectory:
        self.encodes += 1
        item, _ = self.encode(self.pairs[i])
        if item is None:                                     # it encoded before: its video changed since
            raise ValueError(f"SFT record {self.pairs[i][2]} no longer encodes")
        return item

    def keep(self, i: int, t: rollout.Trajectory) -> None:
        size = self._size(t)
        while self.cache and self.held + size > self.cache_bytes:
            self.held -= self._size(self.cache.pop(next(iter(self.cache))))
        if size <= self.cache_bytes:
            self.cache[i] = t
            self.held += size

    @staticmethod
    def _size(t) -> int:
        return sum(pix.nbytes for pix, _ in t.videos if pix is not None)

    def prefetch(self, indices: list[int]) -> None:
        """Encode the items of `indices` that are not held, one thread beside the training step (at most one
        step's batch ahead)."""
        for i in dict.fromkeys(indices):
            if i not in self.cache and i not in self.pending:
                self.pending[i] = self.worker.submit(self._encode, i)


def sft_examples(records: list[dict], processor, video_root: str, cfg: rollout.RolloutConfig, *,
                 sft_data: str | None, seed: int, gated_choices: list[int], always_call: bool, direct_crop: float,
                 budget_fraction: float, tool_free: float, keep_bad_calls: bool, max_bad_fraction: float,
                 workers: int = 1, cache_bytes: float = float("inf"), log=print) -> tuple[SFTItems, int]:
    """(the SFT trajectories, number skipped). From `sft_data` (trajectory records, docs/data.md), or the
    synthetic task's oracle: each record with the evaluation overview, and once more with a K drawn from
    `gated_choices` when given; with probability `budget_fraction` a trajectory that calls the tool is also
    recorded at a smaller tool-turn budget (the forced-answer message, then an answer from what was seen), so
    the model learns to answer when its budget runs out; with probability `tool_free` also as a tool-free teacher
    answers it (data.oracle_sft_pairs: when to call is then left to RL). Every record is encoded once here to
    check it: bad records and trajectories whose tool calls the environment would refuse are reported
    (file:line, reason) and skipped (`keep_bad_calls` keeps the latter); more than `max_bad_fraction` bad stops
    the run. `workers`: threads encoding the trajectories (the same items, in order). The items keep at most
    `cache_bytes` of pixels (`SFTItems`; --sft-cache-gb), the rest encoded again when drawn."""
    if sft_data:
        found, errors = data.sft_pairs(sft_data)
        pairs = [(rec, msgs, where, None, cfg) for rec, msgs, where in found]
    else:
        pairs, errors = data.oracle_sft_pairs(records, cfg, seed, gated_choices, always_call=always_call,
                                              direct_crop=direct_crop, budget_fraction=budget_fraction,
                                              tool_free=tool_free)

    def encode(pair):                        # k: the overview's frame count (None: the rollout's own rule)
        rec, msgs, where, k, c = pair
        try:
            item = encode_messages(processor, rec, msgs, video_root, c, nframes=k)
        except (ValueError, KeyError, TypeError, OSError) as e:
            return None, f"{where}: {e}"
        duration = rec.get("duration") or video.probe(data.resolve_video(video_root, rec["video"])).duration
        return item, data.bad_calls(msgs, duration, cfg.min_window)

    good, n_bad_calls = [], 0
    items = SFTItems(good, encode, cache_bytes)
    # a thread per core: decoding and the processor's tensor work run outside the GIL; map keeps the order; a
    # window of 2 per thread in flight, each result dropped here unless the cache keeps it
    workers = max(1, min(workers, len(pairs)))
    windows = (pairs[j:j + 2 * workers] for j in range(0, len(pairs), 2 * workers))
    with ThreadPoolExecutor(workers) as pool:
        for pair, (item, why) in ((p, r) for w in windows for p, r in zip(w, pool.map(encode, w))):
            if item is None:
                errors.append(why)
                continue
            if why and not keep_bad_calls:
                errors.append(f"{pair[2]}: tool calls the environment would refuse ({'; '.join(why[:3])}); "
                              f"skipped (--keep-bad-calls trains on them)")
                n_bad_calls += 1
                continue
            good.append(pair)
            items.keep(len(good) - 1, item)
    for e in errors[:5]:
        log(f"skipped SFT record: {e}")
    if len(errors) > 5:
        log(f"... {len(errors) - 5} more SFT records skipped")
    if not good or len(errors) > max_bad_fraction * (len(good) + len(errors)):
        raise ValueError(f"{len(errors)} of {len(good) + len(errors)} SFT records are bad; first: {errors[:3]}")
    return items, len(errors)


# -----------------------------------------------------------------------------
# 2. TDAM: the spans of a trajectory and the two rules over them

def tdam_rects(seq_len: int, overview_span: tuple[int, int] | None, answer_span: tuple[int, int] | None,
               call_spans: list[tuple[int, int]], obs_spans: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """
    Video-o3's Task-Decoupled Attention Masking (arXiv 2601.23224, on a fraction of SFT batches), as the rectangles
    (q0, q1, k0, k1) of queries [q0, q1) that may not see keys [k0, k1), on top of the causal mask M[i, j] = j <= i:
      (1) the final answer span may not see the overview video span, when the sequence holds more than one video
          (obs_spans non-empty), so the answer must rest on the cropped evidence;
      (2) every tool-call span after the first may not see the observation video spans that end before it
          starts, so each new call plans from the overview rather than copying the last crop.
    Spans are [start, end) token indices; `answer_span` is the text after `<answer>`. O(#rules): the blocked
    attention (ops.tdam_attention) reads the rectangles and never builds L x L; `tdam_mask` is the dense form.
    """
    obs = [_check_span("obs_span", s, seq_len) for s in obs_spans]
    calls = sorted(_check_span("call_span", s, seq_len) for s in call_spans)
    rects = []
    if overview_span is not None and answer_span is not None and obs:
        v0, v1 = _check_span("overview_span", overview_span, seq_len)
        a0, a1 = _check_span("answer_span", answer_span, seq_len)
        if a0 < v1 and a1 > v0:
            raise ValueError(f"tdam_mask: answer_span {answer_span} overlaps overview_span {overview_span}")
        rects.append((a0, a1, v0, v1))                            # rule (1)
    rects += [(c0, c1, o0, o1) for c0, c1 in calls[1:] for o0, o1 in obs if o1 <= c0]   # rule (2)
    return rects


def _check_span(name: str, span: tuple[int, int], seq_len: int) -> tuple[int, int]:
    start, end = span
    if not 0 <= start <= end <= seq_len:
        raise ValueError(f"tdam_mask: {name} {span} is not a [start, end) span inside a sequence of {seq_len} tokens")
    return start, end


def tdam_mask(seq_len: int, overview_span: tuple[int, int] | None, answer_span: tuple[int, int] | None,
              call_spans: list[tuple[int, int]], obs_spans: list[tuple[int, int]]) -> torch.Tensor:
    """(L, L) bool, True = query i may attend to key j: the causal mask less `tdam_rects`' rectangles."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()  # (L, L) causal
    for q0, q1, k0, k1 in tdam_rects(seq_len, overview_span, answer_span, call_spans, obs_spans):
        mask[q0:q1, k0:k1] = False
    return mask


def tdam_spans(ids: list[int], roles: list[int], tokenizer, video_id: int) -> dict:
    """The spans TDAM needs, for one trajectory of token ids (no pads), found from the DECODED TEXT mapped back
    to tokens (model.decode_with_offsets), so they hold for any tokenizer: on Qwen's `<answer>` is three tokens
    and its '>' can share a token with the answer; such a token counts as part of the answer.
      overview  the prompt's video (its first to last <|video_pad|>, the frame timestamps between included)
      obs       each <tool_response> block's video, likewise
      calls     each <tool_call> / <grounding> block of the policy's turns, tags included
      answer    after the last "<answer>" of the policy's turns to the end; None when there is none
    The prompt ends at the forced "<think>" before the first policy token (the system prompt and the Hermes
    tools block mention the tags themselves). Token spans are [start, end)."""
    n = len(ids)
    text, offsets = model_lib.decode_with_offsets(tokenizer, ids)
    to_tokens = lambda chars: model_lib.text_spans_to_token_spans(offsets, chars)
    first_policy = roles.index(rollout.POLICY) if rollout.POLICY in roles else n
    policy_char = offsets[first_policy][0] if first_policy < n else len(text)
    think = [c for c, _ in model_lib.find_text(text[:policy_char], "<think>")]
    prompt_len = to_tokens([(think[-1], think[-1])])[0][0] if think else first_policy
    start_char = offsets[prompt_len][0] if prompt_len < n else len(text)
    runs, s = [], None
    for j, t in enumerate(list(ids) + [-1]):          # maximal runs of video tokens
        if t == video_id and s is None:
            s = j
        elif t != video_id and s is not None:
            runs.append((s, j))
            s = None
    hull = lambda vs: (vs[0][0], vs[-1][1]) if vs else None
    blocks = to_tokens([b for b in model_lib.tagged_spans(text, "<tool_response>", "</tool_response>") if b[0] >= start_char])
    obs = [sp for o, c in blocks if (sp := hull([v for v in runs if o <= v[0] and v[1] <= c]))]
    calls = sorted(to_tokens([b for tag in ("tool_call", "grounding")
                              for b in model_lib.tagged_spans(text, f"<{tag}>", f"</{tag}>", inner=False)
                              if b[0] >= start_char]))
    answers = [a for a in model_lib.tagged_spans(text, "<answer>", "</answer>") if a[0] >= start_char]
    answer = (to_tokens(answers[-1:])[0][0], n) if answers else None
    return {"overview": hull([v for v in runs if v[1] <= prompt_len]), "obs": obs, "calls": calls,
            "answer": answer if answer and answer[0] < n else None}


def tdam_spec(batch: dict, tokenizer, video_id: int, counts: dict | None = None) -> TdamSpec:
    """The batch's TdamSpec from each row's spans (tdam_spans); rows without an answer keep the causal mask,
    counted in counts["tdam_no_answer"]."""
    lengths = batch["attention_mask"].sum(1)
    rows = []
    for i, n in enumerate(lengths.tolist()):
        sp = tdam_spans(batch["input_ids"][i, :n].tolist(), batch["roles"][i, :n].tolist(), tokenizer, video_id)
        if sp["answer"] is None and counts is not None:
            counts["tdam_no_answer"] = counts.get("tdam_no_answer", 0) + 1
        rows.append(tdam_rects(n, sp["overview"], sp["answer"], sp["calls"], sp["obs"]) if sp["answer"] else [])
    m = max([len(r) for r in rows] + [1])
    rects = torch.tensor([r + [(0, 0, 0, 0)] * (m - len(r)) for r in rows], dtype=torch.long).view(len(rows), m, 4)
    return TdamSpec(lengths, rects)


def tdam_batch_mask(batch: dict, tokenizer, video_id: int, counts: dict | None = None) -> torch.Tensor:
    """(B, 1, L, L) additive mask: the dense form of `tdam_spec` (TDAM on each row plus padding), for models
    and tests that take a 4-D mask. Training uses the spec itself (`tdam_attention`), which never builds it."""
    L = batch["input_ids"].shape[1]
    return to_additive_mask(tdam_spec(batch, tokenizer, video_id, counts).allowed(0, L, L, "cpu")[:, 0])


# -----------------------------------------------------------------------------
# 3. The SFT step: the loss, micro-batches and their backward, the loop

def sft_token_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                   compile: bool, chunk_size: int | None = None, num_tokens: float | torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, int]:
    """Cross-entropy on the policy's tokens through the fused `ops.token_logprobs` (T = 1), token mean:
    loss = -sum_it m_it log_softmax(h_it W^T)[t_it] / num_tokens (default sum(m); micro-batches pass the batch's).
    hidden (B, L, D), lm_head_weight (V, D), targets, mask (B, L) -> (loss, this call's token count)."""
    h, t, mask, _ = policy_rows("sft_token_loss", hidden, targets, mask)
    n_tokens = h.shape[0]
    logp = token_logprobs(h, lm_head_weight, t, chunk_size, compile=compile, temperature=1.0)   # (N,) fp32, T = 1
    return -logp.sum() / (max(n_tokens, 1) if num_tokens is None else num_tokens), n_tokens


@dataclasses.dataclass
class SFTSettings:
    """The SFT warm start's knobs (flags or --set keys sft_steps, sft_batch, ...); defaults: recipes.TINY."""
    steps: int = T["sft_steps"]
    batch: int = T["sft_batch"]
    micro_batch: int = T["sft_micro_batch"]
    micro_batch_tokens: int = T["micro_batch_tokens"]    # ... and rows x longest row at most: the RL update's budget
    lr: float = T["sft_lr"]
    warmup_steps: int | None = None                  # None: recipes.sft_warmup's rule for these steps
    min_lr_ratio: float = T["min_lr_ratio"]
    tdam_ratio: float = T["tdam_ratio"]
    loss_chunk: int = T["loss_chunk"]                # token_logprobs' chunk in the loss; 0: its own rule
    compile: bool = CPU["compile"]                   # resolve: on with CUDA (recipes.ON_DEVICE)
    precision: str = CPU["precision"]                # fp32 | bf16: the forward passes' compute dtype (policy.autocast)

    def __post_init__(self):
        if self.warmup_steps is None:
            self.warmup_steps = recipes.sft_warmup(self.steps, None)


def sft_loss(model, batch: dict, s: SFTSettings, tdam: TdamSpec | None = None) -> tuple[torch.Tensor, int]:
    """Cross-entropy on assistant (POLICY) tokens only, token mean, through the fused `sft_token_loss`; the forward
    in the compute dtype of s.precision (`policy.policy_head`), each layer's attention under TDAM's `tdam` spec."""
    hidden, weight, targets, mask = policy.policy_head(model, batch, s.precision, tdam)
    return sft_token_loss(hidden, weight, targets, mask, chunk_size=s.loss_chunk or None, compile=s.compile)


def sft_micro_batches(items: list, model, pad_id: int, s: SFTSettings):
    """Collated micro-batches, shortest first (rows of like length share a pad length), of at most s.micro_batch
    trajectories and (rows x longest) <= s.micro_batch_tokens padded tokens, a longer row alone (policy.micro_batches)."""
    items = sorted(items, key=lambda t: len(t.token_ids))
    for sl in policy.micro_batches([len(t.token_ids) for t in items], max(1, s.micro_batch), s.micro_batch_tokens):
        yield rollout.collate(items[sl], model, pad_id)


def sft_backward(model, items: list, s: SFTSettings, pad_id: int, tdam_tokenizer=None, counts: dict | None = None,
                 world: int = 1, filler=None) -> tuple[torch.Tensor, int]:
    """Backward of the batch's SFT loss, a token mean over the policy tokens of every rank, through micro-batches
    (`sft_micro_batches`): each micro-batch's token mean weighted by n_i / (N / world), N the tokens of all ranks
    (FSDP averages the ranks' gradients), so the gradients add up to one forward over the global batch. A rank with
    fewer micro-batches than another runs zero-weight passes (on its last micro-batch, or on `filler`), so every
    rank joins the same collectives. tdam_tokenizer: TDAM on (`tdam_spec`; rows without an answer counted in
    `counts`). Returns (this rank's part of the batch loss, detached: the ranks' mean is the batch loss; N)."""
    batches = list(sft_micro_batches(items, model, pad_id, s))
    n_local = sum(int(policy.policy_mask(b["roles"]).sum()) for b in batches)   # sft_loss's own token count
    n_tok, n_pad = rank_totals(n_local, len(batches), world)
    n_tok = max(1, n_tok)
    norm = n_tok / world
    parts = []
    for batch in batches:
        spec = tdam_spec(batch, tdam_tokenizer, model.config.video_token_id, counts) if tdam_tokenizer else None
        micro, n = sft_loss(model, batch, s, spec)
        (micro * (n / norm)).backward()
        parts.append(micro.detach() * (n / norm))
    fill = (batches[-1] if batches else rollout.collate([filler], model, pad_id)) if n_pad else None
    for _ in range(n_pad):                            # zero-weight passes: no gradient, matching collectives
        (sft_loss(model, fill, s)[0] * 0.0).backward()
    return (torch.stack(parts).sum() if parts else torch.zeros(())), n_tok


def sft_draw(seed: int, step: int, rank: int, world: int, n: int, s: SFTSettings) -> tuple[list[int], bool]:
    """A step's SFT batch on a rank (indices into the items) and whether it runs TDAM: one global draw of s.batch
    seeded by (seed, step), dealt round-robin over the ranks, as RL's prompts are (grpo.draw_prompts)."""
    rng = random.Random(f"sft:{seed}:{step}:0")
    idx = [rng.randrange(n) for _ in range(s.batch)]
    return idx[rank::world], rng.random() < s.tdam_ratio


def run_sft(run: Run, model, items: list, optimizer, s: SFTSettings, tokenizer, start: int = 0) -> None:
    """SFT steps start+1 .. s.steps: a global batch drawn per step (`sft_draw`, its share on each rank), TDAM on a
    fraction of batches, AdamW with warmup + cosine, a checkpoint every run.save_every steps and at the end."""
    model.train()
    for step in tqdm(range(start + 1, s.steps + 1), desc="sft", disable=run.rank != 0, initial=start, total=s.steps):
        t0 = time.time()
        lr = policy.set_lr(optimizer, policy.get_lr(step - 1, s.steps, s.lr, s.warmup_steps, s.min_lr_ratio))
        idx, tdam = sft_draw(run.seed, step, run.rank, run.world, len(items), s)
        if step < s.steps and hasattr(items, "prefetch"):   # the next step's trajectories, encoded meanwhile
            items.prefetch(sft_draw(run.seed, step + 1, run.rank, run.world, len(items), s)[0])
        batch = [items[i] for i in idx]
        loss, n_tok = sft_backward(model, batch, s, tokenizer.pad_token_id, tokenizer if tdam else None, run.counters,
                                   run.world, None if idx else items[0])
        if tdam and run.counters.get("tdam_no_answer") and "tdam" not in run.warned:
            run.warned.add("tdam")
            print0(run.rank, "TDAM: a trajectory has no <answer> after its prompt, so it keeps the causal mask "
                             "(counted as tdam_no_answer in metrics.jsonl)")
        gn = run.optimizer_step(model, optimizer, loss.detach(), "sft", step, [t.record_id for t in batch])
        row = all_mean({"loss": float(loss), "grad_norm": gn, "lr": lr, "tokens_per_s": n_tok / (time.time() - t0),
                        "step_time": time.time() - t0, "tdam": float(tdam)}, run.world)
        run.log("sft", step, row)
        if run.rank == 0 and (step % 25 == 0 or step == s.steps):
            tqdm.write(f"sft {step}/{s.steps} | loss {row['loss']:.4f} | lr {lr:.2e} | {row['step_time']:.2f}s")
        if step % run.save_every == 0 or step == s.steps:
            run.save("sft", step, model, optimizer)
    model.eval()
