"""bench/paradox.py: the aggregation and drawing on hand-made run dirs (fast), and the whole study end to
end with tiny budgets (slow: `pytest -m slow tests/test_paradox.py`)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("paradox", ROOT / "bench" / "paradox.py")
paradox = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paradox)


import data  # noqa: E402


@pytest.mark.parametrize("x, window, want", [
    ([1.0, 2.0, 3.0, 4.0], 1, [1.0, 2.0, 3.0, 4.0]),                  # window 1 is the identity
    ([1.0, 2.0, 3.0, 4.0], 3, [1.5, 2.0, 3.0, 3.5]),                  # centred, fewer steps at the ends
    ([0.0, np.nan, 1.0, 1.0], 2, [0.0, 0.0, 1.0, 1.0]),               # a step without a value is skipped
])
def test_moving_average_is_centred_and_skips_gaps(x, window, want):
    np.testing.assert_allclose(paradox.moving_average(np.array(x), window), want)


def test_seed_band_cuts_to_the_shortest_run():
    # a run that stopped early must not leave NaNs or misaligned steps in the band
    mean, lo, hi = paradox.seed_band([np.array([0.0, 1.0, 0.5]), np.array([1.0, 0.0])])
    np.testing.assert_allclose(mean, [0.5, 0.5])
    np.testing.assert_allclose(lo, [0.0, 0.0])
    np.testing.assert_allclose(hi, [1.0, 1.0])


def held_out(out: Path, n: int, seed: int) -> list[dict]:
    return data.make_split(str(out / "cache" / "synthetic"), n, seed=2000 + seed)


def write_predictions(path: Path, records: list[dict], right: list[bool]) -> None:
    rows = [{"id": r["id"], "answer": r["answer"] if ok and r["task"] == "mcq" else "Z", "calls": 1,
             "format_compliant": True} for r, ok in zip(records, right)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_score_predictions_splits_by_tool_need(tmp_path):
    recs = held_out(tmp_path, 16, 0)
    need = [data.tool_needed(r, paradox.SPARSE) for r in recs]
    assert True in need and False in need                 # the split holds both kinds at K = 8
    write_predictions(tmp_path / "p.jsonl", recs, [n is False for n in need])   # right only where not needed
    got = paradox.score_predictions(str(tmp_path / "p.jsonl"), recs, paradox.SPARSE)
    mcq = [n for r, n in zip(recs, need) if r["task"] == "mcq"]
    assert got["acc_tool_needed"] == 0.0 and got["acc_tool_not_needed"] == 1.0
    assert got["accuracy"] == pytest.approx(mcq.count(False) / len(mcq))
    assert got["n_needed"] == mcq.count(True) and got["tool_call_ratio"] == 1.0
    with pytest.raises(ValueError, match="no prediction"):
        write_predictions(tmp_path / "q.jsonl", recs[:-1], [True] * 15)
        paradox.score_predictions(str(tmp_path / "q.jsonl"), recs, paradox.SPARSE)


def fake_run(out: Path, name: str, seed: int, curves: dict, right: dict, n_eval: int) -> None:
    """A run dir as train.py, eval.py and paradox.run_once leave it: RL rows of metrics.jsonl, the two
    predictions files, final.json."""
    run_dir = out / f"{name}-s{seed}"
    run_dir.mkdir(parents=True)
    steps = len(next(iter(curves.values())))
    rows = [{"stage": "rl", "step": i + 1, "reward": 0.0, **{k: v[i] for k, v in curves.items()}} for i in range(steps)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in (paradox.SPARSE, paradox.DENSE):
        write_predictions(run_dir / f"eval-k{k}.jsonl", held_out(out, n_eval, seed), right[k])
    (run_dir / "final.json").write_text(json.dumps({"cmd": [], "seconds": 1.0}))


def test_plot_only_aggregates_over_seeds(tmp_path, capsys):
    rng = np.random.default_rng(0)
    n = 6
    expect = {}
    for v in paradox.VARIANTS:
        accs = []
        for s in range(2):
            right = {k: (rng.random(n) < 0.5).tolist() for k in (paradox.SPARSE, paradox.DENSE)}
            fake_run(tmp_path, v, s, {k: rng.random(5).tolist() for k in paradox.CURVES}, right, n)
            mcq = [ok for r, ok in zip(held_out(tmp_path, n, s), right[paradox.SPARSE]) if r["task"] == "mcq"]
            accs.append(np.mean(mcq))
        expect[v] = accs
    result = paradox.main(["--out", str(tmp_path), "--plot-only", "--seeds", "2", "--n-eval", str(n)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["variants"].keys() == set(paradox.VARIANTS)
    for v, accs in expect.items():
        got = last["variants"][v]["final"][f"k{paradox.SPARSE}"]["accuracy"]
        assert got["mean"] == pytest.approx(np.mean(accs)) and got["min"] == pytest.approx(min(accs))
    assert (tmp_path / "paradox.png").stat().st_size > 0
    md = (tmp_path / "paradox.md").read_text()
    assert all(label in md for label in paradox.LABELS.values()) and "K = 8" in md and "K = 32" in md
    assert result["figure"] == str(tmp_path / "paradox.png")


def test_curve_summaries_are_the_seed_mean(tmp_path, capsys):
    right = {k: [True] * 4 for k in (paradox.SPARSE, paradox.DENSE)}
    base = {"acc_tool_needed": [0.5] * 3, "acc_tool_not_needed": [1.0] * 3}
    fake_run(tmp_path, "vanilla", 0, {"format_compliance": [1.0, 0.5, 0.0], "tool_call_ratio": [1.0, 1.0, 0.0], **base},
             right, 4)
    fake_run(tmp_path, "vanilla", 1, {"format_compliance": [0.0, 0.5, 1.0], "tool_call_ratio": [1.0, 0.0, 0.0], **base},
             right, 4)
    paradox.main(["--out", str(tmp_path), "--plot-only", "--seeds", "2", "--variants", "vanilla", "--smooth", "2",
                  "--n-eval", "4"])
    curves = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["variants"]["vanilla"]["curves"]
    assert curves["format_compliance"]["first2"] == pytest.approx(0.5)
    assert curves["tool_call_ratio"]["first2"] == pytest.approx(0.75)
    assert curves["tool_call_ratio"]["last2"] == pytest.approx(0.25)


@pytest.mark.parametrize("argv, match", [
    (["--variants", "vanilla,nope"], "unknown"),     # a typo in a variant name
    (["--seeds", "0"], "must be >= 1"),               # no seeds means no study
])
def test_bad_flags_are_rejected(argv, match, capsys):
    with pytest.raises(SystemExit):
        paradox.parse_args(argv)
    assert match in capsys.readouterr().err


def test_missing_run_dir_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        paradox.main(["--out", str(tmp_path), "--plot-only", "--seeds", "1", "--variants", "vanilla"])


def test_unknown_flags_pass_through_to_train():
    args, rest = paradox.parse_args(["--rl-steps", "3", "--max-turns", "2"])
    cmd = paradox.rl_command(args, "gating", 1, "ckpt", "run", rest)
    assert cmd[-2:] == ["--max-turns", "2"] and cmd[cmd.index("--rl-steps") + 1] == "3"
    assert cmd[cmd.index("--gating") + 1] == "1" and cmd[cmd.index("--seed") + 1] == "1"


@pytest.mark.slow
def test_study_end_to_end_tiny(tmp_path):
    """SFT + five variants x one seed + the evaluations at K = 8 and 32 + figure, with budgets of a few steps."""
    cmd = [sys.executable, str(ROOT / "bench" / "paradox.py"), "--out", str(tmp_path), "--sft-steps", "4",
           "--rl-steps", "2", "--seeds", "1", "--n-eval", "4", "--group-size", "2", "--prompts-per-step", "2",
           "--n-train", "8", "--sft-batch", "4", "--max-new-tokens", "48"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["variants"].keys() == set(paradox.VARIANTS)
    for v in paradox.VARIANTS:
        assert last["variants"][v]["curves"]["tool_call_ratio"]["steps"] == 2
        for k in ("accuracy", "format_compliance", "tool_call_ratio"):
            assert 0.0 <= last["variants"][v]["final"]["k8"][k]["mean"] <= 1.0
        assert (tmp_path / f"{v}-s0" / "eval-k32.jsonl").exists()
    gated = [json.loads(l)["mean_k"] for l in open(tmp_path / "gating-s0" / "metrics.jsonl") if '"rl"' in l]
    plain = [json.loads(l)["mean_k"] for l in open(tmp_path / "vanilla-s0" / "metrics.jsonl") if '"rl"' in l]
    assert plain == [32.0, 32.0]                 # the ungated run saw the dense overview every step
    assert any(k < 32 for k in gated)            # gating drew fewer frames at least once
    assert (tmp_path / "paradox.png").exists() and (tmp_path / "paradox.md").exists()
