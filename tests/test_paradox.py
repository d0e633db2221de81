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


@pytest.mark.parametrize("x, window", [
    ([1.0, 2.0, 3.0, 4.0], 1),        # window 1 is the identity
    ([1.0, 2.0, 3.0, 4.0], 2),        # the first step averages over itself only
    ([0.0, 1.0, 0.0, 1.0, 1.0], 10),  # window longer than the curve: running mean
])
def test_moving_average_is_a_trailing_mean(x, window):
    want = [np.mean(x[max(0, i + 1 - window):i + 1]) for i in range(len(x))]
    np.testing.assert_allclose(paradox.moving_average(np.array(x), window), want)


def test_seed_band_cuts_to_the_shortest_run():
    # a run that stopped early must not leave NaNs or misaligned steps in the band
    mean, lo, hi = paradox.seed_band([np.array([0.0, 1.0, 0.5]), np.array([1.0, 0.0])])
    np.testing.assert_allclose(mean, [0.5, 0.5])
    np.testing.assert_allclose(lo, [0.0, 0.0])
    np.testing.assert_allclose(hi, [1.0, 1.0])


def fake_run(run_dir: Path, fmt: list[float], tool: list[float], final: dict) -> None:
    """A run dir as train.py + paradox.run_once leave it: SFT-free metrics.jsonl rows and final.json."""
    run_dir.mkdir(parents=True)
    rows = [{"stage": "rl", "step": i + 1, "format_compliance": f, "tool_call_ratio": t, "reward": 0.0}
            for i, (f, t) in enumerate(zip(fmt, tool))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "final.json").write_text(json.dumps({"cmd": [], "seconds": 1.0, "summary": {"after": final}}))


def test_plot_only_aggregates_over_seeds(tmp_path, capsys):
    rng = np.random.default_rng(0)
    expect = {}
    for v in paradox.VARIANTS:
        finals = []
        for s in range(2):
            final = {k: float(rng.random()) for k in paradox.FINALS}
            fake_run(tmp_path / f"{v}-s{s}", rng.random(5).tolist(), rng.random(5).tolist(), final)
            finals.append(final)
        expect[v] = finals
    result = paradox.main(["--out", str(tmp_path), "--plot-only", "--seeds", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["variants"].keys() == set(paradox.VARIANTS)
    for v, finals in expect.items():
        for k in paradox.FINALS:
            vals = [f[k] for f in finals]
            assert last["variants"][v]["final"][k]["mean"] == pytest.approx(np.mean(vals))
            assert last["variants"][v]["final"][k]["min"] == pytest.approx(min(vals))
    assert (tmp_path / "paradox.png").stat().st_size > 0
    md = (tmp_path / "paradox.md").read_text()
    assert all(label in md for label in paradox.LABELS.values())
    assert result["figure"] == str(tmp_path / "paradox.png")


def test_curve_first_last_are_the_seed_mean(tmp_path, capsys):
    # one variant, two seeds with known curves: first/last of the mean curve
    final = {k: 0.0 for k in paradox.FINALS}
    fake_run(tmp_path / "vanilla-s0", [1.0, 0.5, 0.0], [1.0, 1.0, 0.0], final)
    fake_run(tmp_path / "vanilla-s1", [0.0, 0.5, 1.0], [1.0, 0.0, 0.0], final)
    paradox.main(["--out", str(tmp_path), "--plot-only", "--seeds", "2", "--variants", "vanilla", "--smooth", "2"])
    curves = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["variants"]["vanilla"]["curves"]
    assert curves["format_compliance"]["first"] == pytest.approx(0.5)
    assert curves["tool_call_ratio"]["first"] == pytest.approx(1.0)
    assert curves["tool_call_ratio"]["last"] == pytest.approx(0.0)
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
    args, rest = paradox.parse_args(["--rl-steps", "3", "--lr", "1e-4"])
    cmd = paradox.rl_command(args, "gating", 1, "ckpt", "run", rest)
    assert cmd[-2:] == ["--lr", "1e-4"] and cmd[cmd.index("--rl-steps") + 1] == "3"
    assert cmd[cmd.index("--gating") + 1] == "1" and cmd[cmd.index("--seed") + 1] == "1"


@pytest.mark.slow
def test_study_end_to_end_tiny(tmp_path):
    """SFT + five variants x one seed + final evals + figure, with budgets of a few steps (minutes on CPU)."""
    cmd = [sys.executable, str(ROOT / "bench" / "paradox.py"), "--out", str(tmp_path), "--sft-steps", "4",
           "--rl-steps", "2", "--seeds", "1", "--n-train", "8", "--n-eval", "4", "--group-size", "2",
           "--prompts-per-step", "2", "--sft-batch", "4", "--max-new-tokens", "48"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["variants"].keys() == set(paradox.VARIANTS)
    for v in paradox.VARIANTS:
        assert last["variants"][v]["curves"]["tool_call_ratio"]["steps"] == 2
        for k in ("accuracy", "format_compliance", "tool_call_ratio", "clue_score"):
            assert 0.0 <= last["variants"][v]["final"][k]["mean"] <= 1.0
        run = tmp_path / f"{v}-s0"
        assert paradox.latest_checkpoint(str(run)) is not None
    gated = [json.loads(l)["mean_k"] for l in open(tmp_path / "gating-s0" / "metrics.jsonl")]
    plain = [json.loads(l)["mean_k"] for l in open(tmp_path / "vanilla-s0" / "metrics.jsonl")]
    assert plain == [64.0, 64.0]                 # the ungated run saw the 64-frame overview every step
    assert any(k < 64 for k in gated)            # gating drew fewer frames at least once
    assert (tmp_path / "paradox.png").exists() and (tmp_path / "paradox.md").exists()
