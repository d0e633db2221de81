"""One policy: what the sampler saw against what the trainer trains. The behaviour log-probs the rollout records
(rollout.sampled_logprobs, in rollout.draw) against log_softmax; the mismatch figures (eval.mismatch_figures,
eval.mismatch_classes) against numpy, on one rank and over two gloo ranks; the update's figures from its own
forward (grpo.policy_update); the rollout corrections tis and mis (grpo.grpo_token_terms, grpo.grpo_loss) against
their equations by hand; the setting's checks; the figures in the metrics rows of a synchronous and an
asynchronous run.

    pytest tests/test_mismatch.py -q
"""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as evaluation
import grpo
import ops
import policy
import recipes
import rollout
import runtime
from conftest import SpyRun, metrics, rl_job, run, smoke_argv

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("abs_diff_mean", "abs_diff_p99", "abs_diff_max", "k3", "ratio_out", "tokens")
KEYS = [f"mismatch/{c + '/' if c else ''}{n}" for c in evaluation.MISMATCH_CLASSES for n in NAMES]


# -----------------------------------------------------------------------------
# the behaviour log-probs the rollout records

@pytest.mark.parametrize("V", [50, 151_936])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_sampled_logprobs_are_log_softmax_gathered(V, temperature):
    """logit - logsumexp equals log_softmax(logits / T).gather (T = 1 when greedy) in fp64 within 1e-6 plus fp32's
    rounding of the numbers it subtracts (`_close_to_log_softmax`), and fp32's log_softmax within that one's own
    error (at V = 151,936 fp32's log_softmax is up to 1e-5 from the fp64 value)."""
    gen = torch.Generator().manual_seed(V)
    for scale in (1.0, 5.0, 20.0):
        logits = torch.randn(16, V, generator=gen) * scale
        tok = torch.randint(0, V, (16,), generator=gen)
        ours = rollout.sampled_logprobs(logits, tok, temperature)
        assert ours.dtype == torch.float32 and ours.shape == (16,)
        _close_to_log_softmax(ours, logits, tok, temperature)


def _close_to_log_softmax(ours: torch.Tensor, logits: torch.Tensor, tok: torch.Tensor, temperature: float) -> None:
    """ours within 1e-6 of the fp64 log_softmax gather, plus 2e-7 (under two fp32 roundings) of the magnitudes
    subtracted, |log p| + max_v |z_v| (a log-prob of -0.2 out of logits near 60 is 60.0 - 60.2 in fp32); and no
    further from fp32's log_softmax than that one is from the fp64 value, within the same bound."""
    z = logits / (temperature or 1.0)
    exact = torch.log_softmax(z.double(), -1).gather(1, tok[:, None])[:, 0]
    naive = torch.log_softmax(z, -1).gather(1, tok[:, None])[:, 0].double()
    bound = 1e-6 + 2e-7 * (exact.abs() + z.abs().amax(-1).double())
    err = (ours.double() - exact).abs()
    assert torch.all(err <= bound), (err - bound).max()
    assert torch.all((ours.double() - naive).abs() <= (naive - exact).abs() + bound)


def _old_draw(logits, ban, seeds, counters, cfg):
    """rollout.draw as it computed the log-probs with a (n, V) log_softmax: the reference for the draw."""
    masked = logits.index_fill(1, ban, float("-inf")) if ban is not None else logits
    tok = ops.sample_tokens(masked, seeds, counters, cfg.temperature, cfg.top_p)
    lp = torch.log_softmax(logits.float() / (cfg.temperature or 1.0), -1).gather(1, tok[:, None])[:, 0]
    return tok, tok.tolist(), lp.tolist()


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.9), (0.0, 1.0)])
def test_draw_samples_the_same_tokens_and_records_the_same_logprobs(temperature, top_p):
    """draw with its log-probs recorded or not, and the log_softmax draw: the same tokens for the same seeds and
    counters (a banned id never drawn), and the log-probs of the unmasked logits (as log_softmax's, to fp32's
    rounding: `_close_to_log_softmax`)."""
    gen = torch.Generator().manual_seed(1)
    V, n = 151_936, 6
    logits = torch.randn(n, V, generator=gen) * 3.0
    ban = torch.tensor([int(logits[0].argmax()), 7])
    seeds, counters = torch.arange(n) * 1_000_003 + 11, torch.arange(n) + 3
    cfg = rollout.RolloutConfig(temperature=temperature, top_p=top_p, record_logprobs=True)
    tok, values, lps = rollout.draw(logits, ban, seeds, counters, cfg)
    tok_off, values_off, none = rollout.draw(logits, ban, seeds, counters, dataclasses.replace(cfg, record_logprobs=False))
    ref_tok, ref_values, ref_lps = _old_draw(logits, ban, seeds, counters, cfg)
    assert none is None and values == values_off == ref_values and torch.equal(tok, ref_tok)
    assert [int(v) for v in values] == tok.tolist() and not set(tok.tolist()) & set(ban.tolist())
    _close_to_log_softmax(torch.tensor(lps), logits, tok, temperature)
    assert np.allclose(lps, ref_lps, atol=1e-6, rtol=1e-5)


def test_record_logprobs_is_on_by_default():
    assert recipes.COMMON["record_logprobs"] is True and rollout.RolloutConfig().record_logprobs is True


# -----------------------------------------------------------------------------
# the figures

def _expected(train: np.ndarray, behav: np.ndarray) -> dict:
    """The figures of one class by numpy: |d|'s mean, 99th percentile (linear) and max, the mean of r - 1 - log r,
    the fraction of r outside [0.8, 1.25], the count."""
    d = train.astype(np.float64) - behav.astype(np.float64)
    if d.size == 0:
        return dict.fromkeys(NAMES, 0.0)
    r = np.exp(d)
    return {"abs_diff_mean": np.abs(d).mean(), "abs_diff_p99": np.percentile(np.abs(d), 99),
            "abs_diff_max": np.abs(d).max(), "k3": (r - 1 - np.log(r)).mean(),
            "ratio_out": ((r < 0.8) | (r > 1.25)).mean(), "tokens": d.size}


def _check(figures: dict, train, behav, mask, classes) -> None:
    assert sorted(figures) == sorted(KEYS)
    for c in evaluation.MISMATCH_CLASSES:
        sel = mask if not c else mask & classes[c]
        want = _expected(train[sel], behav[sel])
        for n in NAMES:
            assert figures[f"mismatch/{c + '/' if c else ''}{n}"] == pytest.approx(want[n], rel=1e-9, abs=1e-12), (c, n)


def _problem(seed: int, B: int = 5, L: int = 300):
    """Log-probs (B, L) at policy positions of rows with turns (runs of policy tokens between ENV spans), row 1 a
    sub-agent's, a behaviour drawn near the trainer's with some rare tokens."""
    rng = np.random.default_rng(seed)
    policy_ = np.zeros((B, L), dtype=bool)
    for b in range(B):
        at = int(rng.integers(0, 20))
        while at < L:
            n = int(rng.integers(1, 30))
            policy_[b, at:at + n] = True
            at += n + int(rng.integers(1, 15))
    behav = np.log(rng.uniform(1e-5, 1.0, (B, L))).astype(np.float32)
    train = (behav + rng.normal(0, 0.15, (B, L))).astype(np.float32)
    sub = np.arange(B) == 1
    return train, behav, policy_, sub


def test_mismatch_figures_match_numpy_by_class():
    train, behav, pol, sub = _problem(0)
    classes = {k: v.numpy() for k, v in evaluation.mismatch_classes(torch.tensor(pol), torch.tensor(sub),
                                                                    torch.tensor(behav)).items()}
    figures = evaluation.mismatch_figures(torch.tensor(train), torch.tensor(behav), torch.tensor(pol),
                                          {k: torch.tensor(v) for k, v in classes.items()})
    _check(figures, train, behav, pol, classes)
    assert figures["mismatch/tokens"] == pol.sum() > 500
    assert 0 < figures["mismatch/sub/tokens"] < figures["mismatch/main/tokens"]
    assert figures["mismatch/early/tokens"] + figures["mismatch/late/tokens"] == figures["mismatch/tokens"]
    assert 0 < figures["mismatch/low_p/tokens"] and 0 < figures["mismatch/ratio_out"] < 1


def test_mismatch_classes_by_hand():
    """early: a turn's first 8 policy tokens after an ENV span; the rest late; sub / main by row; low_p by the
    behaviour probability."""
    pol = torch.tensor([[False] * 2 + [True] * 11 + [False] * 3 + [True] * 3 + [False],
                        [True] * 10 + [False] * 10])
    behav = torch.full(pol.shape, -0.1)
    behav[0, 5] = math.log(1e-4)
    behav[1, 0] = math.log(2e-3)
    c = evaluation.mismatch_classes(pol, torch.tensor([False, True]), behav)
    early = torch.zeros_like(pol)
    early[0, 2:10] = early[0, 16:19] = early[1, 0:8] = True
    assert torch.equal(c["early"], early) and torch.equal(c["late"], pol & ~early)
    assert c["late"][0].nonzero().flatten().tolist() == [10, 11, 12] and c["late"][1].sum() == 2
    assert torch.equal(c["sub"], torch.stack([torch.zeros(20, dtype=torch.bool), pol[1]]))
    assert torch.equal(c["main"], torch.stack([pol[0], torch.zeros(20, dtype=torch.bool)]))
    assert c["low_p"].nonzero().tolist() == [[0, 5]]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 101, 1000])
def test_mismatch_figures_small_and_empty_classes(n):
    """p99 at small counts (one token: itself; two: interpolated), and a class with no tokens: 0 and count 0, the
    same keys."""
    rng = np.random.default_rng(n)
    train = rng.normal(-1, 0.3, n).astype(np.float32)
    behav = rng.normal(-1, 0.3, n).astype(np.float32)
    mask = np.ones(n, dtype=bool)
    classes = {"sub": np.zeros(n, dtype=bool), "main": mask.copy(), "early": rng.random(n) < 0.5,
               "low_p": np.zeros(n, dtype=bool)}
    classes["late"] = ~classes["early"]
    figures = evaluation.mismatch_figures(torch.tensor(train), torch.tensor(behav), torch.tensor(mask),
                                          {k: torch.tensor(v) for k, v in classes.items()})
    _check(figures, train, behav, mask, classes)
    assert all(figures[f"mismatch/sub/{k}"] == 0 for k in NAMES)


def _two_ranks(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, 2, False, timeout_s=120)
    train, behav, pol, sub = _problem(3)
    mine = slice(0, 1) if rank == 0 else slice(1, None)         # uneven shares: 1 row and 4
    t, b, p = (torch.tensor(x[mine]) for x in (train, behav, pol))
    classes = evaluation.mismatch_classes(p, torch.tensor(sub[mine]), b)
    if rank == 0:
        classes["sub"] = torch.zeros_like(p)                    # this rank has none of a class
    figures = evaluation.mismatch_figures(t, b, p, classes, world=2, group=None)
    torch.save(figures, f"{out}/rank{rank}.pt")
    runtime.finish(2)


def test_mismatch_figures_over_two_gloo_ranks_are_the_whole_batchs(tmp_path):
    """Two ranks holding 1 and 4 of the rows: every figure, p99 and max included, equals one rank's over all rows,
    on both ranks."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = runtime.find_free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    train, behav, pol, sub = _problem(3)
    classes = {k: v.numpy() for k, v in evaluation.mismatch_classes(torch.tensor(pol), torch.tensor(sub),
                                                                    torch.tensor(behav)).items()}
    for r in (0, 1):
        _check(torch.load(tmp_path / f"rank{r}.pt"), train, behav, pol, classes)


# -----------------------------------------------------------------------------
# the corrections: tis and mis by hand

OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]]
BEHAV = [[-1.2, -1.0, -0.6], [-0.8, -1.6, 50.0]]        # row 1's last token is padding: garbage never read
DELTA = [[0.1, -0.3, 0.25], [0.0, 0.05, 0.0]]           # log pi_theta - log pi_old
ADV = [1.0, -1.0]
MASK = [[True, True, True], [True, True, False]]
EPS = 0.2


def _by_hand(weights) -> tuple[float, list]:
    """The token-mean loss -sum w_t min(r_t A, clip(r_t) A) / n and its gradient in log pi_theta, token by token:
    d/dlogp = -w r A / n where the min takes r A (it does unless the clip cuts the token off), else 0."""
    n = sum(map(sum, MASK))
    loss, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        for t in range(3):
            if not MASK[i][t]:
                continue
            r, a, w = math.exp(DELTA[i][t]), ADV[i], weights[i][t]
            loss -= w * min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a) / n
            cut = (r < 1 - EPS and a < 0) or (r > 1 + EPS and a > 0)
            grad[i][t] = 0.0 if cut else -w * r * a / n
    return loss, grad


def _terms(correction, cap, behav=True):
    """grpo_token_terms on the policy tokens (N,), each token's row as its sequence (as grpo_loss hands them)."""
    mask, f64 = torch.tensor(MASK), lambda x: torch.tensor(x, dtype=torch.float64)
    old = f64(OLD)[mask]
    logp = (old + f64(DELTA)[mask]).requires_grad_(True)
    adv = f64(ADV)[:, None].expand(2, 3)[mask]
    per_token, *_ = grpo.grpo_token_terms(logp, old, adv, EPS, EPS, 0.0, None, "k3",
                                          f64(BEHAV)[mask] if behav else None, 5.0, correction=correction,
                                          correction_cap=cap, seq_index=mask.nonzero()[:, 0])
    loss = per_token.sum() / len(logp)
    loss.backward()
    grad = torch.zeros(2, 3, dtype=torch.float64)
    grad[mask] = logp.grad
    return loss.item(), grad


@pytest.mark.parametrize("correction, cap", [("none", None), ("tis", 1.5), ("tis", 1.1), ("mis", 2.0), ("mis", 3.0)])
def test_corrections_weigh_the_loss_as_their_equations(correction, cap):
    """u_t = pi_old / pi_behav (row 0: e^0.2, e^-1, e^0.1; row 1: e^0.5, e^0.4). tis: w_t = min(u_t, C). mis:
    rho_i = prod_t u_t (row 0 e^-0.7, row 1 e^0.9 = 2.46), w = rho_i where rho_i <= C, else 0 (row 1 masked at
    C = 2, kept at C = 3). none in the synchronous loop: no behaviour weight at all."""
    u = [[math.exp(o - b) for o, b in zip(ro, rb)] for ro, rb in zip(OLD, BEHAV)]
    if correction == "none":
        weights = [[1.0] * 3] * 2
    elif correction == "tis":
        weights = [[min(x, cap) for x in row] for row in u]
    else:
        rho = [math.exp(sum(math.log(x) for x, m in zip(row, mrow) if m)) for row, mrow in zip(u, MASK)]
        weights = [[rho[i] if rho[i] <= cap else 0.0] * 3 for i in range(2)]
    want_loss, want_grad = _by_hand(weights)
    loss, grad = _terms(correction, cap, behav=correction != "none")
    assert loss == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    if correction == "mis":
        assert (cap == 2.0) == all(w == 0.0 for w in weights[1]) and weights[0][0] > 0


def test_tis_and_mis_change_the_loss_and_none_leaves_it():
    plain = _terms(None, None, behav=False)
    assert _terms("none", None, behav=False)[0] == plain[0]
    for correction in ("tis", "mis"):
        assert _terms(correction, 2.0)[0] != pytest.approx(plain[0], rel=1e-3)


def test_fused_loss_applies_the_corrections_per_row():
    """grpo_loss from hidden states: each row is a sequence (mis: its product over the row's policy tokens only,
    the masked positions' garbage never read); the same numbers as grpo_token_terms on naive log-probs, and with
    behav = old the tis / mis weights are 1 (the plain loss)."""
    gen = torch.Generator().manual_seed(0)
    B, L, D, V = 3, 6, 8, 30
    hidden, weight = torch.randn(B, L, D, generator=gen), torch.randn(V, D, generator=gen) * 0.4
    targets = torch.randint(0, V, (B, L), generator=gen)
    mask = torch.rand(B, L, generator=gen) > 0.3
    adv = torch.randn(B, generator=gen)
    lp = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    old = lp + 0.05 * torch.randn(B, L, generator=gen)
    behav = torch.where(mask, old - 0.3 * torch.randn(B, L, generator=gen), 100.0)
    kw = dict(clip_low=0.2, clip_high=0.2, temperature=0.7, compile=False, kl_coef=0.0, kl_estimator="k3",
              behav_cap=5.0)
    seq = mask.nonzero()[:, 0]
    for correction, cap in (("tis", 1.2), ("mis", 1.5), ("mis", 100.0)):
        fused, _ = grpo.grpo_loss(hidden, weight, targets, old, adv, mask, behav_logprobs=behav, correction=correction,
                                  correction_cap=cap, **kw)
        terms, *_ = grpo.grpo_token_terms(lp[mask], old[mask], adv[:, None].expand(B, L)[mask], 0.2, 0.2, 0.0, None,
                                          "k3", behav[mask], 5.0, correction=correction, correction_cap=cap,
                                          seq_index=seq)
        assert fused.item() == pytest.approx(terms.sum().item() / len(seq), rel=1e-5)
        same, _ = grpo.grpo_loss(hidden, weight, targets, old, adv, mask, behav_logprobs=old, correction=correction,
                                 correction_cap=cap, **kw)
        plain, _ = grpo.grpo_loss(hidden, weight, targets, old, adv, mask, **kw)
        assert same.item() == pytest.approx(plain.item(), rel=1e-6)


def test_a_bad_rollout_correction_is_refused_clearly(capsys):
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        grpo.grpo_token_terms(torch.zeros(2), torch.zeros(2), torch.ones(2), 0.2, 0.2, 0.0, None, "k3",
                              torch.zeros(2), 5.0, correction="is", correction_cap=2.0)
    for argv, why in ((["--set", "rollout_correction=is"], "rollout_correction must be one of none, tis, mis"),
                      (["--set", "rollout_correction=tis", "--set", "rollout_correction_cap=1"], "cap > 1"),
                      (["--set", "rollout_correction=mis", "--set", "record_logprobs=0"], "needs record_logprobs=1")):
        with pytest.raises(SystemExit):
            recipes.parse_train_args(argv)
        assert why in capsys.readouterr().err
    args = recipes.parse_train_args(["--set", "rollout_correction=mis", "--set", "rollout_correction_cap=3"])
    s = grpo.GRPOSettings(**{k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(grpo.GRPOSettings)}})
    assert (s.rollout_correction, s.rollout_correction_cap) == ("mis", 3.0)
    assert (grpo.GRPOSettings().rollout_correction, grpo.GRPOSettings().rollout_correction_cap) == ("none", 2.0)


# -----------------------------------------------------------------------------
# the update's figures: its own forward against the recorded log-probs

def test_policy_update_measures_its_first_forward_against_the_recorded_logprobs(tiny, packed_rows, monkeypatch):
    """Trajectories whose recorded log-probs are the model's plus a known offset, one a sub-agent's, one without
    recorded log-probs (left out): with one PPO epoch the figures come from the loss's own forward (no extra
    forward runs); with two from the no-grad pi_old; both equal mismatch_figures on an independent forward."""
    model, processor = tiny
    trajs, _, _ = packed_rows
    pad = processor.tokenizer.pad_token_id
    s = grpo.GRPOSettings(pack_prompts=False, micro_batch=4)
    batch = rollout.collate(trajs, model, pad, share_videos=True)
    with torch.no_grad():
        train = policy.forward_logprobs(model, batch, 1024, s.temperature, False, "fp32")
    pol = policy.policy_mask(batch["roles"])
    gen = torch.Generator().manual_seed(0)
    behav = torch.where(pol, train + 0.3 * torch.randn(train.shape, generator=gen), 0.0)
    ours = [dataclasses.replace(t, logprobs=behav[i][pol[i]].tolist(), parent=(0, 0) if i == 2 else None)
            for i, t in enumerate(trajs)]
    ours[4] = dataclasses.replace(ours[4], logprobs=[])                     # recorded nothing: left out
    keep = pol.clone()
    keep[4] = False
    classes = evaluation.mismatch_classes(keep, torch.tensor([i == 2 for i in range(len(trajs))]), behav)
    want = evaluation.mismatch_figures(train, behav, keep, classes)
    items = [(t, a, {"anchor": 0.0}) for t, a in zip(ours, [1.0, -0.5, 0.3, -1.0, 0.7, 0.2])]
    forwards = []
    real = grpo.forward_logprobs
    monkeypatch.setattr(grpo, "forward_logprobs", lambda *a, **k: forwards.append(1) or real(*a, **k))
    for epochs in (1, 2):
        forwards.clear()
        model.zero_grad()
        _, stats = grpo.policy_update(SpyRun(lambda loss: 1.0), model, None, None, items,
                                      rl_job(dataclasses.replace(s, ppo_epochs=epochs)), 1, processor)
        assert len(forwards) == (0 if epochs == 1 else 2)              # pi_old once per micro-batch
        for k in KEYS:
            assert stats[k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), (epochs, k)
    model.zero_grad()
    assert want["mismatch/tokens"] == int(keep.sum()) and want["mismatch/sub/tokens"] == int(pol[2].sum()) > 0


# -----------------------------------------------------------------------------
# the metrics rows of both loops

def test_a_synchronous_run_logs_the_mismatch_every_step(tmp_path, cache_env):
    """Two RL steps under tis: every row carries every mismatch key, finite; sampler and trainer are one policy on
    the CPU in fp32 (the same weights, the cached decode against a full forward), so the gap is float rounding."""
    run(smoke_argv(tmp_path, "--stage", "rl", "--mask-truncated", "0", "--set", "rollout_correction=tis"))
    rows = [r for r in metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in KEYS), [k for k in KEYS if k not in r]
        assert r["mismatch/tokens"] > 0 and r["mismatch/early/tokens"] > 0
        assert r["mismatch/abs_diff_max"] < 1e-3 and r["mismatch/ratio_out"] == 0.0


@pytest.mark.slow
def test_an_asynchronous_run_logs_the_mismatch_every_step(tmp_path, cache):
    """--gpus 3 --rollout-ranks 1 on gloo (two trainers: the figures' collectives over the trainers' group): each
    step's row carries every mismatch key, finite, over the tokens of both trainers."""
    argv = smoke_argv(tmp_path, "--stage", "rl", "--gpus", "3", "--device", "cpu", "--async-staleness", "1",
                      "--rollout-ranks", "1", "--threads", "1", "--max-new-tokens", "24", "--set", "mask_truncated=0",
                      "--set", "rollout_correction=mis")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, argv)], cwd=ROOT,
                          env={**os.environ, "PARAVT_CACHE": cache}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in KEYS), [k for k in KEYS if k not in r]
        assert r["mismatch/tokens"] > 0
