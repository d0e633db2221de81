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
"""
import json
import os
from dataclasses import asdict, dataclass

import torch

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


def build_tiny(cfg: ModelConfig | None = None, seed: int = 0, corpus: tuple[str, ...] = ()):
    """The embedded default: a random-init Qwen3-VL with the real classes, plus its processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    cfg = cfg or ModelConfig()
    tokenizer = build_tokenizer(cfg.vocab_size, corpus)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
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
    return model.float().eval(), build_processor(tokenizer, cfg)


# -----------------------------------------------------------------------------
# load / save (real checkpoints and the tiny default through one entry point)

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(name_or_path: str = "tiny", device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, attn_implementation: str | None = None, seed: int = 0,
               tiny_corpus: tuple[str, ...] = (), tiny_config: ModelConfig | None = None):
    """Return `(model, processor)`: `"tiny"` builds the embedded default; a directory or hub id goes
    through the Auto classes (Qwen3-VL, Qwen2.5-VL, ...). bf16 on CUDA, fp32 on CPU unless `dtype`.
    `attn_implementation`: None (library default), "sdpa", "eager" (needed for TDAM's 4-D masks on
    some versions) or "flash_attention_2". `tiny_corpus` / `tiny_config`: see `build_tokenizer` / `ModelConfig`."""
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if name_or_path == "tiny":
        model, processor = build_tiny(tiny_config, seed=seed, corpus=tiny_corpus)
        if attn_implementation:
            model.set_attn_implementation(attn_implementation)
    else:
        if not os.path.exists(name_or_path) and os.sep in name_or_path:
            raise FileNotFoundError(f"model directory {name_or_path!r} does not exist")
        from transformers import AutoModelForImageTextToText, AutoProcessor
        kwargs = dict(dtype=dtype)
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs)
        processor = AutoProcessor.from_pretrained(name_or_path)
    return model.to(device=device, dtype=dtype).eval(), processor


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
