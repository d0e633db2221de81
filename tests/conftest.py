"""Shared pieces of the training tests (test_train.py, test_reliability.py): the fast CPU smoke
configuration, in-process runs of train.main, the metrics reader, and fixtures."""
import json
import os

import pytest
import torch

import model as model_lib
import rollout
import runtime
import train

# The fast smoke configuration: tiny default model, 8 training prompts, groups of 2, 12 new tokens a turn,
# overviews gated to 4 or 8 frames.
SMOKE = ["--sft-steps", "2", "--rl-steps", "2", "--n-train", "8", "--n-eval", "4", "--group-size", "2",
         "--prompts-per-step", "2", "--max-new-tokens", "12", "--sft-batch", "4", "--gating-choices", "4,8"]


def smoke_argv(run_dir, *extra) -> list[str]:
    """Arguments of a fast CPU smoke run writing to run_dir; `extra` overrides or adds flags."""
    return [*SMOKE, "--run-dir", str(run_dir), *extra]


def run(argv) -> dict:
    """train.main in this process (one rank, no process group)."""
    return train.main(0, runtime.parse_args([str(a) for a in argv]))


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One folder for the synthetic videos of every run in a test file."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def cache_env(cache, monkeypatch):
    monkeypatch.setenv("PARAVT_CACHE", cache)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: these tiny models run about 3x faster so on a small shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())


# The engine's size thresholds shrunk so that every path they choose runs on the tiny model: blocks of 4 tokens (rows
# cross block boundaries inside a turn), attention scores in blocks of 512 elements (several query blocks and K/V
# slabs per chunk, even per decode step), every prompt read once per group in place (as shipped, the tiny prompts
# are read with each row's suffix), prefills of at most 64 tokens a forward (an admission's chunks in several
# forwards, a long one alone), a default memory budget of about one prompt group of the rollout tests (groups
# wait and are admitted as others retire). docs/method.md §8 lists them.
SHRUNK = {("kvcache", "BLOCK"): 4, ("kvcache", "SCORES_BUDGET"): 512, ("kvcache", "JOIN_PROMPT"): 0,
          ("kvcache", "PREFILL_TOKENS"): 64, ("rollout", "CPU_BUDGET_GB"): 0.024}


def shrink_thresholds(monkeypatch) -> None:
    import importlib
    for (module, name), value in SHRUNK.items():
        monkeypatch.setattr(importlib.import_module(module), name, value)


@pytest.fixture(params=["shipped", "shrunk"])
def thresholds(request, monkeypatch):
    """Runs a test twice: with the engine's thresholds as shipped, then shrunk (SHRUNK)."""
    if request.param == "shrunk":
        shrink_thresholds(monkeypatch)
    return request.param


@pytest.fixture
def small_thresholds(monkeypatch):
    """The engine's thresholds shrunk (SHRUNK) for the whole test."""
    shrink_thresholds(monkeypatch)
