"""Faults during training are counted, logged events that lose nothing: a non-finite loss, bad records and
undecodable videos, a SIGKILL mid-run, half-written checkpoints; and checkpoints hold no pickled code.

Run: python -m pytest tests/test_reliability.py -q      (CPU, about a minute)
"""
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import metrics, run, smoke_argv  # shared with the other training tests
from safetensors.torch import load_file

import data
import grpo
import runtime
import sft

REPO = Path(__file__).resolve().parent.parent



@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# -----------------------------------------------------------------------------
# numerics

def nan_on_first_call(fn):
    """`fn` whose first call returns a NaN loss (the graph kept, so backward gives NaN gradients)."""
    calls = []

    def wrapped(*a, **k):
        loss, rest = fn(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), rest
    return wrapped


STAGES = [  # (stage flags, the module and its loss function made to return NaN once)
    (["--stage", "sft", "--sft-batch", "2", "--n-train", "4"], "sft.sft_loss"),
    (["--stage", "rl", "--mask-truncated", "0", "--prompts-per-step", "1"], "grpo.grpo_loss"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags, loss_fn", STAGES)
def test_non_finite_loss_is_skipped_counted_and_logged(flags, loss_fn, tmp_path, capsys, monkeypatch, tiny):
    stage = flags[1]
    module, name = loss_fn.split(".")
    module = {"sft": sft, "grpo": grpo}[module]
    monkeypatch.setattr(module, name, nan_on_first_call(getattr(module, name)))
    run(smoke_argv(tmp_path, *flags, "--save-every", "1"))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["skipped_steps"] for r in rows] == [1, 1]            # counted, cumulative
    assert math.isnan(rows[0]["grad_norm"]) and math.isfinite(rows[1]["grad_norm"])
    logged = [line for line in capsys.readouterr().out.splitlines() if "non-finite" in line]
    assert len(logged) == 1 and f"{stage} step 1" in logged[0]
    assert re.search(r"syn-[14]000-\d{5}", logged[0]), logged[0]      # names the samples of the batch
    # the skipped step changed nothing: checkpoint 1 still holds the initial weights (SFT starts from them)
    if stage == "sft":
        first = load_file(str(tmp_path / "ckpt-sft-000001" / "model.safetensors"))
        init = tiny[0].state_dict()
        assert all(torch.equal(first[k], init[k]) for k in init)
        second = load_file(str(tmp_path / "ckpt-sft-000002" / "model.safetensors"))
        assert not torch.equal(second["lm_head.weight"], init["lm_head.weight"])
        # the count survives a resume (it lives in the checkpoint, not in the process)
        run(smoke_argv(tmp_path, *flags, "--sft-steps", "3", "--resume"))
        assert [(r["step"], r["skipped_steps"]) for r in metrics(tmp_path)] == [(1, 1), (2, 1), (3, 1)]


@pytest.mark.slow
def test_non_finite_loss_raises_with_strict(tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "sft_loss", nan_on_first_call(sft.sft_loss))
    with pytest.raises(FloatingPointError, match="sft step 1"):
        run(smoke_argv(tmp_path, "--stage", "sft", "--sft-batch", "2", "--n-train", "4", "--strict"))


# -----------------------------------------------------------------------------
# bad data at train time

@pytest.fixture
def records_file(tmp_path):
    """A JSONL of 8 good records and 6 bad ones, each bad kind once; returns (path, root, where)."""
    root = tmp_path / "root"
    good = data.make_split(str(root), 8, seed=7, duration=64.0)
    (root / "videos" / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(2048))
    (root / "videos" / "empty.mp4").write_bytes(b"")
    (tmp_path / "outside.mp4").write_bytes((root / good[0]["video"]).read_bytes())   # exists, outside the root
    bad = [  # (record, what the report must say) -- found when the file is read
        ({"id": "bad-fields", "video": good[0]["video"]}, "missing field"),
        ({**good[1], "id": "bad-answer", "answer": "F"}, "not a letter among the options"),
        ({**good[2], "id": "bad-missing", "video": "videos/nowhere.mp4"}, "not found"),
        ({**good[3], "id": "bad-escape", "video": "../outside.mp4"}, "outside the video root"),
    ]
    decode_bad = [  # valid records whose video only fails when decoded
        {**good[4], "id": "bad-corrupt", "video": "videos/corrupt.mp4"},
        {**good[5], "id": "bad-empty", "video": "videos/empty.mp4"},
    ]
    lines = [json.dumps(r) for r in good[:4]] + [json.dumps(r) for r, _ in bad] + \
            [json.dumps(r) for r in decode_bad] + [json.dumps(r) for r in good[4:]]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    where = {f"{path}:{5 + i}": why for i, (_, why) in enumerate(bad)}   # file:line of each bad record
    return path, root, where


@pytest.mark.slow
def test_bad_records_are_reported_and_bad_videos_counted(records_file, tmp_path, capsys):
    path, root, where = records_file
    run(smoke_argv(tmp_path / "run", "--stage", "sft", "--sft-steps", "1", "--sft-batch", "2", "--data", path,
                   "--video-root", root, "--max-bad-fraction", "0.5", "--set", "sft_gated_overviews=0",
                   "--set", "sft_tool_free=0"))                         # one SFT trajectory per record (no tool-free
    out = capsys.readouterr().out                                   # twin), so one count per video
    for loc, why in where.items():                                 # each bad record, by file:line, with the reason
        line = [l for l in out.splitlines() if f"{loc}:" in l]
        assert line and why in line[0], (loc, why, out[-2000:])
    for rid in ("bad-corrupt", "bad-empty"):                       # decode failures: logged ...
        assert re.search(rf"skipped SFT record: {rid}: .*(empty|not a readable video)", out), rid
    (row,) = metrics(tmp_path / "run")
    assert row["bad_samples"] == 2 and math.isfinite(row["loss"])  # ... and counted; the run trained on the rest


@pytest.mark.slow
def test_too_many_bad_records_stop_the_run(records_file, tmp_path):
    path, root, _ = records_file                                   # 4 of 14 lines bad > the default 20%
    with pytest.raises(ValueError, match=r"train.jsonl: 4 of 14 lines are bad \(more than 20%\)"):
        run(smoke_argv(tmp_path / "run", "--stage", "sft", "--data", path, "--video-root", root))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()       # stopped before any step


@pytest.mark.slow
def test_undecodable_videos_in_rl_are_counted_then_stop_the_run(records_file, tmp_path, capsys):
    """RL rollouts of records whose video fails to decode: counted every step, each warned once, and past
    --max-bad-fraction (checked from step 6 on) the run stops with a clear message."""
    path, root, _ = records_file
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text("".join(l + "\n" for l in path.read_text().splitlines() if '"bad-corrupt"' in l or '"bad-empty"' in l))
    with pytest.raises(RuntimeError, match="more than 20% of samples failed by step 6"):
        run(smoke_argv(tmp_path / "run", "--stage", "rl", "--rl-steps", "8", "--data", only_bad, "--video-root", root))
    rows = metrics(tmp_path / "run")
    assert [r["bad_samples"] for r in rows] == [4 * s for s in range(1, 6)]   # 2 prompts x 2 samples a step
    warned = re.findall(r"skipped sample (\S+) \(rl step", capsys.readouterr().out)
    assert warned and len(warned) == len(set(warned)) and set(warned) <= {"bad-corrupt", "bad-empty"}


# -----------------------------------------------------------------------------
# crash and resume

@pytest.mark.slow
def test_sigkill_then_resume_loses_and_repeats_nothing(tmp_path, cache, capsys):
    run_dir = tmp_path / "run"
    flags = ["--stage", "rl", "--save-every", "1", "--mask-truncated", "0", "--prompts-per-step", "1"]
    env = {**os.environ, "PARAVT_CACHE": cache, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "train.py", *smoke_argv(run_dir, *flags, "--rl-steps", "100")],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 240
            while runtime.latest_checkpoint(str(run_dir)) is None and proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            delay = random.uniform(0.0, 3.0)                        # somewhere in a later step, or mid-save
            time.sleep(delay)
        finally:
            proc.kill()                                             # SIGKILL: no handler, no cleanup
            proc.wait()
    assert proc.returncode == -9, (tmp_path / "log.txt").read_text()[-2000:]
    before = {r["step"]: r for r in metrics(run_dir)}
    ckpt = runtime.latest_checkpoint(str(run_dir))
    k = int(ckpt[-6:])
    assert k >= 1 and set(before) >= set(range(1, k + 1)), (delay, sorted(before), ckpt)

    run(smoke_argv(run_dir, *flags, "--rl-steps", k + 2, "--resume"))
    assert f"resumed from {ckpt} (rl step {k})" in capsys.readouterr().out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, k + 3)), f"kill after {delay:.2f} s, checkpoint {k}"
    assert all(rows[s - 1] == before[s] for s in range(1, k + 1))   # rows up to the checkpoint: untouched
    assert runtime.latest_checkpoint(str(run_dir)).endswith(f"ckpt-rl-{k + 2:06d}")


def _make(run_dir, name: str, complete: bool) -> None:
    os.makedirs(run_dir / name)
    (run_dir / name / "model.safetensors").write_bytes(b"")
    if complete:
        (run_dir / name / "trainer.pt").write_bytes(b"")


@pytest.mark.parametrize("dirs, expected", [
    ([("ckpt-rl-000002", True), ("ckpt-rl-000003.tmp", True)], "ckpt-rl-000002"),  # a save still in its .tmp dir
    ([("ckpt-rl-000002", True), ("ckpt-rl-000004", False)], "ckpt-rl-000002"),      # no trainer.pt: incomplete
    ([("ckpt-rl-000003.old", True)], None),                # the previous copy, moved aside while being replaced
    ([("ckpt-sft-000150", True), ("ckpt-rl-000002", True)], "ckpt-rl-000002"),      # RL comes after SFT
    ([("ckpt-rl-000009", True), ("ckpt-rl-000010", True)], "ckpt-rl-000010"),       # by step number
    ([("ckpt-sft-000003", True)], "ckpt-sft-000003"),     # a run stopped during SFT
    ([], None),                                            # nothing saved yet
])
def test_latest_checkpoint_picks_only_complete_ones(dirs, expected, tmp_path):
    for name, complete in dirs:
        _make(tmp_path, name, complete)
    got = runtime.latest_checkpoint(str(tmp_path))
    assert (os.path.basename(got) if got else None) == expected


# -----------------------------------------------------------------------------
# security: no pickle anywhere in a checkpoint

def test_trainer_state_is_loaded_with_weights_only():
    src = "".join(p.read_text() for p in REPO.glob("*.py"))          # every module of the project
    loads = re.findall(r"torch\.load\(([^\n]*)", src)
    assert loads and all("weights_only=True" in call for call in loads), loads


def test_checkpoint_is_safetensors_and_plain_tensors(tiny, tmp_path):
    """The weights as safetensors, the trainer state as plain tensors (weights_only), and AdamW's moments in the
    torch.distributed.checkpoint folder, restored exactly into a fresh optimizer."""
    model, processor = tiny
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)      # lr 0: the shared model stays as it is
    model.lm_head.weight.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    path = runtime.save_checkpoint(str(tmp_path), 3, model, processor, optimizer,
                                 {"stage": "rl", "counters": {"skipped_steps": 1, "bad_samples": 2}})
    files = sorted(os.listdir(path))
    assert "model.safetensors" in files and "train_state" in files
    assert not [f for f in files if f.endswith((".bin", ".pkl", ".pickle", ".pth"))], files
    assert [f for f in files if f.endswith(".pt")] == ["trainer.pt"]
    state = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)   # raises on any pickled object
    assert (state["stage"], state["step"], state["counters"]["bad_samples"]) == ("rl", 3, 2)
    assert isinstance(state["rng_torch"], torch.Tensor)
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.AdamW(model.parameters(), lr=0.0)
    runtime.load_train_state(path, model, fresh)
    want, got = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    assert want and set(want) <= set(got)                          # (params without a gradient: fresh zeros)
    assert all(not got[k]["exp_avg"].any() for k in set(got) - set(want))
    assert all(torch.equal(want[k]["exp_avg"], got[k]["exp_avg"]) and torch.equal(want[k]["exp_avg_sq"], got[k]["exp_avg_sq"])
               for k in want)
