"""
Real shapes, real tokenizer, real video: a Qwen3-VL built from the published Qwen3-VL-8B config
(model.qwen3vl_config) with the depth cut, random weights, Qwen's tokenizer (model.qwen_tokenizer) and
a real mp4 from ../shared/real_videos at ParaVT's 64-frame overview, through the code paths a real run
takes: prompt + overview prefill, one scripted turn with a parallel crop_video call in each tool mode
(interleaved: clips in context; subagent: a sub-agent summary per call), the answer turn, one GRPO
loss forward/backward (policy.forward_logprobs + grpo_loss) and one SFT step under a TDAM mask.

    python -m pytest tests/test_real_shapes.py -q

What is published and kept: vocab 151,936 and Qwen's ids, 32 query heads / 8 KV heads / head_dim 128,
the interleaved M-RoPE sections [24, 20, 20] and theta 5e6, the vision tower's width 1152 / 16 heads /
MLP 4304 / patch 16 / temporal patch 2 / merge 2 / 2304 position embeddings, deepstack, bf16.
What is cut so CI runs it in under a minute on 2 CPU cores (~40 s measured on a shared one): 3 decoder
layers and 2 vision blocks (deepstack taps [8, 16, 24] -> [0, 1], feeding decoder layers 0 and 1), the
text width 4096 -> 256 and MLP 12288 -> 512 (with them the vision merger's output), and the overview
frames to ~64x64 pixels. The same episode at the full 8B widths (hidden 4096, MLP 12288: 2.0 B parameters
with 3 layers, ~4 minutes and 12 GB on that CPU) was bench/real_shapes.py, removed from the tree
(docs/experiments.md, "Figures of 2026-11-30"); bench/gpu.py runs the 8B shapes on a GPU.
"""
import re
from pathlib import Path

import pytest
import torch

import kvcache
import model as model_lib
import ops
import rollout
import recipes
import sft
import train
import video
import policy
import oracles

REAL = Path(__file__).resolve().parents[2] / "shared" / "real_videos"
VIDEO = "nasa_13013.mp4"                          # 13 s of NASA footage, 320x180 / 480x270 streams
SEED = 0
RECORD = {"id": "nasa", "video": VIDEO, "question": "What is shown at the start of the video?",
          "options": ["a rocket launch", "a cooking show", "a football match", "a city street"], "task": "mcq",
          "answer": "A"}
CI_TEXT = dict(hidden_size=256, intermediate_size=512)     # the only widths cut (see the module docstring)
CALLS = [(1.0, 4.0), (8.0, 11.5)]


def call(start: float, end: float) -> str:
    return ('<tool_call>\n{"name": "crop_video", "arguments": {"start_time": %s, "end_time": %s}}\n</tool_call>'
            % (start, end))


TURNS = ["two moments to check\n</think>\n" + "\n".join(call(a, b) for a, b in CALLS),
         "the first clip shows it\n</think>\n<answer>A</answer>"]


class Scripted:
    """Stand-in for rollout.sample_tokens (batched): the agent row (seed, record 0, sample 0) emits TURNS[t] then
    <|im_end|> in its turn t; every other row (a sub-agent) emits `sub`. The engine still runs every forward."""

    def __init__(self, tokenizer, sub: str = "A rocket lifts off from the pad."):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        self.agent, self.turns, self.sub = rollout.row_seed(SEED, 0, 0), [enc(t) for t in TURNS], enc(sub)
        self.pos = {}

    def one(self, seed: int) -> int:
        turn, p = self.pos.get(seed, (0, 0))
        toks = self.turns[min(turn, len(self.turns) - 1)] if seed == self.agent else self.sub
        self.pos[seed] = (turn + 1, 0) if p + 1 == len(toks) else (turn, p + 1)
        return toks[p]

    def __call__(self, logits, seeds, counters, temperature, top_p):
        assert logits.shape[-1] == model_lib.QWEN_VOCAB_SIZE and logits.shape[0] == len(seeds)
        return torch.tensor([self.one(s) for s in seeds.tolist()], device=logits.device)


@pytest.fixture(scope="module")
def real_8b_cut():
    """(model, processor): published 8B config, 3 decoder layers (deepstack taps on layers 0 and 1) + 2 vision
    blocks, text width cut, bf16, random weights."""
    if not (REAL / VIDEO).exists():
        pytest.fail(f"{REAL / VIDEO} is missing: the real-shapes test needs shared/real_videos beside the repo")
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    config = model_lib.qwen3vl_config("8b", text_layers=3, vision_depth=2, text_overrides=CI_TEXT)
    yield model_lib.build_qwen3vl(config, dtype=torch.bfloat16, seed=SEED)
    torch.set_num_threads(threads)


def mode_rollout_config(mode: str) -> rollout.RolloutConfig:
    """ParaVT's overview (64 frames) at 64x64 pixels a frame; 2 fps crops at the same size; log-probs recorded."""
    return rollout.RolloutConfig(tool_mode=mode, max_turns=2, max_new_tokens=128, temperature=1.0, group_size=1,
                                 overview_nframes=64, overview_max_pixels=64 * 64, crop_fps=2.0,
                                 crop_max_pixels=64 * 64, subagent_max_pixels=64 * 64, subagent_max_frames=8,
                                 subagent_max_new_tokens=32, tools_block=True, record_logprobs=True)


def test_published_8b_config_and_cut():
    full = model_lib.qwen3vl_config("8b", text_layers=None, vision_depth=None)
    t, v = full.text_config, full.vision_config
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.vocab_size) == (4096, 12288, 36, 32, 8, 128, 151936)
    assert t.rope_parameters["mrope_section"] == [24, 20, 20] and t.rope_parameters["rope_theta"] == 5e6
    assert t.rope_parameters["mrope_interleaved"] and sum(t.rope_parameters["mrope_section"]) == t.head_dim // 2
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size, v.patch_size,
            v.temporal_patch_size, v.spatial_merge_size, v.deepstack_visual_indexes) == \
        (27, 1152, 4304, 16, 4096, 16, 2, 2, [8, 16, 24])
    assert (full.video_token_id, full.vision_start_token_id, full.tie_word_embeddings) == (151656, 151652, False)
    cut = model_lib.qwen3vl_config("8b", text_layers=3, vision_depth=2, text_overrides=CI_TEXT)
    assert cut.text_config.num_hidden_layers == 3 and cut.vision_config.depth == 2
    assert cut.vision_config.deepstack_visual_indexes == [0, 1] and cut.vision_config.out_hidden_size == 256
    assert model_lib.cut_deepstack([8, 16, 24], 27, 27, 36) == [8, 16, 24]
    assert model_lib.cut_deepstack([8, 16, 24], 27, 2, 2) == [0]          # no tap on the last decoder layer
    assert model_lib.cut_deepstack([8, 16, 24], 27, 9, 36) == [2, 5, 8]
    assert model_lib.qwen3vl_config("4b", 1, 1).vision_config.deepstack_visual_indexes == [0]
    with pytest.raises(ValueError, match="size must be one of"):
        model_lib.qwen3vl_config("7b")


@pytest.fixture(scope="module")
def trajectories(real_8b_cut):
    """{mode: Trajectory}: one scripted episode (parallel call, then the answer) per tool mode."""
    model, processor = real_8b_cut
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)                   # token-by-token decoding is latency-bound: one thread is faster
    with pytest.MonkeyPatch.context() as mp:
        for mode in ("interleaved", "subagent"):
            mp.setattr(rollout, "sample_tokens", Scripted(processor.tokenizer))
            [out[mode]] = rollout.run_agent(model, processor, [RECORD], str(REAL), mode_rollout_config(mode), seed=SEED)
    torch.set_num_threads(threads)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_rollout_turn_at_real_shapes(real_8b_cut, trajectories, mode):
    """Prefill of the prompt + 64-frame real overview, the parallel call executed in `mode`, the answer."""
    model, processor = real_8b_cut
    t, tok = trajectories[mode], processor.tokenizer
    assert t.error is None and not t.truncated and t.done, (t.error, t.text[-300:])
    assert t.answer == "A" and t.windows == CALLS and (t.n_tool_turns, t.n_calls, t.tool_failures) == (1, 2, 0)
    assert t.nframes == 64 and next(model.parameters()).dtype == torch.bfloat16
    # the overview: 64 frames -> 32 temporal patches, each "<t seconds>" + its merged 2x2 patch tokens
    pix, grid = t.videos[0]
    (T, H, W), = grid.tolist()                               # 320x180 footage at ~64x64 pixels: 2x4 patches
    assert (T, H, W) == (32, 2, 4) and pix.shape == (T * H * W, 3 * 2 * 16 * 16)
    prompt = tok.decode(t.token_ids[:t.prompt_len], skip_special_tokens=False)
    stamps = [float(s) for s in re.findall(r"<(\d+\.\d) seconds>", prompt)]
    assert len(stamps) == 32 and stamps == sorted(stamps) and 0.0 <= stamps[0] and stamps[-1] <= 13.1
    assert t.token_ids[:t.prompt_len].count(151656) == T * H * W // 4
    if mode == "interleaved":
        assert len(t.videos) == 2 and t.videos[1][1].shape == (2, 3)    # overview; the turn's two clips
        assert "Clip 1.0-4.0 s:" in t.text and "Clip 8.0-11.5 s:" in t.text
    else:
        assert len(t.videos) == 1 and len(t.subagents) == 2 and "A rocket lifts off" in t.text
    # M-RoPE positions (t, h, w) over the whole sequence: text has t = h = w; a video token its grid cell
    pos = rollout.collate([t], model, tok.pad_token_id)["position_ids"]
    assert pos.shape == (3, 1, len(t.token_ids))
    p, vid = pos[:, 0], torch.tensor(t.token_ids) == 151656
    assert torch.equal(p[0][~vid], p[1][~vid]) and torch.equal(p[1][~vid], p[2][~vid])
    assert (p[1][vid] != p[2][vid]).any() and (p[0].diff() >= 0).all()


def text_tdam(tok, ids: list[int], prompt_len: int) -> torch.Tensor:
    """(L, L) TDAM mask with every span found from the decoded text (Qwen has no <answer> token): overview =
    the prompt's first <|vision_start|> .. last <|vision_end|>, answer = after the text "<answer>" to the end,
    calls = the policy's <tool_call> blocks, observations = <tool_response> blocks that hold video."""
    text, offsets = model_lib.decode_with_offsets(tok, ids)
    spans = lambda chars: model_lib.text_spans_to_token_spans(offsets, chars)
    policy_from = offsets[prompt_len][0]
    start = text.find("<|vision_start|>")
    end = text.rfind("<|vision_end|>", 0, policy_from) + len("<|vision_end|>")
    [overview] = spans([(start, end)])
    answers = [a for a in model_lib.tagged_spans(text, "<answer>", "</answer>") if a[0] >= policy_from]
    calls = [c for c in model_lib.tagged_spans(text, "<tool_call>", "</tool_call>", inner=False) if c[0] >= policy_from]
    obs = [o for o in spans(model_lib.tagged_spans(text, "<tool_response>", "</tool_response>"))
           if 151656 in ids[o[0]:o[1]]]
    answer = (spans(answers[-1:])[0][0], len(ids)) if answers else None
    assert overview[1] <= prompt_len
    return sft.tdam_mask(len(ids), overview, answer, spans(calls), obs)


@pytest.mark.slow
def test_rl_and_sft_step_at_real_shapes(real_8b_cut, trajectories):
    """Both episodes in one batch: recorded log-probs = a full forward, one GRPO backward; then one SFT step
    under TDAM (the answer's rows blind to the overview) on the interleaved episode."""
    model, processor = real_8b_cut
    tok = processor.tokenizer
    trajs = [trajectories["interleaved"], trajectories["subagent"]]
    batch = rollout.collate(trajs, model, tok.pad_token_id)
    B, L = batch["input_ids"].shape
    model.train()
    lp = policy.forward_logprobs(model, batch, 64, 1.0, False, "fp32")             # (B, L-1) fp32
    mask = batch["roles"][:, 1:] == rollout.POLICY
    assert lp.dtype == torch.float32 and lp.shape == (B, L - 1)
    for b, t in enumerate(trajs):                   # the sampling-time log-probs (KV cache, bf16) agree
        assert int(mask[b].sum()) == len(t.logprobs) > 0
        torch.testing.assert_close(lp[b][mask[b]].detach(), torch.tensor(t.logprobs), atol=0.05, rtol=0)

    # one GRPO step: on-policy ratio 1, advantages +1 / -1 on the two rows' policy tokens
    adv = torch.tensor([[1.0], [-1.0]]).expand_as(lp)
    loss, _ = oracles.grpo_loss_on_logprobs(lp, lp.detach(), adv, mask.float(), clip_low=0.2, clip_high=0.28)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss) and all(torch.isfinite(g.float()).all() for g in grads.values())
    assert grads["lm_head.weight"].abs().sum() > 0
    assert any(n.startswith("model.visual.blocks.0") and g.abs().sum() > 0 for n, g in grads.items())
    assert any("deepstack_merger_list.1" in n and g.abs().sum() > 0 for n, g in grads.items())
    model.zero_grad(set_to_none=True)

    # one SFT step under TDAM, spans from the text, on the interleaved episode (the one with observation
    # videos, where TDAM's rule (1) applies); the subagent episode's text-derived mask is causal
    sub = trajectories["subagent"]
    n1 = len(sub.token_ids)
    assert torch.equal(text_tdam(tok, sub.token_ids, sub.prompt_len), torch.ones(n1, n1, dtype=torch.bool).tril())
    t = trajectories["interleaved"]
    one = rollout.collate([t], model, tok.pad_token_id)
    tdam = text_tdam(tok, t.token_ids, t.prompt_len)                            # (L, L) bool
    assert not torch.equal(tdam, torch.ones_like(tdam).tril())                 # rule (1) masks the overview
    mask4 = ops.to_additive_mask(tdam, torch.bfloat16)                        # (1, 1, L, L)
    ref = sft.tdam_batch_mask(one, tok, model.config.video_token_id)        # train.py's own spans, from the text
    assert ref.shape == mask4.shape == (1, 1, len(t.token_ids), len(t.token_ids))
    allowed = ref[0, 0] == 0                                                   # on the real tokenizer: not causal
    pads = [j for j in range(t.prompt_len) if t.token_ids[j] == model.config.video_token_id]
    assert not allowed[-1, pads].any() and allowed[-1, :pads[0]].all()         # the answer is blind to the overview
    assert not tdam[-1, pads].any()                                            # as the text-built reference says
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = model.lm_head.weight.detach().clone()
    sft_loss, n = sft.sft_loss(model, dict(one, attention_mask=mask4), sft.SFTSettings(loss_chunk=64))
    sft_loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    assert torch.isfinite(sft_loss) and n == t.draws and 5.0 < float(sft_loss.detach()) < 20.0   # ~ln(151936)
    assert not torch.equal(before, model.lm_head.weight)


def worst_frames(n: int, max_pixels: int, factor: int) -> torch.Tensor:
    """n frames of the shape whose visual tokens per temporal patch reach max_pixels / factor^2 exactly (a x b
    cells of factor x factor pixels, a * b = that quota; the most any aspect ratio gets), as video.resize_frames
    leaves them."""
    t = max_pixels // factor ** 2
    a = max(d for d in range(1, int(t ** 0.5) + 1) if t % d == 0)
    frames = torch.zeros(n, 3, a * factor, t // a * factor, dtype=torch.uint8)
    assert video.resize_frames(frames[:1], max_pixels, factor).shape == frames[:1].shape
    return frames


@pytest.mark.slow
def test_videoo3_full_protocol_fits_its_context():
    """Defect 9 of issue 54: the Video-o3 preset holds its own protocol (docs/method.md §5). At the real Qwen3-VL
    processor settings (patch 16, merge 2, temporal patch 2, Qwen's tokenizer) a full-length trajectory: the prompt
    with a 768-frame overview of a 10-hour video (five-digit timestamps) at the most visual tokens a frame shape
    gets, max_turns rounds of max_calls_per_turn fine crops of 64 s (128 frames, the fine quota reached), each turn
    max_new_tokens long. It fits the preset's max_context, so the engine (which ends a row truncated once it holds
    max_context tokens) never cuts it and --mask-truncated drops no full-length row; the prompt stays within the
    release's 18,432 tokens; the engine's worst case (row_blocks) covers it. The preset used to hold 32,768
    tokens: the prompt and about 1.5 of the 6 rounds of 5 medium crops."""
    cfg = train.rollout_config_of_args(recipes.parse_train_args(["--preset", "videoo3", "--model", "Qwen/Qwen3-VL-8B-Instruct"]))
    published = model_lib.qwen3vl_config("8b", text_layers=None, vision_depth=None)
    v = published.vision_config
    processor = model_lib.build_processor(model_lib.qwen_tokenizer(), model_lib.ModelConfig(
        patch_size=v.patch_size, spatial_merge=v.spatial_merge_size, temporal_patch=v.temporal_patch_size))
    factor = rollout.video_factor(processor)
    assert (factor, processor.video_processor.temporal_patch_size) == (32, 2)
    pad = lambda c: int((c.ids == published.video_token_id).sum())
    duration = 36_000.0
    record = {"id": "long", "video": "long.mp4", "task": "mcq", "answer": "C",
              "question": "After the woman in the red coat leaves the kitchen for the second time, what does the man "
                          "standing by the window pick up from the table and where does he put it?",
              "options": ["a blue notebook, into his bag", "a set of keys, into his pocket",
                          "a coffee mug, onto the shelf", "a phone, onto the sofa"]}
    kw = rollout.overview_kwargs(duration, cfg, factor, cfg.overview_nframes)
    n = video.even_count(round(duration * cfg.overview_fps), cfg.overview_max_frames)
    overview = video.Clip(worst_frames(n, kw["max_pixels"], factor), video.uniform_targets(0.0, duration, n), "v", n)
    prompt = rollout.encode_chunk(processor, rollout.prompt_text(processor, record, cfg.tools_block), [overview])
    assert n == 768 and len(prompt.ids) <= 18_432, (n, pad(prompt), len(prompt.ids))
    rounds = []
    for k in range(cfg.max_turns):
        windows = [(duration - 64.0 * (5 * k + j + 1), duration - 64.0 * (5 * k + j)) for j in range(cfg.max_calls_per_turn)]
        n_crop, px = video.crop_budget(64.0, "fine", cfg.crop_fps, cfg.crop_max_frames, factor ** 2)
        px = min(px, cfg.crop_max_pixels or px)
        clips = [video.Clip(worst_frames(n_crop, px, factor), video.uniform_targets(s, e, n_crop), "v", n_crop)
                 for s, e in windows]
        c = rollout.encode_chunk(processor, rollout.response_chunk_text([rollout.clip_part(w) for w in windows],
                                                                        forced=k == cfg.max_turns - 1), clips)
        assert n_crop == 128 and pad(c) == cfg.max_calls_per_turn * video.LEVEL_TOKENS["fine"]
        rounds.append(len(c.ids))
    turns = rollout.assistant_turns(cfg) * cfg.max_new_tokens          # every turn at its limit, <|im_end|> included
    total = len(prompt.ids) + sum(rounds) + turns
    assert total < cfg.max_context, (len(prompt.ids), rounds, turns, total, cfg.max_context)
    assert cfg.max_context <= published.text_config.max_position_embeddings
    assert rollout.row_blocks(cfg, len(prompt.ids), factor) * kvcache.BLOCK >= total - len(prompt.ids)
    # the context is the release's prompt budget + the engine's worst case of a row's suffix, not a guess
    assert rollout.row_blocks(cfg, 18_432, factor) == rollout.blocks_for(cfg.max_context - 18_432)
