"""Correctness of the RL path where the users run it (each test failed on the code before its fix):
environment text never read as the answer, the release's answer body, the sampling temperature in the loss,
ParaVT's k1 KL folded into the reward, DAPO's refilling dynamic sampling, refused flag combinations, and
several ranks: a rank with nothing to learn still joins the step, and the 2-rank update equals one process's.
The distributed checkpoint round trip on 2 gloo ranks is in test_train.py."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import smoke_argv

import data
import model as model_lib
import ops
import rewards
import rollout
import runtime
import train


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
    total, parts = rewards.paravt_reward(text, "B", "mcq")
    assert parts["acc"] == 1.0 and rewards.extract_answer(text) == "B"
    assert rewards.format_compliant(text)
    assert parts["format"] == pytest.approx(1.0)


def test_answer_body_anywhere_as_released():
    """An unclosed <think> followed by an answer: 0.2 think + 0.5 answer - 0.15 anchor = 0.55 (the release)."""
    text = "<think>\nthe shape is red so B" + "<answer>B</answer>"
    assert rewards.format_reward(text) == pytest.approx(0.55)


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, message", [
    (["--recipe", "vtgr", "--anchoring", "sequence"], "vtgr --anchoring sequence"),
    (["--kl-coef", "0.01", "--kl-estimator", "k1"], "zero expected gradient"),
    (["--video-root", "/data/videos"], "--video-root without --data"),
    (["--sft-data", "sft.jsonl"], "--sft-data without --data"),
])
def test_combinations_that_cannot_work_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        runtime.parse_args(argv)
    assert message in capsys.readouterr().err


def test_paravt_preset_folds_k1_into_the_reward():
    args = runtime.parse_args(["--preset", "paravt"])
    s = train.grpo_settings(args)
    assert (s.recipe, s.kl_estimator, s.kl_in_reward, s.kl_coef, s.temperature) == ("para_grpo", "k1", True, 0.01, 0.7)
    assert runtime.parse_args(["--kl-coef", "0.01", "--kl-estimator", "k1", "--kl-in-reward", "1"]).kl_in_reward


# ----------------------------------------------------------------------------- the loss at the sampling temperature

@pytest.fixture(scope="module")
def encoded(tiny, cache):
    """Two SFT-encoded synthetic trajectories (a tool call, an answer) and their collated batch."""
    model, processor = tiny
    recs = data.make_split(os.path.join(cache, "synthetic"), 4, seed=77, duration=64.0)
    cfg = train.rollout_config(runtime.parse_args([]))
    rng = __import__("numpy").random.default_rng(0)
    trajs = [rollout.encode_messages(processor, r, data.oracle_turns(r, rng, always_call=True, nframes=8),
                                     os.path.join(cache, "synthetic"), cfg, nframes=8) for r in recs[:2]]
    return trajs, rollout.collate(trajs, model, processor.tokenizer.pad_token_id)


def test_logprobs_in_the_loss_use_the_sampling_temperature(tiny, encoded):
    model, _ = tiny
    trajs, batch = encoded
    with torch.no_grad():
        got = train.forward_logprobs(model, batch, 64, temperature=0.7, compile=False)
        logits = model(**{k: v for k, v in batch.items() if k != "roles"}).logits[:, :-1].float()
        want = F.log_softmax(logits / 0.7, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = train.policy_mask(batch["roles"])
    assert mask.any()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[mask], train.forward_logprobs(model, batch, 64, compile=False)[mask])


def test_sequence_kl_is_the_sum_of_k1_over_policy_tokens(tiny, encoded):
    model, _ = tiny
    trajs, batch = encoded
    ref, _ = model_lib.load_model("tiny", device="cpu", seed=1, tiny_corpus=rollout.prompt_corpus())
    s = train.GRPOSettings(temperature=0.7, micro_batch=1)
    got = train.sequence_kl(model, ref, trajs, s, model.config.text_config.pad_token_id or 0)
    with torch.no_grad():
        lp = train.forward_logprobs(model, batch, 64, 0.7, compile=False)
        rp = train.forward_logprobs(ref, batch, 64, 0.7, compile=False)
    want = ((lp - rp) * train.policy_mask(batch["roles"])).sum(1)
    assert got == pytest.approx(want.tolist(), rel=1e-4, abs=1e-4) and abs(want).sum() > 0


# ----------------------------------------------------------------------------- dynamic sampling refills the batch

def test_dynamic_sampling_draws_until_the_batch_holds_groups_with_signal(monkeypatch):
    """The first draw gives only zero-variance groups; more prompts are drawn until the batch is full, and the
    number of draws is reported."""
    G, calls = 2, []

    def fake_agent(model, processor, recs, root, cfg, seed, nframes, pool=None):
        calls.append(len(recs))
        return [rollout.Trajectory(r["id"], s, [1, 2, 3], [0, 1, 1], 1, [], text=f"draw{len(calls)}")
                for r in recs for s in range(G)]

    def fake_score(t, rec, *a):                       # draw 1: all equal; later draws: varied
        return (0.0 if t.text == "draw1" else float(t.sample)), {"acc": 0.0, "anchor": 0.0}

    monkeypatch.setattr(rollout, "run_agent", fake_agent)
    monkeypatch.setattr(rewards, "score_trajectory", fake_score)
    model = SimpleNamespace(config=SimpleNamespace(video_token_id=999))
    records = [{"id": f"r{i}"} for i in range(10)]
    run = SimpleNamespace(seed=0, rank=0)
    s = train.GRPOSettings(group_size=G, prompts_per_step=3, dynamic_sampling=True, max_draws=4, mask_truncated=False)
    g = train.collect_groups(run, model, None, None, records, "", rollout.RolloutConfig(), s, 1, 0)
    assert g.draws == 2 and calls == [3, 3]
    assert len(g.items) == 3 * G and {t.text for t, _, _ in g.items} == {"draw2"}
    assert g.zero_var_frac == pytest.approx(0.5)
    s.max_draws = 1                                   # the cap: one draw, nothing with signal, nothing kept
    calls.clear()
    g = train.collect_groups(run, model, None, None, records, "", rollout.RolloutConfig(), s, 1, 0)
    assert g.draws == 1 and g.items == []


# ----------------------------------------------------------------------------- two ranks (gloo)

def _rank_update(rank: int, world: int, port: int, items_of_rank: dict, out: str, loss_chunk: int = 0) -> None:
    """One policy_update on `world` gloo ranks (world 1: no process group), the full weights saved to `out`.
    loss_chunk 0: the tiny model's logits are small, so token_loss takes its plain path; > 0: the fused chunks."""
    torch.set_num_threads(1)
    if world > 1:                      # (a spawned rank's own environment; world 1 runs in the test process)
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model, processor = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())
    if world > 1:
        runtime.shard_model(model)
    trajs = torch.load(items_of_rank["trajs"], weights_only=False)
    mine = [(trajs[i], adv, {"anchor": 0.0}) for i, adv in items_of_rank[rank]]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    s = train.GRPOSettings(micro_batch=1, temperature=0.7, loss_chunk=loss_chunk)
    step = lambda loss: (optimizer.step(), optimizer.zero_grad())
    gn, _ = train.policy_update(model, None, optimizer, mine, s, processor.tokenizer.pad_token_id, processor.tokenizer, world,
                                filler=trajs[0], step_fn=step)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, out)
    if world > 1:
        torch.distributed.barrier()       # no rank tears the group down while another still talks to it
        torch.distributed.destroy_process_group()


def _run_ranks(world: int, items_of_rank: dict, out: str, loss_chunk: int = 0) -> dict:
    if world == 1:
        _rank_update(0, 1, 0, items_of_rank, out, loss_chunk)
    else:
        torch.multiprocessing.spawn(_rank_update, args=(world, runtime.find_free_port(), items_of_rank, out, loss_chunk),
                                    nprocs=world)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("split", ["both_ranks_learn", "rank1_idle"])
def test_two_rank_update_equals_one_process(split, encoded, tmp_path):
    """FSDP2 on 2 gloo ranks: the update equals one process's on the union of the ranks' trajectories (token-mean
    over all ranks). A rank whose samples were all dropped still joins with zero-weight passes: the step is not
    skipped for everybody (before: all ranks skipped when one rank had nothing)."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)] if split == "both_ranks_learn" else []}
    two = _run_ranks(2, items, str(tmp_path / "two.pt"))
    one = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "one.pt"))
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    moved = [n for n, p in init.named_parameters() if not torch.equal(p.detach(), one[n])]
    assert moved, "the update changed nothing"
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=2e-5, rtol=1e-4, msg=n)


def test_two_rank_update_through_the_fused_chunks_equals_the_plain_loss(encoded, tmp_path, monkeypatch):
    """The RL step through token_loss's fused chunks (--loss-chunk 16: chunk boundaries inside every sequence),
    on 2 FSDP2 gloo ranks, equals one process's update through the plain loss (log_softmax over all logits): the
    lm_head gradient formed inside the forward reaches FSDP's sharded parameter as an ordinary gradient would."""
    trajs, _ = encoded
    torch.save(trajs, tmp_path / "trajs.pt")
    items = {"trajs": str(tmp_path / "trajs.pt"), 0: [(0, 1.0)], 1: [(1, -1.0)]}
    calls, real_apply = [], ops._TokenLoss.apply                        # record each fused call's chunk
    monkeypatch.setattr(ops._TokenLoss, "apply", lambda *a: calls.append(a[4]) or real_apply(*a))
    one_plain = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "plain.pt"))
    assert calls == [], "the tiny model's logits are small: the default takes the plain path"
    one_fused = _run_ranks(1, {"trajs": items["trajs"], 0: items[0] + items[1]}, str(tmp_path / "fused.pt"), 16)
    assert calls and set(calls) == {16}, "--loss-chunk 16 runs the fused chunks"
    two_fused = _run_ranks(2, items, str(tmp_path / "two.pt"), 16)
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    assert not torch.equal(init.lm_head.weight.detach(), one_plain["lm_head.weight"]), "the update moved lm_head"
    for n in one_plain:
        torch.testing.assert_close(one_fused[n], one_plain[n], atol=2e-5, rtol=1e-4, msg=n)
        torch.testing.assert_close(two_fused[n], one_plain[n], atol=2e-5, rtol=1e-4, msg=n)


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
    credit = train.anchor_credit(ids, tok, [0.7])                        # (1, L-1): position j predicts token j+1
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
    sp = train.tdam_spans(ids, roles, tok, vid)
    assert sp["answer"] is not None and sp["answer"][1] == len(ids)
    assert tok.decode(ids[sp["answer"][0]:]).lstrip(">").startswith("B</answer>")
    assert "answer>" in tok.decode(ids[sp["answer"][0] - 2:sp["answer"][0] + 1]) or name == "tiny"
    assert sp["overview"] == (ids.index(vid), ids.index(vid) + 4)
    (c0, c1), = sp["calls"]
    assert tok.decode(ids[c0:c1]).startswith("<tool_call>") and tok.decode(ids[c0:c1]).endswith("</tool_call>")
    (o0, o1), = sp["obs"]
    assert ids[o0:o1] == [vid] * 3
