"""Tests for the training loop of train.py: the CPU smoke runs (`--stage all`, `--stage rl`), exact resume,
FSDP2 on two CPU processes (gloo), the launcher's device checks, TDAM on real encoded trajectories and
the reward of each recipe, and the objective's math (the GRPO loss on log-prob tensors, the KL estimators,
the learning-rate schedule); the fused kernels are tested in test_ops.py.

Run: python -m pytest tests/test_train.py -q      (CPU, a few minutes)
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
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import (SFT_MIX, SpyRun, assert_flex_close, metrics, oracle_turns, rl_job, run, score_with,
                      smoke_argv)  # shared with the other training tests
from safetensors.torch import load_file

import data
import model as model_lib
import layers
import ops
import rewards
import rollout
import recipes
import runtime
import sft
import eval as evaluation
import grpo
import train
import video
import policy
from grpo import kl_penalty
from oracles import grpo_loss_on_logprobs
from policy import get_lr

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


@pytest.mark.parametrize("extra, ks", [(["--set", "sft_gated_overviews=0", "--gating", "0"], {8}), ([], {4, 8})])
def test_sft_examples_overview_sizes(tmp_path, tiny, extra, ks):
    """Synthetic SFT: every record once with the evaluation overview (K = 8) and, by default (RL gates), once more
    with a K drawn from the gating choices; sft_gated_overviews=0 (with --gating 0) leaves the second copy out."""
    model, processor = tiny
    args = recipes.parse_train_args(smoke_argv(tmp_path, "--gating-choices", "4", *extra))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    items, bad = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), sft_data=None, seed=args.seed,
                                    gated_choices=args.gating_choices if args.sft_gated_overviews else [], **SFT_MIX)
    assert bad == 0 and len(items) == len(records) * len(ks)
    assert {t.nframes for t in items} == ks and [t.record_id for t in items[::len(ks)]] == [r["id"] for r in records]


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


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_sft_examples_in_threads_are_the_serial_ones(tmp_path, tiny, name):
    """`sft_examples(workers=2)` (train.py: a thread per core) encodes the very trajectories of the serial loop, in
    its order: the same token ids, roles and pixels; with the tiny tokenizer and with the real Qwen tokenizer (the
    threads share one processor)."""
    model, processor = tiny if name == "tiny" else model_lib.load_model(name, device="cpu", seed=0,
                                                                        tiny_corpus=rollout.prompt_corpus())
    args = recipes.parse_train_args(smoke_argv(tmp_path))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    kw = dict(SFT_MIX, sft_data=None, seed=0, gated_choices=args.gating_choices, direct_crop=0.5, budget_fraction=0.5)
    one, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), workers=1, **kw)
    two, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), workers=2, **kw)
    assert len(one) == len(two) > len(records)
    for a, b in zip(one, two):
        assert (a.record_id, a.token_ids, a.roles, a.nframes) == (b.record_id, b.token_ids, b.roles, b.nframes)
        assert len(a.videos) == len(b.videos) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                                      for x, y in zip(a.videos, b.videos))


def test_sft_items_keep_at_most_their_budget_of_pixels_and_train_the_same(tmp_path, tiny):
    """--sft-cache-gb shrunk to two trajectories' pixels: sft_examples encodes every record to check it but keeps
    at most that budget (a 1,000-record cold start at Qwen's sizes held whole: 352 GiB a rank), a step draws the
    rest encoded again (the next step's batch by a thread meanwhile), each comes back as it was (ids, roles,
    pixels), and SFT steps give the weights of the unbounded run, bit for bit."""
    model, processor = tiny
    args = recipes.parse_train_args(smoke_argv(tmp_path))
    records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration, args.task_mix,
                                            os.environ["PARAVT_CACHE"])
    kw = dict(SFT_MIX, sft_data=None, seed=0, gated_choices=[])
    whole, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), **kw)
    budget = 2 * max(sft.SFTItems._size(t) for t in whole) + 1
    held, _ = sft.sft_examples(records, processor, root, train.rollout_config_of_args(args), cache_bytes=budget, **kw)
    assert len(held) == len(whole) > 4 and held.held <= budget and len(held.cache) <= 2
    for i in range(len(whole)):
        a, b = whole[i], held[i]
        assert (a.record_id, a.token_ids, a.roles) == (b.record_id, b.token_ids, b.roles)
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a.videos, b.videos))
        assert held.held <= budget
    assert held.encodes >= len(whole) - 2 and whole.encodes == 0          # re-encoded when drawn; never, unbounded
    s = sft.SFTSettings(steps=3, batch=4, micro_batch=2, lr=1e-3, tdam_ratio=0.0)
    out = {}
    for name, items in (("whole", whole), ("held", held)):
        m = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
        run_ = runtime.Run(str(tmp_path / name), 0, 1, 0, 100, 0, False, 1.0)
        run_.processor = processor
        sft.run_sft(run_, m, items, policy.make_optimizer(m, s.lr, 0.0), s, processor.tokenizer)
        out[name] = {n: p.detach().clone() for n, p in m.named_parameters()}
        assert items.held <= (budget if name == "held" else float("inf")) and not items.pending
    assert all(torch.equal(out["whole"][n], out["held"][n]) for n in out["whole"])


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
# TDAM on real encoded trajectories

def _call(a: float, b: float) -> str:
    args = {"start_time": a, "end_time": b}
    return f"<tool_call>\n{json.dumps({'name': 'crop_video', 'arguments': args})}\n</tool_call>"


def two_tool_turns(rec: dict) -> list[dict]:
    """Crop the clue, look at the clip, crop again, look again, answer: two observations, two call turns."""
    (s, e), = rec["clues"]
    tool = lambda a, b: {"role": "tool", "content": [{"type": "video", "video": rec["video"], "video_start": a,
                                                      "video_end": b}]}
    return [{"role": "assistant", "content": f"<think>\nI see a mark, let me crop it.\n</think>\n{_call(s, e)}"},
            tool(s, e),
            {"role": "assistant", "content": f"<think>\nThe start again.\n</think>\n{_call(0.0, 8.0)}"},
            tool(0.0, 8.0),
            {"role": "assistant", "content": "<think>\nIt is red.\n</think>\n<answer>A</answer>"}]


def _positions(ids: list[int], tok: int) -> list[int]:
    return [j for j, t in enumerate(ids) if t == tok]


def expected_tdam(traj, special: dict, video_id: int) -> torch.Tensor:
    """(n, n) allowed-mask worked out from the trajectory's own bookkeeping: prompt_len, and the tags the
    environment wrote. A video's columns run from its first to its last video token (the frame
    timestamps between them included). The prompt itself mentions <think> and <answer>."""
    ids, n, start = traj.token_ids, len(traj.token_ids), traj.prompt_len
    after = lambda tok: [j for j in _positions(ids, special[tok]) if j >= start]
    block = lambda js: list(range(js[0], js[-1] + 1))
    videos = _positions(ids, video_id)
    overview = block([j for j in videos if j < start])
    obs = [block([j for j in videos if o < j < c]) for o, c in zip(after("<tool_response>"), after("</tool_response>"))]
    calls = list(zip(after("<tool_call>"), after("</tool_call>")))
    answer = after("<answer>")[-1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[answer + 1:, overview] = False                     # (1) the answer cannot look at the overview
    for c0, c1 in calls[1:]:                                   # (2) later calls cannot look at earlier crops
        for cols in obs:
            if cols[-1] < c0:
                allowed[c0:c1 + 1, cols] = False
    return allowed


@pytest.fixture(scope="module")
def tdam_batch(tiny, tmp_path_factory):
    """A collated batch of an oracle trajectory with one crop and a two-tool-turn trajectory (padded)."""
    model, processor = tiny
    root = str(tmp_path_factory.mktemp("tdam"))
    recs = [r for r in data.make_split(root, 8, seed=5, duration=64.0) if r["data_type"] == "single_clue"][:2]
    cfg = train.rollout_config_of_args(recipes.parse_train_args([]))
    oracle = oracle_turns(recs[0], np.random.default_rng(0))
    assert any(m["role"] == "tool" for m in oracle)            # the oracle crops
    trajs = [sft.encode_messages(processor, recs[0], oracle, root, cfg),
             sft.encode_messages(processor, recs[1], two_tool_turns(recs[1]), root, cfg)]
    assert len(trajs[0].token_ids) != len(trajs[1].token_ids)
    assert [len(t.videos) for t in trajs] == [2, 3]            # overview + one / two observations
    return trajs, rollout.collate(trajs, model, processor.tokenizer.pad_token_id)


def test_tdam_batch_mask_on_encoded_trajectories(tiny, tdam_batch):
    model, processor = tiny
    trajs, batch = tdam_batch
    special = model_lib.special_token_ids(processor)
    video_id = model.config.video_token_id
    mask = sft.tdam_batch_mask(batch, processor.tokenizer, video_id)
    B, L = batch["input_ids"].shape
    assert mask.shape == (B, 1, L, L)
    allowed = mask[:, 0] == 0
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        want = expected_tdam(t, special, video_id)
        assert torch.equal(allowed[i, :n, :n], want), f"row {i}: {(allowed[i, :n, :n] != want).nonzero()[:5]}"
        assert not allowed[i, :n, n:].any()                    # real tokens never see pads
        assert torch.equal(allowed[i, n:, :], torch.eye(L, dtype=torch.bool)[n:])   # pads see only themselves
    # the rules really cut something in both rows: the answer loses the overview, call 2 loses crop 1
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    assert all(int((causal[:len(t.token_ids), :len(t.token_ids)] & ~allowed[i, :len(t.token_ids), :len(t.token_ids)])
                   .sum()) > 0 for i, t in enumerate(trajs))
    ids1 = trajs[1].token_ids
    second_call = _positions(ids1, special["<tool_call>"])[1]
    first_obs = [j for j in _positions(ids1, video_id) if j > trajs[1].prompt_len][0]
    assert not allowed[1, second_call, first_obs] and allowed[1, second_call, 0]


def test_tdam_mask_reaches_attention(tiny, tdam_batch):
    """The 4-D mask path: a causal 4-D mask reproduces the 2-D loss, the TDAM mask changes it, both finite."""
    model, processor = tiny
    trajs, batch = tdam_batch
    L = batch["input_ids"].shape[1]
    with torch.no_grad():
        s = sft.SFTSettings(loss_chunk=1024)
        plain, _ = sft.sft_loss(model, batch, s)
        causal = torch.zeros(len(trajs), L, L, dtype=torch.bool)
        for i, t in enumerate(trajs):
            n = len(t.token_ids)
            causal[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            causal[i, range(n, L), range(n, L)] = True
        same, _ = sft.sft_loss(model, dict(batch, attention_mask=ops.to_additive_mask(causal)), s)   # a 4-D mask
        tdam, _ = sft.sft_loss(model, dict(batch, attention_mask=sft.tdam_batch_mask(
            batch, processor.tokenizer, model.config.video_token_id)), s)
    assert math.isfinite(float(tdam))
    assert abs(float(same) - float(plain)) < 1e-5
    assert abs(float(tdam) - float(plain)) > 1e-6


def test_blocked_tdam_attention_equals_the_dense_mask(tiny, tdam_batch):
    """tdam_attention in the model (block-sparse tiles from the rectangles, the CPU's blocked kernel) gives the loss
    and gradients of the dense (B, 1, L, L) mask, with tiles that split the rows; and the rules cut something."""
    model, processor = tiny
    trajs, batch = tdam_batch
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    spec.block = 16                                              # several blocks per row
    assert spec.rects.shape[1] >= 1 and (spec.rects[:, :, 1] > spec.rects[:, :, 0]).any()
    dense = sft.tdam_batch_mask(batch, processor.tokenizer, model.config.video_token_id)
    losses, grads = [], []
    for b, spec_ in ((dict(batch, attention_mask=dense), None), (batch, spec)):
        model.zero_grad(set_to_none=True)
        loss, _ = sft.sft_loss(model, b, sft.SFTSettings(), spec_)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.model.language_model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    assert abs(losses[0] - losses[1]) < 1e-5
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-4


def test_tdam_attention_is_reached_by_keyword_in_plain_calls(tiny, tdam_batch, monkeypatch):
    """The `tdam` keyword alone picks TDAM's attention in every decoder layer (layers.attention calls
    ops.tdam_attention: no registry, the model's attention implementation untouched), and a forward without it is
    SDPA's, padding mask included, the same loss as before the TDAM forward."""
    model, processor = tiny
    _, batch = tdam_batch
    lm = model.model.language_model
    impl = lm.config._attn_implementation
    calls = []
    tdam = layers.tdam_attention
    monkeypatch.setattr(layers, "tdam_attention", lambda *a: (calls.append(a[3]), tdam(*a))[1])
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    with torch.no_grad():
        before = sft.sft_loss(model, batch, sft.SFTSettings())[0]
        assert not calls
        sft.sft_loss(model, batch, sft.SFTSettings(), tdam=spec)
        after = sft.sft_loss(model, batch, sft.SFTSettings())[0]
    assert len(calls) == len(lm.layers) and all(c is spec for c in calls)
    assert lm.config._attn_implementation == impl and torch.equal(before, after)


def test_tdam_gradients_equal_with_gradient_checkpointing(tiny, tdam_batch):
    """`--grad-checkpointing` recomputes each decoder layer in backward: a TDAM forward must be recomputed with
    the same attention and spec, so every parameter's gradient equals the one without checkpointing (fp32)."""
    model, processor = tiny
    _, batch = tdam_batch
    spec = sft.tdam_spec(batch, processor.tokenizer, model.config.video_token_id)
    spec.block = 16
    grads = []
    model.train()
    try:
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable()                  # as train.main does
            model.zero_grad(set_to_none=True)
            loss, _ = sft.sft_loss(model, batch, sft.SFTSettings(), tdam=spec)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)
    assert len(grads[0]) > 10 and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-5), name


@pytest.mark.slow
def test_sft_step_with_tdam_on_every_batch(tmp_path):
    """`--tdam-ratio 1.0`: the SFT step trains through the 4-D mask with a finite loss."""
    run(smoke_argv(tmp_path, "--stage", "sft", "--sft-steps", "1", "--sft-batch", "2", "--tdam-ratio", "1.0",
                   "--n-train", "4"))
    (row,) = metrics(tmp_path)
    assert row["tdam"] == 1.0 and math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


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
# Recipe.score: the reward of each recipe

THINK = rollout.THINK_PREFIX
CALL_TURN = f"{THINK}I see a mark near 12 seconds, let me crop it.\n</think>\n{_call(12.0, 20.0)}"
ANSWER_TURN = f"{THINK}The clip shows a red shape.\n</think>\n<answer>A</answer>"


def hand_trajectory(turns=(CALL_TURN, ANSWER_TURN), windows=((12.0, 20.0),)) -> SimpleNamespace:
    """What run_agent returns, by hand: the text as the model saw it and the policy's own text."""
    response = "<|im_end|>\n<|im_start|>user\n<tool_response>\nClip 12.0-20.0 s:\n</tool_response><|im_end|>\n" \
               "<|im_start|>assistant\n"
    text = response.join(turns) + "<|im_end|>"
    policy = "<|im_end|>".join(t[len(THINK):] for t in turns) + "<|im_end|>"
    return SimpleNamespace(text=text, policy_text=policy, turns=list(turns), windows=list(windows),
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


@pytest.mark.parametrize("tdam", [False, True])
def test_sft_micro_batches_give_the_batch_gradient(tiny, tdam_batch, tdam, small_thresholds, monkeypatch):
    """sft_backward over length-sorted micro-batches: the loss and gradients of one forward over the
    whole batch (token mean), with fewer padded tokens; TDAM masks included; and through token_logprobs' fused
    chunks (loss_chunk 64, boundaries inside the rows) the same as through its plain path (the default here at
    the shipped sizes; with the thresholds shrunk the default takes the fused chunks too, 3 of them)."""
    model, processor = tiny
    trajs, _ = tdam_batch
    items, pad_id = [trajs[1], trajs[0], trajs[1], trajs[0]], processor.tokenizer.pad_token_id
    tdam_tok = processor.tokenizer if tdam else None
    chunks, real_apply = [], ops._TokenLogprobs.apply                      # the fused path's chunk sizes
    monkeypatch.setattr(ops._TokenLogprobs, "apply", lambda *a: (chunks.append(a[3]) if torch.is_grad_enabled() else None) or real_apply(*a))

    def grads(rows, loss_chunk=None):
        model.zero_grad(set_to_none=True)
        loss, n = sft.sft_backward(model, items, sft.SFTSettings(micro_batch=rows, loss_chunk=loss_chunk or 0), pad_id,
                                   tdam_tok)
        return float(loss), n, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    (l4, n4, g4), (l2, n2, g2), (l1, n1, g1) = grads(4), grads(2), grads(1)
    assert bool(chunks) == bool(small_thresholds), chunks            # the default rule: plain, or fused when shrunk
    lf, nf, gf = grads(2, 64)
    model.zero_grad(set_to_none=True)
    assert n4 == n2 == n1 == nf == sum(sum(r == 1 for r in t.roles[1:]) for t in items)
    assert abs(l2 - l4) < 1e-5 and abs(l1 - l4) < 1e-5 and abs(lf - l4) < 1e-5 and g4.norm() > 0
    for g in (g2, g1, gf):
        assert float((g - g4).norm() / g4.norm()) < 1e-5
    shapes = [b["input_ids"].shape for b in sft.sft_micro_batches(items, model, pad_id, sft.SFTSettings(micro_batch=2))]
    short, long_ = sorted(len(t.token_ids) for t in trajs)
    assert shapes == [(2, short), (2, long_)]            # like lengths together: the short pair pads to `short`


def test_sft_micro_batches_keep_the_token_budget(tiny, tdam_batch, monkeypatch):
    """SFT micro-batches take the RL update's padded-token budget (--micro-batch-tokens, shrunk here to the rows'
    lengths): two unequal rows whose padded pair exceeds it go one at a time, and no decoder layer then receives a
    (B, 1, L, L) mask (before: sft_micro_batch rows whatever their length, 2 rows of 32k tokens a 2 GiB mask a
    layer call); within the budget they share a micro-batch and its mask, as before."""
    model, processor = tiny
    trajs, _ = tdam_batch
    pad_id = processor.tokenizer.pad_token_id
    short, long_ = sorted(len(t.token_ids) for t in trajs)
    masks, cls = [], type(model.model.language_model.layers[0])           # the decoder layer the model runs
    real = cls.forward

    def spy(self, hidden_states, attention_mask=None, **kw):
        masks.append(None if attention_mask is None else tuple(attention_mask.shape))
        return real(self, hidden_states, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(cls, "forward", spy)
    for tokens, want in ((2 * long_, [(2, 1, long_, long_)]), (2 * long_ - 1, [None, None])):
        masks.clear()
        s = sft.SFTSettings(micro_batch=2, micro_batch_tokens=tokens)
        batches = list(sft.sft_micro_batches(trajs, model, pad_id, s))
        assert [b["input_ids"].shape[0] for b in batches] == ([2] if want[0] else [1, 1])
        model.zero_grad(set_to_none=True)
        sft.sft_backward(model, trajs, s, pad_id)
        n_layers = len(model.model.language_model.layers)
        assert masks == [w for w in want for _ in range(n_layers)]
    model.zero_grad(set_to_none=True)
    args = recipes.parse_train_args(["--micro-batch-tokens", "4096"])
    assert train.sft_settings(args).micro_batch_tokens == 4096


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_vision_lr_scale(scale):
    """make_optimizer: the vision tower at scale x lr (the merger included), every other parameter at lr; 0 freezes
    the tower (no gradient, no optimizer state) and one step moves every other parameter."""
    model = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    opt = policy.make_optimizer(model, 1e-3, scale)
    policy.set_lr(opt, 2e-3)
    vision = {id(p) for n, p in model.named_parameters() if n.startswith("model.visual.")}
    assert vision and any("merger" in n for n, _ in model.named_parameters() if n.startswith("model.visual."))
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert all(lrs[id(p)] == 2e-3 for p in model.parameters() if id(p) not in vision)
    if scale == 0:
        assert not (vision & set(lrs)) and not any(p.requires_grad for p in model.parameters() if id(p) in vision)
    else:
        assert all(lrs[i] == pytest.approx(2e-3 * scale) for i in vision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert "lm_head.weight" in moved and "model.language_model.embed_tokens.weight" in moved


# -----------------------------------------------------------------------------
# mixed precision: bf16 compute on fp32 master weights, fp32 AdamW state

def one_step(model, optimizer, items: list, pad_id: int, precision: str) -> tuple[float, set]:
    """One SFT step (sft_backward + optimizer.step): the fraction of the weights with a nonzero gradient that the
    step changed, and the dtypes the first decoder layer's MLP computed in."""
    seen = set()
    hook = model.model.language_model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    model.train()
    sft.sft_backward(model, items, sft.SFTSettings(micro_batch=2, precision=precision), pad_id)
    hook.remove()
    has_grad = {n: p.grad != 0 for n, p in model.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    moved = sum(int((before[n] != p.detach())[has_grad[n]].sum()) for n, p in model.named_parameters() if n in has_grad)
    return moved / sum(int(g.sum()) for g in has_grad.values()), seen


def test_bf16_step_moves_the_fp32_master_weights(tdam_batch):
    """--precision bf16 as a GPU runs it, here on CPU: parameters and AdamW state stay fp32 (master weights), the
    forward computes in bf16 (autocast), and one AdamW step at lr 1e-6 moves more than 99 % of the weights that
    have a gradient. The control: pure-bf16 parameters under a bf16 AdamW (the model loaded bf16, as CUDA runs
    trained before) move a few percent, since an update of 1e-6 is below half a bf16 ulp of almost every weight."""
    trajs, _ = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    pad_id = processor.tokenizer.pad_token_id
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    optimizer = policy.make_optimizer(model, 1e-6, vision_lr_scale=1.0)
    moved, dtypes = one_step(model, optimizer, trajs, pad_id, "bf16")
    assert dtypes == {torch.bfloat16} and moved > 0.99, (dtypes, moved)
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    pure = model_lib.load_model("tiny", device="cpu", dtype=torch.bfloat16, seed=0, tiny_corpus=rollout.prompt_corpus())[0]
    moved_pure, _ = one_step(pure, torch.optim.AdamW(pure.parameters(), lr=1e-6, weight_decay=0.0), trajs, pad_id, "bf16")
    assert moved_pure < 0.1, moved_pure
    with pytest.raises(ValueError, match="fp32"):            # never an AdamW step on bf16 parameters
        policy.make_optimizer(pure, 1e-6, vision_lr_scale=1.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_forward_hands_the_model_pixels_in_the_compute_dtype(tdam_batch, precision):
    """The training forward hands the model its pixels in the dtype it computes in: bf16 under --precision bf16
    (whose parameters are fp32 master weights, FSDP2 shards or not), fp32 otherwise. Cast to the parameters'
    dtype, a bf16 run's (patches, 1536) pixels went to the device in fp32, twice their size. The hidden states
    are the same as with fp32 pixels, bit for bit: the tower's first matmul rounds them to bf16 under autocast."""
    _, batch = tdam_batch
    model, _ = policy.policy_model("tiny", torch.device("cpu"), precision, world=1, seed=0)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["pixel_values_videos"].dtype),
                                                 with_kwargs=True)
    with torch.no_grad(), policy.autocast(precision, model):
        hidden = policy.hidden_and_targets(model, batch)[0]
    hook.remove()
    assert seen == [{"fp32": torch.float32, "bf16": torch.bfloat16}[precision]]
    with torch.no_grad(), policy.autocast(precision, model), \
            mock.patch.object(model_lib, "compute_dtype", lambda m: torch.float32):
        assert torch.equal(policy.hidden_and_targets(model, batch)[0], hidden)


def test_bf16_tdam_sft_step_on_one_process(tdam_batch):
    """--precision bf16 on one process (no FSDP: fp32 weights under autocast) with TDAM on, as a single-GPU SFT run
    does with --tdam-ratio: Qwen3-VL's q / k norms hand the attention fp32 queries and keys beside bf16 values, which
    the TDAM kernel takes in autocast's dtype as SDPA does; the loss is finite, every decoder weight gets a gradient,
    and it equals the dense-mask SDPA run's (the same TDAM mask as a 4-D tensor) to bf16 rounding."""
    trajs, batch = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    pad_id, tok = processor.tokenizer.pad_token_id, processor.tokenizer
    model.train()
    loss, n = sft.sft_backward(model, trajs, sft.SFTSettings(micro_batch=2, precision="bf16"), pad_id, tdam_tokenizer=tok)
    assert torch.isfinite(loss) and n > 0
    layer = model.model.language_model.layers[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    mask = sft.tdam_batch_mask(batch, tok, model.config.video_token_id)
    fresh, _ = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    with torch.no_grad():
        dense, _ = sft.sft_loss(fresh, dict(batch, attention_mask=mask), sft.SFTSettings(precision="bf16"))
    assert float(loss) == pytest.approx(float(dense), rel=2e-2)


def test_bf16_checkpoint_exports_bf16_and_resumes_the_fp32_master_weights(tmp_path, tdam_batch):
    """Trained in bf16, a checkpoint's Hugging Face export (model.safetensors, config dtype) is bf16, what a
    serving stack loads; its train_state keeps the fp32 master weights and fp32 AdamW moments, and a resumed run
    takes its weights from there (exactly), not from the bf16 export."""
    trajs, _ = tdam_batch
    model, processor = policy.policy_model("tiny", torch.device("cpu"), "bf16", world=1, seed=0)
    optimizer = policy.make_optimizer(model, 1e-3, vision_lr_scale=1.0)
    one_step(model, optimizer, trajs, processor.tokenizer.pad_token_id, "bf16")
    run_ = runtime.Run(str(tmp_path), 0, 1, 0, 50, 3, False, 0.2, export_dtype=torch.bfloat16)
    run_.processor = processor
    ckpt = run_.save("sft", 1, model, optimizer)
    export = weights(ckpt)
    assert {t.dtype for t in export.values()} == {torch.bfloat16}
    assert json.load(open(os.path.join(ckpt, "config.json")))["dtype"] == "bfloat16"
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(master[n], export[n].float()) for n in master)   # the export is rounded
    fresh, _ = policy.policy_model(ckpt, torch.device("cpu"), "bf16", world=1, seed=0)
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}
    runtime.Run(str(tmp_path), 0, 1, 0, 50, 3, False, 0.2).resume(ckpt, fresh)
    assert all(torch.equal(p.detach(), master[n]) for n, p in fresh.named_parameters())
    opt2 = policy.make_optimizer(fresh, 1e-3, vision_lr_scale=1.0)
    runtime.load_train_state(ckpt, fresh, opt2)
    assert {s["exp_avg"].dtype for s in opt2.state.values()} == {torch.float32}


# -----------------------------------------------------------------------------
# the objective: GRPO loss on log-prob tensors, KL estimators, the learning-rate schedule

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


@pytest.mark.parametrize("lengths, rows, tokens, expected", [
    ([10] * 5, 2, 100, [(0, 2), (2, 4), (4, 5)]),           # rows alone decide: 2 x 10 <= 100
    ([10] * 5, 8, 30, [(0, 3), (3, 5)]),                    # tokens decide: 3 x 10 <= 30 < 4 x 10
    ([10, 30, 200, 5, 5, 5], 8, 100, [(0, 2), (2, 3), (3, 6)]),   # 200 > 100 goes alone, in its place
    ([60, 40, 30], 8, 100, [(0, 1), (1, 3)]),               # 2 x 60 > 100; then 2 x 40 <= 100 < 3 x 40
    ([40, 60], 8, 100, [(0, 1), (1, 2)]),                   # the longest so far counts: 2 x 60 > 100
    ([50, 50, 50], 8, 100, [(0, 2), (2, 3)]),               # (items + 1) x longest == tokens still joins
    ([30, 5, 30, 5], 8, 10 ** 6, [(0, 4)]),                 # never sorted: one batch in the given order
    ([], 8, 100, []),
])
def test_micro_batches_are_consecutive_within_rows_and_padded_tokens(lengths, rows, tokens, expected):
    """policy.micro_batches: consecutive items in their order, at most `rows` a micro-batch and items x its longest
    <= `tokens`; an item longer than `tokens` alone (the update's micro-batches and sequence_kl's)."""
    got = policy.micro_batches(lengths, rows, tokens)
    assert [(s.start, s.stop) for s in got] == expected
    assert [i for s in got for i in range(len(lengths))[s]] == list(range(len(lengths)))


def test_micro_batch_tokens_flag_is_the_settings_default_and_one_row_at_video_o3_lengths():
    """--micro-batch-tokens (default 16,384, the GRPOSettings default) reaches the settings; at Video-o3's and
    ParaVT's row lengths (17k-32k tokens) the default budget makes every micro-batch one row, at the tiny
    default's (a few hundred tokens, eight rows of its longest oracle rows in 6k) the fixed chunks of
    --micro-batch are unchanged (the embedded default computes what it did)."""
    args = recipes.parse_train_args([])
    assert args.micro_batch_tokens == grpo.GRPOSettings().micro_batch_tokens == 16384
    assert train.grpo_settings(recipes.parse_train_args(["--micro-batch-tokens", "4096"])).micro_batch_tokens == 4096
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--micro-batch-tokens", "0"])
    s = train.grpo_settings(recipes.parse_train_args(["--preset", "videoo3"]))
    assert [sl.stop - sl.start for sl in policy.micro_batches([27000, 31000, 26500, 32000], s.micro_batch,
                                                             s.micro_batch_tokens)] == [1, 1, 1, 1]
    tiny = [400, 560, 812, 386] * 16                      # a step of the default: 4 prompts x 16 rows
    assert policy.micro_batches(tiny, 8, args.micro_batch_tokens) == [slice(i, i + 8) for i in range(0, 64, 8)]


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


@pytest.mark.parametrize("step, warmup, expected", [
    (0, 0, 1.0),          # no warmup: starts at the peak
    (0, 10, 0.1),         # first warmup step: lr / warmup
    (9, 10, 1.0),         # last warmup step reaches the peak
    (10, 10, 1.0),        # cosine starts at the peak
    (55, 10, 0.55),       # half way through the cosine: (lr + min_lr) / 2
    (100, 10, 0.1),       # the end: min_lr = 0.1 * lr
    (250, 10, 0.1),       # past the end: stays at min_lr
])
def test_get_lr_endpoints(step, warmup, expected):
    assert get_lr(step, total_steps=100, lr=1.0, warmup_steps=warmup, min_lr_ratio=0.1) == pytest.approx(expected)


def test_get_lr_decreases_after_warmup():
    lrs = [get_lr(s, 50, 3e-6, warmup_steps=5, min_lr_ratio=0.1) for s in range(5, 60)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[0] > lrs[-1]


@pytest.mark.parametrize("total, warmup", [
    (0, 0),     # no steps at all
    (10, 11),   # warmup longer than the run
])
def test_get_lr_rejects_bad_schedule(total, warmup):
    with pytest.raises(ValueError, match="get_lr"):
        get_lr(0, total, 1.0, warmup_steps=warmup, min_lr_ratio=0.1)


# -----------------------------------------------------------------------------
# packed prompts (--pack-prompts): each shared prompt once in the update's forward

@pytest.fixture(scope="module")
def packed_rows(tiny, tmp_path_factory):
    """Six encoded trajectories: record A three times (the oracle calling, not calling, two tool turns), record B
    twice, record C once, interleaved A A B A B C; the rows of a record share its overview tensor, as a rollout
    group's samples do. Returns (trajs, the collated batch, shared_prompts' keys)."""
    model, processor = tiny
    root = str(tmp_path_factory.mktemp("packed"))
    a, b, c = [r for r in data.make_split(root, 8, seed=5, duration=64.0) if r["data_type"] == "single_clue"][:3]
    cfg = train.rollout_config_of_args(recipes.parse_train_args([]))
    enc = lambda rec, msgs: sft.encode_messages(processor, rec, msgs, root, cfg)
    oracle = lambda rec, seed, call: oracle_turns(rec, np.random.default_rng(seed), always_call=call)
    trajs = [enc(a, oracle(a, 0, True)), enc(a, oracle(a, 1, False)), enc(b, oracle(b, 0, True)),
             enc(a, two_tool_turns(a)), enc(b, two_tool_turns(b)), enc(c, oracle(c, 0, True))]
    for t in trajs:                              # train every token after the prompt, crops included
        t.roles = [rollout.POLICY if i >= t.prompt_len else rollout.ENV for i in range(len(t.token_ids))]
    for i, j in [(1, 0), (3, 0), (4, 2)]:        # one overview tensor per record
        trajs[i].videos[0] = trajs[j].videos[0]
    prompts = policy.shared_prompts(trajs, model.config.video_token_id, model.config.vision_config.spatial_merge_size)
    assert [p is not None for p in prompts] == [True] * 6
    assert prompts[0][0] == prompts[1][0] == prompts[3][0] != prompts[2][0] == prompts[4][0] != prompts[5][0]
    assert len({len(t.token_ids) for t in trajs}) >= 3 and any(len(t.videos) > 2 for t in trajs)   # ragged
    return trajs, rollout.collate(trajs, model, processor.tokenizer.pad_token_id, share_videos=True), prompts


def test_packed_prompts_equal_one_row_per_sample(tiny, packed_rows):
    """hidden_and_targets on pack_prompts' one row equals the plain rows at every policy position (hidden states
    to 1e-5), and every parameter's gradient of the GRPO loss matches: three prompts in one row, each once (the
    row holds 3 prompts + 6 suffixes, no more), suffixes with crops of their own, keys interleaved (A A B A B C)."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    packed = policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)
    size = sum(len(t.token_ids) - t.prompt_len for t in trajs) + sum(trajs[i].prompt_len for i in (0, 2, 5))
    assert packed["input_ids"].shape == (1, size) and packed["tdam"].lengths.tolist() == [size]
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(b):
        hidden, weight, targets, mask = policy.policy_head(model, b, "fp32")
        adv = torch.linspace(-1, 1, len(trajs))
        loss, _ = grpo.grpo_loss(hidden, weight, targets, None, adv, mask, clip_low=0.2, clip_high=0.3,
                                 compile=False, kl_coef=0.0, kl_estimator="k3", temperature=1.0, behav_cap=5.0)
        return hidden[mask].detach(), loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    h_plain, _, g_plain = loss_and_grads(batch)       # (the on-policy loss is -mean A whatever the forward: not
    h_pack, _, g_pack = loss_and_grads({**batch, "packed": packed})   # compared; its gradient is)
    torch.testing.assert_close(h_pack, h_plain, atol=1e-5, rtol=0)
    for (name, _), gp, gq in zip([x for x in model.named_parameters() if x[1].requires_grad], g_plain, g_pack):
        assert (gp is None) == (gq is None), name
        if gp is not None:
            torch.testing.assert_close(gq, gp, atol=1e-5 * float(gp.abs().max()) + 1e-9, rtol=1e-4, msg=name)


def test_packed_prompts_in_bf16_add_no_error_of_their_own(tiny, packed_rows):
    """Under --precision bf16 (autocast on the fp32 weights, as on a GPU) the packed row's hidden states are as
    close to the fp32 ones as the plain rows' are (each within bf16's rounding, neither further than twice the
    other's error)."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    packed = {**batch, "packed": policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)}
    with torch.no_grad():
        ref, _, _, mask = policy.policy_head(model, batch, "fp32")
        plain = policy.policy_head(model, batch, "bf16")[0]
        pack = policy.policy_head(model, packed, "bf16")[0]
    assert pack.dtype == plain.dtype == torch.bfloat16
    err = lambda h: float((h[mask].float() - ref[mask]).abs().max())
    scale = float(ref[mask].abs().max())
    assert 0 < err(plain) < 0.05 * scale and err(pack) <= 2 * err(plain), (err(plain), err(pack), scale)


def test_packed_spec_plan_and_rectangles_are_one_mask(tiny, packed_rows):
    """The packed row's attention four ways on random q, k, v: TdamSpec.plan's exact runs (the CPU kernel), the
    rectangles through the tile plan, and dense SDPA under TdamSpec.allowed: equal values and gradients; and the
    flex kernel CUDA runs, on the same rectangles, equal in value (forward: no CPU backward). And the mask is the
    segments': a suffix sees its prompt and itself, causally, nothing else."""
    model, _ = tiny
    trajs, batch, prompts = packed_rows
    spec = policy.pack_prompts(batch, trajs, prompts, model.config.video_token_id)["tdam"]
    L = int(spec.lengths[0])
    allowed = spec.allowed(0, L, L, "cpu")[0, 0]
    from_plan = torch.zeros(L, L, dtype=torch.bool)
    for _, q0, q1, runs in spec.plan:
        for k0, k1, kind in runs:
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            from_plan[q0:q1, k0:k1] = block.tril() if kind == ops.CAUSAL else block
    assert torch.equal(allowed, from_plan)
    assert int(allowed.sum()) < L * (L + 1) // 2 // 2        # most of the causal triangle is cut away
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, L, 2, 16, generator=g)

    def run(attend):
        out = attend(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    dense = run(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=0.25).transpose(1, 2))
    plan = run(lambda q, k, v: ops.tdam_attention(q, k, v, spec, 0.25))
    tiles = run(lambda q, k, v: ops.tdam_attention(q, k, v, ops.TdamSpec(spec.lengths, spec.rects, block=64), 0.25))
    for a, b, c in zip(dense, plan, tiles):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    # the CUDA kernel's block mask from the same rectangles (forward: CPU flex has no backward): eager, and compiled
    # where torch's CPU template agrees with its eager kernel at these shapes
    flex_spec = ops.TdamSpec(spec.lengths, spec.rects, kernel="flex")
    assert_flex_close(lambda: ops.tdam_attention(q.detach(), k.detach(), v.detach(), flex_spec, 0.25), dense[0])


@pytest.mark.parametrize("lengths, prompts, rows, tokens, expected", [
    ([100, 120, 110], "AAA", 8, 150, [(0, 3)]),              # 90 + 10 + 30 + 20 = 150: one prompt, three suffixes
    ([100, 120, 110], "AAA", 8, 149, [(0, 2), (2, 3)]),      # 150 > 149
    ([100, 120, 110], "AAA", 2, 10 ** 6, [(0, 2), (2, 3)]),  # rows still count items
    ([100, 120, 100, 110], "ABAB", 8, 250, [(0, 4)]),        # 90 + 10 + 90 + 30 + 10 + 20 = 250: each prompt once
    ([100, 120, 100, 110], "ABAB", 8, 249, [(0, 3), (3, 4)]),
    ([100, 300, 100], "A-A", 8, 250, [(0, 1), (1, 2), (2, 3)]),   # an unpacked row counts whole; 300 alone
    ([], "", 8, 100, []),
])
def test_micro_batches_count_each_packed_prompt_once(lengths, prompts, rows, tokens, expected):
    """policy.micro_batches with shared_prompts' keys: a micro-batch is one packed row, its size each distinct
    prompt (90 tokens here) once plus every item's suffix, at most `tokens`; at most `rows` items."""
    keys = [((k, ()), 90, 1) if k != "-" else None for k in prompts]
    got = policy.micro_batches(lengths, rows, tokens, keys)
    assert [(s.start, s.stop) for s in got] == expected


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
