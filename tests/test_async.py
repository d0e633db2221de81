"""Rollout beside training (async_rl.py): the decoupled PPO objective against a hand computation and against PPO-clip,
the behaviour log-probs the rollout records against a training forward, the weight broadcast on 3 gloo ranks (FSDP2
trainers on their own mesh, one rollout rank), the staleness bound and the versions of a 3-rank run and its resume,
eta = 0 as the synchronous loop byte for byte, and a rollout rank's death named rather than waited on.

    pytest tests/test_async.py -q
"""
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import async_rl
import data
import grpo
import rollout
import runtime
import policy
import oracles
from conftest import TEST_ROLLOUT, metrics, run, smoke_argv

ROOT = Path(__file__).resolve().parents[1]


# -----------------------------------------------------------------------------
# the objective

def test_decoupled_loss_equals_a_hand_computed_example():
    """Two tokens, A = +1 and -1, eps 0.2: token 0 inside the clip range, weight pi_prox / pi_behav = e^0.5;
    token 1 ratio e^0.3 > 1.2 with A < 0 (not clipped: min takes the larger loss), weight e^2 = 7.39 > cap 5: dropped;
    token 2 (A = +1, ratio e^0.3 clipped to 1.2), weight e^-1."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.1, -2.3, -0.8]])
    behav = torch.tensor([[-1.6, -4.3, 0.2]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = oracles.grpo_loss_on_logprobs(logp, prox, adv, mask, 0.2, 0.2, behav_logprobs=behav, behav_cap=5.0)
    r0, r2 = math.exp(0.1), math.exp(0.3)
    by_hand = (-math.exp(0.5) * r0 * 1.0 + 0.0 - math.exp(-1.0) * 1.2 * 1.0) / 3
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    # d/dlogp: token 0 -w r A / 3; token 1 dropped; token 2 clipped (no gradient)
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.exp(0.5) * r0 / 3, 0.0, 0.0]]))
    assert stats["n_tokens"] == 3 and r2 > 1.2


def test_decoupled_loss_is_ppo_clip_when_behaviour_is_proximal():
    """pi_behav = pi_prox: w = 1 everywhere, the loss and its gradient are PPO-clip's, on the fused path (hidden
    states, ops.token_logprobs) and on log-probs alike."""
    gen = torch.Generator().manual_seed(0)
    B, L, D, V = 2, 7, 16, 40
    hidden = torch.randn(B, L, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * 0.3
    targets = torch.randint(0, V, (B, L), generator=gen)
    mask = torch.rand(B, L, generator=gen) > 0.3
    adv = torch.randn(B, generator=gen)
    with torch.no_grad():
        prox = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, targets[..., None])[..., 0] + \
            0.1 * torch.randn(B, L, generator=gen)
    out = []
    for behav in (None, prox):
        h = hidden.clone().requires_grad_(True)
        loss, _ = grpo.grpo_loss(h, weight, targets, prox, adv, mask, clip_low=0.2, clip_high=0.3, temperature=0.7,
                                  compile=False, behav_logprobs=behav, kl_coef=0.0, kl_estimator="k3", behav_cap=5.0)
        loss.backward()
        out.append((loss.detach(), h.grad))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=0)
    behav = prox - 0.2            # a staler behaviour policy: w = e^0.2 on every token scales the loss by it
    loss, _ = grpo.grpo_loss(hidden, weight, targets, prox, adv, mask, clip_low=0.2, clip_high=0.3, temperature=0.7,
                              compile=False, behav_logprobs=behav, kl_coef=0.0, kl_estimator="k3", behav_cap=5.0)
    assert loss.item() == pytest.approx(math.exp(0.2) * out[0][0].item(), rel=1e-5)


@pytest.mark.slow
def test_behaviour_logprobs_are_the_training_forwards_at_the_sampling_temperature(tiny, tmp_path):
    """The rollout records log p_T of each sampled token (T = 0.7 here); collated, `behaviour_logprobs` puts them
    where the loss reads them, and a training forward of the same weights gives the same numbers: at staleness 0
    the decoupled weight is 1."""
    model, processor = tiny
    recs = data.make_split(str(tmp_path), 2, seed=0, duration=64.0)
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "temperature": 0.7, "group_size": 2, "max_new_tokens": 64,
                                   "record_logprobs": True})
    trajs = rollout.run_agent(model, processor, recs, str(tmp_path), cfg, seed=3)
    pad = processor.tokenizer.pad_token_id
    batch = rollout.collate(trajs, model, pad, share_videos=True)
    behav = rollout.behaviour_logprobs(trajs, batch)
    with torch.no_grad():
        prox = policy.forward_logprobs(model, batch, 1024, 0.7, False, "fp32")
    mask = policy.policy_mask(batch["roles"])
    assert mask.sum() > 20 and torch.all(behav[~mask] == 0)
    torch.testing.assert_close(behav[mask], prox[mask], atol=1e-4, rtol=0)
    trajs[0].logprobs.pop()
    with pytest.raises(ValueError, match="recorded log-probs"):
        rollout.behaviour_logprobs(trajs, batch)


# -----------------------------------------------------------------------------
# the weight broadcast on 3 gloo ranks: 2 FSDP2 trainers, 1 rollout rank

def test_buckets_cut_the_parameter_list_the_same_way_within_the_limit():
    shapes = [("a", torch.Size([10])), ("b", torch.Size([30])), ("c", torch.Size([100])), ("d", torch.Size([5]))]
    assert async_rl.buckets(shapes, 4, limit=160) == [[shapes[0], shapes[1]], [shapes[2]], [shapes[3]]]
    assert async_rl.buckets(shapes, 2, limit=10 ** 6) == [shapes]


def _wait_for(path: Path, seconds: float = 60.0) -> bool:
    """Polls for a file another rank writes (a signal outside the process groups); False if it never came."""
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > seconds:
            return False
        time.sleep(0.05)
    return True


def _broadcast_rank(rank: int, port: int, out: str, dtype_name: str) -> None:
    """Rank 0 sends two versions (the trainers' weights, then those weights + 1) back to back and marks that both
    sends returned; the rollout rank posts its receives only after that mark, then takes the versions in order,
    the second into the first's host buckets."""
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3")
    rank, world, device = runtime.setup_distributed(rank, 3, "cpu", threads=1)
    layout = async_rl.make_layout(world, 1)
    dtype, sent_mark = getattr(torch, dtype_name), Path(out) / "sent"
    model, _ = policy.policy_model("tiny", device, "fp32", 1, seed=0 if rank < 2 else 1)   # the rollout's differ
    if not layout.is_rollout(rank):
        from torch.distributed.device_mesh import DeviceMesh
        runtime.shard_model(model, None, DeviceMesh.from_group(layout.trainers, "cpu"))
        fulls, sends = [], []
        for step in (0, 1):
            with torch.no_grad():                              # the trainers move away from the init, then update
                for p in model.parameters():
                    p.mul_(1.25).add_(0.01) if step == 0 else p.add_(1.0)
            full = async_rl.full_state(model, layout.n_trainers, dtype)
            if rank == 0:
                assert {(t.dtype, t.device.type) for t in full.values()} == {(dtype, "cpu")}   # cast before the host
                fulls.append({n: full[n].clone() for n, _ in model.named_parameters()})
                sends.append(async_rl.broadcast_weights(model, full, layout.sync, dtype, bucket_bytes=2 ** 16))
        if rank == 0:
            sent_mark.write_text("both sends returned before any receive was posted")
            for t in sends:
                t.wait()
            torch.save({"full": fulls, "sent": [t.bytes for t in sends]}, f"{out}/trainer.pt")
    else:
        waited = _wait_for(sent_mark)
        got, posted = [], None
        for _ in range(2):
            posted = async_rl.broadcast_weights(model, None, layout.sync, dtype, bucket_bytes=2 ** 16,
                                                into=posted and posted.flats)
            async_rl.load_weights(model, posted)
            got.append({n: p.detach().clone() for n, p in model.named_parameters()})
        torch.save({"got": got, "sender_returned_first": waited}, f"{out}/rollout.pt")
    runtime.finish(world)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_after_the_broadcast_the_rollout_ranks_weights_are_the_trainers(tmp_path, dtype):
    """fp32 buckets: bit for bit; bf16 buckets (the GPU default): the trainers' weights rounded to bf16, and half the
    bytes. Many buckets (64 KiB each), so the cut is exercised. The sends do not wait for the receiver (rank 0
    sends two versions before the rollout rank posts a receive), and the versions arrive in order."""
    torch.multiprocessing.spawn(_broadcast_rank, args=(runtime.find_free_port(), str(tmp_path), dtype), nprocs=3)
    trainer, rolled = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "rollout.pt")
    assert rolled["sender_returned_first"]
    params = sum(t.numel() for t in trainer["full"][0].values())
    for full, got in zip(trainer["full"], rolled["got"], strict=True):
        want = {n: t.to(getattr(torch, dtype)).float() for n, t in full.items()}
        assert set(want) == set(got) and len(got) > 10
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    assert trainer["sent"] == [params * (4 if dtype == "float32" else 2)] * 2


def _mail_rank(rank: int, port: int, out: str) -> None:
    """The rollout rank sends three steps' messages without waiting, then marks it; rank 0 receives only after."""
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, 2, False, timeout_s=120)
    layout = async_rl.make_layout(2, 1)
    mark = Path(out) / "sent"
    if rank == 1:
        big = torch.arange(3 * 10 ** 6)                       # 24 MB: larger than any socket buffer
        pending = [x for u in (1, 2, 3) for x in async_rl.send_groups({"step": u, "items": [big * u]}, layout.mail)]
        mark.write_text("sent")
        for w, _ in pending:
            w.wait()
    else:
        returned = _wait_for(mark)
        got = [async_rl.receive_groups(1, u, layout.mail) for u in (1, 2, 3)]
        ok = all(torch.equal(m["items"][0], torch.arange(3 * 10 ** 6) * m["step"]) for m in got)
        Path(out, "result.txt").write_text(f"{returned} {ok}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_rollout_rank_sends_its_steps_without_waiting_for_rank_0(tmp_path):
    """A rollout rank's step goes out while the rank samples on: three sends return before rank 0 receives any,
    and rank 0 receives them whole and in order."""
    torch.multiprocessing.spawn(_mail_rank, args=(runtime.find_free_port(), str(tmp_path)), nprocs=2)
    assert (tmp_path / "result.txt").read_text() == "True True"


# -----------------------------------------------------------------------------
# whole runs

ASYNC = ["--gpus", "3", "--device", "cpu", "--async-staleness", "1", "--rollout-ranks", "1", "--threads", "1",
         "--max-new-tokens", "48", "--set", "mask_truncated=0", "--save-every", "1"]


def _train(argv: list, cache: str, script: Path = ROOT / "train.py") -> subprocess.CompletedProcess:
    env = {**os.environ, "PARAVT_CACHE": cache}
    return subprocess.run([sys.executable, str(script), *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


# train.py with async_rl.run_rl spied on: each rank writes the optimizers still alive when it enters the RL stage
# (spawned ranks import this script as their main module, so the spy is theirs too)
SPIED = """
import gc, os, sys
sys.path.insert(0, {root!r})
import torch, async_rl, train
real = async_rl.run_rl
def spy(run, *args, **kw):
    gc.collect()
    alive = sum(isinstance(o, torch.optim.Optimizer) for o in gc.get_objects())
    with open(os.path.join({out!r}, f"optimizers-at-rl-{{run.rank}}"), "w") as f:
        f.write(str(alive))
    return real(run, *args, **kw)
async_rl.run_rl = spy
if __name__ == "__main__":
    train.cli(sys.argv[1:])
"""


@pytest.mark.slow
def test_three_rank_async_run_keeps_the_bound_carries_versions_and_resumes(tmp_path, cache):
    """--gpus 3 --rollout-ranks 1 --async-staleness 1 on gloo: SFT on all ranks, then 2 trainers beside 1 rollout
    rank. No rank holds the SFT stage's AdamW when RL starts (before: every rank did, ~13 GB a GPU at 8B on 8).
    Every step's groups come from version u - 1 - eta or newer (step 1 from 0, then one behind: staleness
    1), every trained trajectory carries the versions of its turns, the held-out evaluation runs at the end; a
    --resume from the step-2 checkpoint continues at step 3, sampled by version 2 (the checkpoint's)."""
    argv = smoke_argv(tmp_path, *ASYNC, "--rl-steps", "3")
    script = tmp_path / "spied_train.py"
    script.write_text(SPIED.format(root=str(ROOT), out=str(tmp_path)))
    done = _train(argv, cache, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / f"optimizers-at-rl-{r}").read_text() for r in range(3)] == ["0", "0", "0"]
    rows = [r for r in metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["policy_version"] == max(0, r["step"] - 2) and r["staleness"] == min(1, r["step"] - 1)
        assert all(max(0, r["step"] - 2) <= v <= r["step"] - 1 for v in r["trained_versions"])
    assert sum(r["kept"] for r in rows) > 0 and any(r["trained_versions"] for r in rows)
    assert '"after"' in done.stdout                                  # the final evaluation ran on every rank
    os.remove(next(Path(tmp_path).glob("ckpt-rl-000003")) / "trainer.pt")   # as if killed before step 3's save
    done = _train([*argv, "--resume"], cache)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy_version"] == 2 and rows[-1]["staleness"] == 0


@pytest.mark.slow
def test_eta_zero_is_the_synchronous_loop_byte_for_byte(tmp_path, cache_env):
    """--async-staleness 0 (the default) runs train.run_rl: the same checkpoint bytes as a run without the flag."""
    out = {}
    for name, extra in (("sync", []), ("eta0", ["--async-staleness", "0", "--rollout-ranks", "1"])):
        run(smoke_argv(tmp_path / name, "--stage", "rl", "--rl-steps", "2", *extra))
        ckpt = tmp_path / name / "ckpt-rl-000002"
        out[name] = {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in sorted(ckpt.rglob("*"))
                     if p.is_file() and p.name not in ("trainer.pt", ".metadata")}
        # trainer.pt holds the RNG state and counters, DCP's .metadata a fresh uuid per save; the rest is compared:
        # the weights and AdamW's state (train_state/*.distcp) and the Hugging Face export
    assert out["sync"].keys() == out["eta0"].keys() and any(k.endswith(".safetensors") for k in out["sync"]) \
        and any(k.endswith(".distcp") for k in out["sync"])
    assert out["sync"] == out["eta0"]


# -----------------------------------------------------------------------------
# a rollout rank that dies

def _dying_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, 2, False, timeout_s=120)
    if rank == 1:
        os._exit(3)                                   # a rollout rank killed (OOM, a signal) before it sends step 1
    try:
        async_rl.receive_groups(1, 1)
        Path(out).write_text("returned")
    except RuntimeError as e:
        Path(out).write_text(str(e))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_dead_rollout_rank_is_named_not_waited_on(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    port, out = runtime.find_free_port(), str(tmp_path / "error.txt")
    procs = [ctx.Process(target=_dying_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 3]
    assert "lost rollout rank 1 while waiting for RL step 1" in Path(out).read_text()


def test_flags_refuse_a_layout_without_trainers_or_rollout_ranks():
    import recipes
    for argv in (["--async-staleness", "1", "--gpus", "1"], ["--async-staleness", "1", "--gpus", "2",
                                                             "--rollout-ranks", "2"],
                 ["--async-staleness", "-1"], ["--behav-weight-cap", "1"]):
        with pytest.raises(SystemExit):
            recipes.parse_train_args(argv)
    args = recipes.parse_train_args(["--async-staleness", "2", "--gpus", "8"])
    assert (args.async_staleness, args.rollout_ranks, args.behav_weight_cap) == (2, 1, 5.0)
