"""layers.py: our decoder layer forward against transformers' own, on Qwen3-VL (tiny, with a video and its
deepstack features, padding) and Qwen2.5-VL (q / k / v biases, no q / k norms); the rotary identity; checkpoints."""
import copy

import pytest
import torch

import layers
import model as model_lib


def _theirs(model):
    """A copy of `model` whose decoder layers and final norm run transformers' forward again."""
    other = copy.deepcopy(model)
    text = other.model.language_model
    for module in list(text.layers) + [text.norm]:
        module.__class__ = type(module).__bases__[1]
    assert not any(isinstance(m, (layers.PlainLayer, layers.PlainNorm)) for m in other.modules())
    return other


def _video_batch(processor, seed: int = 0):
    """Two right-padded rows, the first with a video (deepstack features on its visual tokens)."""
    torch.manual_seed(seed)
    frames = torch.randint(0, 255, (4, 3, 64, 64), dtype=torch.uint8)
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(conv, add_generation_prompt=True)
    meta = {"fps": 1.0, "total_num_frames": 4, "frames_indices": [0.0, 1.0, 2.0, 3.0]}
    out = processor(text=[text, "a short one"], videos=[frames], padding=True, return_tensors="pt",
                    videos_kwargs=dict(do_sample_frames=False, do_resize=False, video_metadata=[meta]))
    return {k: v for k, v in out.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_layers_equal_transformers_on_qwen3vl(tiny, dtype):
    """Hidden states of a padded batch with a video: equal bit for bit (fp32 and bf16, on the CPU, whose rms_norm
    rounds as transformers' form does); in fp32 their gradients bit for bit too (so a training run is the same run);
    in bf16 every gradient within bf16's rounding (rms_norm's backward rounds in its own order)."""
    model, processor = tiny
    ours = copy.deepcopy(model).to(dtype)
    theirs = _theirs(ours)
    batch = _video_batch(processor)
    batch["pixel_values_videos"] = batch["pixel_values_videos"].to(dtype)
    outs = []
    for m in (ours, theirs):
        m.zero_grad(set_to_none=True)
        h = m.model(**batch, use_cache=False).last_hidden_state
        h.float().pow(2).mean().backward()
        outs.append((h.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (h1, g1), (h2, g2) = outs
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert torch.equal(h1, h2)
    if dtype == torch.float32:
        assert all(torch.equal(g1[n], g2[n]) for n in g1)
    else:
        assert all(float((g1[n] - g2[n]).abs().max()) <= 2e-2 * float(g2[n].abs().max()) for n in g1)


def test_plain_layers_read_transformers_cache(tiny):
    """With transformers' cache (what model.generate decodes on): a prefill and then one token at a time give the
    hidden states of transformers' layers bit for bit, and each step's equal the full forward's at that position
    (fp32): the layer appends its keys / values to the cache and attends over all of them."""
    from transformers import DynamicCache
    model, processor = tiny
    theirs = _theirs(model)
    torch.manual_seed(0)
    ids = torch.randint(20, model.config.text_config.vocab_size, (1, 12))
    with torch.no_grad():
        full = model.model(input_ids=ids, use_cache=False).last_hidden_state
        steps = []
        for m in (model, theirs):
            cache = DynamicCache(config=m.config)
            h = [m.model(input_ids=ids[:, :8], cache=cache, use_cache=True).last_hidden_state]
            for j in range(8, 12):
                h.append(m.model(input_ids=ids[:, j:j + 1], cache=cache, use_cache=True).last_hidden_state)
            assert cache.get_seq_length() == 12
            steps.append(torch.cat(h, 1))
    assert torch.equal(steps[0], steps[1])
    torch.testing.assert_close(steps[0], full, rtol=1e-5, atol=1e-5)


def qwen25vl(vocab_size: int = 300):
    """A small Qwen2.5-VL of transformers' classes, seeded (0), its q / k / v biases away from their zero init."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = Qwen2_5_VLConfig(text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                    mrope_section=[2, 3, 3])),
                              vision_config=dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


def test_plain_layers_equal_transformers_on_qwen25vl():
    """Qwen2.5-VL's decoder (biases on q / k / v, no q / k norms, its own M-RoPE layout): the same logits."""
    theirs = qwen25vl()
    ours = layers.use_plain_layers(copy.deepcopy(theirs))
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert isinstance(ours.model.language_model.layers[0], layers.PlainLayer)
    assert torch.equal(a, b)


def test_rope_by_roll_is_rotate_half_bit_for_bit():
    """x cos + roll(x, d/2) signed_sin is x cos + rotate_half(x) sin exactly, fp32 and bf16."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import rotate_half
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3 * 5, 4, 16).to(dtype)                      # (n l, heads, d)
        cos, sin = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 5, 16).to(dtype)
        want = x * cos.reshape(15, 1, 16) + rotate_half(x) * sin.reshape(15, 1, 16)
        assert torch.equal(layers.rope(x, *layers.rope_tables(cos, sin, rows_of_tokens=True)), want)
        xt = x.view(3, 5, 4, 16).transpose(1, 2)                   # (n, heads, l, d)
        assert torch.equal(layers.rope(xt, *layers.rope_tables(cos, sin, rows_of_tokens=False)),
                           want.view(3, 5, 4, 16).transpose(1, 2))


def test_checkpoint_names_and_reload_unchanged(tiny, tmp_path):
    """The state dict's names are transformers' own; a saved model reloads (load_model) with plain layers and
    gives the same logits."""
    model, processor = tiny
    theirs = _theirs(model)
    assert list(model.state_dict()) == list(theirs.state_dict())
    model_lib.save_model(model, processor, str(tmp_path / "ckpt"))
    again, _ = model_lib.load_model(str(tmp_path / "ckpt"), device="cpu")
    assert all(isinstance(layer, layers.PlainLayer) for layer in again.model.language_model.layers)
    ids = torch.randint(300, 1000, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_unknown_decoder_layer_is_refused():
    """A model whose decoder layers are not Qwen3-VL's or Qwen2.5-VL's gets a clear error, not a wrong forward."""
    class Other(torch.nn.Module):
        pass

    text = torch.nn.Module()
    text.layers, text.norm = torch.nn.ModuleList([Other()]), torch.nn.Module()
    fake = torch.nn.Module()
    fake.model = torch.nn.Module()
    fake.model.language_model = text
    with pytest.raises(ValueError, match="decoder layer Other is not one of"):
        layers.use_plain_layers(fake)
