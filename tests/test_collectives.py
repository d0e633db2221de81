"""The collectives on the process group a real run creates: NCCL serves CUDA tensors alone, so every all-reduce
must hand the group a tensor on the device it serves. On CPU the rule is tested as it decides: the CUDA path's
request (a group that serves one device type), the device read off the group's backend config, and 2 gloo ranks
whose group is created as the CUDA path creates it (one device type served), running every collective the runs
use and a whole eval.predict.

    pytest tests/test_collectives.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import eval as ev
import runtime


def test_a_cuda_run_asks_for_a_group_that_serves_cuda_alone(monkeypatch):
    """setup_distributed on an 8-GPU machine (CUDA faked): the group serves CUDA tensors with NCCL and nothing
    else, and the collectives' device, read off that group, is this rank's GPU. A plain "gloo" group would have
    served CPU tensors too and hidden collectives that NCCL refuses ("No backend type associated with device
    type cpu")."""
    asked, current = {}, {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.update(device=i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: asked["backend"])
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    rank, world, device = runtime.setup_distributed(3, None, "auto", threads=0)
    assert (rank, world, device) == (3, 8, torch.device("cuda", 3))
    assert asked["backend"] == "cuda:nccl" and (asked["rank"], asked["world_size"]) == (3, 8)
    assert runtime.collective_device() == torch.device("cuda", 3)


@pytest.mark.parametrize("config, want", [("cuda:nccl", "cuda"), ("cpu:gloo", "cpu"), ("cpu:gloo, cuda:gloo", "cpu"),
                                          ("cuda:nccl, cpu:gloo", "cpu")])
def test_collective_device_is_the_device_type_the_group_serves(config, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert runtime.collective_device(config).type == want
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        runtime.collective_device("xpu:xccl")


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: the group from setup_distributed (as a CUDA run creates it, for this CPU rank's device), every
    collective helper, and eval.predict over 5 records (rank 0: 3, rank 1: 2) writing one predictions file."""
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    rank, world, device = runtime.setup_distributed(rank, world, "cpu", threads=1)
    served = dist.get_backend_config()
    got = {"served": served, "device": str(runtime.collective_device()),
           "all_sum": runtime.all_sum(rank + 1), "all_max": runtime.all_max(10 * rank),
           "all_sum_float": runtime.all_sum_float(0.5 * (rank + 1)),
           "all_sums": runtime.all_sums([rank, 2.0], world),
           "all_mean": runtime.all_mean({"a": float(rank), "b": 4.0}, world),
           "all_gather_objects": runtime.all_gather_objects({"rank": rank}, world),
           "broadcast": runtime.broadcast_object({"from": rank}, world),
           "gather": runtime.gather_objects(rank, world)}
    records = [{"id": f"q{i}", "answer": "A"} for i in range(5)]
    run_batch = lambda batch: [{"id": r["id"], "response": f"<answer>A</answer> by {rank}"} for r in batch]
    rows = ev.predict(records, run_batch, out_path=Path(out) / "preds.jsonl", batch_size=2, rank=rank, world=world)
    got["rows"] = rows
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    runtime.finish(world)


@pytest.mark.slow
def test_every_collective_on_two_ranks_of_a_one_device_type_group(tmp_path):
    torch.multiprocessing.spawn(_rank, args=(2, runtime.find_free_port(), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        assert g["served"] == "cpu:gloo" and g["device"] == "cpu"          # one device type, as NCCL's group
        assert (g["all_sum"], g["all_max"], g["all_sum_float"]) == (3, 10, 1.5)
        assert g["all_sums"] == [1.0, 4.0] and g["all_mean"] == {"a": 0.5, "b": 4.0}
        assert g["all_gather_objects"] == [{"rank": 0}, {"rank": 1}]           # on every rank, in rank order
        assert g["broadcast"] == {"from": 0}
    assert got[0]["gather"] == [0, 1] and got[1]["gather"] is None
    assert [r["id"] for r in got[0]["rows"]] == [f"q{i}" for i in range(5)] and got[1]["rows"] is None
    assert [r["response"][-1] for r in got[0]["rows"]] == ["0", "1", "0", "1", "0"]     # question i -> rank i % 2
    assert [r["id"] for r in ev.read_predictions(tmp_path / "preds.jsonl")] == [f"q{i}" for i in range(5)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collectives_on_an_nccl_group(monkeypatch):
    """The first machine with a GPU: the group as a CUDA run creates it (one rank, cuda:nccl) takes every
    collective helper (before: `No backend type associated with device type cpu` at the first one)."""
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(runtime.find_free_port()))
    torch.cuda.set_device(0)
    runtime.init_process_group(0, 1, use_cuda=True)
    try:
        assert dist.get_backend_config() == "cuda:nccl" and runtime.collective_device().type == "cuda"
        assert (runtime.all_sum(3), runtime.all_max(7), runtime.all_sum_float(0.5)) == (3, 7, 0.5)
        assert runtime._all_reduce([1.0, 2.0], dist.ReduceOp.SUM) == [1.0, 2.0]
        # the collective paths of the world > 1 helpers, on this 1-rank group
        assert runtime.all_sums([1, 2.5], world=2) == [1.0, 2.5]
        assert runtime.all_mean({"a": 4.0}, world=2) == {"a": 2.0}                 # a sum over 1 rank, / 2
        box = [None]
        dist.all_gather_object(box, "names")
        assert box == ["names"]
    finally:
        dist.destroy_process_group()


LAUNCHED = """
import argparse, sys
sys.path.insert(0, {repo!r})
import runtime

def main(rank, args):
    rank, world, _ = runtime.setup_distributed(rank, args.gpus, args.device, 1)
    print(f"rank{{rank}} of {{world}} done", end="")             # no newline, no flush: finish must flush it
    runtime.finish(world)
    open(f"{{args.out}}/after{{rank}}", "w").close()            # never reached: the rank left in finish

if __name__ == "__main__":
    runtime.launch(main, argparse.Namespace(gpus=2, device="cpu", out={out!r}))
"""


@pytest.mark.slow
def test_a_launched_rank_leaves_at_finish(tmp_path):
    """A rank that `launch` spawned (torch.multiprocessing.spawn) leaves in runtime.finish, after the barrier and
    the group's teardown, by os._exit(0): the interpreter's teardown, where a gloo rank at times aborted (SIGABRT)
    after its work was done, never runs. Its unflushed output still arrives, the launcher exits 0, and nothing
    after finish runs."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(repo=str(Path(__file__).resolve().parents[1]), out=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank0 of 2 done" in proc.stdout and "rank1 of 2 done" in proc.stdout, proc.stdout
    assert not list(tmp_path.glob("after*"))
