"""bench/headroom.py: held-out MCQs binned by greedy result and sampled accuracy; the sampled mode's accuracy."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import headroom  # noqa: E402
import rollout  # noqa: E402


@pytest.mark.parametrize("p, label", [(0.0, "p = 0"), (1 / 16, "0 < p < 1/4"), (0.25, "1/4 <= p < 1/2"),
                                      (0.5, "1/2 <= p < 3/4"), (0.9375, "3/4 <= p < 1"), (1.0, "p = 1")])
def test_p_bins_edges(p, label):
    assert headroom.p_bin(p) == label


def test_counts_and_the_accuracy_of_the_sampled_mode():
    greedy = {"a": True, "b": True, "c": False, "d": False, "e": False}
    sampled = {"a": 1.0, "b": 0.25, "c": 0.75, "d": 0.0, "e": 0.5, "unused": 1.0}
    out = headroom.headroom(greedy, sampled)
    assert out["questions"] == 5 and out["greedy_accuracy"] == pytest.approx(0.4)
    assert out["sampled_accuracy"] == pytest.approx((1.0 + 0.25 + 0.75 + 0.0 + 0.5) / 5)
    assert out["mode_accuracy"] == pytest.approx(2 / 5)          # a and c: p = 1/2 is not a majority
    assert (out["wrong_with_p_above_half"], out["right_with_p_below_half"],
            out["wrong_with_p_below_quarter"]) == (1, 1, 1)
    assert out["counts"] == {"right, p = 1": 1, "right, 1/4 <= p < 1/2": 1, "wrong, 3/4 <= p < 1": 1,
                             "wrong, 1/2 <= p < 3/4": 1, "wrong, p = 0": 1}


def test_a_question_without_a_sampled_accuracy_is_an_error_naming_it():
    with pytest.raises(ValueError, match="e.g. b"):
        headroom.headroom({"a": True, "b": False}, {"a": 1.0})


def test_main_scores_each_questions_group_across_chunks(monkeypatch, capsys):
    """The command's plumbing on a fake agent: MCQs only, questions in chunks of --batch, each question's greedy
    answer and its --group samples scored by the final turn's answer (Trajectory.answer), one JSON line last."""
    G = 4
    records = [{"id": f"q{i}", "task": "mcq", "answer": "A"} for i in range(7)] + [{"id": "t", "task": "tvg"}]
    calls = []

    def fake_run_agent(model, processor, chunk, root, cfg, seed=0, nframes=None):
        assert nframes == [8] * len(chunk) and all(r["task"] == "mcq" for r in chunk)
        calls.append((len(chunk), cfg.temperature, cfg.group_size))
        out = []
        for r in chunk:
            i = int(r["id"][1:])
            if cfg.temperature == 0.0:      # greedy: right on the even questions
                out.append(SimpleNamespace(answer="A" if i % 2 == 0 else "B", text="<answer>B</answer>"))
            else:                           # sampled: question i right in min(i, G) of its G samples
                out += [SimpleNamespace(answer="A" if k < min(i, G) else "C", text="<answer>B</answer>")
                        for k in range(cfg.group_size)]
        return out

    monkeypatch.setattr(headroom, "checkpoint_or_exit", lambda path, script: path)
    monkeypatch.setattr(headroom.benchmarks, "synthetic_records", lambda root, n, seed: records)
    monkeypatch.setattr(headroom.evaluation, "load_agent", lambda *a: (None, None, rollout.RolloutConfig()))
    monkeypatch.setattr(headroom.rollout, "run_agent", fake_run_agent)
    out = headroom.main(["--model", "ckpt", "--group", str(G), "--batch", "3"])
    assert calls == [(3, 0.0, 1), (3, 0.7, G), (3, 0.0, 1), (3, 0.7, G), (1, 0.0, 1), (1, 0.7, G)]
    p = [min(i, G) / G for i in range(7)]
    assert out["questions"] == 7 and out["greedy_accuracy"] == pytest.approx(4 / 7)
    assert out["sampled_accuracy"] == pytest.approx(sum(p) / 7)
    assert out["mode_accuracy"] == pytest.approx(4 / 7)            # p > 1/2: questions 3 to 6
    assert out["counts"] == {"right, p = 0": 1, "right, 1/2 <= p < 3/4": 1, "right, p = 1": 2,
                             "wrong, 1/4 <= p < 1/2": 1, "wrong, 3/4 <= p < 1": 1, "wrong, p = 1": 1}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["questions"] == 7


def test_a_path_without_a_checkpoint_exits_naming_the_script_and_the_path(tmp_path):
    with pytest.raises(SystemExit, match=r"^headroom\.py: .*empty: neither a checkpoint dir"):
        headroom.main(["--model", str(tmp_path / "empty")])
