"""Real shapes at the published Qwen3-VL-8B widths: the episode of tests/test_real_shapes.py (real video,
Qwen's tokenizer, a scripted parallel call in each tool mode, one GRPO forward/backward, one SFT step
under a text-derived TDAM mask) on a random-weight Qwen3-VL from model.qwen3vl_config("8b") with only
the depth cut, side by side with the CI test's cut widths, in one run.

    python bench/real_shapes.py                          # CPU: several minutes, ~8 GB of RAM
    python bench/real_shapes.py --max-pixels 0 --text-layers 2 --device cuda

Sides: "ci"  = the CI test's model (text hidden 256, MLP 512; every other width published);
       "8b"  = hidden 4096, MLP 12288, 32/8 heads x 128, vocab 151,936, vision 1152 x 4304, all published.
Both: --text-layers decoder layers (default 3: deepstack taps on layers 0 and 1), --vision-depth vision
blocks (default 2), bf16, ParaVT's 64-frame overview of shared/real_videos/nasa_13013.mp4 at --max-pixels
per frame (default 64*64 as in CI; 0 = the rollout's own budget, ~16k visual tokens over the overview).
Per side: build seconds, each mode's rollout seconds, the largest gap between a log-prob recorded at
sampling time (KV cache) and the full forward's, GRPO forward+backward seconds over both episodes,
SFT step seconds, sequence lengths, and the process's peak RSS during the side (VmHWM, reset between
sides through /proc/self/clear_refs; Linux only, else the run's peak). Ratios are 8b / ci.
The last line printed is one JSON object.
"""
import argparse
import dataclasses
import gc
import time

import torch
from common import print_json, set_threads, table  # bench/common.py (puts the repo on sys.path)

import model as model_lib
import ops
import rollout
import train
from tests.test_real_shapes import CI_TEXT, REAL, RECORD, Scripted, mode_rollout_config, text_tdam


def peak_rss_gb(reset: bool = False) -> float:
    """Peak resident set size of this process in GB (VmHWM); reset=True restarts the peak (Linux)."""
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return float("nan")


def run_side(name: str, text_overrides: dict, args) -> dict:
    peak_rss_gb(reset=True)
    t0 = time.perf_counter()
    config = model_lib.qwen3vl_config("8b", text_layers=args.text_layers, vision_depth=args.vision_depth,
                                      text_overrides=text_overrides)
    model, processor = model_lib.build_qwen3vl(config, dtype=torch.bfloat16, seed=0)
    model.to(args.device)
    out = dict(side=name, params=model_lib.count_parameters(model), build_s=time.perf_counter() - t0)
    tok = processor.tokenizer
    trajs = {}
    for mode in ("interleaved", "subagent"):
        cfg = mode_rollout_config(mode)
        if args.max_pixels != 64 * 64:
            cfg = dataclasses.replace(cfg, overview_max_pixels=args.max_pixels or None,
                                      crop_max_pixels=args.max_pixels or None)
        rollout.sample_tokens = Scripted(tok)
        set_threads(1 if args.device == "cpu" else 0)
        t0 = time.perf_counter()
        [trajs[mode]] = rollout.run_agent(model, processor, [RECORD], str(REAL), cfg, seed=0)
        out[f"rollout_{mode}_s"] = time.perf_counter() - t0
        t = trajs[mode]
        if t.error or t.answer != "A" or t.n_calls != 2:
            raise RuntimeError(f"{name}/{mode}: the scripted episode did not run: error={t.error} "
                               f"answer={t.answer} calls={t.n_calls}")
        out[f"tokens_{mode}"] = len(t.token_ids)
    set_threads(args.threads)
    model.train()
    batch = rollout.collate(list(trajs.values()), model, tok.pad_token_id)
    t0 = time.perf_counter()
    lp = train.forward_logprobs(model, batch, chunk_size=1024, compile=False)
    mask = (batch["roles"][:, 1:] == rollout.POLICY).to(lp.device)
    out["logprob_max_abs_diff"] = max(float((lp[b][mask[b]].detach().cpu() - torch.tensor(t.logprobs)).abs().max())
                                      for b, t in enumerate(trajs.values()))   # sampling time vs full forward
    adv = torch.tensor([[1.0], [-1.0]], device=lp.device).expand_as(lp)
    loss, _ = train.grpo_loss_on_logprobs(lp, lp.detach(), adv, mask.float(), clip_low=0.2, clip_high=0.28)
    loss.backward()
    out["grpo_fwd_bwd_s"] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    t = trajs["interleaved"]
    one = rollout.collate([t], model, tok.pad_token_id)
    mask4 = ops.to_additive_mask(text_tdam(tok, t.token_ids, t.prompt_len), torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    sft, _ = train.sft_loss(model, one, chunk_size=1024, attn_mask_4d=mask4, compile=False)
    sft.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["sft_step_s"] = time.perf_counter() - t0
    out["sft_loss"] = float(sft.detach())
    out["peak_rss_gb"] = peak_rss_gb()
    if args.device == "cuda":
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        torch.cuda.reset_peak_memory_stats()
    del model, processor, opt, lp, loss, sft
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text-layers", type=int, default=3)
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--max-pixels", type=int, default=64 * 64, help="per overview/crop frame; 0 = rollout default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sides", default="ci,8b")
    args = ap.parse_args()
    set_threads(args.threads)
    sides = {"ci": CI_TEXT, "8b": {}}
    results = {s: run_side(s, sides[s], args) for s in args.sides.split(",")}
    keys = [k for k in results[next(iter(results))] if k != "side"]
    print(table([[k, *[results[s].get(k) for s in results]] for k in keys], ["figure", *results]))
    summary = dict(text_layers=args.text_layers, vision_depth=args.vision_depth, max_pixels=args.max_pixels,
                   device=args.device, threads=args.threads, **{s: r for s, r in results.items()})
    if "ci" in results and "8b" in results:
        summary["ratio_8b_over_ci"] = {k: results["8b"][k] / results["ci"][k] for k in keys
                                       if isinstance(results["ci"][k], (int, float)) and results["ci"][k]}
    print_json(summary)


if __name__ == "__main__":
    main()
