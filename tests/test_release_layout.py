"""
The release layout at real sizes (python train.py --gpus 8 --rollout-ranks 1 --async-staleness 2 --preset paravt):
each mechanism that a size, a dtype, a role or a torch version decides, checked by the thing that decides it on the
GPU, on the tiny model: the asynchronous rollout rank's weights (compute dtype, no gradients) and the K/V budget it
reads; which side loads the reference; the process groups' timeout; torchrun's world for the asynchronous layout;
the prompt prefill's SDPA call at Qwen3-VL-8B's heads; the packed update's micro-batches at the papers' lengths; a
step's items dealt to the trainers. Elsewhere: the SFT stage's AdamW gone before asynchronous RL (test_async's
3-rank run), SFT micro-batches under the token budget (test_train), the weight send's host copy (test_async), the
plan's coefficients against the code's (test_plan, bench/roles.py).

    python -m pytest tests/test_release_layout.py -q
"""
import dataclasses
import json
import types

import pytest
import torch
import torch.distributed as dist

import async_rl
import grpo
import kvcache
import recipes
import rollout
import runtime
import train
import policy
from model import load_model
from test_rollout import _KeptCasts

GB = 2 ** 30


# -----------------------------------------------------------------------------
# the asynchronous rollout rank: compute-dtype weights without gradients, and the K/V budget they leave

def test_rollout_rank_holds_the_compute_dtype_without_gradients():
    """A rollout rank's policy (policy.sampler_model) under bf16 is 2 bytes a parameter with no gradients, so autocast
    keeps no copies through its rollout (before: the trainers' fp32 masters with requires_grad, 4 + 2 B/param, plus
    the bf16 copies: 8 B/param at 8B where the plan assumed 2); fp32 in a CPU fp32 run, as before."""
    model, _ = policy.sampler_model("tiny", "cpu", "bf16")
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and not any(p.requires_grad for p in params)
    assert sum(p.numel() * p.element_size() for p in params) == 2 * sum(p.numel() for p in params)
    assert kvcache.autocast_copies(model) == 0
    ids = torch.randint(300, model.get_input_embeddings().weight.shape[0], (1, 16))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), _KeptCasts() as kept:
        model(input_ids=ids)
        assert kept.alive == 0
    fp32, _ = policy.sampler_model("tiny", "cpu", "fp32")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32} and kvcache.autocast_copies(fp32) == 0


class _Stop(Exception):
    pass


@pytest.mark.parametrize("rank, preset, wants_ref", [
    (1, "paravt", True),       # rollout rank, k1 in the reward: the rollout computes the KL (collect_groups)
    (0, "paravt", False),      # trainer, k1 in the reward: the update never reads the reference
    (1, "videoo3", False),     # Video-o3 has no KL
    (0, "videoo3", False),
])
def test_async_ranks_build_their_role(monkeypatch, rank, preset, wants_ref):
    """async_rl.run_rl builds a rollout rank's model with policy.sampler_model and a trainer's with policy_model, and
    loads the reference only on the side that computes the KL (before: every rank of a ParaVT run loaded it, 17.5 GB
    a trainer at 8B that nothing read)."""
    s = train.grpo_settings(recipes.parse_train_args(["--preset", preset]))
    built, refs = [], []

    def build(kind):
        def make(*args, **kw):
            built.append(kind)
            return object(), None
        return make

    monkeypatch.setattr(policy, "sampler_model", build("sampler"))
    monkeypatch.setattr(policy, "policy_model", build("policy"))
    monkeypatch.setattr(async_rl, "rollout_loop", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    monkeypatch.setattr(async_rl, "trainer_loop", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    monkeypatch.setattr(policy, "make_optimizer", lambda *a, **k: None)
    layout = async_rl.Layout(world=2, rollout_ranks=1)        # one trainer: no FSDP2 mesh to build
    run = types.SimpleNamespace(rank=rank, seed=0, load_optimizer=lambda *a: None)
    job = grpo.RLJob([], "", None, dataclasses.replace(s, precision="bf16"), model_source="tiny",
                     reference=lambda: refs.append(1))
    with pytest.raises(_Stop):
        async_rl.run_rl(run, layout, None, job, torch.device("cpu"))
    assert built == ["sampler" if rank == 1 else "policy"]
    assert bool(refs) == wants_ref


def test_default_budget_counts_what_the_model_will_cast(monkeypatch):
    """The K/V budget subtracts autocast's copies by the model, not by the world size: an unsharded fp32 policy with
    gradients under bf16 autocast is cast whatever the run's W (before: W > 1 was read as FSDP2 and nothing was
    subtracted, which an asynchronous rollout rank, unsharded in a world of 8, is not: 63.94 vs 64.0 GiB); FSDP2's
    DTensor shards and a rollout rank's bf16 weights are not cast."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(kvcache, "autocast_dtype", lambda device: torch.bfloat16)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    master, _ = load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
    copies = kvcache.autocast_copies(master)
    assert copies > 0
    assert kvcache.memory_budget(None, "cuda", master) == int(0.8 * (10 * GB - 2 * copies))
    sampler, _ = policy.sampler_model("tiny", "cpu", "bf16")
    assert kvcache.memory_budget(None, "cuda", sampler) == int(0.8 * 10 * GB)


def test_fsdp2_shards_are_not_counted_as_autocast_copies(monkeypatch):
    """FSDP2's parameters are DTensor shards, all-gathered in bf16 for the forward: autocast casts none of them."""
    monkeypatch.undo()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(runtime.find_free_port()))
    runtime.init_process_group(0, 1, use_cuda=False, timeout_s=60)
    try:
        model, _ = load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
        assert kvcache.autocast_copies(model) > 0
        runtime.shard_model(model, torch.bfloat16)
        assert kvcache.autocast_copies(model) == 0
    finally:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# the process groups: the run's timeout, torchrun's world

def test_every_group_gets_the_runs_timeout(monkeypatch):
    """A CUDA run's group ("cuda:nccl", which torch does not read as Backend.NCCL, so it gave 30 minutes) and the
    asynchronous layout's three groups get the run's dist_timeout_min; train.main passes it to both."""
    asked = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.append(("world", backend, kw)))
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: asked.append(("group", ranks, kw)))
    runtime.init_process_group(0, 8, use_cuda=True, timeout_s=7200)
    async_rl.make_layout(8, 1, 7200)
    assert [a[0] for a in asked] == ["world", "group", "group", "group", "group"]
    assert all(a[2]["timeout"].total_seconds() == 7200 for a in asked)
    assert [a[2].get("backend") for a in asked[1:]] == [None, "gloo", "gloo", "gloo"]   # only FSDP2's is the world's
    args = recipes.parse_train_args([])
    assert args.dist_timeout_min == 120.0

    seen = {}

    def setup(rank, gpus, device, threads, timeout_s=None):
        seen["timeout_s"] = timeout_s
        raise _Stop()

    monkeypatch.setattr(runtime, "setup_distributed", setup)
    with pytest.raises(_Stop):
        train.main(0, recipes.parse_train_args(["--set", "dist_timeout_min=5"]))
    assert seen["timeout_s"] == 300
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--set", "dist_timeout_min=0"])


def test_torchrun_world_admits_the_async_layout(monkeypatch):
    """Under torchrun (WORLD_SIZE set, no --gpus) the asynchronous layout is checked against torchrun's world, as
    runtime.setup_distributed takes it (before: refused unless --gpus was passed too)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = recipes.parse_train_args(["--async-staleness", "2", "--rollout-ranks", "1"])
    assert (args.async_staleness, args.rollout_ranks) == (2, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--async-staleness", "2", "--rollout-ranks", "1"])


# -----------------------------------------------------------------------------
# the prompt prefill's attention at Qwen3-VL-8B's heads: the SDPA kernel CUDA would pick

def cuda_sdpa_kernel(dtype: torch.dtype, q_heads: int, kv_heads: int, torch_minor: int) -> str:
    """The kernel torch's CUDA SDPA dispatch takes for an unmasked causal call (sdp_utils.cpp), by the properties it
    reads: flash and cuDNN take fp16 / bf16 only; the memory-efficient kernel takes fp32 and, from torch 2.14 on,
    grouped K/V heads; otherwise the math kernel, which builds the (n, H, L, L) scores."""
    if dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if q_heads == kv_heads or torch_minor >= 14:
        return "efficient"
    return "math"


def test_prompt_prefill_never_hands_cuda_the_math_kernel(monkeypatch):
    """One prompt prefill of a 1-layer model with Qwen3-VL-8B's attention (32 query heads, 8 K/V heads, head dim
    128) under the rollout's bf16 autocast: every SDPA call it makes takes a fused kernel on CUDA for each torch from
    2.9 (requirements.txt's floor) to 2.14 (before: fp32 with 8 K/V heads, the math kernel below 2.14: 32 GiB of
    scores a 16k-token prompt, twice); and its output is the grouped-query attention's, bit for bit on this CPU."""
    from transformers import Qwen3VLForConditionalGeneration
    import model as model_lib
    cfg = model_lib.qwen3vl_config("8b", text_layers=1, vision_depth=1, text_overrides=dict(
        hidden_size=256, intermediate_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=1000), vision_overrides=dict(hidden_size=64, intermediate_size=64, num_heads=2))
    model = model_lib.use_plain_layers(Qwen3VLForConditionalGeneration._from_config(cfg)).eval()
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, enable_gqa=False, **kw):
        calls.append((q.dtype, q.shape[1], k.shape[1]))
        out = real(q, k, v, *args, enable_gqa=enable_gqa, **kw)
        if q.shape[-2] > 1 and kw.get("is_causal"):          # the grouped-query call it stands for
            grouped = real(q, k[:, ::q.shape[1] // k.shape[1]], v[:, ::q.shape[1] // k.shape[1]], *args,
                           enable_gqa=True, **kw) if k.shape[1] == q.shape[1] else out
            assert torch.equal(out, grouped)
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    L = 256
    kv = kvcache.GroupKV(model, "cpu", 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        kv.add_prompts(model, [kvcache.Chunk(torch.randint(0, 900, (L,)), torch.zeros(L, dtype=torch.int32))], 0)
    assert calls and all(c[1] == 32 for c in calls)
    for minor in range(9, 15):
        assert {cuda_sdpa_kernel(*c, minor) for c in calls} <= {"flash", "efficient"}, (minor, calls)


# -----------------------------------------------------------------------------
# the packed update at the papers' lengths

@pytest.mark.parametrize("preset, prompt, suffix, G, groups", [
    ("paravt", 16384, 1300, 8, 7),       # a 16k-token overview, sub-agents' summaries: a group packs to ~27k
    ("videoo3", 12288 + 1500, 6000, 16, 4),
])
def test_packed_update_packs_at_the_papers_lengths(preset, prompt, suffix, G, groups):
    """The micro-batches the update forms (grpo.update_micro_batches, as policy_update calls it) with the preset's
    settings, at rows of the papers' lengths: a ParaVT group is one packed row, its prompt run once (before: under
    --micro-batch-tokens 16,384 every row went alone, 5.7x the tokens); Video-o3's rows pack several to a row, within
    packed_tokens, each prompt at most once a row."""
    s = train.grpo_settings(recipes.parse_train_args(["--preset", preset]))
    lengths = [prompt + suffix + 37 * j for g in range(groups) for j in range(G)]
    prompts = [((("prompt", g), ()), prompt, 1) for g in range(groups) for _ in range(G)]
    packed = grpo.update_micro_batches(lengths, s, prompts)
    forwarded = [sum(n - prompt for n in lengths[sl]) + prompt * len({p[0] for p in prompts[sl]}) for sl in packed]
    assert all(f <= s.packed_tokens for f in forwarded)
    once = groups * prompt + sum(n - prompt for n in lengths)
    unpacked = grpo.update_micro_batches(lengths, s, None)
    assert [sl.stop - sl.start for sl in unpacked] == [1] * len(lengths)       # padded rows: one at a time
    ratio = sum(forwarded) / once
    if preset == "paravt":
        assert [sl.stop - sl.start for sl in packed] == [G] * groups and ratio == 1.0
    else:                      # 1-3 rows of a group to a packed row (13.8k + 3 x ~6k): 1.72x each prompt once, not 2.81x
        assert max(sl.stop - sl.start for sl in packed) == 3 and ratio < 1.75 < 2.8 < sum(lengths) / once



# -----------------------------------------------------------------------------
# a step's items: rank 0 deals each trainer its share, point to point on the host

def _deal_rank(rank: int, port: int, out: str) -> None:
    import os
    import pickle
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    runtime.init_process_group(rank, 3, use_cuda=False, timeout_s=120)
    group = dist.new_group([0, 1, 2], backend="gloo")
    pixels = lambda i: torch.full((64, 48), float(i), dtype=torch.bfloat16)       # a trajectory's overview, bf16
    item = lambda i: (types.SimpleNamespace(record_id=f"r{i}", pixels=pixels(i)), 0.5, None)
    steps = {"five": [{"items": [item(i) for i in range(3)]}, {"items": [item(i) for i in range(3, 5)]}],
             "one": [{"items": [item(7)]}]}
    got = {}
    for name, messages in steps.items():
        received = []
        real_recv = dist.recv
        dist.recv = lambda t, *a, **k: received.append(t.numel() * t.element_size()) or real_recv(t, *a, **k)
        mine = async_rl.deal_groups(messages if rank == 0 else None, rank, 3, group)
        dist.recv = real_recv
        whole = len(pickle.dumps([it for m in messages for it in m["items"]]))
        got[name] = {"ids": [t.record_id for t, _, _ in mine], "dtype": str(mine[0][0].pixels.dtype) if mine else None,
                     "received": sum(received),
                     "whole": whole}
    with open(f"{out}/deal{rank}.json", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_trainers_receive_only_their_share(tmp_path):
    """deal_groups on 3 gloo ranks (the trainers' host group): trainer r gets items[r n / 3:(r + 1) n / 3] of the
    step's n in order, pixels as sent (bf16), and fewer bytes than the whole step (before: every item to every
    trainer, over the trainers' NCCL group onto each GPU); a share may be empty (that trainer's update runs
    zero-weight passes on its own filler row)."""
    torch.multiprocessing.spawn(_deal_rank, args=(runtime.find_free_port(), str(tmp_path)), nprocs=3)
    got = [json.loads((tmp_path / f"deal{r}.json").read_text()) for r in range(3)]
    assert [g["five"]["ids"] for g in got] == [["r0"], ["r1", "r2"], ["r3", "r4"]]
    assert {g["five"]["dtype"] for g in got} == {"torch.bfloat16"}
    for g in got[1:]:
        assert 0 < g["five"]["received"] < g["five"]["whole"]
    assert [g["one"]["ids"] for g in got] == [[], [], ["r7"]]
