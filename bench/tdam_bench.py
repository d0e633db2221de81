"""
TDAM at the papers' lengths: one forward + backward of a small Qwen3-VL decoder with Video-o3's TDAM, the dense
(B, 1, L, L) additive mask through SDPA (what train.py built before) vs `ops.tdam_attention` (query blocks,
masks from the rule rectangles, scores recomputed in backward), at L = 16,384 tokens by default.

Each side runs in its own process, so one side's freed memory cannot hide the other's peak; peak memory is
the resident memory above the level after the model is built (bench/common.PeakRSS). The sequence is a
Video-o3-like layout: a 4,096-token overview, two tool calls each followed by a 1,024-token clip, an answer.

    python bench/tdam_bench.py                       # L = 16,384, 1 decoder layer of the tiny model's widths
    python bench/tdam_bench.py --length 4096 --layers 2

Last line: one JSON object with each side's seconds and peak MB and the ratios.
"""
import argparse
import json
import subprocess
import sys
import time

import torch
from common import PeakRSS, print_json, set_threads, table  # bench/common.py (puts the repo on sys.path)

import model as model_lib
import ops
import train


def layout(L: int) -> dict:
    """Spans of a Video-o3-like trajectory of L tokens (the proportions of a 16k-token one)."""
    f = L / 16384
    at = lambda x: int(x * f)
    return dict(overview=(at(200), at(4296)), calls=[(at(4400), at(4460)), (at(5600), at(5660))],
                obs=[(at(4500), at(5524)), (at(5700), at(6724))], answer=(at(16000), L))


def side(name: str, L: int, layers: int, block: int) -> dict:
    torch.manual_seed(0)
    cfg = model_lib.ModelConfig(layers=layers)
    model, _ = model_lib.build_tiny(cfg, seed=0)
    lm = model.model.language_model
    sp = layout(L)
    ids = torch.randint(0, 1000, (1, L))
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        kw = dict(input_ids=ids, use_cache=False)
        if name == "dense":
            allowed = ops.tdam_mask(L, sp["overview"], sp["answer"], sp["calls"], sp["obs"])
            kw["attention_mask"] = ops.to_additive_mask(allowed)
            lm.config._attn_implementation = "sdpa"
        else:
            spec = ops.TdamSpec(torch.tensor([L]), torch.tensor(
                [ops.tdam_rects(L, sp["overview"], sp["answer"], sp["calls"], sp["obs"])]), block=block)
            kw["tdam"] = spec
            lm.config._attn_implementation = "paravt_tdam"
        hidden = lm(**kw).last_hidden_state
        hidden.float().pow(2).mean().backward()
        seconds = time.perf_counter() - t0
    grad = torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])
    return dict(side=name, seconds=seconds, peak_mb=mem.mb, grad_norm=float(grad.norm()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384, help="tokens in the sequence")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the tiny model's widths")
    p.add_argument("--block", type=int, default=256, help="query rows per block of tdam_attention")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--side", choices=("dense", "blocked"), default=None, help="(internal) run one side")
    args = p.parse_args()
    set_threads(args.threads)
    if args.side:
        print(json.dumps(side(args.side, args.length, args.layers, args.block)))
        return
    res = {}
    for name in ("dense", "blocked"):
        cmd = [sys.executable, __file__, "--side", name, "--length", str(args.length), "--layers", str(args.layers),
               "--block", str(args.block), "--threads", str(args.threads)]
        res[name] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    d, b = res["dense"], res["blocked"]
    print(table([[n, f"{r['seconds']:.1f}", f"{r['peak_mb']:.0f}", f"{r['grad_norm']:.6g}"] for n, r in res.items()],
                ["TDAM form", "fwd+bwd s", "peak MB", "grad norm"]))
    print_json(dict(length=args.length, layers=args.layers, block=args.block, dense=d, blocked=b,
                    memory_ratio=d["peak_mb"] / b["peak_mb"], time_ratio=b["seconds"] / d["seconds"],
                    grad_rel_diff=abs(d["grad_norm"] - b["grad_norm"]) / d["grad_norm"]))


if __name__ == "__main__":
    main()
