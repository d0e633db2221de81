"""
Tests for model.py: the embedded tiny Qwen3-VL, its offline tokenizer and chat template, the real
processor's video path (text timestamps), and saving / reloading in Hugging Face format.

    python -m pytest tests/test_model.py -q

The tiny model is built once per module. Reference for the chat-template shape: the Qwen3 template
(ChatML turns, Hermes `<tools>` block in the system turn, `<tool_call>` JSON lines, tool results folded
into one user turn of `<tool_response>` blocks).
"""
import json
import re

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForImageTextToText, AutoProcessor

import model as model_lib
import rollout
import video

FPS, SECONDS, SIDE = 10, 40, 64        # the synthetic test video: 40 s at 10 fps, 64x64
VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"
TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
          "<|image_pad|>", "<|video_pad|>"]
TAGS = [t for t in model_lib.SPECIAL_TOKENS if t not in CHATML]   # <think>, <tool_call>, <answer>, ...
RECORD = {"video": "clip.mp4", "question": "What colour is the square?", "options": ["red", "blue"], "task": "mcq"}


@pytest.fixture(scope="module")
def tiny():
    """(model, processor) of the embedded default, fp32 on CPU (so logits compare exactly)."""
    return model_lib.load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())


@pytest.fixture(scope="module")
def clip() -> video.Clip:
    """An (8, 3, 64, 64) uint8 clip at 0.5 s spacing, no file behind it."""
    frames = video.synthetic_frames(8, SIDE, SIDE, seed=3)
    return video.Clip(frames, np.arange(8) * 0.5 + 10.0, "clip.mp4", 8)


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("vid") / "long.mp4"
    video.write_video(path, video.synthetic_frames(FPS * SECONDS, SIDE, SIDE, seed=1), FPS)
    return path


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """The tiny model written with save_model (Hugging Face format)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    model_lib.save_model(*tiny, str(path))
    return path


def inputs(processor, clip: video.Clip) -> dict:
    """Model kwargs for the full agent prompt (system + tools + video + question) around `clip`."""
    c = rollout.encode_chunk(processor, rollout.prompt_text(processor, RECORD, tools_block=True), [clip])
    return dict(input_ids=c.ids[None], attention_mask=torch.ones_like(c.ids)[None],
                mm_token_type_ids=c.mm_types[None], pixel_values_videos=c.pixels, video_grid_thw=c.grid)


def logits(model, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs).logits


# ----------------------------------------------------------------------------- architecture

def test_tiny_is_a_real_qwen3_vl(tiny):
    model, processor = tiny
    assert type(model) is transformers.Qwen3VLForConditionalGeneration
    assert type(processor) is transformers.Qwen3VLProcessor
    assert model.config.model_type == "qwen3_vl"
    assert len(model.config.vision_config.deepstack_visual_indexes) > 0
    rope = model.config.text_config.rope_parameters
    # M-RoPE: the (t, h, w) sections split the head's rotary pairs exactly
    assert sum(rope["mrope_section"]) == model.config.text_config.head_dim // 2
    assert 1e6 <= model_lib.count_parameters(model) <= 2e7
    assert next(model.parameters()).dtype == torch.float32
    assert json.loads(model_lib.describe(model))["model_type"] == "qwen3_vl"


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_is_deterministic(tiny):
    """Two offline builds give the same vocabulary and merges, and the same as the loaded model's."""
    a = model_lib.build_tokenizer(2048, rollout.prompt_corpus())
    b = model_lib.build_tokenizer(2048, rollout.prompt_corpus())
    assert a.get_vocab() == b.get_vocab() == tiny[1].tokenizer.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(tiny[1].tokenizer) <= tiny[0].config.text_config.vocab_size


@pytest.mark.parametrize("token", model_lib.SPECIAL_TOKENS)
def test_special_token_is_one_token_and_round_trips(tiny, token):
    """Alone and inside text, each structural token is a single id that decodes back to itself."""
    tok = tiny[1].tokenizer
    ids = tok(token, add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(token)]
    assert tok.decode(ids, skip_special_tokens=False) == token
    text = f"look 12.5{token}the end"
    inner = tok(text, add_special_tokens=False)["input_ids"]
    assert inner.count(ids[0]) == 1
    assert tok.decode(inner, skip_special_tokens=False) == text


def test_text_tags_survive_skip_special_tokens(tiny):
    """Qwen3's tokenizer marks only the ChatML / vision tokens special; <think>, <tool_call>, <answer>, ...
    are plain added tokens, so decode(skip_special_tokens=True) keeps them (as rollout's sub-agent text
    does on a real checkpoint) while it drops <|im_end|> and the vision markers."""
    tok = tiny[1].tokenizer
    text = "".join(f"{t}x" for t in TAGS)
    ids = tok(f"<|im_start|>{text}{VIDEO_TEXT}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text


# ----------------------------------------------------------------------------- chat template

CALLS = [{"type": "function", "function": {"name": "crop_video", "arguments": {"start_time": 12.0, "end_time": 20.0}}},
         {"type": "function", "function": {"name": "crop_video",
                                           "arguments": {"start_time": 3.5, "end_time": 9.5, "resolution": "fine"}}}]
CONVERSATION = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "Q?"}]},
    {"role": "assistant", "content": "<think>\nlook closer\n</think>", "tool_calls": CALLS},
    {"role": "tool", "content": "first result"},
    {"role": "tool", "content": [{"type": "video", "video": "c.mp4"}, {"type": "text", "text": "second"}]},
]
TURNS = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Q?<|im_end|>\n"
         "<|im_start|>assistant\n<think>\nlook closer\n</think>\n"
         "<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 12.0, \"end_time\": 20.0}}"
         "\n</tool_call>\n"
         "<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 3.5, \"end_time\": 9.5, "
         "\"resolution\": \"fine\"}}\n</tool_call><|im_end|>\n"
         "<|im_start|>user\n<tool_response>\nfirst result\n</tool_response>\n"
         "<tool_response>\n<|vision_start|><|video_pad|><|vision_end|>second\n</tool_response><|im_end|>\n"
         "<|im_start|>assistant\n")


def test_chat_template_with_tools(tiny):
    """System + Hermes <tools> block (one JSON line per tool), then the turns; the two tool messages
    fold into one user turn of <tool_response> blocks."""
    tools_block = ("<|im_start|>system\nSYS\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                   "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                   + json.dumps(video.CROP_VIDEO_TOOL) + "\n</tools>\n\nFor each function call, return a json object "
                   "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    for renderer in (tiny[1].tokenizer, tiny[1]):   # tokenizer and processor carry the same template
        got = renderer.apply_chat_template(CONVERSATION, tools=[video.CROP_VIDEO_TOOL], tokenize=False,
                                           add_generation_prompt=True)
        assert got == tools_block + TURNS


def test_chat_template_without_tools(tiny):
    got = tiny[1].tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert got == "<|im_start|>system\nSYS<|im_end|>\n" + TURNS
    # the agent prompt ends on the assistant tag and holds exactly one video placeholder
    prompt = rollout.prompt_text(tiny[1], RECORD, tools_block=True)
    assert prompt.endswith("<|im_start|>assistant\n") and prompt.count("<|video_pad|>") == 1


ARGS = {"start_time": 1.0, "end_time": 2.0}
ONE_CALL = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 1.0, "end_time": 2.0}}\n</tool_call>'


@pytest.mark.parametrize("content, arguments, expected", [
    ("ok", ARGS, "ok\n" + ONE_CALL),              # tool calls after text: a newline separates them
    ("", ARGS, ONE_CALL),                         # no text before the first call: Qwen3 adds no blank line
    # arguments already a JSON string (OpenAI wire format): Qwen3 inserts it verbatim, not re-quoted
    ("ok", json.dumps(ARGS), "ok\n" + ONE_CALL),
], ids=["text-then-call", "call-only", "string-arguments"])
def test_chat_template_tool_call_edge_cases(tiny, content, arguments, expected):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": {"name": "crop_video", "arguments": arguments}}]}]
    got = tiny[1].tokenizer.apply_chat_template(messages, tokenize=False)
    assert got == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n" + expected + "<|im_end|>\n"


# ----------------------------------------------------------------------------- forward / generate

@pytest.mark.slow
def test_forward_and_generate_with_video(tiny, clip):
    model, processor = tiny
    kw = inputs(processor, clip)
    n = kw["input_ids"].shape[1]
    # 8 frames of 64x64 -> 4 temporal patches x (64/32)^2 = 16 video tokens
    assert (kw["input_ids"] == model.config.video_token_id).sum().item() == 16
    out = logits(model, kw)
    assert out.shape == (1, n, model.config.text_config.vocab_size)
    assert torch.isfinite(out).all()
    # the pixels reach the logits: another clip changes them
    other = video.Clip(255 - clip.frames, clip.times, clip.path, clip.decoded)
    assert not torch.allclose(out, logits(model, inputs(processor, other)))
    with torch.no_grad():
        gen = model.generate(**kw, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert gen.shape == (1, n + 6)
    assert torch.equal(gen[0, :n], kw["input_ids"][0])
    # every greedy token is the argmax of one full forward over the prompt and the tokens before it (generate
    # decodes on transformers' cache, which our decoder layers must read: a layer that dropped it would have each
    # new token attend to itself alone, and only the first token would agree)
    full = {**kw, "input_ids": gen, "attention_mask": torch.ones_like(gen),
            "mm_token_type_ids": torch.cat([kw["mm_token_type_ids"], torch.zeros(1, 6, dtype=torch.long)], 1)}
    stop = model.generation_config.eos_token_id
    want = logits(model, full)[0, n - 1:-1].index_fill(1, torch.tensor([stop]).view(-1), float("-inf")).argmax(-1)
    assert gen[0, n:].tolist() == want.tolist()


# ----------------------------------------------------------------------------- processor timestamps

@pytest.mark.parametrize("kind, lo, hi", [
    ("crop", 20.0, 24.0),      # a crop's timestamps are absolute times in the video, not 0-based
    ("overview", 0.0, SECONDS),  # an overview spans the whole video
])
def test_processor_timestamps_are_absolute(tiny, video_path, kind, lo, hi):
    processor = tiny[1]
    if kind == "crop":
        c = video.crop(video_path, lo, hi, level="medium", fps=2.0, max_frames=128, max_pixels=SIDE * SIDE)
    else:
        c = video.sample_overview(video_path, nframes=8)
    chunk = rollout.encode_chunk(processor, VIDEO_TEXT, [c])
    stamps = [float(s) for s in TIMESTAMP.findall(processor.tokenizer.decode(chunk.ids))]
    T = len(c.times)
    assert len(stamps) == T // 2 == chunk.grid[0, 0].item()
    assert all(lo <= s <= hi for s in stamps)
    span = (hi - lo) / (T // 2)                      # one temporal patch covers this much time
    assert stamps[0] - lo < span and hi - stamps[-1] < span
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] > (hi - lo) / 2
    # one timestamp per 2-frame patch: the mean of the pair's times, printed with one decimal
    pairs = c.times.reshape(-1, 2).mean(axis=1)
    np.testing.assert_allclose(stamps, pairs, atol=0.05 + 1e-9)


# ----------------------------------------------------------------------------- save / load

def test_save_writes_hugging_face_files(saved):
    names = {p.name for p in saved.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads((saved / "config.json").read_text())["model_type"] == "qwen3_vl"


def test_reload_with_auto_classes(tiny, saved, clip):
    model, processor = tiny
    model2 = AutoModelForImageTextToText.from_pretrained(str(saved)).eval()
    processor2 = AutoProcessor.from_pretrained(str(saved))
    assert type(model2) is type(model) and type(processor2) is type(processor)
    # the reloaded processor encodes prompt + video exactly as the original
    kw, kw2 = inputs(processor, clip), inputs(processor2, clip)
    assert kw.keys() == kw2.keys() and all(torch.equal(kw[k], kw2[k]) for k in kw)
    text = "Question: what came first? <think>\n</think><answer>B</answer> 12.5 seconds"
    assert processor2.tokenizer(text)["input_ids"] == processor.tokenizer(text)["input_ids"]
    assert model_lib.special_token_ids(processor2) == model_lib.special_token_ids(processor)
    assert processor2.tokenizer.apply_chat_template(CONVERSATION, tools=[video.CROP_VIDEO_TOOL], tokenize=False) == \
        processor.tokenizer.apply_chat_template(CONVERSATION, tools=[video.CROP_VIDEO_TOOL], tokenize=False)
    # the plain Hugging Face class (Conv3d patch embedding) agrees to rounding; with our matmul, exactly
    torch.testing.assert_close(logits(model2, kw), logits(model, kw), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits(model_lib.use_linear_patch_embed(model2), kw), logits(model, kw))


def test_load_model_from_directory(tiny, saved, clip):
    """The real-checkpoint path of load_model, on CPU in fp32."""
    model2, processor2 = model_lib.load_model(str(saved), device="cpu")
    assert next(model2.parameters()).dtype == torch.float32
    assert next(model2.parameters()).device.type == "cpu" and not model2.training
    kw = inputs(processor2, clip)
    assert torch.equal(logits(model2, kw), logits(tiny[0], kw))


@pytest.mark.parametrize("source", ["tiny", "saved"])
def test_bf16_load_keeps_the_rotary_frequencies_fp32(tiny, saved, source):
    """--precision bf16's loads (eval.py on CUDA, the KL reference) put the parameters in bf16 and leave every
    buffer as it was: a bf16 inv_freq is off by about 14 rad of angle at 16k tokens. Both paths of load_model:
    the embedded default and a checkpoint directory (from_pretrained, then the cast)."""
    model, _ = model_lib.load_model(source if source == "tiny" else str(saved), device="cpu", dtype=torch.bfloat16,
                                    tiny_corpus=rollout.prompt_corpus())
    reference = dict(tiny[0].named_buffers())
    rotary = [n for n, _ in model.named_buffers() if n.endswith("inv_freq")]
    assert rotary and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for name, buf in model.named_buffers():
        assert buf.dtype == reference[name].dtype, name
        assert torch.equal(buf, reference[name]), name
    angle = lambda m: 16384 * dict(m.named_buffers())[rotary[0]].double()
    assert (angle(model) - angle(tiny[0])).abs().max() == 0


@pytest.mark.parametrize("rel", [
    "missing",               # absolute path to a directory that does not exist
    "nested/missing/model",  # several levels below the temporary folder
])
def test_load_model_missing_directory(tmp_path, rel):
    path = str(tmp_path / rel)
    with pytest.raises(FileNotFoundError, match=re.escape(path)):
        model_lib.load_model(path, device="cpu")


# ----------------------------------------------------------------------------- special ids

def test_special_token_ids(tiny):
    model, processor = tiny
    ids = model_lib.special_token_ids(processor)
    assert list(ids) == model_lib.SPECIAL_TOKENS
    assert all(isinstance(i, int) for i in ids.values()) and len(set(ids.values())) == len(ids)
    assert all(processor.tokenizer.convert_ids_to_tokens(i) == t for t, i in ids.items())
    # the model config points at the same ids
    assert ids["<|video_pad|>"] == model.config.video_token_id
    assert ids["<|vision_start|>"] == model.config.vision_start_token_id
    assert ids["<|im_end|>"] == model.generation_config.eos_token_id
    assert ids["<|endoftext|>"] == model.generation_config.pad_token_id


# ----------------------------------------------------------------------------- the transformers floor

@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.20.0", "5.23.0", "5.24.0", "5.25.0.dev0"])
def test_check_transformers_below_floor_raises(version):
    """Below 5.24 Qwen3-VL's forward has no `cache=` argument: the engine's K/V store would be silently
    ignored (the keyword lands in **kwargs); 5.24 nests a video's frames in an extra outer vision pair that no
    Qwen3-VL checkpoint was trained on. Importing model.py must refuse such a version."""
    with pytest.raises(RuntimeError, match=re.escape(version) + ".*" + re.escape(model_lib.MIN_TRANSFORMERS)):
        model_lib.check_transformers(version)


@pytest.mark.parametrize("version", ["5.25.0", "5.25.1", "5.30.0"])
def test_check_transformers_at_or_above_floor_passes(version):
    model_lib.check_transformers(version)


@pytest.mark.slow
def test_import_model_below_floor_fails(tmp_path):
    """Importing model.py under an older transformers (its version as importlib.metadata reports it,
    faked here in a fresh interpreter) fails at once with one line naming both versions."""
    import os
    import subprocess
    import sys
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '5.23.0' if name == 'transformers' else real(name); import model")
    root = os.path.dirname(model_lib.__file__)
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError") and "5.23.0" in last and model_lib.MIN_TRANSFORMERS in last


def test_requirements_floor_is_the_checked_floor():
    """requirements.txt's `transformers>=X` is the floor model.py enforces."""
    with open(f"{model_lib.__file__.rsplit('/', 1)[0]}/requirements.txt") as f:
        pins = [line.split(",")[0].strip() for line in f if line.startswith("transformers")]
    assert pins == [f"transformers>={model_lib.MIN_TRANSFORMERS}"]


# ----------------------------------------------------------------------------- the vision patch embedding as one matmul

def _patch_embeds():
    """(name, HF patch embedding, patch volume) with random weights: the tiny Qwen3-VL's, Qwen3-VL-8B's
    (3 channels x 2 frames x 16 x 16 -> 1152, with bias) and Qwen2.5-VL's (3 x 2 x 14 x 14 -> 1280, no bias)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed
    torch.manual_seed(0)
    tiny_vision = model_lib.build_tiny()[0].config.vision_config
    out = [("tiny", Qwen3VLVisionPatchEmbed(tiny_vision)),
           ("qwen3vl-8b", Qwen3VLVisionPatchEmbed(model_lib.qwen3vl_config("8b").vision_config)),
           ("qwen2.5vl", Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=1280))]
    for _, m in out:
        torch.nn.init.normal_(m.proj.weight, std=0.02)
        if m.proj.bias is not None:
            torch.nn.init.normal_(m.proj.bias)
    return [(name, m, m.in_channels * m.temporal_patch_size * m.patch_size ** 2) for name, m in out]


def test_linear_patch_embed_equals_conv3d():
    """The Conv3d (kernel == stride, input already cut into patches) is one linear map of each flattened
    patch: LinearPatchEmbed gives the Conv3d's output to 1e-5, in fp32, keeping the same parameters; in
    bf16 (fp32 pixels cast to the weight dtype, as the HF forward does) to bf16 rounding."""
    for name, conv, volume in _patch_embeds():
        x = torch.randn(300, volume, generator=torch.Generator().manual_seed(1))
        lin = model_lib.LinearPatchEmbed(conv)
        assert lin.proj is conv.proj and type(lin.proj) is torch.nn.Conv3d
        with torch.no_grad():
            torch.testing.assert_close(lin(x), conv(x), atol=1e-5, rtol=1e-5, msg=name)
            conv.to(torch.bfloat16)
            got, want = lin(x), conv(x)
        assert got.dtype == torch.bfloat16 and got.shape == (300, conv.embed_dim)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.slow
def test_models_run_the_linear_patch_embed(tiny, saved):
    """Built and loaded models (tiny; a checkpoint through load_model; Qwen3-VL at published shapes) run
    the patch embedding as a matmul, and their state dict keeps the Hugging Face layout (a 5-D Conv3d weight
    under ...patch_embed.proj.weight), so save_pretrained output reloads with the Auto classes."""
    from transformers import Qwen3VLForConditionalGeneration
    reference = Qwen3VLForConditionalGeneration(tiny[0].config).state_dict()
    loaded = model_lib.load_model(str(saved), device="cpu")[0]
    shaped = model_lib.build_qwen3vl(model_lib.qwen3vl_config("8b", text_layers=1, vision_depth=1,
                                                                text_overrides=dict(hidden_size=256, intermediate_size=256,
                                                                                    num_attention_heads=2, num_key_value_heads=1)))[0]
    for m in (tiny[0], loaded, shaped):
        assert type(m.model.visual.patch_embed) is model_lib.LinearPatchEmbed
    sd = tiny[0].state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in reference.items()}
    assert sd["model.visual.patch_embed.proj.weight"].dim() == 5
