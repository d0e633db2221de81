"""Tests of grpo.py: each recipe's reward as the step takes it (Recipe.score), the GRPO objective on log-prob
tensors against hand computations (tests/oracles.py: clip, KL estimators and term, masks, per-token advantages,
micro-batches), and the update with packed prompts equal to the unpacked one.
"""
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import _call, SpyRun, rl_job

import rewards
import rollout
import recipes
import grpo
from grpo import kl_penalty
from oracles import grpo_loss_on_logprobs


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# -----------------------------------------------------------------------------
# each recipe's reward, as collect_groups takes it (Recipe.score)

THINK = rollout.THINK_PREFIX
CALL_TURN = f"{THINK}I see a mark near 12 seconds, let me crop it.\n</think>\n{_call(12.0, 20.0)}"
ANSWER_TURN = f"{THINK}The clip shows a red shape.\n</think>\n<answer>A</answer>"


def hand_trajectory(turns=(CALL_TURN, ANSWER_TURN), windows=((12.0, 20.0),)) -> SimpleNamespace:
    """What run_agent returns, by hand: the text as the model saw it and the policy's own text."""
    response = "<|im_end|>\n<|im_start|>user\n<tool_response>\nClip 12.0-20.0 s:\n</tool_response><|im_end|>\n" \
               "<|im_start|>assistant\n"
    text = response.join(turns) + "<|im_end|>"
    own = "<|im_end|>".join(t[len(THINK):] for t in turns) + "<|im_end|>"
    return SimpleNamespace(text=text, policy_text=own, turns=list(turns), windows=list(windows),
                           n_tool_turns=len(turns) - 1)


RECORD = {"answer": "A", "task": "mcq", "options": ["red", "green", "blue", "yellow"], "clues": [[12.0, 20.0]],
          "data_type": "single_clue"}
NO_CLUES = {**RECORD, "clues": None, "data_type": None}


def score(recipe: str, traj, record: dict, anchoring: str, released_scoring: bool = False):
    """The recipe's reward of a trajectory, as grpo.collect_groups takes it."""
    return recipes.RECIPES[recipe].score(traj, record, anchoring, released_scoring)


def test_combined_uses_vtgr_tool_term_when_clues_exist():
    t = hand_trajectory()
    assert rewards.grounding_format_reward(t.turns) == 1.0   # strict format holds, so the VTGR term is live
    total, parts = score("combined", t, RECORD, "sequence")
    vtgr_tool = rewards.vtgr_tool_term("single_clue", rewards.hybrid_clue_score(t.windows, RECORD["clues"]),
                                       rewards.turn_decay(1), 1, True, True)
    paravt_total, paravt_parts = rewards.paravt_reward(t.text, "A", "mcq", anchor_weight=rewards.ANCHOR_WEIGHT)
    assert vtgr_tool != paravt_parts["tool"]                 # the two tool terms differ here
    assert parts["tool"] == pytest.approx(vtgr_tool)
    assert total == pytest.approx(paravt_total - paravt_parts["tool"] + vtgr_tool)
    assert parts["clue"] == pytest.approx(rewards.hybrid_clue_score(t.windows, RECORD["clues"]))
    # without clue windows, combined is ParaVT's reward unchanged
    total, parts = score("combined", t, NO_CLUES, "sequence")
    assert total == pytest.approx(paravt_total) and parts["tool"] == paravt_parts["tool"]


@pytest.mark.parametrize("turns, windows, why", [
    ((ANSWER_TURN,), [], "anchor 0.7: a closed think, an answer body (R_fmt under its cap of 1)"),
    ((f"{THINK}It is red, the answer is A",), [], "anchor -0.3: the only think never closes"),
])
def test_anchor_by_recipe_and_anchoring(turns, windows, why):
    t = hand_trajectory(turns, windows)
    anchor = rewards.format_anchor(t.text)
    assert anchor != 0, why
    seq, parts = score("para_grpo", t, RECORD, "sequence")
    tok, tok_parts = score("para_grpo", t, RECORD, "token")
    vanilla, _ = score("vanilla", t, RECORD, "none")
    acc = rewards.accuracy_reward(t.text, "A", "mcq")
    plain = acc + rewards.format_reward(t.text, anchor_weight=0.0) + rewards.tool_reward(t.text, acc)
    assert vanilla == pytest.approx(plain)                   # vanilla: no anchor at all
    assert tok == pytest.approx(plain)                       # token anchoring: the anchor leaves the sequence reward
    assert tok_parts["anchor"] == pytest.approx(anchor)      # ... and is handed on for the closing tags
    assert seq == pytest.approx(acc + rewards.format_reward(t.text, anchor_weight=0.5) + rewards.tool_reward(t.text, acc))
    assert rewards.ANCHOR_WEIGHT == 0.5                      # lambda of ParaVT's exploration anchoring
    assert seq != pytest.approx(plain)                       # sequence anchoring: 0.5 * anchor inside R_fmt
    assert parts["anchor"] == pytest.approx(anchor)


def test_released_scoring_scores_policy_text():
    """The release scored generated tokens only: no forced "<think>\\n", no tool responses."""
    t = hand_trajectory()
    ours, _ = score("para_grpo", t, RECORD, "sequence", False)
    released, _ = score("para_grpo", t, RECORD, "sequence", True)
    assert released == pytest.approx(rewards.paravt_reward(t.policy_text, "A", "mcq", rewards.ANCHOR_WEIGHT)[0])
    assert ours == pytest.approx(rewards.paravt_reward(t.text, "A", "mcq", rewards.ANCHOR_WEIGHT)[0])
    assert released < ours                                   # the forced prefix and the tool response go unseen


def test_vtgr_recipe_is_video_o3_reward():
    t = hand_trajectory()
    total, parts = score("vtgr", t, RECORD, "none")
    want, _ = rewards.vtgr_reward(t.turns, t.text, "A", "mcq", "single_clue", t.windows, RECORD["clues"], 1)
    assert total == pytest.approx(want) and total > 2.0      # right answer, strict format, a good crop
    with pytest.raises(ValueError, match="no sequence-level anchor"):    # its strict format has no anchor term
        score("vtgr", t, RECORD, "sequence")
    assert parts["anchor"] == pytest.approx(rewards.format_anchor(t.text))


# -----------------------------------------------------------------------------
# the objective on log-prob tensors (tests/oracles.py), by hand

LN2 = math.log(2.0)


def test_grpo_loss_on_policy_is_minus_mean_advantage():
    """ratio = 1: loss = -sum(mask * A) / sum(mask) = -(1 + 1 - 0.5) / 3."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = grpo_loss_on_logprobs(logprobs, logprobs.detach(), torch.tensor([1.0, -0.5]), mask)
    assert loss.item() == pytest.approx(-0.5)
    assert stats == {"clip_frac": 0.0, "kl": 0.0, "n_tokens": 3, "ratio_mean": 1.0}
    loss.backward()  # d loss / d logp = -A / 3 on policy tokens (the policy gradient), 0 elsewhere
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_loss_clipped_by_hand():
    """
    eps_low 0.2, eps_high 0.3; old logp 0, so ratio r = exp(logp). Per token -min(rA, clip(r)A):
      seq 0, A = +1: r 1.5 -> clip 1.3 -> -1.3 (clipped)   r 0.5 -> -0.5 (pessimistic side, kept)   r 1.1 -> -1.1
      seq 1, A = -2: r 0.5 -> clip 0.8 -> +1.6 (clipped)   r 1.5 -> +3.0 (kept)                      r 0.9 masked
    loss = (-1.3 - 0.5 - 1.1 + 1.6 + 3.0) / 5 = 0.34, clip_frac 2/5, ratio_mean 5.1/5.
    Gradient -A r / 5 where unclipped, 0 where clipped or masked.
    """
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 0.9]])
    logprobs = ratios.log().requires_grad_()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = grpo_loss_on_logprobs(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask,
                            clip_low=0.2, clip_high=0.3)
    assert loss.item() == pytest.approx(0.34, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["ratio_mean"] == pytest.approx(1.02, abs=1e-6)
    assert stats["n_tokens"] == 5
    loss.backward()
    expected = torch.tensor([[0.0, -0.5 / 5, -1.1 / 5], [0.0, 2 * 1.5 / 5, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


@pytest.mark.parametrize("logp, ref, estimator, expected", [
    (-1.0, -1.0, "k3", 0.0),                     # identical policies: no divergence
    (-1.0, -1.0 - LN2, "k1", LN2),               # k1 = logp - ref
    (-2.0, -2.0 + LN2, "k1", -LN2),              # k1 goes negative when the reference is likelier
    (-1.0, -1.0 - LN2, "k3", 0.5 + LN2 - 1.0),   # k3 = e^(ref-logp) - (ref-logp) - 1 with ref-logp = -ln 2
    (-2.0, -2.0 + LN2, "k3", 2.0 - LN2 - 1.0),   # ... and with ref-logp = +ln 2; k3 stays >= 0
])
def test_kl_penalty_by_hand(logp, ref, estimator, expected):
    got = kl_penalty(torch.tensor([logp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64), estimator)
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_kl_penalty_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k1' or 'k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k2")


@pytest.mark.parametrize("estimator, ref, expected_kl", [
    ("k3", [-1.0 - LN2, -2.0 + LN2, 7.0], ((0.5 + LN2 - 1.0) + (2.0 - LN2 - 1.0)) / 2),  # = 0.25
    ("k1", [-1.0 - LN2, -2.0 - 3 * LN2, 7.0], (LN2 + 3 * LN2) / 2),                     # = 2 ln 2
])
def test_grpo_loss_kl_term(estimator, ref, expected_kl):
    """On policy with A = 0 the loss is kl_coef * token-mean(KL); the third token is masked."""
    logprobs = torch.tensor([[-1.0, -2.0, -5.0]])
    loss, stats = grpo_loss_on_logprobs(logprobs, logprobs, torch.zeros(1), torch.tensor([[1, 1, 0]]),
                            kl_coef=0.1, ref_logprobs=torch.tensor([ref]), kl_estimator=estimator)
    assert stats["kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * expected_kl, abs=1e-6)


def test_grpo_loss_masked_tokens_get_exactly_zero_gradient():
    """Garbage (inf, NaN) at prompt / tool-response / pad positions must not leak into loss or gradient."""
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.randn(2, 5).where(mask, torch.tensor(float("nan"))).requires_grad_()
    old = (logprobs.detach() + 0.4 * torch.randn(2, 5)).where(mask, torch.tensor(float("-inf")))
    ref = (logprobs.detach() - 0.3).where(mask, torch.tensor(float("inf")))
    adv = torch.randn(2, 5)  # per-token advantages
    loss, stats = grpo_loss_on_logprobs(logprobs, old, adv, mask, clip_low=0.1, clip_high=0.1,
                            kl_coef=0.05, ref_logprobs=ref, kl_estimator="k3")
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
    assert torch.equal(logprobs.grad[~mask], torch.zeros(int((~mask).sum())))
    assert logprobs.grad[mask].abs().sum() > 0


def test_grpo_loss_per_token_advantage():
    """(B, L) advantages: token-level credit, e.g. anchoring a closing tag, counts only where given."""
    logprobs = torch.zeros(1, 4, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 3.0, 1.0]])  # +2 extra at the closing-tag position
    loss, _ = grpo_loss_on_logprobs(logprobs, logprobs.detach(), adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-6.0 / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv / 4)


def test_grpo_loss_micro_batches_add_up_with_global_normaliser():
    """Token-mean over the whole batch: two micro-batches with num_tokens = total sum to the full loss."""
    torch.manual_seed(1)
    logprobs, old, adv = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4)
    mask = torch.rand(4, 6) > 0.3
    full, _ = grpo_loss_on_logprobs(logprobs, old, adv, mask)
    total = mask.sum()
    parts = [grpo_loss_on_logprobs(logprobs[s], old[s], adv[s], mask[s], num_tokens=total)[0] for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(advantages=torch.zeros(3)), "advantages"),                   # one advantage per sequence, B = 2
    (dict(mask=torch.ones(2, 4)), r"must all be \(B, L\)"),            # mask longer than the sequences
    (dict(kl_coef=0.1), "needs ref_logprobs"),                         # KL asked for without a reference
    (dict(ref_logprobs=torch.zeros(2, 2)), "ref_logprobs"),            # reference of the wrong length
])
def test_grpo_loss_rejects_bad_shapes(kwargs, message):
    args = dict(logprobs=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=message):
        grpo_loss_on_logprobs(**{**args, **kwargs})


# -----------------------------------------------------------------------------
# the update

def test_policy_update_packed_equals_unpacked(tiny, packed_rows):
    """policy_update with pack_prompts on and off on the same items: the same gradient on every parameter
    (micro-batches of 4 rows: the packed ones hold 2 prompts, then 2)."""
    model, processor = tiny
    trajs, _, _ = packed_rows
    items = [(t, a, {"anchor": 0.0}) for t, a in zip(trajs, [1.0, -0.5, 0.3, -1.0, 0.7, 0.2])]
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for pack in (True, False):
        s = grpo.GRPOSettings(pack_prompts=pack, micro_batch=4)
        model.zero_grad()
        grads = []
        step = lambda loss: grads.append([None if p.grad is None else p.grad.clone() for p in params]) or 1.0
        _, stats = grpo.policy_update(SpyRun(step), model, None, None, items, rl_job(s), 1, processor)
        out[pack] = stats["loss"], grads[0]
    model.zero_grad()
    for gp, gq in zip(out[False][1], out[True][1]):
        assert (gp is None) == (gq is None)
        if gp is not None:
            torch.testing.assert_close(gq, gp, atol=1e-5 * float(gp.abs().max()) + 1e-9, rtol=1e-4)
