"""
TDAM at the papers' lengths: one forward + backward of a small Qwen3-VL decoder at L = 16,384 tokens, three ways:
  causal  plain causal attention, the model's default (SDPA with is_causal, no mask tensor): the time to match
  dense   TDAM as a dense (1, 1, L, L) additive mask through SDPA (what train.py built before)
  tdam    TDAM through `ops.tdam_attention` (block-sparse tiles; on the CPU its "blocked" kernel)
on a Video-o3-like layout (a 4,096-token overview, two calls each followed by a 1,024-token clip, an answer), each
run of a side in its own process (a warm-up, one timed pass; peak RSS above the built model), interleaved --repeats
times, medians; the dense and tdam gradients compared. Last line: one JSON object (time_vs_causal: target <= 1.5).

    python bench/tdam_bench.py                             # L = 16,384, 1 decoder layer of the tiny model's widths
    python bench/tdam_bench.py --length 4096 --layers 2
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from common import PeakRSS, median, print_json, set_threads, table  # bench/common.py (puts the repo on sys.path)

import model as model_lib
import ops
import sft

SIDES = ("causal", "dense", "tdam")


def layout(L: int) -> dict:
    """Spans of a Video-o3-like trajectory of L tokens (the proportions of a 16k-token one)."""
    f = L / 16384
    at = lambda x: int(x * f)
    return dict(overview=(at(200), at(4296)), calls=[(at(4400), at(4460)), (at(5600), at(5660))],
                obs=[(at(4500), at(5524)), (at(5700), at(6724))], answer=(at(16000), L))


def side(name: str, L: int, layers: int, block: int, grad_file: str | None) -> dict:
    """One warm-up and one timed forward + backward of side `name`; the gradients saved to grad_file if given."""
    torch.manual_seed(0)
    model, _ = model_lib.build_tiny(model_lib.ModelConfig(layers=layers), seed=0)
    lm = model.model.language_model
    sp = layout(L)
    ids = torch.randint(0, 1000, (1, L))
    rects = sft.tdam_rects(L, sp["overview"], sp["answer"], sp["calls"], sp["obs"])

    def step():
        kw = dict(input_ids=ids, use_cache=False)
        if name == "dense":            # built in the step: the dense path builds its mask every batch
            kw["attention_mask"] = ops.to_additive_mask(sft.tdam_mask(L, sp["overview"], sp["answer"], sp["calls"],
                                                                      sp["obs"]))
        elif name == "tdam":
            kw["tdam"] = ops.TdamSpec(torch.tensor([L]), torch.tensor([rects]), block=block)
        model.zero_grad(set_to_none=True)
        lm(**kw).last_hidden_state.float().pow(2).mean().backward()

    with PeakRSS() as mem:
        step()
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if grad_file:
        torch.save(torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None]), grad_file)
    return dict(side=name, seconds=wall, cpu_seconds=cpu, peak_mb=mem.mb)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384, help="tokens in the sequence")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the tiny model's widths")
    p.add_argument("--block", type=int, default=256, help="tile side of tdam_attention (TdamSpec.block)")
    p.add_argument("--repeats", type=int, default=3, help="processes per side, run interleaved")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side in this process")
    p.add_argument("--grad-file", default=None, help="(internal) save the side's gradients here")
    args = p.parse_args()
    set_threads(args.threads)
    if args.side:
        print(json.dumps(side(args.side, args.length, args.layers, args.block, args.grad_file)))
        return
    runs = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        grads = {name: os.path.join(tmp, f"{name}.pt") for name in ("dense", "tdam")}
        for r in range(args.repeats):
            for name in SIDES:
                grad = ["--grad-file", grads[name]] if r == 0 and name in grads else []     # saved once
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", name, *grad],
                                     capture_output=True, text=True, check=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
        dense_grad, tdam_grad = torch.load(grads["dense"]), torch.load(grads["tdam"])
    res = {name: {k: median([r[k] for r in rs]) for k in ("seconds", "cpu_seconds", "peak_mb")} for name, rs in runs.items()}
    c, d, t = res["causal"], res["dense"], res["tdam"]
    print(table([[n, r["seconds"], r["cpu_seconds"], r["peak_mb"], r["seconds"] / c["seconds"]] for n, r in res.items()],
                ["attention", "fwd+bwd s", "CPU s", "peak MB", "x causal"]))
    print_json(dict(length=args.length, layers=args.layers, block=args.block, threads=args.threads,
                    repeats=args.repeats, causal=c, dense=d, tdam=t,
                    time_vs_causal=t["seconds"] / c["seconds"], cpu_time_vs_causal=t["cpu_seconds"] / c["cpu_seconds"],
                    time_vs_dense=t["seconds"] / d["seconds"], memory_ratio=d["peak_mb"] / t["peak_mb"],
                    grad_max_diff=float((tdam_grad - dense_grad).abs().max() / dense_grad.abs().max())))


if __name__ == "__main__":
    main()
