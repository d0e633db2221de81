"""bench/paradox.py through its command line: the aggregation and drawing on hand-made run dirs (--plot-only), the
commands it runs (--dry-run), its flags (fast); the whole study end to end with tiny budgets (slow: `pytest -m slow
tests/test_paradox.py`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("vanilla", "gating", "anchoring", "para-grpo", "para+vtgr")
SPARSE, DENSE = 8, 32            # the evaluation overviews: where needles need the tool, and the ungated one
CURVES = ("format_compliance", "tool_call_ratio", "acc_tool_needed", "acc_tool_not_needed")


def paradox(*argv, ok: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python bench/paradox.py ARGV`; with ok, it must succeed."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "paradox.py"), *map(str, argv)], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)
    assert not ok or r.returncode == 0, r.stderr[-3000:]
    return r


def last_json(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def held_out(out: Path, n: int, seed: int) -> list[dict]:
    """The held-out split the study evaluates seed `seed` on (train.py --seed s holds out 2000 + s)."""
    return data.make_split(str(out / "cache" / "synthetic"), n, seed=2000 + seed)


def write_predictions(path: Path, records: list[dict], right: list[bool]) -> None:
    rows = [{"id": r["id"], "answer": r["answer"] if ok and r["task"] == "mcq" else "Z", "calls": 1,
             "format_compliant": True} for r, ok in zip(records, right)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_run(out: Path, name: str, seed: int, curves: dict, right: dict, n_eval: int) -> None:
    """A run dir as train.py, eval.py and the study leave it: RL rows of metrics.jsonl, the two predictions files,
    final.json."""
    run_dir = out / f"{name}-s{seed}"
    run_dir.mkdir(parents=True)
    steps = len(next(iter(curves.values())))
    rows = [{"stage": "rl", "step": i + 1, "reward": 0.0, **{k: v[i] for k, v in curves.items()}} for i in range(steps)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in (SPARSE, DENSE):
        write_predictions(run_dir / f"eval-k{k}.jsonl", held_out(out, n_eval, seed), right[k])
    (run_dir / "final.json").write_text(json.dumps({"cmd": [], "seconds": 1.0}))


def test_plot_only_aggregates_over_seeds(tmp_path):
    rng = np.random.default_rng(0)
    n = 6
    expect = {}
    for v in VARIANTS:
        accs = []
        for s in range(2):
            right = {k: (rng.random(n) < 0.5).tolist() for k in (SPARSE, DENSE)}
            fake_run(tmp_path, v, s, {k: rng.random(5).tolist() for k in CURVES}, right, n)
            mcq = [ok for r, ok in zip(held_out(tmp_path, n, s), right[SPARSE]) if r["task"] == "mcq"]
            accs.append(np.mean(mcq))
        expect[v] = accs
    last = last_json(paradox("--out", tmp_path, "--plot-only", "--seeds", 2, "--n-eval", n))
    assert last["variants"].keys() == set(VARIANTS)
    for v, accs in expect.items():
        got = last["variants"][v]["final"][f"k{SPARSE}"]["accuracy"]
        assert got["mean"] == pytest.approx(np.mean(accs)) and got["min"] == pytest.approx(min(accs))
    assert (tmp_path / "paradox.png").stat().st_size > 0 and last["figure"] == str(tmp_path / "paradox.png")
    md = (tmp_path / "paradox.md").read_text()
    assert "vanilla GRPO (K = 32)" in md and "PARA-GRPO + VTGR tool term" in md and "K = 8" in md and "K = 32" in md


def test_curve_summaries_are_the_seed_mean_cut_to_the_shortest_run(tmp_path):
    right = {k: [True] * 4 for k in (SPARSE, DENSE)}
    base = {"acc_tool_needed": [0.5] * 3, "acc_tool_not_needed": [1.0] * 3}
    fake_run(tmp_path, "vanilla", 0, {"format_compliance": [1.0, 0.5, 0.0], "tool_call_ratio": [1.0, 1.0, 0.0], **base},
             right, 4)
    fake_run(tmp_path, "vanilla", 1, {"format_compliance": [0.0, 0.5, 1.0], "tool_call_ratio": [1.0, 0.0, 0.0], **base},
             right, 4)
    short = {k: v[:2] for k, v in base.items()}                 # a run that stopped after 2 of 3 steps
    fake_run(tmp_path, "gating", 0, {"format_compliance": [0.0, 1.0, 0.5], "tool_call_ratio": [0.0] * 3, **base},
             right, 4)
    fake_run(tmp_path, "gating", 1, {"format_compliance": [1.0, 0.0], "tool_call_ratio": [0.0] * 2, **short}, right, 4)
    last = last_json(paradox("--out", tmp_path, "--plot-only", "--seeds", 2, "--variants", "vanilla,gating",
                             "--smooth", 2, "--n-eval", 4))
    curves = last["variants"]["vanilla"]["curves"]
    assert curves["format_compliance"]["first2"] == pytest.approx(0.5)
    assert curves["tool_call_ratio"]["first2"] == pytest.approx(0.75)
    assert curves["tool_call_ratio"]["last2"] == pytest.approx(0.25)
    gated = last["variants"]["gating"]["curves"]["format_compliance"]
    assert gated["steps"] == 2 and gated["first2"] == gated["last2"] == pytest.approx(0.5)


def test_finals_split_by_tool_need_and_a_missing_prediction_is_an_error(tmp_path):
    recs = held_out(tmp_path, 16, 0)
    need = [data.tool_needed(r, SPARSE) for r in recs]
    assert True in need and False in need                       # the split holds both kinds at K = 8
    right = [n is False for n in need]                           # right only where the tool is not needed
    fake_run(tmp_path, "vanilla", 0, {k: [0.5] for k in CURVES}, {SPARSE: right, DENSE: right}, 16)
    last = last_json(paradox("--out", tmp_path, "--plot-only", "--seeds", 1, "--variants", "vanilla", "--n-eval", 16))
    got = {m: v["mean"] for m, v in last["variants"]["vanilla"]["final"][f"k{SPARSE}"].items()}
    mcq = [n for r, n in zip(recs, need) if r["task"] == "mcq"]
    assert got["acc_tool_needed"] == 0.0 and got["acc_tool_not_needed"] == 1.0
    assert got["accuracy"] == pytest.approx(mcq.count(False) / len(mcq)) and got["tool_call_ratio"] == 1.0
    assert f"({mcq.count(True)} MCQs per seed need the tool" in (tmp_path / "paradox.md").read_text()
    write_predictions(tmp_path / "vanilla-s0" / f"eval-k{SPARSE}.jsonl", recs[:-1], right)
    r = paradox("--out", tmp_path, "--plot-only", "--seeds", 1, "--variants", "vanilla", "--n-eval", 16, ok=False)
    assert r.returncode != 0 and f"no prediction for {recs[-1]['id']}" in r.stderr


@pytest.mark.parametrize("argv, match", [
    (["--variants", "vanilla,nope"], "unknown"),     # a typo in a variant name
    (["--seeds", "0"], "must be >= 1"),               # no seeds means no study
])
def test_bad_flags_are_rejected(argv, match):
    r = paradox(*argv, ok=False)
    assert r.returncode == 2 and match in r.stderr


def test_missing_run_dir_names_the_file(tmp_path):
    r = paradox("--out", tmp_path, "--plot-only", "--seeds", 1, "--variants", "vanilla", "--n-eval", 2, ok=False)
    assert r.returncode != 0 and "metrics.jsonl: missing" in r.stderr


def test_dry_run_prints_the_commands_and_unknown_flags_pass_through_to_train(tmp_path):
    cmds = last_json(paradox("--out", tmp_path, "--dry-run", "--seeds", 2, "--rl-steps", 3, "--max-turns", 2))
    assert cmds["sft"][-2:] == ["--max-turns", "2"] and not (tmp_path / "sft").exists()     # nothing ran
    assert set(cmds["runs"]) == {f"{v}-s{s}" for v in VARIANTS for s in (0, 1)}
    rl, *evals = cmds["runs"]["gating-s1"]
    assert rl[-2:] == ["--max-turns", "2"] and rl[rl.index("--rl-steps") + 1] == "3"
    assert rl[rl.index("--gating") + 1] == "1" and rl[rl.index("--seed") + 1] == "1"
    assert [e[e.index("--overview-nframes") + 1] for e in evals] == [str(SPARSE), str(DENSE)]


@pytest.mark.slow
def test_study_end_to_end_tiny(tmp_path):
    """SFT + five variants x one seed + the evaluations at K = 8 and 32 + figure, with budgets of a few steps."""
    r = paradox("--out", tmp_path, "--sft-steps", "4", "--rl-steps", "2", "--seeds", "1", "--n-eval", "4",
                "--group-size", "2", "--prompts-per-step", "2", "--n-train", "8", "--sft-batch", "4",
                "--max-new-tokens", "48", timeout=1800)
    last = last_json(r)
    assert last["variants"].keys() == set(VARIANTS)
    for v in VARIANTS:
        assert last["variants"][v]["curves"]["tool_call_ratio"]["steps"] == 2
        for k in ("accuracy", "format_compliance", "tool_call_ratio"):
            assert 0.0 <= last["variants"][v]["final"]["k8"][k]["mean"] <= 1.0
        assert (tmp_path / f"{v}-s0" / "eval-k32.jsonl").exists()
    gated = [json.loads(l)["mean_k"] for l in open(tmp_path / "gating-s0" / "metrics.jsonl") if '"rl"' in l]
    plain = [json.loads(l)["mean_k"] for l in open(tmp_path / "vanilla-s0" / "metrics.jsonl") if '"rl"' in l]
    assert plain == [32.0, 32.0]                 # the ungated run saw the dense overview every step
    assert any(k < 32 for k in gated)            # gating drew fewer frames at least once
    assert (tmp_path / "paradox.png").exists() and (tmp_path / "paradox.md").exists()
