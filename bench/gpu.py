"""The prepared GPU run: one script, one H200, random weights at the Qwen3-VL-8B config (model.qwen3vl_config) with
the real tokenizer (model.qwen_tokenizer); and the same code at 2 layers and tiny sizes on CPU (`--dry-run`, run in
CI by tests/test_engine_gpu_dryrun.py).

    python bench/gpu.py --out docs/gpu_h200.json    # on the GPU machine (~10 min)
    python bench/gpu.py --dry-run                   # CPU, a few minutes (the rehearsal --ci: ~1 min of it)

Sections (each prints a line and lands in the last-line JSON):
1. prefill    GroupKV prefill of a 64- and a 768-frame overview (tokens, seconds, tokens/s, peak memory)
2. rollout    run_agent on 8 prompts x group 8 x 3 tool turns, interleaved and sub-agent modes; the sampler runs
              (its cost counted) and its draws are replaced by a scripted crop_video turn (random weights never
              call a tool): tokens/s, peak memory, host syncs per decode step (runtime.HostSyncCounter on a
              group-2 rerun of one prompt)
3. loss       bench/logprob_bench.py in its own process: the fused gather (ops.token_logprobs) vs naive logits ->
              log_softmax at 16k tokens, the 8B widths and vocabulary, bf16
4. rehearsal  bench/rehearsal.py in its own process: the paravt RL step (both tool modes), its update and SFT step
              through train.py's own one-GPU path, at the 8B widths, 4 decoder layers, the 27-block vision tower, a
              1280x720 video (~16k overview tokens), each part's peak memory beside bench/plan.py's projection
              (dry run: --ci on CPU)
5. pytest     `pytest -m gpu` (dry run: collection only)
"""
import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time

import torch
from common import ROOT  # the repo root (bench/common.py also puts it on sys.path)
from engines import STATS, Timed, swapped  # bench/engines.py: the engine counting its decode steps

import data
import kvcache
import rollout
import runtime
from model import ModelConfig, build_tiny, cast_parameters, special_token_ids


def timed_on(device, fn) -> tuple[float, object]:
    """(seconds, fn()); on CUDA synchronised, and the peak memory (`peak_mb`) counted from this call."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def peak_mb(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else None


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
        with torch.no_grad():        # the pool's allocation counted too (its peak, its time)
            s, _ = timed_on(device, lambda: kvcache.GroupKV(model, device, kvcache.blocks_for(len(chunk.ids)))
                            .add_prompts(model, [chunk], pad))
        res[f"frames{frames}"] = dict(tokens=len(chunk.ids), seconds=s, tok_s=len(chunk.ids) / s, peak_mb=peak_mb(device))
    return res


def section_rollout(model, processor, root, recs, args, device) -> dict:
    res = {}
    for mode in ("interleaved", "subagent"):
        cfg = rollout.RolloutConfig(tool_mode=mode, max_turns=3, max_new_tokens=args.new_tokens, temperature=0.7,
                                    group_size=args.group, overview_nframes=args.rollout_frames,
                                    overview_max_pixels=args.frame_pixels, crop_max_pixels=args.frame_pixels,
                                    subagent_max_pixels=args.frame_pixels, subagent_max_new_tokens=args.new_tokens)
        rollout.sample_tokens = ToolScript(processor, recs[0]["duration"], device)
        try:
            s, out = timed_on(device, lambda: rollout.run_agent(model, processor, recs[:args.prompts], root, cfg, seed=0))
            # host syncs as they happen (HostSyncCounter hooks every torch call: not timed), one prompt, group 2
            counted = STATS["decode_steps"]
            with runtime.HostSyncCounter(device) as syncs, swapped(Timed):
                rollout.run_agent(model, processor, recs[:1], root, dataclasses.replace(cfg, group_size=2), seed=0)
            counted = STATS["decode_steps"] - counted
        finally:
            rollout.sample_tokens = rollout.sample_tokens.sample
        sampled = sum(t.draws + sum(st.draws for st in t.subagents) for t in out)
        res[mode] = dict(trajectories=len(out), tool_turns=sum(t.n_tool_turns for t in out), sampled_tokens=sampled,
                         seconds=s, tok_s=sampled / s, peak_mb=peak_mb(device),
                         host_syncs_per_step=syncs.in_steps / max(1, counted),
                         host_syncs_outside_steps=syncs.count - syncs.in_steps,
                         errors=sum(t.error is not None for t in out))
    return res


def bench_json(script: str, *flags: str) -> dict:
    """Another bench script run in a process of its own: its last-line JSON, or its exit code and the tail of its
    errors."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *flags], cwd=str(ROOT), capture_output=True,
                       text=True)
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
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
    torch.manual_seed(0)
    out = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dry_run=small)
    model, processor = build(args, device)
    with tempfile.TemporaryDirectory() as root:
        recs = data.make_split(root, max(args.prompts, 1), seed=0, duration=64.0)
        out["prefill"] = section_prefill(model, processor, root, recs[0], args, device)
        print("prefill", json.dumps(out["prefill"]), flush=True)
        out["rollout"] = section_rollout(model, processor, root, recs, args, device)
        print("rollout", json.dumps(out["rollout"]), flush=True)
    # bench/logprob_bench.py: naive vs fused at 16k tokens of the 8B widths and vocabulary, bf16 (dry run: tiny, CPU)
    loss = (["--n", "512", "--d", "64", "--vocab", "4096", "--device", "cpu", "--no-compile"] if small
            else ["--n", "16384", "--device", "cuda", "--dtype", "bfloat16"])
    out["loss"] = bench_json("logprob_bench.py", "--methods", "naive,fused", "--repeats", "1", *loss)
    print("loss", json.dumps(out["loss"].get("ratios", out["loss"])), flush=True)
    # bench/rehearsal.py on one GPU at the 8B widths, 4 decoder layers (dry run: its --ci sizes on CPU)
    out["rehearsal"] = bench_json("rehearsal.py", "--ranks", "1", *(["--ci"] if small else [
        "--device", "cuda", "--hidden", "4096", "--mlp", "12288", "--heads", "32", "--text-layers", "4",
        "--vision-depth", "27", "--threads", "8"]))
    out["rehearsal"].pop("per_rank", None)
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
