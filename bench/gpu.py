"""The prepared GPU run: one script, one H200, random weights at the Qwen3-VL-8B config with the real
tokenizer; and the same code at 2 layers and tiny sizes on CPU (`--dry-run`, run in CI by
tests/test_engine_gpu_dryrun.py).

    python bench/gpu.py --out docs/gpu_h200.json    # on the GPU machine (~10 min)
    python bench/gpu.py --dry-run                   # CPU, a few minutes (the rehearsal --ci: ~1 min of it)

Sections (each prints a line and lands in the last-line JSON):
1. prefill    GroupKV prefill of a 64- and a 768-frame overview (tokens, seconds, tokens/s, peak memory)
2. rollout    run_agent on 8 prompts x group 8 x 3 tool turns, interleaved and sub-agent modes. The random
              weights never write a tool call, so the sampler runs as always (on the device, its cost
              counted) and its draws are then replaced by a scripted turn that calls crop_video
              (tokens/s over sampled tokens, peak memory, host syncs per decode step: measured by
              runtime.HostSyncCounter on a group-2 rerun of one prompt)
3. train      one PARA-GRPO update on the rollout: FSDP2 (fully_shard per decoder layer) on one rank,
              gradient checkpointing, bf16, rollout.shared_video_hidden_states (vision once per prompt), grpo_loss, AdamW
4. loss       ops.token_loss (fused, chunked) vs naive logits -> log_softmax at 16k tokens, bf16
5. rehearsal  bench/rehearsal.py on this GPU: one RL step (both tool modes, two rounds of two parallel crops) and one
              SFT step (TDAM, gradient checkpointing) of the paravt preset at the 8B widths (hidden 4096, MLP 12288,
              32 / 8 heads x 128, the published 27-block vision tower), 4 decoder layers, a 1280x720 video (the
              64-frame overview: ~16k tokens), --precision bf16, one process; peak memory per part beside
              bench/plan.py's projection (dry run: its --ci sizes on CPU, one process). Run as its own process:
              its JSON, or its exit code and the tail of its errors, land here
6. pytest     `pytest -m gpu` (dry run: collection only)
The 8B config and real tokenizer come from model.qwen3vl_config / model.qwen_tokenizer.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from common import ROOT  # the repo root (bench/common.py also puts it on sys.path)

import data
import kvcache
import ops
import rollout
import runtime
import train
from model import ModelConfig, build_tiny, cast_parameters, special_token_ids


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_mb(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build(args, device):
    """(model, processor): tiny 2-layer shapes on --dry-run, else the 8B config with the real tokenizer."""
    if args.dry_run:
        model, processor = build_tiny(ModelConfig(layers=2), corpus=rollout.prompt_corpus())
        return model.to(device), processor
    from transformers import Qwen3VLForConditionalGeneration

    from model import qwen3vl_config, qwen_tokenizer, use_linear_patch_embed
    config, processor = qwen3vl_config("8b"), qwen_tokenizer()
    with torch.device(device):
        model = use_linear_patch_embed(Qwen3VLForConditionalGeneration(config))
    return cast_parameters(model, torch.bfloat16).eval(), processor   # rotary inv_freq stays fp32


class ToolScript:
    """Runs the real sampler, then replaces each row's draw by the next token of a scripted turn: a
    crop_video call in every turn (the forced-answer turn included), so every row takes all its turns. On the
    device, by each row's draw counter (its k-th draw: token k of the script, cyclically): no host sync of its own,
    so the rollout's measured syncs are the engine's."""

    def __init__(self, processor, duration: float, device):
        tok = processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        text = ("look closer\n</think>\n<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": "
                f"{duration / 4:.1f}, \"end_time\": {duration / 2:.1f}}}}}\n</tool_call>")
        self.toks = torch.tensor(tok(text, add_special_tokens=False)["input_ids"] + [end], device=device)
        self.sample = rollout.sample_tokens

    def __call__(self, logits, seeds, counters, temperature, top_p):
        self.sample(logits, seeds, counters, temperature, top_p)             # the real cost, on the device
        return self.toks[counters % len(self.toks)]


def section_prefill(model, processor, root, rec, args, device) -> dict:
    res = {}
    pad = special_token_ids(processor)["<|endoftext|>"]
    for frames in args.prefill_frames:
        cfg = rollout.RolloutConfig(overview_nframes=frames, overview_max_pixels=args.frame_pixels, tools_block=True)
        _, _, chunk, _ = rollout.encode_prompt(processor, rec, root, cfg)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            kv = kvcache.GroupKV(model, device, kvcache.blocks_for(len(chunk.ids)))
            kv.add_prompts(model, [chunk], pad)
        sync(device)
        s = time.perf_counter() - t0
        res[f"frames{frames}"] = dict(tokens=len(chunk.ids), seconds=s, tok_s=len(chunk.ids) / s, peak_mb=peak_mb(device))
        del kv
    return res


def section_rollout(model, processor, root, recs, args, device) -> tuple[dict, list]:
    res, trajs = {}, None
    for mode in ("interleaved", "subagent"):
        cfg = rollout.RolloutConfig(tool_mode=mode, max_turns=3, max_new_tokens=args.new_tokens, temperature=0.7,
                                    group_size=args.group, overview_nframes=args.rollout_frames,
                                    overview_max_pixels=args.frame_pixels, crop_max_pixels=args.frame_pixels,
                                    subagent_max_pixels=args.frame_pixels, subagent_max_new_tokens=args.new_tokens)
        rollout.sample_tokens = ToolScript(processor, recs[0]["duration"], device)
        try:
            reset_peak(device)
            sync(device)
            t0 = time.perf_counter()
            out = rollout.run_agent(model, processor, recs[:args.prompts], root, cfg, seed=0)
            sync(device)
            s = time.perf_counter() - t0
            # the host syncs as they happen (runtime.HostSyncCounter: a Python hook on every torch call, so not in
            # the timed run): one prompt of the same rollout, group 2
            counted = rollout.STATS["decode_steps"]
            with runtime.HostSyncCounter(device) as syncs:
                rollout.run_agent(model, processor, recs[:1], root, dataclasses.replace(cfg, group_size=2), seed=0)
            counted = rollout.STATS["decode_steps"] - counted
        finally:
            rollout.sample_tokens = rollout.sample_tokens.sample
        sampled = sum(len(t.logprobs) + sum(len(st.logprobs) for st in t.subagents) for t in out)
        res[mode] = dict(trajectories=len(out), tool_turns=sum(t.n_tool_turns for t in out), sampled_tokens=sampled,
                         seconds=s, tok_s=sampled / s, peak_mb=peak_mb(device),
                         host_syncs_per_step=syncs.in_steps / max(1, counted),
                         host_syncs_outside_steps=syncs.count - syncs.in_steps,
                         errors=sum(t.error is not None for t in out))
        if mode == "interleaved":
            trajs = out
    return res, trajs


def section_train(model, processor, trajs, args, device) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        runtime.init_process_group(0, 1, use_cuda=device.type == "cuda")
    model.train()
    model.gradient_checkpointing_enable()
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard([model.model.language_model.norm, model.lm_head])
    fully_shard(model.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pad = special_token_ids(processor)["<|endoftext|>"]
    trajs = [t for t in trajs if t.error is None][:args.train_rows]
    batch = rollout.collate(trajs, model, pad, share_videos=True)
    roles = batch.pop("roles")
    batch = {k: v.to(device) for k, v in batch.items()}
    if "pixel_values_videos" in batch:
        batch["pixel_values_videos"] = batch["pixel_values_videos"].to(torch.bfloat16 if not args.dry_run else torch.float32)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    hidden = rollout.shared_video_hidden_states(model, batch)[:, :-1]
    targets = batch["input_ids"][:, 1:]
    policy = (roles[:, 1:] == rollout.POLICY).to(device)
    model.lm_head.unshard()                  # FSDP: its weight is read directly, as train.forward_logprobs does
    lp = torch.zeros(targets.shape, device=device)
    lp[policy] = ops.token_logprobs(hidden[policy], model.lm_head.weight, targets[policy], compile=False)
    mask = policy.float()
    adv = torch.linspace(-1, 1, len(trajs), device=device)
    loss, _ = train.grpo_loss_on_logprobs(lp, lp.detach(), adv, mask)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    s = time.perf_counter() - t0
    return dict(rows=len(trajs), tokens=int(batch["attention_mask"].sum()), seconds=s, peak_mb=peak_mb(device),
                loss=float(loss.detach()))


def section_loss(model, args, device) -> dict:
    D, V = model.lm_head.weight.shape[1], model.lm_head.weight.shape[0]
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.loss_tokens, D, device=device, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(V, D, device=device, dtype=dtype, generator=g) * 0.02
    t = torch.randint(0, V, (args.loss_tokens,), device=device, generator=g)
    fused_fn = lambda: ops.token_loss(h, w, t, lambda lp, rows: -lp.sum())
    naive_fn = lambda: -torch.log_softmax((h @ w.T).float(), -1).gather(-1, t[:, None]).sum()
    res = {}
    for name, fn in (("fused", fused_fn), ("naive", naive_fn)):
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        try:
            fn().backward()
            sync(device)
            res[name] = dict(seconds=time.perf_counter() - t0, peak_mb=peak_mb(device))
        except torch.OutOfMemoryError:
            res[name] = dict(error="out of memory")
        h.grad = None
    res["tokens"] = args.loss_tokens
    return res


def section_rehearsal(small: bool) -> dict:
    """bench/rehearsal.py in a process of its own (one GPU, the 8B widths at 4 layers; dry run: --ci on CPU)."""
    sizes = ["--ci"] if small else ["--device", "cuda", "--hidden", "4096", "--mlp", "12288", "--heads", "32",
                                    "--text-layers", "4", "--vision-depth", "27", "--threads", "8"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rehearsal.json")
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "rehearsal.py"), "--ranks", "1", *sizes, "--out", path],
                           cwd=str(ROOT), capture_output=True, text=True)
        if r.returncode == 0:
            return {k: v for k, v in json.load(open(path)).items() if k != "per_rank"}
    return dict(returncode=r.returncode, stderr_tail=r.stderr.strip().splitlines()[-12:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, 2 layers, tiny sizes: the same code end to end")
    p.add_argument("--out", help="also write the JSON here (e.g. docs/gpu_h200.json)")
    args = p.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if not args.dry_run and device.type != "cuda":
        sys.exit("bench/gpu.py: no CUDA device; use --dry-run on CPU")
    small = args.dry_run
    args.prefill_frames = [4, 8] if small else [64, 768]
    args.frame_pixels = 64 * 64 if small else None
    args.rollout_frames = 4 if small else 64
    args.prompts, args.group = (2, 2) if small else (8, 8)
    args.new_tokens = 64 if small else 512     # the scripted tool turn is ~40 tokens
    args.train_rows = 4 if small else 16
    args.loss_tokens = 512 if small else 16384
    torch.manual_seed(0)
    out = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dry_run=small)
    model, processor = build(args, device)
    with tempfile.TemporaryDirectory() as root:
        recs = data.make_split(root, max(args.prompts, 1), seed=0)
        out["prefill"] = section_prefill(model, processor, root, recs[0], args, device)
        print("prefill", json.dumps(out["prefill"]), flush=True)
        out["rollout"], trajs = section_rollout(model, processor, root, recs, args, device)
        print("rollout", json.dumps(out["rollout"]), flush=True)
    out["loss"] = section_loss(model, args, device)
    print("loss", json.dumps(out["loss"]), flush=True)
    out["train"] = section_train(model, processor, trajs, args, device)
    print("train", json.dumps(out["train"]), flush=True)
    out["rehearsal"] = section_rehearsal(small)
    print("rehearsal", json.dumps(out["rehearsal"].get("parts", out["rehearsal"])), flush=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q"] + (["--collect-only"] if small else [])
    r = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True)
    out["pytest_gpu"] = dict(returncode=r.returncode, tail=r.stdout.strip().splitlines()[-1:] or [""])
    print("pytest -m gpu:", out["pytest_gpu"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
