"""
Tests for the real Qwen tokenizer built offline (model.qwen_tokenizer), the text-derived span helpers
(decode_with_offsets, text_spans_to_token_spans, tagged_spans, tag_token_mask) on BOTH tokenizers, and
the tiny model on Qwen's tokenizer and vocab (load_model("tiny-qwen")).

    python -m pytest tests/test_qwen.py -q

Reference for the ids: Qwen2/Qwen3's tokenizer.json and tokenizer_config.json (151,643 BPE ranks, 151,387
merges, added tokens 151643..151668; "<|im_end|>" = 151645, "<|video_pad|>" = 151656, "</think>" = 151668).
Where `tiktoken` is installed (a dependency of `qwen-tokenizer`) the encodings are compared with a
tiktoken.Encoding over the same ranks, the reference implementation of this BPE.
"""
import json
import unicodedata

import numpy as np
import pytest
import torch

import model as model_lib
import rollout
import video

RECORD = {"video": "clip.mp4", "question": "What colour is the square?", "options": ["red", "blue"], "task": "mcq"}
CLOSE_TAGS = ("</think>", "</tool_call>", "</answer>")
SAMPLES = [
    "Hello, world!", "<answer>B</answer>", "I'm sure they'll say it's 2024-05-17: 3.14159 x 10^3",
    "  leading spaces\tand\ttabs\r\n\r\nnew lines\n\n\n  ", "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé café naïve 東京タワー 你好，世界！ 😀👍🏽 مرحبا", "e\u0301 composed by NFC",   # NFC: e + U+0301 -> é
    '{"name": "crop_video", "arguments": {"start_time": 12.5, "end_time": 20.0}}',
    "<|im_start|>user\n<|vision_start|><|video_pad|><|video_pad|><|vision_end|>Why?<|im_end|>",
    "<think>\nlook closer\n</think>\n<tool_call>\n{}\n</tool_call><tool_response>x</tool_response>",
]


@pytest.fixture(scope="module")
def qwen():
    return model_lib.qwen_tokenizer()


@pytest.fixture(scope="module")
def tiny_tok():
    return model_lib.build_tokenizer(2048, rollout.prompt_corpus())


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def tok(request, tiny_tok, qwen):
    """Each span test runs on both tokenizers: tags as single added tokens (tiny) and as text (Qwen)."""
    return tiny_tok if request.param == "tiny" else qwen


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the real tokenizer

def test_qwen_reference_ids(qwen):
    """Two reference encodings of the released tokenizer."""
    assert encode(qwen, "Hello, world!") == [9707, 11, 1879, 0]
    ids = encode(qwen, "<answer>B</answer>")
    assert ids == [27, 9217, 36721, 522, 9217, 29]
    assert qwen.convert_ids_to_tokens(ids) == ["<", "answer", ">B", "</", "answer", ">"]
    assert encode(qwen, "2024") == [17, 15, 17, 19]           # single digits (\p{N}, not \p{N}{1,3})


def test_qwen_added_tokens_at_real_ids(qwen):
    expect = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
              "<|box_start|>": 151648, "<|quad_start|>": 151650, "<|vision_start|>": 151652,
              "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
              "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_pad|>": 151662,
              "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665,
              "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
    for token, i in expect.items():
        assert encode(qwen, f"a{token}b") == [64, i, 65], token
        assert qwen.decode([i]) == token
    assert len(qwen) == 151669 <= model_lib.QWEN_VOCAB_SIZE
    assert (qwen.eos_token, qwen.pad_token, qwen.bos_token, qwen.unk_token) == ("<|im_end|>", "<|endoftext|>", None, None)
    # <answer> is NOT a token of Qwen: special_token_ids says so instead of returning a wrong id
    ids = model_lib.special_token_ids(type("P", (), {"tokenizer": qwen})())
    assert ids["<answer>"] is None and ids["</answer>"] is None and ids["<think>"] == 151667


def test_qwen_skip_special_keeps_tags_drops_chatml(qwen):
    """As released: ChatML / vision markers are special, the tool and reasoning tags are not."""
    ids = encode(qwen, "<|im_start|><think>a</think><tool_call>b</tool_call><|video_pad|><|im_end|>")
    assert qwen.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>b</tool_call>"


@pytest.mark.parametrize("text", SAMPLES)
def test_qwen_round_trip_and_tiktoken_reference(qwen, text):
    """decode(encode(x)) = NFC(x); and the ids equal tiktoken's over the same ranks and pattern."""
    ids = encode(qwen, text)
    assert qwen.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    tiktoken = pytest.importorskip("tiktoken")
    ref = _tiktoken_reference(tiktoken)
    assert ids == ref.encode(unicodedata.normalize("NFC", text), allowed_special="all")


_REFERENCE = {}


def _tiktoken_reference(tiktoken):
    if "enc" not in _REFERENCE:
        data, name = model_lib._qwen_ranks_file()
        specials = {t: 151643 + k for k, (t, _) in enumerate(model_lib.QWEN_ADDED_TOKENS)}
        _REFERENCE["enc"] = tiktoken.Encoding("qwen-ref", pat_str=model_lib.QWEN_PRETOKENIZE,
                                              mergeable_ranks=model_lib.parse_bpe_ranks(data, name),
                                              special_tokens=specials)
    return _REFERENCE["enc"]


def test_qwen_long_random_text_matches_tiktoken(qwen):
    """A long pseudo-random mix of bytes-level edge cases (digits, CJK, punctuation runs, whitespace)."""
    tiktoken = pytest.importorskip("tiktoken")
    rng = np.random.default_rng(0)
    alphabet = list("abcxyzABC0123456789 .,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|\n\t") + list("éüß東京你好世界😀")
    text = "".join(rng.choice(alphabet, size=4000)) + " " + " ".join(SAMPLES)
    ref = _tiktoken_reference(tiktoken).encode(unicodedata.normalize("NFC", text), allowed_special="all")
    assert encode(qwen, text) == ref


def test_merges_recovered_from_ranks():
    """Toy ranks: the merge of each token is the last join of BPE on its own bytes; non-BPE ranks fail."""
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"cab": 6}
    assert model_lib.bpe_merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"c", b"ab")]
    with pytest.raises(ValueError, match="cannot be built"):
        model_lib.bpe_merges_from_ranks({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


@pytest.mark.slow
def test_qwen_merge_count_and_disk_cache(tmp_path, monkeypatch):
    """151,387 merges as in Qwen's tokenizer.json; the built tokenizer is written once under cache_dir
    and read back (same vocabulary and merges) when the in-process cache is empty."""
    data, name = model_lib._qwen_ranks_file()
    a = model_lib.qwen_tokenizer(cache_dir=str(tmp_path))
    state = json.loads(a.backend_tokenizer.to_str())
    assert len(state["model"]["merges"]) == 151387 and len(state["model"]["vocab"]) == model_lib.QWEN_NUM_RANKS
    [path] = tmp_path.iterdir()
    assert path.name.startswith("qwen-") and path.suffix == ".json"
    monkeypatch.setattr(model_lib, "_QWEN_TOKENIZER_JSON", {})
    monkeypatch.setattr(model_lib, "_build_qwen_backend", lambda ranks: pytest.fail("rebuilt despite the disk cache"))
    b = model_lib.qwen_tokenizer(cache_dir=str(tmp_path))
    assert b.backend_tokenizer.to_str() == a.backend_tokenizer.to_str()
    assert b is not a and encode(b, "Hello, world!") == [9707, 11, 1879, 0]


def test_bad_ranks_file_is_named():
    with pytest.raises(ValueError, match=r"ranks.tiktoken line 2 is not 'base64 rank'"):
        model_lib.parse_bpe_ranks(b"YQ== 0\nnot-a-line\n", "ranks.tiktoken")
    with pytest.raises(ValueError, match="ranks.tiktoken holds 1 distinct ranks"):
        model_lib.parse_bpe_ranks(b"YQ== 0\n", "ranks.tiktoken")


def test_same_prompts_on_both_tokenizers(tiny_tok, qwen):
    """The project's chat template on both: the prompt text (system, Hermes tools block, video, question)
    and a rendered trajectory with tool calls and tool results are identical strings."""
    processors = [model_lib.build_processor(t, model_lib.ModelConfig()) for t in (tiny_tok, qwen)]
    a, b = (rollout.prompt_text(p, RECORD, tools_block=True) for p in processors)
    assert a == b and "<tools>" in a and a.endswith("<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"function": {"name": "crop_video", "arguments": {"start_time": 1.0, "end_time": 2.0}}}]},
                {"role": "tool", "content": "clip"}]
    a, b = (t.apply_chat_template(messages, tokenize=False) for t in (tiny_tok, qwen))
    assert a == b and "<tool_call>\n{\"name\": \"crop_video\"" in a and "<tool_response>\nclip\n</tool_response>" in a


# ----------------------------------------------------------------------------- spans from the text, both tokenizers

TRAJ = ("<|im_start|>assistant\n<think>\ntwo marks, look closer\n</think>\n"
        + "<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 30.0, \"end_time\": 34.0}}\n</tool_call>\n"
        + "<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 10.0, \"end_time\": 14.0}}\n</tool_call>"
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\nClip 30.0-34.0 s:<|vision_start|><|video_pad|>"
        + "<|video_pad|><|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nseen\n</think>\n"
        + "<answer>B</answer><|im_end|>")


def covered_text(text, offsets, span) -> str:
    t0, t1 = span
    return text[offsets[t0][0]:offsets[t1 - 1][1]] if t1 > t0 else ""


@pytest.mark.parametrize("text", SAMPLES + [TRAJ])
def test_offsets_tile_the_decoded_text(tok, text):
    """The offsets are over exactly tok.decode(ids); consecutive tokens meet or share one character
    (a multi-byte character split across tokens), and cover the whole text."""
    ids = encode(tok, text)
    decoded, offsets = model_lib.decode_with_offsets(tok, ids)
    assert decoded == tok.decode(ids, skip_special_tokens=False)
    assert len(offsets) == len(ids) and offsets[0][0] == 0 and offsets[-1][1] == len(decoded)
    for (s0, e0), (s1, e1) in zip(offsets, offsets[1:]):
        assert s0 < e0 and s1 in (e0, e0 - 1), (offsets, decoded)
    assert model_lib.token_offsets(tok, torch.tensor(ids)) == offsets
    if all(ord(c) < 128 for c in decoded):              # one byte per character: pieces are the tokens' text
        assert [decoded[s:e] for s, e in offsets] == [tok.decode([i]) for i in ids]
        assert model_lib._prefix_offsets(tok, ids) == (decoded, offsets)   # the generic fallback agrees


def test_answer_span_after_the_text_answer_tag(tok):
    """The answer's tokens are found from the text '<answer>', also when Qwen merges its '>' with the answer."""
    for answer in ["B", "B. blue", "12.5"]:
        ids = encode(tok, f"<think>\nok\n</think>\n<answer>{answer}</answer><|im_end|>")
        text, offsets = model_lib.decode_with_offsets(tok, ids)
        [chars] = model_lib.tagged_spans(text, "<answer>", "</answer>")
        assert text[chars[0]:chars[1]] == answer
        [span] = model_lib.text_spans_to_token_spans(offsets, [chars])
        got = covered_text(text, offsets, span)
        assert answer in got and got in f">{answer}<"            # at most the merged tag characters around it
        if "<answer>" in tok.get_vocab():                        # tiny: one added token before the answer
            assert ids[span[0] - 1] == tok.convert_tokens_to_ids("<answer>")
        elif answer[0].isalpha():                                # Qwen: '>B' carries the tag's last character
            assert tok.convert_ids_to_tokens(ids[span[0]]) == ">" + answer[0]


def test_tool_call_spans(tok):
    ids = encode(tok, TRAJ)
    text, offsets = model_lib.decode_with_offsets(tok, ids)
    chars = model_lib.tagged_spans(text, "<tool_call>", "</tool_call>", inner=False)
    spans = model_lib.text_spans_to_token_spans(offsets, chars)
    assert len(spans) == 2 and spans[0][1] <= spans[1][0]
    for (t0, t1), window in zip(spans, ["30.0", "10.0"]):
        got = tok.decode(ids[t0:t1], skip_special_tokens=False)
        assert got.startswith("<tool_call>") and got.endswith("</tool_call>") and window in got
    # a truncated call (no close tag) runs to the end of the text
    text2 = "<tool_call>\n{\"name\": \"crop"
    assert model_lib.tagged_spans(text2, "<tool_call>", "</tool_call>") == [(11, len(text2))]


def test_closing_tag_mask(tok):
    """tag_token_mask marks exactly the tokens that hold characters of each closing tag."""
    ids = encode(tok, TRAJ)
    text, offsets = model_lib.decode_with_offsets(tok, ids)
    mask = model_lib.tag_token_mask(tok, ids)
    assert mask.dtype == torch.bool and mask.shape == (len(ids),)
    tag_chars = [s for tag in CLOSE_TAGS for s in model_lib.find_text(text, tag)]
    assert len(tag_chars) == 5                                   # 2 </think>, 2 </tool_call>, 1 </answer>
    overlaps = lambda s, e: any(s < c1 and c0 < e for c0, c1 in tag_chars)
    assert mask.tolist() == [overlaps(s, e) for s, e in offsets]
    marked = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    for tag in CLOSE_TAGS:
        assert tag in marked
    assert "<answer>" not in marked and "<think>" not in marked.replace("</think>", "")
    # batched (B, L) form, one row at a time
    batch = torch.tensor([ids, ids])
    assert torch.equal(model_lib.tag_token_mask(tok, batch), torch.stack([mask, mask]))


def test_video_pad_runs_from_text(tok):
    """The character spans of '<|video_pad|>' in the decoded text are exactly the video placeholder tokens
    the real processor wrote (text timestamps between the temporal patches included)."""
    processor = model_lib.build_processor(tok, model_lib.ModelConfig())
    frames = video.synthetic_frames(8, 64, 64, seed=3)
    clip = video.Clip(frames, np.arange(8) * 0.5 + 10.0, "clip.mp4", 8)
    c = rollout.encode_chunk(processor, rollout.prompt_text(processor, RECORD, tools_block=True), [clip])
    ids = c.ids.tolist()
    text, offsets = model_lib.decode_with_offsets(tok, ids)
    pads = model_lib.text_spans_to_token_spans(offsets, model_lib.find_text(text, "<|video_pad|>"))
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    assert [t0 for t0, t1 in pads] == [j for j, i in enumerate(ids) if i == video_id]
    assert all(t1 == t0 + 1 for t0, t1 in pads) and len(pads) == 4 * 2 * 2     # 4 temporal patches x 2x2
    # the whole video: per temporal patch "<t seconds><|vision_start|> pads <|vision_end|>", and no outer
    # <|vision_start|> .. <|vision_end|> pair around them all (the processor replaces the chat template's)
    c0 = text.find("<10.2 seconds>")
    c1 = text.rfind("<|vision_end|>") + len("<|vision_end|>")
    [(v0, v1)] = model_lib.text_spans_to_token_spans(offsets, [(c0, c1)])
    got = tok.decode(ids[v0:v1], skip_special_tokens=False)
    assert got.count("seconds>") == 4 and got.count("<|vision_start|>") == 4 == got.count("<|vision_end|>")
    assert text[:c0].count("<|vision_start|>") == 0 and got.startswith("<10.2 seconds><|vision_start|>")
    assert ids[v0:v1].count(video_id) == 16 and ids[v1 - 1] == tok.convert_tokens_to_ids("<|vision_end|>")


def test_split_multibyte_character(qwen):
    """A CJK character split over two byte-level tokens: both tokens cover it, and a span over it maps to both."""
    text = "看"                                                   # not one Qwen token: bytes split
    ids = encode(qwen, f"a {text} b")
    decoded, offsets = model_lib.decode_with_offsets(qwen, ids)
    [(c0, c1)] = model_lib.find_text(decoded, text)
    t0, t1 = model_lib.text_spans_to_token_spans(offsets, [(c0, c1)])[0]
    assert qwen.decode(ids[t0:t1]).strip() == text
    if len(encode(qwen, text)) > 1:
        assert t1 - t0 >= 2 and offsets[t0][1] > c0 and offsets[t1 - 1][0] < c1


def test_ids_past_the_tokenizer_are_empty(qwen):
    """The model's vocab (151,936) is larger than the tokenizer's (151,669): such an id decodes to nothing."""
    assert model_lib.decode_with_offsets(qwen, [9707, 151700, 11]) == ("Hello,", [(0, 5), (5, 5), (5, 6)])


def test_text_spans_to_token_spans_by_hand():
    offsets = [(0, 1), (1, 7), (7, 9), (9, 11), (11, 17), (17, 18)]     # '<' 'answer' '>B' '</' 'answer' '>'
    assert model_lib.text_spans_to_token_spans(offsets, [(8, 9), (9, 18), (0, 8), (8, 8), (18, 18)]) == \
        [(2, 3), (3, 6), (0, 3), (2, 2), (6, 6)]
    assert model_lib.text_spans_to_token_spans([(0, 2), (1, 3)], [(1, 2)]) == [(0, 2)]  # shared character


# ----------------------------------------------------------------------------- tiny model on Qwen's tokenizer

@pytest.mark.slow
def test_tiny_qwen_model_runs_the_prompt():
    """load_model("tiny-qwen"): the tiny architecture with Qwen's tokenizer and the 151,936-row vocab; the
    processor path (timestamps, video placeholders) works as on the tiny model and a forward runs."""
    model, processor = model_lib.load_model("tiny-qwen", device="cpu")
    assert model.config.text_config.vocab_size == model_lib.QWEN_VOCAB_SIZE
    assert model.config.video_token_id == 151656 and model.config.vision_start_token_id == 151652
    assert model.get_input_embeddings().weight.shape == (model_lib.QWEN_VOCAB_SIZE, model_lib.ModelConfig().hidden)
    assert model.config.tiny_model_config["tokenizer"] == "qwen"
    assert encode(processor.tokenizer, "Hello, world!") == [9707, 11, 1879, 0]
    frames = video.synthetic_frames(8, 64, 64, seed=3)
    clip = video.Clip(frames, np.arange(8) * 0.5 + 10.0, "clip.mp4", 8)
    c = rollout.encode_chunk(processor, rollout.prompt_text(processor, RECORD, tools_block=True), [clip])
    assert int((c.ids == 151656).sum()) == 16
    assert processor.tokenizer.decode(c.ids, skip_special_tokens=False).count(" seconds><|vision_start|>") == 4
    with torch.no_grad():
        out = model(input_ids=c.ids[None], mm_token_type_ids=c.mm_types[None], pixel_values_videos=c.pixels,
                    video_grid_thw=c.grid)
    assert out.logits.shape == (1, len(c.ids), model_lib.QWEN_VOCAB_SIZE) and torch.isfinite(out.logits).all()


def test_qwen_processor_saves_and_reloads(qwen, tmp_path):
    """A tiny-qwen checkpoint's processor (save_model writes it) reloads through AutoProcessor with the same
    tokenizer: ids, added tokens, special flags and chat template."""
    from transformers import AutoProcessor
    processor = model_lib.build_processor(qwen, model_lib.ModelConfig())
    processor.save_pretrained(str(tmp_path))
    back = AutoProcessor.from_pretrained(str(tmp_path))
    text = TRAJ + " Hello, world! 2024 東京"
    assert encode(back.tokenizer, text) == encode(qwen, text)
    assert back.tokenizer.decode(encode(qwen, TRAJ), skip_special_tokens=True) == \
        qwen.decode(encode(qwen, TRAJ), skip_special_tokens=True)
    assert rollout.prompt_text(back, RECORD, tools_block=True) == rollout.prompt_text(processor, RECORD, tools_block=True)
