"""
The SFT warm start's data: the trajectories it trains on and TDAM's spans in them (docs/method.md §6).

    encode_messages  a recorded trajectory's messages -> a rollout.Trajectory, through the rollout's own pieces
                   (the prompt, the tool's crops, rollout.tool_response_parts), so SFT trains on what a rollout sees
    sft_examples   recorded (--sft-data) or oracle (the synthetic task) trajectories, each encoded so, checked
                   once, bad ones counted and skipped
    SFTItems       those trajectories, re-encoded on demand and kept while their pixels fit --set sft_cache_gb
    tdam_spans     the overview, call, observation and answer spans of one trajectory, found from its text
    tdam_spec      a batch's TdamSpec (ops.tdam_attention's block-sparse mask), tdam_batch_mask its dense form

train.py's run_sft / sft_backward / sft_loss train on them. Shapes: a batch is rollout.collate's dict
(input_ids, attention_mask, roles (B, L), the vision inputs); a TdamSpec holds lengths (B,) and rects (B, R, 4).
"""
import re
from concurrent.futures import ThreadPoolExecutor

import torch

import data
import model as model_lib
import rollout
import video
from data import content_text, message_text
from model import decode_with_offsets
from ops import TdamSpec, tdam_rects, to_additive_mask
from rewards import extract_answer, parse_tool_calls


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
    i = 0
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
            # the forced-answer request only where a rollout would send it: the limit reached and the recording
            # ends with the next turn (a longer recorded trajectory, e.g. Video-o3's 8 turns, goes on as recorded)
            goes_on = any(_tool_results(x) is not None for x in messages[j:])
            forced = t.n_tool_turns >= cfg.max_turns and not goes_on
            rc = rollout.encode_chunk(processor, rollout.response_chunk_text(parts, forced), clips)
            add(rc.ids.tolist(), rollout.ENV)
            if rc.pixels is not None:
                t.videos.append((rc.pixels, rc.grid))
        elif calls and j < len(messages) and t.n_tool_turns >= cfg.max_turns:
            # calls with the budget spent and an answer recorded after them: the rollout's forced-answer message
            add(rollout.encode_chunk(processor, rollout.response_chunk_text([], True)).ids.tolist(), rollout.ENV)
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
                 sft_data: str | None, seed: int, gated_choices: list[int], always_call: bool = False,
                 direct_crop: float = 0.0, budget_fraction: float = 0.0, tool_free: float = 0.0,
                 keep_bad_calls: bool = False, max_bad_fraction: float = 0.2, workers: int = 1,
                 cache_bytes: float = float("inf"), log=print) -> tuple[SFTItems, int]:
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
        pairs, errors = data.oracle_sft_pairs(records, cfg, seed, gated_choices, always_call, direct_crop,
                                              budget_fraction, tool_free)

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
