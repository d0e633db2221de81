"""Tests of train.py: the CPU smoke runs (`--stage all`, `--stage rl`), exact resume, FSDP2 on two CPU processes
(gloo), the launcher's device checks, the RL metrics row reduced over ranks, and the settings a bare run takes.
The RL step is tested in test_grpo.py, the SFT warm start in test_sft.py, the policy's forward passes and
optimizer in test_policy.py, the kernels in test_ops.py.
"""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import metrics, run, score_with, smoke_argv
from safetensors.torch import load_file

import data
import model as model_lib
import rollout
import recipes
import runtime
import sft
import eval as evaluation
import grpo
import train


REPO = Path(__file__).resolve().parent.parent


# The RL metrics row (ParaVT's curves plus the optimiser's health).
RL_METRICS = ("reward", "reward/acc", "reward/format", "reward/tool", "accuracy", "format_compliance",
              "tool_call_ratio", "calls_per_turn", "turns", "tool_failure_rate", "mean_k", "zero_var_frac",
              "clip_frac", "kl", "grad_norm", "lr", "tokens_per_s", "step_time", "skipped_steps", "bad_samples")


def weights(ckpt_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckpt_dir, "model.safetensors"))


@pytest.fixture(autouse=True)
def _setup(cache_env, one_thread):
    """Synthetic videos in a module-wide scratch folder; one torch thread."""


# -----------------------------------------------------------------------------
# smoke runs

@pytest.mark.slow
def test_smoke_stage_all(tmp_path, capsys, tiny):
    """The default pipeline end to end: SFT, RL with every metric logged, evaluation, curves, summary line."""
    run(smoke_argv(tmp_path, "--stage", "all", "--mask-truncated", "0", "--set", "eval_before=1"))
    out = capsys.readouterr().out.strip().splitlines()
    assert any(l.startswith("recipe: para_grpo (PARA-GRPO: R_acc + R_fmt + R_tool, exploration anchoring (sequence), "
                            "nFrames gating K in {4, 8}") for l in out)          # the method, named at the start
    summary = json.loads(out[-1])                       # the last printed line is one JSON object
    assert set(summary) == {"before", "sft", "after", "seconds"}
    assert summary["seconds"] > 0
    assert set(summary["after"]) >= {"accuracy", "format_compliance", "tool_call_ratio"}

    rows = metrics(tmp_path)
    sft = [r for r in rows if r["stage"] == "sft"]
    rl = [r for r in rows if r["stage"] == "rl"]
    assert [r["step"] for r in sft] == [1, 2] and [r["step"] for r in rl] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in sft)
    for r in rl:
        missing = [k for k in RL_METRICS if k not in r]
        assert not missing, f"RL row lacks {missing}"
        assert r["kept"] > 0 and math.isfinite(r["grad_norm"])   # the update ran on every step
        assert 4 <= r["mean_k"] <= 8                             # gated overview sizes
    assert (tmp_path / "curves.png").stat().st_size > 0

    # training moved the weights away from the initial model (the same seed builds the same model)
    init = {k: v.detach() for k, v in tiny[0].state_dict().items()}
    for ckpt in ("ckpt-sft-000002", "ckpt-rl-000002"):
        final = weights(tmp_path / ckpt)
        assert set(final) == set(init)
        changed = [k for k in final if not torch.equal(final[k], init[k])]
        assert "lm_head.weight" in changed and len(changed) > len(init) // 2, ckpt


def test_the_default_run_is_para_grpo():
    """`python train.py` with no flag: PARA-GRPO (ParaVT's reward, sequence anchoring, nFrames gating) from an SFT
    warm start that also shows gated overviews, evaluated on at least 96 held-out questions. Asking for an SFT of
    K = 8 overviews only is refused with gating on (the tiny model would meet overview sizes it never saw)."""
    args = recipes.parse_train_args([])
    s = train.grpo_settings(args)
    assert (s.recipe, s.anchoring, s.gating, args.sft_gated_overviews) == ("para_grpo", "sequence", True, 1)
    assert tuple(s.gating_choices) == recipes.PRESETS["tiny"]["gating_choices"] == (4, 8, 16, 32)
    assert args.n_eval >= 96
    assert grpo.recipe_line(s).startswith("recipe: para_grpo (PARA-GRPO: ")
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--set", "sft_gated_overviews=0"])
    assert not recipes.parse_train_args(["--set", "sft_gated_overviews=0", "--gating", "0"]).gating
    assert recipes.parse_train_args(["--gating", "0"]).sft_gated_overviews == 0
    assert recipes.parse_train_args(["--preset", "paravt"]).gating_choices == (4, 8, 16, 32, 64)


def test_the_default_cold_start_leaves_when_to_call_to_rl(capsys):
    """The tiny default's SFT records a tool-free twin beside each oracle trajectory that calls the tool
    (--sft-tool-free 1) on 10 recordings a step; a preset (a real checkpoint) keeps the oracle alone at 8, and a
    flag overrides either."""
    args = recipes.parse_train_args([])
    assert (args.sft_tool_free, args.sft_batch) == (1.0, 10)
    assert train.sft_settings(args).batch == 10
    preset = recipes.parse_train_args(["--preset", "paravt"])
    assert (preset.sft_tool_free, preset.sft_batch) == (0.0, 8)
    assert (recipes.parse_train_args(["--set", "sft_tool_free=0", "--sft-batch", "8"]).sft_tool_free,
            recipes.parse_train_args(["--sft-batch", "8"]).sft_batch) == (0.0, 8)
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--set", "sft_tool_free=1.5"])
    assert "sft_tool_free is a probability" in capsys.readouterr().err


@pytest.mark.slow
def test_one_minute_sft_reads_colours_above_chance(tmp_path, capsys, tiny):
    """The 1-minute version of the default run (the embedded default visibly learns): a smaller task
    (16 s videos, direct questions only: a big glyph the overview shows), 100 SFT steps, then greedy
    accuracy on 32 held-out questions. Four options: chance is 1/4; P(>= 16 of 32 right | chance) = 0.002."""
    run(["--stage", "sft", "--final-eval", "--run-dir", tmp_path, "--set", "task_duration=16", "--set", "task_mix=direct=1",
         "--n-train", "64", "--n-eval", "32", "--sft-steps", "100", "--gating-choices", "4,8",
         "--save-every", "100", "--seed", "0"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    losses = [r["loss"] for r in metrics(tmp_path) if r["stage"] == "sft"]
    assert len(losses) == 100 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    init, final = tiny[0].state_dict(), weights(tmp_path / "ckpt-sft-000100")
    assert sum(not torch.equal(final[k], init[k]) for k in init) > len(init) // 2      # parameters changed
    assert summary["after"]["format_compliance"] >= 0.9
    assert summary["after"]["accuracy"] >= 50.0, summary                    # MCQ accuracy in %; chance: 25


@pytest.mark.slow
def test_rl_decodes_in_the_pool_and_reuses_cached_overviews(tmp_path):
    """The RL loop decodes through the decode pool and its frame cache: the next step's overviews are decoded
    while a step trains, and prompts drawn again hit the cache (two RL prompts, so every step repeats)."""
    run(smoke_argv(tmp_path, "--stage", "rl", "--rl-steps", "3", "--set", "n_rl=2", "--mask-truncated", "0"))
    rows = metrics(tmp_path)
    assert all(r["decode_s"] >= 0 and r["decode_wait_s"] >= 0 for r in rows)
    assert rows[0]["decode_s"] > 0                                   # step 1 decoded its overviews in the pool
    assert rows[-1]["frame_cache_hit_rate"] > 0.5                    # later steps: the same two videos, cached


@pytest.mark.slow
def test_stage_rl_alone(tmp_path):
    """`--stage rl` straight from the tiny default: two steps, the whole metrics row, a checkpoint."""
    run(smoke_argv(tmp_path, "--stage", "rl", "--mask-truncated", "0"))
    rows = metrics(tmp_path)
    assert [(r["stage"], r["step"]) for r in rows] == [("rl", 1), ("rl", 2)]
    for r in rows:
        assert all(k in r for k in RL_METRICS), [k for k in RL_METRICS if k not in r]
        assert r["lr"] > 0 and r["step_time"] > 0 and r["tokens_per_s"] > 0
        assert r["groups"] == 2                       # --prompts-per-step 2 on one rank
    assert runtime.latest_checkpoint(str(tmp_path)).endswith("ckpt-rl-000002")


@pytest.mark.slow
@pytest.mark.parametrize("n_rl, split", [(4, "syn-4000-"), (0, "syn-1000-")])
def test_rl_draws_its_own_prompts(tmp_path, monkeypatch, n_rl, split):
    """`--n-rl N`: the synthetic RL stage samples prompts of its own split (seed 4000 + s), never the SFT split's
    (1000 + s) nor the held-out ones (2000 + s); `--n-rl 0` (the default) samples the SFT split's prompts."""
    seen, real_run_agent = [], rollout.run_agent

    def spy(model, processor, records, *a, **k):
        seen.extend(r["id"] for r in records)
        return real_run_agent(model, processor, records, *a, **k)

    monkeypatch.setattr(rollout, "run_agent", spy)
    run(smoke_argv(tmp_path, "--stage", "rl", "--mask-truncated", "0", "--set", f"n_rl={n_rl}"))
    assert len(seen) == 4 and all(i.startswith(split) for i in seen), seen
    rl = data.synthetic_rl(0, 4, 64.0, None, os.environ["PARAVT_CACHE"])
    sft, held, _ = data.synthetic_data(0, 8, 4, 64.0, None, os.environ["PARAVT_CACHE"])
    assert not {r["id"] for r in rl} & {r["id"] for r in sft + held}
    assert not {r["video"] for r in rl} & {r["video"] for r in sft + held}


@pytest.mark.slow
def test_held_out_batch_size_reaches_the_rollout(tmp_path, monkeypatch):
    """--set eval_batch: the tiny model's default 64, a real checkpoint's 8 (its overviews stay in memory for the
    whole batch), and the held-out evaluation rolls out that many questions at a time."""
    assert recipes.parse_train_args([]).eval_batch == 64
    assert recipes.parse_train_args(["--preset", "paravt"]).eval_batch == 8
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--set", "eval_batch=0"])
    import eval as evaluation
    sizes, real_predict = [], evaluation.predict

    def spy(records, run_batch, out_path=None, batch_size=1, *a, **k):
        sizes.append(batch_size)
        return real_predict(records, run_batch, out_path, batch_size, *a, **k)

    monkeypatch.setattr(evaluation, "predict", spy)
    run(smoke_argv(tmp_path, "--stage", "sft", "--final-eval", "--set", "eval_batch=3"))
    assert sizes == [3]


@pytest.mark.slow
def test_sampled_video_placeholder_is_left_out_of_the_update(tmp_path, monkeypatch):
    """Regression: a random policy samples <|video_pad|> now and then (1 in ~40 trajectories of the tiny
    model). `collate` took it for a video placeholder without frames and the update crashed
    (StopIteration in get_rope_index). Such a sample is scored, but not trained on."""
    real_run_agent = rollout.run_agent

    def with_placeholder(model, *a, **k):
        trajs = real_run_agent(model, *a, **k)
        trajs[0].token_ids.append(model.config.video_token_id)
        trajs[0].roles.append(rollout.POLICY)
        return trajs

    monkeypatch.setattr(rollout, "run_agent", with_placeholder)
    run(smoke_argv(tmp_path, "--stage", "rl", "--rl-steps", "1", "--mask-truncated", "0", "--prompts-per-step", "1"))
    (row,) = metrics(tmp_path)
    assert row["kept"] == 1 and math.isfinite(row["grad_norm"])   # the other sample of the group trained


# -----------------------------------------------------------------------------
# resume

class Interrupted(Exception):
    pass


def varied_reward(traj, record, anchoring, released_scoring):
    """A reward that differs between samples of a group (a function of the sampled tokens), so
    advantages are non-zero and every step really moves the weights; the real components are kept."""
    total, parts = SCORE(traj, record, anchoring, released_scoring)
    return total + (sum(traj.token_ids) % 7) / 7.0 + traj.sample / 8.0, parts   # samples of a group always differ


SCORE = recipes.RECIPES["para_grpo"].score


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_exact(tmp_path, monkeypatch, precision):
    """Stopped after step 2 and resumed to step 4 == 4 steps in one go, bit for bit (CPU, fixed seeds).
    The stop is an exception in the rollout of step 3 (after checkpoint 2), not `--rl-steps 2`: the
    cosine schedule depends on --rl-steps, so a 2-step run is a different run. bf16 (--device cpu --precision
    bf16, the GPU's arithmetic): the checkpoints' exports are bf16, and the resumed run takes the fp32 master
    weights from train_state (from the bf16 export, steps 3-4 would start from rounded weights)."""
    score_with(monkeypatch, varied_reward)
    argv = lambda d: smoke_argv(d, "--stage", "rl", "--rl-steps", "4", "--save-every", "1", "--mask-truncated", "0",
                                "--prompts-per-step", "1", "--device", "cpu", "--precision", precision)
    run(argv(tmp_path / "straight"))

    real_run_agent, calls = rollout.run_agent, []

    def stop_at_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise Interrupted
        return real_run_agent(*a, **k)

    monkeypatch.setattr(rollout, "run_agent", stop_at_step_3)
    with pytest.raises(Interrupted):
        run(argv(tmp_path / "resumed"))
    assert runtime.latest_checkpoint(str(tmp_path / "resumed")).endswith("ckpt-rl-000002")
    monkeypatch.setattr(rollout, "run_agent", real_run_agent)
    run(argv(tmp_path / "resumed") + ["--resume"])

    a, b = weights(tmp_path / "straight" / "ckpt-rl-000004"), weights(tmp_path / "resumed" / "ckpt-rl-000004")
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, f"resumed run differs from the straight run: {diff}"
    moved = weights(tmp_path / "straight" / "ckpt-rl-000002")
    assert any(not torch.equal(a[k], moved[k]) for k in a), "steps 3-4 did not change the weights"
    assert {t.dtype for t in a.values()} == {dict(fp32=torch.float32, bf16=torch.bfloat16)[precision]}
    rows_a, rows_b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):                   # same rewards, same gradients, step by step
        assert (ra["reward"], ra["grad_norm"], ra["lr"]) == (rb["reward"], rb["grad_norm"], rb["lr"])
    assert all(r["grad_norm"] > 0 for r in rows_a)


# -----------------------------------------------------------------------------
# several processes, launcher

@pytest.mark.slow
def test_fsdp_two_cpu_processes(tmp_path, cache):
    """`--gpus 2 --device cpu`: FSDP2 over gloo trains (SFT and RL steps) end to end, evaluates, and the checkpoint
    rank 0 gathered moved every parameter (their gradients arrived through the shards). The 2-rank update equals
    one process's: tests/test_rl_correctness.py. --prompts-per-step is the global batch, as on one rank
    (test_stage_rl_alone): 1 prompt on 2 ranks is 1 group a step (before: 1 per rank, 2 in all), and rank 1, whose
    share is 0, rolls out nothing yet joins every collective of the update (zero-weight passes on a filler)."""
    env = {**os.environ, "PARAVT_CACHE": cache, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", *smoke_argv(tmp_path, "--stage", "all", "--sft-steps", "1", "--sft-batch", "2",
                                                     "--n-eval", "1", "--mask-truncated", "0", "--prompts-per-step", "1"),
           "--gpus", "2", "--device", "cpu", "--vision-lr-scale", "1"]      # the vision tower trains too
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["after"] is not None
    saved = weights(tmp_path / "ckpt-sft-000001")
    init = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    unchanged = [n for n, p in init.named_parameters() if torch.equal(saved[n], p.detach())]
    assert not unchanged, f"FSDP training left these untouched (their gradients never arrived): {unchanged}"
    assert [r["step"] for r in metrics(tmp_path) if r["stage"] == "rl"] == [1, 2]
    assert [r["groups"] for r in metrics(tmp_path) if r["stage"] == "rl"] == [1, 1]
    assert sorted(os.listdir(tmp_path / "ckpt-rl-000002" / "train_state")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_fsdp_kill_and_resume_equals_an_uninterrupted_run(tmp_path, cache):
    """--gpus 2 on gloo: SIGKILL the launcher after a checkpoint (its ranks die with it), resume from the
    distributed checkpoint (model and AdamW state), and the weights at the end equal an uninterrupted run's.
    The 2-rank checkpoint also loads into one process (resharded)."""
    env = {**os.environ, "PARAVT_CACHE": cache, "OMP_NUM_THREADS": "1"}
    argv = lambda d: [sys.executable, "train.py", *smoke_argv(d, "--stage", "sft", "--sft-steps", "4", "--sft-batch", "2",
                                                             "--save-every", "2", "--keep-last", "0"),
                      "--gpus", "2", "--device", "cpu"]
    proc = subprocess.run(argv(tmp_path / "straight"), cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = subprocess.Popen(argv(tmp_path / "killed"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while runtime.latest_checkpoint(str(tmp_path / "killed")) is None and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    launcher.kill()
    launcher.wait()
    assert runtime.latest_checkpoint(str(tmp_path / "killed")).endswith("ckpt-sft-000002")
    time.sleep(3)                                          # the ranks die with the launcher: nothing more is written
    assert runtime.latest_checkpoint(str(tmp_path / "killed")).endswith("ckpt-sft-000002")
    proc = subprocess.run(argv(tmp_path / "killed") + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = weights(tmp_path / "straight" / "ckpt-sft-000004"), weights(tmp_path / "killed" / "ckpt-sft-000004")
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    moved = weights(tmp_path / "straight" / "ckpt-sft-000002")
    assert [k for k in a if not torch.equal(a[k], moved[k])], "steps 3-4 changed nothing"
    model, _ = model_lib.load_model(str(tmp_path / "straight" / "ckpt-sft-000002"), device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    runtime.load_train_state(str(tmp_path / "straight" / "ckpt-sft-000002"), model, opt)
    assert sum(int(s["exp_avg"].abs().sum() > 0) for s in opt.state.values()) > len(opt.state) // 2


@pytest.mark.parametrize("argv", [
    ["--gpus", "4"],                     # more processes than CUDA devices (none here)
    ["--gpus", "4", "--device", "cuda"],  # the same, asking for CUDA explicitly
    ["--device", "cuda"],                # one process on a CUDA device that is not there
])
def test_launcher_rejects_missing_devices(argv, monkeypatch):
    """A bad device request is a ValueError raised before any model, data or process is started."""
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has the CUDA devices")
    started = []
    monkeypatch.setattr(train, "main", lambda *a, **k: started.append("main"))
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *a, **k: started.append("spawn"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        train.start(recipes.parse_train_args(argv))
    assert started == []


def test_fresh_run_refuses_a_run_dir_holding_another_run(tmp_path, monkeypatch):
    """Without --resume, a run dir with this stage's checkpoints (or an SFT metrics.jsonl) is refused before
    anything starts: the new run would append to the old curves and leave old checkpoints for --resume."""
    run = tmp_path / "run"
    assert runtime.stale_run(str(run), "all", False) is None                 # no dir yet
    (run / "ckpt-sft-000700").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"stage": "sft", "step": 1}\n')
    assert "ckpt-sft-000700" in runtime.stale_run(str(run), "all", False)
    assert "metrics.jsonl" in runtime.stale_run(str(run), "sft", False)
    assert runtime.stale_run(str(run), "all", True) is None                  # --resume continues it
    assert runtime.stale_run(str(run), "rl", False) is None                  # RL after this SFT: the usual two-step run
    (run / "ckpt-rl-000002").mkdir()
    assert "ckpt-rl-000002" in runtime.stale_run(str(run), "rl", False)
    started = []
    monkeypatch.setattr(train, "main", lambda *a, **k: started.append("main"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        train.start(recipes.parse_train_args(["--run-dir", str(run), "--device", "cpu"]))
    assert started == []
    train.start(recipes.parse_train_args(["--run-dir", str(run), "--device", "cpu", "--resume"]))
    assert started == ["main"]


# -----------------------------------------------------------------------------
# the RL metrics row: accuracy and tool use split by tool need, reduced over ranks as sums and counts

def _need_records() -> dict:
    """Two synthetic-looking MCQ records: one whose 0.5 s glyph falls between the frames of a K = 8 overview
    (the tool is needed), one whose glyph covers the whole video (it is not)."""
    frames = sorted(f for _, f0, f1 in data.overview_patch_times(64.0, 8) for f in (f0, f1))
    gap = next(a + 0.25 for a, b in zip(frames, frames[1:]) if b - a > 1.0)       # a point no frame shows
    base = {"task": "mcq", "duration": 64.0, "clues": [[0.0, 8.0]]}
    recs = {"need": {**base, "id": "need", "meta": {"glyph_windows": [[gap, gap + 0.5]]}},
            "easy": {**base, "id": "easy", "meta": {"glyph_windows": [[0.0, 64.0]]}}}
    assert data.tool_needed(recs["need"], 8) and data.tool_needed(recs["easy"], 8) is False
    return recs


def _traj(rid: str, calls: int, error=None) -> SimpleNamespace:
    return SimpleNamespace(record_id=rid, nframes=8, n_calls=calls, n_tool_turns=int(calls > 0), tool_failures=0,
                           truncated=False, hit_turn_limit=False, error=error, text="")


# per rank: (record, calls, reward accuracy, error) of each trajectory it sampled
RANK_TRAJS = {0: [("need", 1, 1.0, None), ("easy", 0, 1.0, None), ("easy", 1, 0.0, None)],
              1: [("need", 0, 0.0, None), ("need", 0, 0.0, None), ("need", 2, 0.0, "decode timeout"),
                  ("easy", 1, 1.0, None)]}


def _rank_metrics(rank: int, world: int, port: int, out: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
        runtime.init_process_group(rank, world, use_cuda=False)
    mine = RANK_TRAJS[rank] if world > 1 else RANK_TRAJS[0] + RANK_TRAJS[1]
    trajs = [_traj(rid, calls, err) for rid, calls, _, err in mine]
    comps = [{"acc": acc, "format": 1.0} for _, _, acc, _ in mine]
    shares = runtime.all_gather_objects((len(trajs), evaluation.rollout_metrics(trajs, comps, _need_records())), world)
    m = evaluation.step_row(shares, runtime.all_mean({"kept": 1}, world), 0)      # as the RL loop builds its row
    if rank == 0:
        json.dump(m, open(out, "w"))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tool_use_split_by_need_reduced_over_two_ranks_as_sums_and_counts(tmp_path):
    """The metrics row on 2 gloo ranks, reduced as the RL loop reduces it (evaluation.step_row): accuracy and
    tool-call ratio on the questions that need the tool and on those that do not are all-rank hits / n and calls /
    n (rank 0: 1 of 1 needed question called, rank 1: 0 of 3, one of them an error, which counts as no call: 1 / 4,
    where a mean of the ranks' ratios would say 1 / 2), the same as one process on all the trajectories. (The
    loop once split off the hits and counts but not the calls: every run logged a tool-call ratio of 0 on both.)"""
    torch.multiprocessing.spawn(_rank_metrics, args=(2, runtime.find_free_port(), str(tmp_path / "two.json")), nprocs=2)
    _rank_metrics(0, 1, 0, str(tmp_path / "one.json"))
    two, one = json.load(open(tmp_path / "two.json")), json.load(open(tmp_path / "one.json"))
    want = {"acc_tool_needed": 1 / 4, "tool_call_ratio_needed": 1 / 4,
            "acc_tool_not_needed": 2 / 3, "tool_call_ratio_not_needed": 2 / 3}
    for k, v in want.items():
        assert two[k] == pytest.approx(v) and one[k] == pytest.approx(v), k
    assert not any(k.endswith(("_hits", "_calls", "_n")) for k in two)      # the sums never reach the log


def test_merge_figures_weighs_shares_by_their_counts():
    """evaluation.merge_figures, the one weighting of the sync ranks' rows and the async rollout ranks' messages: a mean
    weighs each share by its trajectory count (1 and 3: (1 * 1.0 + 3 * 0.0) / 4), a key one share lacks weighs 0
    there, the per-need sums are summed before split_accuracy divides, and a lone share's figures come back as
    they are (no n * v / n rounding)."""
    a = {"accuracy": 1.0, "only_a": 0.7, "tool_needed_hits": 1.0, "tool_needed_calls": 1, "tool_needed_n": 1}
    b = {"accuracy": 0.0, "tool_needed_hits": 0.0, "tool_needed_calls": 0, "tool_needed_n": 3}
    m = evaluation.merge_figures([(1, a), (3, b)])
    assert m["accuracy"] == 0.25 and m["only_a"] == 0.7
    assert m["acc_tool_needed"] == 0.25 and m["tool_call_ratio_needed"] == 0.25
    assert not any(k.endswith(evaluation.SUMMED) for k in m)
    assert evaluation.merge_figures([(3, {"accuracy": 0.1})])["accuracy"] == 0.1


def test_tool_use_split_left_out_where_no_question_was():
    trajs, comps = [_traj("easy", 1)], [{"acc": 1.0}]
    m = evaluation.split_accuracy(evaluation.rollout_metrics(trajs, comps, _need_records()))
    assert m["tool_call_ratio_not_needed"] == 1.0 and m["acc_tool_not_needed"] == 1.0
    assert "tool_call_ratio_needed" not in m and "acc_tool_needed" not in m


def test_curves_show_accuracy_and_tool_use_split_by_need(tmp_path, monkeypatch):
    """curves.png has a panel of accuracy and one of tool-call ratio on the sampled questions that needed the tool
    and on those that did not, each series drawn from its metrics.jsonl key."""
    rows = [{"stage": "sft", "step": 1, "loss": 1.0}] + [
        {"stage": "rl", "step": i, "reward": 1.0, "format_compliance": 1.0, "tool_call_ratio": 0.5,
         "acc_tool_needed": 0.1 * i, "acc_tool_not_needed": 0.9, "tool_call_ratio_needed": 0.2 * i,
         "tool_call_ratio_not_needed": 0.3} for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert runtime.plot_run(str(tmp_path)).endswith("curves.png")
    panels = {ax.get_title(): ax for ax in figures[0].axes}
    for title, key in (("RL: accuracy", "acc_tool_needed"), ("RL: tool-call ratio", "tool_call_ratio_needed")):
        lines = {l.get_label(): l for l in panels[title].get_lines()}
        needed = next(l for label, l in lines.items() if label.startswith("tool needed"))
        assert list(needed.get_ydata()) == pytest.approx([r[key] for r in rows[1:]])
        assert any(label.startswith("tool not needed") for label in lines)


# -----------------------------------------------------------------------------
# the settings: a bare run, --help, --set

def test_a_bare_run_is_the_tiny_literal_and_the_settings_defaults_are_what_runs():
    """`python train.py` resolves to recipes.PRESETS['tiny'] over its recipe, with the tiny model's frames
    (recipes.TINY), key by key; the settings dataclasses' defaults are those same values (a bare GRPOSettings,
    SFTSettings and RolloutConfig are what the default run trains with, on CPU); the tiny preset is the para_grpo
    Recipe with its own KL, shaping and gating choices."""
    args = recipes.parse_train_args([])
    assert args.preset == "tiny" and args.tiny
    for key, value in recipes.TINY.items():
        got = getattr(args, key)
        want = {"sft_gated_overviews": True}.get(key, value)
        assert got == want, key
    assert train.grpo_settings(args) == grpo.GRPOSettings()
    assert train.sft_settings(args) == sft.SFTSettings()
    assert train.rollout_config_of_args(args) == rollout.RolloutConfig.of(recipes.TINY)
    assert rollout.RolloutConfig() == rollout.RolloutConfig.of(recipes.TINY_PROTOCOL)
    assert rollout.RolloutConfig().crop_max_frames == recipes.COMMON["crop_max_frames"]
    para = recipes.RECIPES["para_grpo"]
    assert (args.anchoring, args.gating) == (para.anchoring, para.gating)
    assert (args.kl_coef, args.shaping, tuple(args.gating_choices)) == (0.0, False, (4, 8, 16, 32)) != \
        (para.kl_coef, para.shaping, para.gating_choices)
    paravt = recipes.parse_train_args(["--preset", "paravt"])
    assert (paravt.kl_coef, paravt.kl_in_reward, paravt.shaping) == (para.kl_coef, True, True)


def test_help_prints_what_runs_in_at_most_60_flags(capsys):
    """train.py --help: at most 60 flags (the rest are --set keys, listed with every preset's value), and each
    preset-dependent flag's default as resolve sets it per preset."""
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--help"])
    text = capsys.readouterr().out
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", text, flags=re.M)) | set(re.findall(r"^\s+-h, (--help)", text, flags=re.M))
    assert 40 < len(flags) <= 60, sorted(flags)
    flat = " ".join(text.split())
    for flag, key in (("--group-size", "group_size"), ("--lr", "lr"), ("--max-new-tokens", "max_new_tokens")):
        values = [recipes.preset_values(p)[key] for p in recipes.PRESETS]
        assert "; ".join(f"{p} {v:,}" if isinstance(v, int) else f"{p} {v}" for p, v in zip(recipes.PRESETS, values)) \
            in flat, flag
    assert "sft_tool_free 1.0 / 0.0 / 0.0" in flat                 # a --set key with each preset's value


def test_set_reaches_every_other_setting_in_its_type():
    args = recipes.parse_train_args(["--set", "kl_estimator=k1", "--set", "kl_in_reward=1", "--kl-coef", "0.01",
                                     "--set", "task_mix=direct=1", "--set", "n_rl=4", "--set", "placebo=true"])
    assert (args.kl_estimator, args.kl_in_reward, args.task_mix, args.n_rl, args.placebo) == ("k1", True, "direct=1",
                                                                                             4, True)
    for bad in ("nokey=1", "placebo=maybe", "n_rl"):
        with pytest.raises(SystemExit):
            recipes.parse_train_args(["--set", bad])


def test_gating_choices_parsed_once_and_checked():
    assert recipes.parse_train_args(["--gating-choices", "4,16"]).gating_choices == (4, 16)
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--gating-choices", "4,x"])
