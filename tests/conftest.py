"""Shared pieces of the training tests (test_train.py, test_reliability.py, test_rl_correctness.py): the fast
CPU smoke configuration, in-process runs of train.main, the metrics reader, the size thresholds shrunk, a bench
script as a module, and fixtures."""
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import data
import model as model_lib
import policy
import recipes
import rollout
import sft
import train

# The fast smoke configuration: tiny default model, 8 SFT prompts and 4 RL prompts, groups of 2, 12 new tokens a
# turn, overviews gated to 4 or 8 frames.
SMOKE = ["--sft-steps", "2", "--rl-steps", "2", "--n-train", "8", "--set", "n_rl=4", "--n-eval", "4", "--group-size", "2",
         "--prompts-per-step", "2", "--max-new-tokens", "12", "--sft-batch", "4", "--gating-choices", "4,8"]


def pytest_collection_modifyitems(config, items):
    """gpu and soak tests stay deselected unless -m names them: pytest.ini's addopts deselect them, but a -m on the
    command line (`pytest -m "not slow"`) replaces that one."""
    expr = config.getoption("markexpr") or ""
    off = [m for m in ("gpu", "soak") if not re.search(rf"\b{m}\b", expr)]
    drop = {item for item in items if any(item.get_closest_marker(m) for m in off)}
    if drop:
        config.hook.pytest_deselected(items=[item for item in items if item in drop])
        items[:] = [item for item in items if item not in drop]


BENCH = Path(__file__).resolve().parent.parent / "bench"


@functools.lru_cache(maxsize=None)
def bench_module(name: str):
    """bench/NAME.py as a module (its functions called directly), loaded once; bench/ on sys.path for its `common`
    import."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The tiny model's rollout as the engine tests drive it: its 64 x 64 frames, one sample at T = 1, 256 new tokens a
# turn (a test sets what it checks; a run's settings come from recipes.PRESETS).
TEST_ROLLOUT = {**recipes.TINY_FRAMES, "group_size": 1, "temperature": 1.0, "max_new_tokens": 256}


# The synthetic oracle as the tests record it (data.oracle_turns takes each explicitly): the tiny model's K = 8
# overview and crop sampling, every tool-calling answer cropped (a direct glyph read off the overview).
ORACLE = dict(nframes=recipes.TINY["overview_nframes"], crop_fps=recipes.TINY["crop_fps"],
              crop_max_frames=recipes.TINY["crop_max_frames"], always_call=False, direct_crop=0.0)
# ... and the SFT mix around it (sft.sft_examples): the oracle alone, no budget recordings or tool-free twins.
SFT_MIX = dict(always_call=False, direct_crop=0.0, budget_fraction=0.0, tool_free=0.0, keep_bad_calls=False,
               max_bad_fraction=recipes.TINY["max_bad_fraction"])


def oracle_turns(record: dict, rng, **kw) -> list[dict]:
    """data.oracle_turns under ORACLE, `kw` over it."""
    import data
    return data.oracle_turns(record, rng, **{**ORACLE, **kw})


def score_with(monkeypatch, score, recipe: str = "para_grpo") -> None:
    """The recipe's reward replaced by `score(traj, record, anchoring, released_scoring) -> (total, components)`
    for the test (recipes.Recipe.score: what grpo.collect_groups calls)."""
    import dataclasses
    monkeypatch.setitem(recipes.RECIPES, recipe, dataclasses.replace(recipes.RECIPES[recipe], score=score))


# torch's compiled CPU flex_attention (Inductor's C++ template, torch 2.14.1) differs from its own eager kernel at
# some shapes on AVX2 (and on AVX-512 when an AVX2 run filled the same Inductor cache), on torch's own causal mask
# too (tests/test_ops.py::test_cpu_flex_template_reproducer; docs/experiments.md). The product never runs it (ops.tdam_kernel: "auto" is flex on CUDA only). The tests check our
# flex path against the dense mask on the eager kernel, always, and compiled where torch's template agrees with it.

def cpu_isa() -> str:
    """The ISA torch computes with on this CPU: ATen's dispatch level and the vector ISA Inductor compiles for."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return f"ATen {torch.backends.cpu.get_cpu_capability()}, Inductor {pick_vec_isa()!s}"


def _flex_error(compute, ref) -> str | None:
    """compute() compiled afresh against ref: None where they agree to 1e-5, else what it gives (or raises: the
    template also fails to build or trips its own bound checks)."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            err = float((compute() - ref).abs().nan_to_num(float("inf")).max())
    except Exception as e:
        return f"raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    finally:
        torch._dynamo.reset()
    return None if err <= 1e-5 else f"max |compiled - eager| = {err:.3g}"


def cpu_flex_probe(B: int, H: int, H_kv: int, L: int, D: int, block: int) -> str | None:
    """torch's compiled CPU flex_attention against its eager kernel on torch's own causal BlockMask
    (create_block_mask), none of our code: None where they agree, else what the compiled one gives."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h in (H, H_kv, H_kv))
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, L, L, device="cpu", BLOCK_SIZE=block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                     # "called without torch.compile": that is the point
        eager = flex_attention(q, k, v, block_mask=mask, enable_gqa=H != H_kv)
    return _flex_error(lambda: torch.compile(flex_attention)(q, k, v, block_mask=mask, enable_gqa=H != H_kv), eager)


def assert_flex_close(call, ref: torch.Tensor) -> None:
    """call() runs our flex path (ops.tdam_attention with kernel "flex"). On flex_attention's eager kernel, what the
    compiled one is defined to compute, it must give ref, the dense mask's output (our BlockMask and call). Compiled
    afresh it must give the same; where it does not, torch's compiled template is wrong on this CPU at these shapes,
    and the test skips saying so."""
    from torch.nn.attention.flex_attention import flex_attention
    import ops
    with warnings.catch_warnings(), mock.patch.object(ops, "_compiled_flex", lambda: flex_attention):
        warnings.simplefilter("ignore")
        with torch.no_grad():
            eager = call()
    torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
    error = _flex_error(call, eager)
    if error is not None:
        pytest.skip(f"torch {torch.__version__}'s compiled CPU flex_attention differs from its eager kernel on this "
                    f"CPU ({cpu_isa()}) at q {tuple(ref.shape)}: {error}")


class SpyRun:
    """The Run that grpo.policy_update steps the optimizer through, outside a run: `optimizer_step` hands the loss
    to the test's `step(loss)` (which may read the gradients) and returns what it returns."""

    def __init__(self, step, world: int = 1, group=None, rank: int = 0):
        self.step, self.world, self.group, self.rank = step, world, group, rank

    def optimizer_step(self, model, optimizer, loss, stage, step, sample_ids):
        return self.step(loss)


def rl_job(s, filler=None):
    """A grpo.RLJob around settings `s` for a lone policy_update (no records: `filler` is the zero-weight row)."""
    import grpo
    return grpo.RLJob([], "", rollout.RolloutConfig(), s, spare=filler)


def smoke_argv(run_dir, *extra) -> list[str]:
    """Arguments of a fast CPU smoke run writing to run_dir; `extra` overrides or adds flags."""
    return [*SMOKE, "--run-dir", str(run_dir), *extra]


def run(argv) -> dict:
    """train.main in this process (one rank, no process group)."""
    return train.main(0, recipes.parse_train_args([str(a) for a in argv]))


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


# Sizes that choose a code path, {module: {constant: small value}}: at the shipped values the tiny model takes
# the small-input path of each, so the tests that take `small_thresholds` also run with them shrunk and the tiny
# model goes where a real model goes (docs/method.md §8, "Sizes that choose a path"). Add a module's constants
# here when it gains one.
SMALL_THRESHOLDS = {
    "ops": {"_MIN_CHUNK_LOGITS": 1,      # the losses: the fused chunks, not the plain log_softmax (tiny logits)
            "MAX_CHUNKS": 3},            # the default chunk rule's cap: 3 chunks, the last one padded
    "kvcache": {"BLOCK": 4,              # paged K/V: rows cross 4-token blocks inside a turn
                "SCORES_BUDGET": 512,    # attention scores in blocks of 512 elements: several query blocks and
                                         # K/V slabs per chunk, even per decode step
                "JOIN_PROMPT": 0,        # every prompt read once per group in place (as shipped, the tiny
                                         # prompts are read with each row's suffix as one causal sequence)
                "PREFILL_TOKENS": 64,    # prefills of at most 64 tokens a forward (an admission's chunks in
                                         # several forwards, a long one alone)
                "GATHER_BUDGET": 2048,   # the attention's slabs split past 32 keys of the tiny model: rows
                                         # in several slabs, each large prompt alone (in place or gathered)
                "CPU_BUDGET_GB": 0.024},  # the default memory budget: about one prompt group of the rollout tests
}                                         # (groups wait and are admitted as others retire)


def set_thresholds(sizes: dict) -> None:
    """Set the {module: {constant: value}} constants (a spawned rank does not inherit a test's monkeypatches)."""
    for module, constants in sizes.items():
        for name, value in constants.items():
            setattr(importlib.import_module(module), name, value)


def _shrink(monkeypatch) -> dict:
    for module, constants in SMALL_THRESHOLDS.items():
        for name, value in constants.items():
            monkeypatch.setattr(importlib.import_module(module), name, value)
    return SMALL_THRESHOLDS


@pytest.fixture(params=["shipped", "small"])
def small_thresholds(request, monkeypatch) -> dict:
    """Runs a test twice: at the shipped sizes, and with every SMALL_THRESHOLDS constant shrunk. Returns what it
    set ({} the first time), for tests that hand it to spawned ranks (`set_thresholds`)."""
    return {} if request.param == "shipped" else _shrink(monkeypatch)


@pytest.fixture
def shrunk_thresholds(monkeypatch) -> dict:
    """Every SMALL_THRESHOLDS constant shrunk for the whole test (tests of the small-size paths themselves)."""
    return _shrink(monkeypatch)


@pytest.fixture
def decode_steps(monkeypatch):
    """A spy on rollout.Engine.step: decode_steps() is the number of decode steps every engine has made so far."""
    count, step = [0], rollout.Engine.step

    def counted(self):
        count[0] += 1
        return step(self)
    monkeypatch.setattr(rollout.Engine, "step", counted)
    return lambda: count[0]


# -----------------------------------------------------------------------------
# encoded trajectories shared by test_sft.py, test_policy.py and test_grpo.py

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
