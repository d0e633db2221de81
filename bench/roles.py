"""
The asynchronous layout's roles, measured from the code: bench/plan.py takes its coefficients from this script's
JSON (`plan.py --roles FILE`; without it, the figures below as measured on 12-07, marked as fallbacks), and
tests/test_plan.py fails when the code's measured coefficient and the plan's differ by more than 15 %.

    python bench/roles.py                     # a cut Qwen3-VL-8B (hidden 1024, 2 layers, Qwen's vocab), bf16
    python bench/roles.py --ci                # small widths, seconds (tests/test_plan.py)
    python bench/roles.py --out roles.json && python bench/plan.py --roles roles.json

Each role is built by the function the run builds it with, at --precision bf16:
  rollout_bytes_per_param    a rollout rank (policy.sampler_model): its weights plus the weight casts autocast keeps
                             through a forward, a parameter (a trainer's fp32 policy used so: policy_as_sampler)
  trainer_bytes_per_param    one trainer (policy.policy_model, unsharded): weights, gradients and AdamW's state after an
                             update, a parameter (FSDP2 divides it by the trainers)
  send_copy_bytes_per_param  rank 0 as sender: the bytes a parameter that cross to its host (async_rl.full_state)
  send_host_bytes_per_param  ... and one version's host buckets in flight (async_rl.broadcast_weights), a parameter
  message_bytes_per_visual_token  a trainer's share of a step's items as async_rl.deal_groups pickles it, per visual
                             token of the distinct videos it holds (the tiny model's rollout, pixels in bf16)
  kv_written_per_read        bytes a decode step's attention writes per bf16 K/V byte it reads (GroupKV on its CUDA
                             path: one layer of Qwen3-VL-8B's 8 K/V heads x 128, 2 prompts, 8 rows each)
Last line: one JSON object.
"""
import argparse
import json
import os
import pickle
import random
import tempfile
import types
import weakref

import torch
from common import print_json  # bench/common.py (puts the repo on sys.path)

import async_rl
import data
import grpo
import kvcache
import model as model_lib
import recipes
import rehearsal
import runtime
import train
import policy
from torch.utils._python_dispatch import TorchDispatchMode


class KeptCasts(TorchDispatchMode):
    """Bytes of the fp32 -> bf16 casts made while active that are still alive (autocast's weight cache)."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and out.dtype == torch.bfloat16:
            self.casts.append((weakref.ref(out), out.numel() * out.element_size()))
        return out

    @property
    def alive(self) -> int:
        return sum(n for ref, n in self.casts if ref() is not None)


class Written(TorchDispatchMode):
    """Bytes the operations write while active (views write nothing)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func.__name__.startswith("_unsafe_view")):
            self.bytes += sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else [out])
                              if isinstance(t, torch.Tensor))
        return out


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def resident(model, precision: str) -> float:
    """Bytes a parameter the model holds through a no-grad forward under the run's autocast: its weights plus the
    casts autocast keeps until the region ends."""
    ids = torch.randint(300, model.get_input_embeddings().weight.shape[0], (1, 32))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad(), policy.autocast(precision, model), KeptCasts() as kept:
        model(input_ids=ids)
        return (weights + kept.alive) / n_params(model)


def trainer_state(model, precision: str) -> float:
    """Bytes a parameter of one trainer after an update: weights, gradients, AdamW's moments."""
    optimizer = policy.make_optimizer(model, 1e-6, 1.0)
    ids = torch.randint(300, model.get_input_embeddings().weight.shape[0], (1, 32))
    with policy.autocast(precision, model):
        loss = model(input_ids=ids).logits.float().mean()
    loss.backward()
    optimizer.step()
    total = sum(p.numel() * p.element_size() + (p.grad.numel() * p.grad.element_size() if p.grad is not None else 0)
                for p in model.parameters())
    total += sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim())
    return total / n_params(model)


def sender(model, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes a parameter crossing to rank 0's host, bytes a parameter of one version's buckets), on a 1-rank group."""
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(runtime.find_free_port()))
    runtime.init_process_group(0, 1, use_cuda=False)
    try:
        full = async_rl.full_state(model, 1, dtype)
        copied = sum(t.numel() * t.element_size() for t in full.values())
        transfer = async_rl.broadcast_weights(model, full, torch.distributed.new_group([0], backend="gloo"), dtype)
        transfer.wait()
        return copied / n_params(model), transfer.bytes / n_params(model)
    finally:
        torch.distributed.destroy_process_group()


def message(cache: str) -> float:
    """Bytes of a trainer's share (deal_groups' pickle, 2 trainers) per visual token of its distinct videos, from one
    RL step of the tiny model sampled by a bf16 rollout rank."""
    args = recipes.parse_train_args(["--precision", "bf16", "--group-size", "4", "--prompts-per-step", "2",
                                     "--max-new-tokens", "48", "--n-train", "8"])
    model, processor = policy.sampler_model("tiny", "cpu", "bf16")
    records, _, root = data.synthetic_data(0, 8, 2, args.task_duration, args.task_mix, cache)
    cfg, s = train.rollout_config_of_args(args), train.grpo_settings(args)
    share = types.SimpleNamespace(seed=0, rank=0, world=1)
    g = grpo.collect_groups(share, model, None, processor, records, root, cfg, s, 1, processor.tokenizer.pad_token_id)
    items = g.items or [(t, 0.0, None) for t in g.trajs]
    mine = items[:max(1, len(items) // 2)]
    merge = model.config.vision_config.spatial_merge_size ** 2
    videos = {id(px): (px, grid) for t, _, _ in mine for x in [t] + t.subagents for px, grid in x.videos}
    tokens = sum(int(grid.prod()) // merge for _, grid in videos.values())
    dtypes = {str(px.dtype) for px, _ in videos.values()}
    assert dtypes == {"torch.bfloat16"}, dtypes
    return len(pickle.dumps((mine, None))) / max(1, tokens)


def kv_written(prompt: int) -> float:
    """Bytes a decode step's attention writes per bf16 K/V byte it reads: GroupKV on its CUDA path (FUSED_CPU off),
    one layer of Qwen3-VL-8B's attention (8 K/V heads x 128, 32 query heads), a bf16 pool, 2 prompts of `prompt`
    tokens forked into 8 rows each, suffixes of 100-400 tokens."""
    from transformers import Qwen3VLForConditionalGeneration
    cfg = model_lib.qwen3vl_config("8b", text_layers=1, vision_depth=1, text_overrides=dict(
        hidden_size=256, intermediate_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=1000), vision_overrides=dict(hidden_size=64, intermediate_size=64, num_heads=2))
    model = model_lib.use_plain_layers(Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)).eval()
    kv = kvcache.GroupKV(model, "cpu", 256)
    rng = random.Random(0)
    chunk = lambda n: kvcache.Chunk(torch.randint(0, 900, (n,)), torch.zeros(n, dtype=torch.int32))
    fused = kvcache.FUSED_CPU
    kvcache.FUSED_CPU = False
    try:
        with torch.no_grad():
            prompts, _ = kv.add_prompts(model, [chunk(prompt) for _ in range(2)], 0)
            rows = [r for p in prompts for r in kv.fork(p, 8)]
            kv.extend(model, rows, [chunk(rng.randint(100, 400)) for _ in rows], 0)
            meter, attend = Written(), kv.attend

            def counted(*a, **k):
                with meter:
                    return attend(*a, **k)
            kv.attend = counted
            kv.step(model, rows, torch.randint(0, 900, (len(rows),)))
    finally:
        kvcache.FUSED_CPU = fused
    visible = sum(kv.prompts[p].length for p in prompts) + sum(kv.rows[r].length for r in rows)
    return meter.bytes / (visible * 8 * 128 * 2 * 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="small widths: seconds (tests/test_plan.py)")
    ap.add_argument("--hidden", type=int, default=1024, help="text hidden size (8B: 4096)")
    ap.add_argument("--mlp", type=int, default=3072, help="text MLP size (8B: 12288)")
    ap.add_argument("--heads", type=int, default=8, help="query heads of 128 (8B: 32; K/V heads stay 8)")
    ap.add_argument("--text-layers", type=int, default=2, help="decoder layers (8B: 36)")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of each prompt in the decode measurement (the "
                    "same with --ci: the figure falls slowly with the prompt, 7.0 at 1,024, 6.7 at 2,048)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.ci:
        args.hidden, args.mlp, args.heads, args.text_layers = 256, 512, 8, 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = argparse.Namespace(hidden=args.hidden, mlp=args.mlp, heads=args.heads, text_layers=args.text_layers,
                               vision_depth=1, vision_width=64, vision_mlp=128)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        rehearsal.build_checkpoint(ckpt, shape)
        sampler, _ = policy.sampler_model(ckpt, "cpu", "bf16")
        out["params"] = n_params(sampler)
        out["rollout_bytes_per_param"] = resident(sampler, "bf16")
        del sampler
        trainer, _ = policy.policy_model(ckpt, "cpu", "bf16", 1)
        out["policy_as_sampler_bytes_per_param"] = resident(trainer, "bf16")
        out["send_copy_bytes_per_param"], out["send_host_bytes_per_param"] = sender(trainer, torch.bfloat16)
        out["trainer_bytes_per_param"] = trainer_state(trainer, "bf16")
        del trainer
        out["message_bytes_per_visual_token"] = message(os.path.join(tmp, "cache"))
    out["kv_written_per_read"] = kv_written(args.prompt)
    out.update(ci=args.ci, hidden=args.hidden, text_layers=args.text_layers, precision="bf16")
    for k, v in out.items():
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    print_json(out)


if __name__ == "__main__":
    main()
