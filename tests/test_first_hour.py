"""A new user's first hour with train.py: one run per run dir, ranks that die with their launcher, an honest
held-out set, SFT trajectories with bad tool calls reported, one-line errors, --keep-last, evaluation-only use."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import SFT_MIX, metrics, oracle_turns, run, smoke_argv

import data
import recipes
import runtime
import sft
import train

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


def test_a_second_run_on_the_same_dir_is_refused_with_the_holders_pid(tmp_path):
    lock = runtime.RunLock(str(tmp_path))
    try:
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {os.getpid()}\)"):
            runtime.RunLock(str(tmp_path))
    finally:
        lock.release()
    runtime.RunLock(str(tmp_path)).release()          # free again once the holder is gone


@pytest.mark.slow
def test_spawned_rank_dies_with_its_launcher(tmp_path):
    """The launcher is SIGKILLed; its child (a rank) must not run on as an orphan."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        pid = os.fork()
        if pid == 0:
            import runtime
            runtime.die_with_parent()
            open({str(tmp_path / 'armed')!r}, 'w').close()
            time.sleep(60)
            os._exit(0)
        open({str(tmp_path / 'child')!r}, 'w').write(str(pid))
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while not (tmp_path / "armed").exists() and time.time() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    launcher.kill()
    launcher.wait()
    if not (tmp_path / "armed").exists():            # the child died before arming: nothing was tested
        pytest.fail("the child never called runtime.die_with_parent()")
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:                                        # a zombie of an exited child counts as dead
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the rank outlived its launcher")


def test_held_out_records_are_never_drawn_for_training(tmp_path):
    recs = [{"id": f"r{i}"} for i in range(50)]
    train_recs, held = data.split_held_out(recs, 32, seed=3)
    assert len(held) == 10                          # at most 20 % of the records
    assert not {r["id"] for r in held} & {r["id"] for r in train_recs}
    assert len(train_recs) + len(held) == 50
    assert data.split_held_out(recs, 32, seed=3)[1] == held            # seeded
    assert data.split_held_out(recs, 32, seed=4)[1] != held


def _sft_file(tmp_path, records, window) -> str:
    rec = records[0]
    call = json.dumps({"name": "crop_video", "arguments": {"start_time": window[0], "end_time": window[1]}})
    good = oracle_turns(rec, __import__("numpy").random.default_rng(0), always_call=True, nframes=8)
    bad = [{"role": "assistant", "content": f"<think>\nlook\n</think>\n<tool_call>\n{call}\n</tool_call>"},
           {"role": "tool", "content": "Error"},
           {"role": "assistant", "content": "<think>\nok then\n</think>\n<answer>A</answer>"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({**r, "messages": m}) + "\n" for r, m in
                            [(rec, good), (records[1], bad), (records[2], good)]))
    return str(path)


def test_sft_trajectories_with_calls_the_environment_refuses_are_reported_and_skipped(tmp_path, cache, tiny):
    model, processor = tiny
    root = os.path.join(cache, "synthetic")
    records = data.make_split(root, 4, seed=91, duration=64.0)
    path = _sft_file(tmp_path, records, (100.0, 120.0))          # past the end of a 64 s video
    cfg = train.rollout_config_of_args(recipes.parse_train_args([]))
    logged = []
    items, bad = sft.sft_examples(records, processor, root, cfg, sft_data=path, seed=0, gated_choices=[],
                                    **dict(SFT_MIX, max_bad_fraction=0.5), log=logged.append)
    assert len(items) == 2 and bad == 1
    assert any(f"{path}:2" in m and "past the end" in m for m in logged), logged
    items, bad = sft.sft_examples(records, processor, root, cfg, sft_data=path, seed=0, gated_choices=[],
                                    **dict(SFT_MIX, keep_bad_calls=True, max_bad_fraction=0.5), log=logged.append)
    assert len(items) == 3 and bad == 0


@pytest.mark.slow
def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "--data", str(tmp_path / "missing.jsonl"), "--video-root", str(tmp_path),
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    err = [l for l in proc.stderr.splitlines() if l.strip() and "Warning" not in l]
    assert len(err) == 1 and err[0].startswith("train.py: error:") and "missing.jsonl" in err[0], proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(cmd + ["--debug"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_keep_last_prunes_old_checkpoints_but_keeps_the_sft_result_and_the_best(tmp_path):
    for name in ["ckpt-sft-000001", "ckpt-sft-000002"] + [f"ckpt-rl-{s:06d}" for s in range(1, 7)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer.pt").write_bytes(b"")
    (tmp_path / "best.json").write_text(json.dumps({"checkpoint": "ckpt-rl-000002"}))
    deleted = runtime.prune_checkpoints(str(tmp_path), 2)
    assert sorted(deleted) == ["ckpt-rl-000001", "ckpt-rl-000003", "ckpt-rl-000004"]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert left == ["ckpt-rl-000002", "ckpt-rl-000005", "ckpt-rl-000006", "ckpt-sft-000001", "ckpt-sft-000002"]


def test_resumed_run_keeps_the_best_checkpoint_until_a_better_one(tmp_path, monkeypatch):
    """After --resume, the best checkpoint is the one best.json names (its score read back): a worse evaluation
    does not replace it (it did: the resumed Run started with no best and took the first evaluation). A best.json
    whose checkpoint never completed is ignored."""
    (tmp_path / "ckpt-rl-000002").mkdir()
    (tmp_path / "ckpt-rl-000002" / "trainer.pt").write_bytes(b"")
    runtime.atomic_write_json(str(tmp_path / "best.json"), {"checkpoint": "ckpt-rl-000002", "eval": {"r_acc": 0.8}})
    monkeypatch.setattr(runtime, "load_train_state", lambda *a: None)
    monkeypatch.setattr(torch, "load", lambda *a, **k: {"stage": "rl", "step": 4, "rng_torch": torch.get_rng_state(),
                                                         "rng_random": random.getstate()})
    run_ = runtime.Run(str(tmp_path), 0, 1, 0, 50, 3, False, 0.2)
    run_.resume(str(tmp_path / "ckpt-rl-000004"), model=None)
    assert run_.best == ("ckpt-rl-000002", 0.8)
    assert not run_.is_best({"r_acc": 0.7}) and run_.is_best({"r_acc": 0.9})
    (tmp_path / "ckpt-rl-000002" / "trainer.pt").unlink()                 # the best one never completed
    assert runtime.read_best(str(tmp_path)) is None


@pytest.mark.slow
def test_keep_last_in_a_run(tmp_path):
    run(smoke_argv(tmp_path, "--stage", "rl", "--rl-steps", "4", "--save-every", "1", "--keep-last", "2",
                   "--mask-truncated", "0", "--prompts-per-step", "1"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt-rl-000003", "ckpt-rl-000004"]


@pytest.mark.slow
def test_evaluation_only_run_prints_its_result(tmp_path, cache, capsys):
    """`--stage rl --rl-steps 0 --final-eval` evaluates and prints the summary (it crashed drawing curves)."""
    root = os.path.join(cache, "synthetic")
    recs = data.make_split(root, 3, seed=92, duration=64.0)
    path = tmp_path / "held.jsonl"
    data.write_records(str(path), recs)
    summary = run(smoke_argv(tmp_path / "run", "--stage", "rl", "--rl-steps", "0", "--final-eval",
                             "--data", str(path), "--eval-data", str(path), "--video-root", root))
    assert set(summary["after"]) >= {"accuracy", "format_compliance", "tool_call_ratio"}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["after"] == summary["after"]


@pytest.mark.slow
def test_videoo3_preset_on_a_saved_checkpoint_samples_a_2fps_overview(tmp_path, cache, tiny):
    """`--preset videoo3 --model CKPT --data ... --stage rl`: the overview follows Video-o3's 2 fps rule (a 64 s
    video: 128 frames) on a saved tiny checkpoint, and the preset's recipe and sampling are in effect."""
    model, processor = tiny
    ckpt = tmp_path / "ckpt"
    import model as model_lib
    model_lib.save_model(model, processor, str(ckpt))
    root = os.path.join(cache, "synthetic")
    path = tmp_path / "rl.jsonl"
    data.write_records(str(path), data.make_split(root, 6, seed=93, duration=64.0))
    argv = ["--preset", "videoo3", "--model", str(ckpt), "--data", str(path), "--video-root", root, "--stage", "rl",
            "--rl-steps", "1", "--group-size", "2", "--prompts-per-step", "1", "--max-new-tokens", "8",
            "--max-turns", "1", "--run-dir", str(tmp_path / "run")]
    args = recipes.parse_train_args(argv)
    assert (args.recipe, args.clip_high, args.dynamic_sampling, args.anchoring) == ("vtgr", 0.3, True, "none")
    cfg = train.rollout_config_of_args(args)
    assert cfg.overview_nframes is None and cfg.overview_fps == 2.0 and cfg.overview_max_frames == 768
    run(argv)
    (row,) = [r for r in metrics(tmp_path / "run") if r["stage"] == "rl"]
    assert row["mean_k"] == 128


def test_an_error_raised_inside_a_library_keeps_its_traceback(monkeypatch, tmp_path):
    """Only the project's own checks become one line: a ValueError from library code is a bug to report whole
    (the one-line form once hid a model error in the RL step)."""
    monkeypatch.setattr(train, "start", lambda args: json.loads("{"))              # raised inside json
    with pytest.raises(json.JSONDecodeError):
        train.cli(["--run-dir", str(tmp_path / "run")])

    monkeypatch.setattr(train, "start", lambda args: data.resolve_video(str(tmp_path), ""))   # a check of ours
    with pytest.raises(SystemExit) as e:
        train.cli(["--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2
