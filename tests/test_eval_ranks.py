"""Evaluation on several processes (2 gloo ranks on CPU): `eval.py --gpus 2 --device cpu` answers the same as
one process, a run killed mid-way resumes per rank to the same file, one progress bar counts every rank's
questions; train.py's held-out evaluation is split over the ranks the same way, and the best-checkpoint
decision is made once, so every rank calls the (collective) save together.

    pytest tests/test_eval_ranks.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import eval as ev
import grpo
import model as model_lib
import rollout
import runtime
import train
import policy
from conftest import TEST_ROLLOUT

pytestmark = pytest.mark.slow               # every test here starts processes (subprocess or spawned ranks)

REPO = Path(__file__).resolve().parents[1]
N = 7                                   # questions: rank 0 gets 4, rank 1 gets 3


def _same(rows: list[dict]) -> list[dict]:
    """Rows without their wall-clock latency (the one field two runs never share)."""
    return [{k: v for k, v in r.items() if k != "latency"} for r in rows]


@pytest.fixture(scope="module")
def records_file(tmp_path_factory):
    """N synthetic questions as the user's own records; the last one's video is missing (an error row)."""
    root = tmp_path_factory.mktemp("videos")
    recs = data.make_split(str(root), N, seed=5, duration=64.0)
    mine = [{k: r[k] for k in ("id", "video", "question", "options", "answer", "task", "clues", "duration")} for r in recs]
    mine[-1]["video"] = "videos/missing.mp4"
    path = root / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mine), encoding="utf-8")
    return path, root


def argv(records_file, out, *extra) -> list[str]:
    path, root = records_file
    return ["--bench", "records", "--annotations", str(path), "--video-root", str(root), "--max-new-tokens", "16",
            "--batch-size", "2", "--threads", "1", "--out", str(out), *extra]


def cli(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "eval.py", *args], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_process(records_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "preds.jsonl"
    proc = cli(argv(records_file, out))
    return ev.read_predictions(out), json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_answer_as_one(records_file, one_process, tmp_path):
    """--gpus 2 --device cpu: question i on rank i % 2, each rank its own file, merged by rank 0 in annotation
    order; the rows equal one process's (greedy), scored once; one bar over all 7 questions with the rate and
    the error rows; the rank files are gone."""
    rows, metrics = one_process
    out = tmp_path / "preds.jsonl"
    proc = cli(argv(records_file, out, "--gpus", "2", "--device", "cpu"))
    assert _same(ev.read_predictions(out)) == _same(rows)
    assert [r["id"] for r in rows] == [json.loads(l)["id"] for l in records_file[0].read_text().splitlines()]
    timeless = lambda m: {k: v for k, v in m.items() if k != "mean_latency_s"}
    assert timeless(json.loads(proc.stdout.strip().splitlines()[-1])) == timeless(metrics)
    assert metrics["n"] == N and metrics["n_error"] == 1
    assert proc.stdout.count('"n": 7') == 1                        # scored and printed once, by rank 0
    bar = proc.stderr.replace("\r", "\n")
    assert f"{N}/{N} [" in bar and "4/4 [" not in bar and "3/3 [" not in bar   # one bar, every rank's questions
    assert "q/min, 1 error rows" in bar
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl"]


def _eval_rank(rank: int, job, fail_rank: int, fail_after: int) -> None:
    """A rank of `eval.py --gpus 2` whose rank `fail_rank` dies (an uncaught error) after answering
    `fail_after` questions: spawn then stops the other rank too, as a kill would."""
    real = ev.agent_runner

    def runner(*a, **k):
        run_batch, answered = real(*a, **k), []

        def maybe_die(batch):
            if rank == fail_rank and len(answered) >= fail_after:
                raise RuntimeError("killed mid-run")
            rows = run_batch(batch)
            answered.extend(rows)
            return rows
        return maybe_die
    ev.agent_runner = runner
    ev.rank_main(rank, job)


def test_killed_run_resumes_per_rank(records_file, one_process, tmp_path, monkeypatch):
    """Rank 1 dies after 2 questions (rank 0 is stopped with it): each rank's file keeps what it answered; the
    rerun, on 2 processes, answers only the rest and the merged file equals an uninterrupted run's."""
    rows, _ = one_process
    out = tmp_path / "preds.jsonl"
    job = ev.job_of(ev.parse_args(argv(records_file, out, "--gpus", "2", "--device", "cpu", "--batch-size", "1")))
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(runtime.find_free_port()))
    with pytest.raises(Exception, match="killed mid-run"):
        torch.multiprocessing.spawn(_eval_rank, args=(job, 1, 2), nprocs=2)
    kept = {r: ev.read_predictions(ev.rank_path(out, r)) for r in (0, 1)}
    ids = [r["id"] for r in rows]
    assert [r["id"] for r in kept[1]] == ids[1::2][:2] and 1 <= len(kept[0]) < 4 and not out.exists()
    proc = cli(argv(records_file, out, "--gpus", "2", "--device", "cpu", "--batch-size", "1"))
    assert _same(ev.read_predictions(out)) == _same(rows)
    assert all(r in ev.read_predictions(out) for r in kept[0] + kept[1])   # kept as written, not answered again
    assert f"{len(kept[0]) + 2}/{N} [" in proc.stderr.replace("\r", "\n").split(f"{N}/{N} [")[0]   # bar resumed there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl"]


def test_one_process_resumes_what_two_left(records_file, one_process, tmp_path, monkeypatch):
    """The rank files of a killed 2-process run resume on one process too (any number of ranks)."""
    rows, _ = one_process
    out = tmp_path / "preds.jsonl"
    ev.rank_path(out, 0).write_text("".join(json.dumps(r) + "\n" for r in rows[0:4:2]), encoding="utf-8")
    ev.rank_path(out, 1).write_text(json.dumps(rows[1]) + "\n" + '{"id": "cut sh', encoding="utf-8")
    ran = []
    real = ev.agent_runner
    monkeypatch.setattr(ev, "agent_runner", lambda *a, **k: (lambda batch: ran.extend(r["id"] for r in batch)
                                                               or real(*a, **k)(batch)))
    ev.main(argv(records_file, out))
    assert ran == [r["id"] for r in rows[3:]]
    assert _same(ev.read_predictions(out)) == _same(rows) and sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl"]


# ----------------------------------------------------------------------------- train.py on 2 ranks

def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, world, use_cuda=False, timeout_s=60)
    torch.set_num_threads(1)


def _tiny_sharded(world: int):
    model, processor = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())
    if world > 1:
        runtime.shard_model(model)
    return model, processor


def _held_out_rank(rank: int, world: int, port: int, run_dir: str, cache: str) -> None:
    """ev.evaluate_held_out on `world` ranks (FSDP2-sharded tiny model); logs the ids this rank ran and the
    metrics it got to run_dir/rank<r>.json. On 2 ranks, then an evaluation of one question (rank 1 runs no
    forward) and a training forward and backward on both ranks."""
    if world > 1:
        _init(rank, world, port)
    model, processor = _tiny_sharded(world)
    records = data.make_split(cache, 5, seed=11, duration=64.0)
    ran, real = [], ev.agent_runner

    def runner(*a, **k):
        run_batch = real(*a, **k)
        return lambda batch: ran.extend(r["id"] for r in batch) or run_batch(batch)
    run = runtime.Run(run_dir, rank, world, 0, 100, 0, False, 1.0)
    run.processor = processor
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 12})
    ev.agent_runner = runner
    try:
        metrics = ev.evaluate_held_out(model, processor, records, cache, cfg, run, "final", batch_size=8, report_questions=2)
    finally:
        ev.agent_runner = real                      # (world 1 runs in the test process)
    trained = None
    if world > 1:                                   # one question: rank 1 runs no forward, then both train
        ev.evaluate_held_out(model, processor, records[:1], cache, cfg, run, "one", batch_size=8, report_questions=0)
        ids = torch.arange(16).view(1, 16)
        for _ in range(2):
            model(input_ids=ids).logits.float().sum().backward()
        trained = all(p.grad is not None for n, p in model.named_parameters() if ".visual." not in f".{n}")
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps({"ran": ran, "metrics": metrics, "trained": trained}))
    runtime.finish(world)


def test_held_out_evaluation_is_split_over_the_ranks(tmp_path):
    """Each of 2 ranks runs its share of the held-out questions (i -> rank i % 2, none runs them all); the
    merged RUN_DIR/eval/final.jsonl and the metrics every rank returns equal one process's. A rank left
    without questions and one that had some enter the next training step alike (before: a collective
    mismatch in the backward, FSDP's record of one rank's evaluation forwards steering its prefetching)."""
    cache = str(tmp_path / "cache")
    _held_out_rank(0, 1, 0, str(tmp_path / "one"), cache)
    torch.multiprocessing.spawn(_held_out_rank, args=(2, runtime.find_free_port(), str(tmp_path / "two"), cache), nprocs=2)
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    two = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in (0, 1)]
    ids = one["ran"]
    assert len(ids) == 5 and two[0]["ran"] == ids[0::2] and two[1]["ran"] == ids[1::2]
    assert two[0]["metrics"] == two[1]["metrics"] == one["metrics"]
    merged, single = (ev.read_predictions(tmp_path / d / "eval" / "final.jsonl") for d in ("two", "one"))
    assert _same(merged) == _same(single)
    assert sorted(os.listdir(tmp_path / "two" / "eval")) == ["final.jsonl", "one.jsonl"]
    assert (tmp_path / "two" / "report" / "final" / "index.html").is_file()
    assert two[0]["trained"] is True and two[1]["trained"] is True


def _best_rank(rank: int, world: int, port: int, run_dir: str) -> None:
    """run_rl for 3 steps on 2 ranks (the rollout and the update stubbed out) with an evaluation after each step
    whose result differs between the ranks at step 2 (rank 0: better, rank 1: worse), a step that is not saved
    anyway: every rank must save it together, or neither."""
    _init(rank, world, port)
    model, processor = _tiny_sharded(world)
    run = runtime.Run(run_dir, rank, world, 0, 100, 0, False, 1.0)
    run.processor = processor
    fake = grpo.Groups(trajs=[], comps=[], rewards=torch.zeros(1), seq_kl=torch.zeros(1), items=[], n_groups=0,
                        draws=1, zero_var_frac=0.0)
    grpo.collect_groups = lambda *a, **k: fake
    grpo.policy_update = lambda *a, **k: (None, {"clip_frac": 0.0, "kl": 0.0})   # stubbed: no zero-weight pass
    ev.rollout_metrics = lambda *a, **k: {"accuracy": 0.0, "format_compliance": 0.0, "tool_call_ratio": 0.0,
                                             "turns": 0.0, "mean_k": 8.0}
    scores = {0: [0.5, 0.7, 0.6], 1: [0.5, 0.1, 0.1]}[rank]
    evaluate = lambda m, name: {"r_acc": scores[int(name.split("-")[1]) - 1]}
    optimizer = policy.make_optimizer(model, 1e-4, 0.0)
    settings = grpo.GRPOSettings(group_size=2, rl_steps=3, lr=1e-4, warmup_steps=0, eval_every=1)
    train.run_rl(run, model, None, processor, optimizer, grpo.RLJob([], "", rollout.RolloutConfig(), settings,
                                                                    evaluate=evaluate))
    Path(run_dir, f"best{rank}.json").write_text(json.dumps(run.best))
    runtime.finish(world)


def test_best_checkpoint_is_decided_once_on_two_ranks(tmp_path):
    """The held-out results of the ranks disagree (rank 0: better at step 2, rank 1: worse): rank 0's decision
    holds on both, both ranks save step 2's checkpoint together (before: rank 1 skipped the collective save and
    the ranks hung), and best.json names it."""
    torch.multiprocessing.spawn(_best_rank, args=(2, runtime.find_free_port(), str(tmp_path)), nprocs=2)
    best = [json.loads((tmp_path / f"best{r}.json").read_text()) for r in (0, 1)]
    assert best[0] == best[1] == ["ckpt-rl-000002", 0.7]
    assert json.loads((tmp_path / "best.json").read_text())["checkpoint"] == "ckpt-rl-000002"
    assert [d for _, _, d in runtime.checkpoints(str(tmp_path))] == ["ckpt-rl-000001", "ckpt-rl-000002", "ckpt-rl-000003"]

