"""
Benchmark: the three GEMMs of the fused loss on one chunk of C tokens, token-major vs vocab-major, beside the
same GEMMs over the whole batch of N tokens (what the naive path runs).

    token-major   logits (C, V) = h_c W^T      grad_h (C, D) = G W          grad_W += G^T h_c
    vocab-major   logits^T (V, C) = W h_c^T    grad_h^T (D, C) = W^T G^T    grad_W += G^T h_c   (G^T is the buffer)
    whole         logits (N, V) = h W^T        grad_h (N, D) = G W          grad_W = G^T h

The figures are seconds for N tokens: a chunk GEMM's time x N / C, so the three columns compare directly.
Beside the vocab-major GEMMs: the two compiled softmax passes of a chunk (ops._chunk_logprobs and
ops._chunk_grad_logits_, at T = 0.7), the only other work of token_loss per chunk.
ops.token_loss and ops.token_logprobs use the vocab-major layout because of this measurement (see the
"Layout" note in train.py).

    python bench/chunk_layout.py                      # N 1,024, D 4,096, V 151,936, C 128 / 256 / 512, fp32
    python bench/chunk_layout.py --vocab 32000 --n 512 --chunks 64,128

Each figure is the median of --repeats calls after one untimed call; the token-major and vocab-major calls of a
GEMM run interleaved (bench/common.ab_times). The last line of output is one JSON object.
"""
import argparse

import torch
from common import ab_times, median, print_json  # (common puts the repo root on sys.path)

import ops
import train


def seconds(sides: dict, repeats: int) -> dict:
    """Median wall seconds of each side's call, the sides interleaved after one untimed call each."""
    wall, _ = ab_times(sides, repeats)
    return {name: median(times) for name, times in wall.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1024, help="tokens (N)")
    p.add_argument("--d", type=int, default=4096, help="hidden size (D)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary (V)")
    p.add_argument("--chunks", default="128,256,512", help="chunk sizes C to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    n, d, v = args.n, args.d, args.vocab
    h, w = torch.randn(n, d), torch.randn(v, d) * d ** -0.5
    grad_w = torch.zeros(v, d)

    logits, grad_h = torch.empty(n, v), torch.empty(n, d)
    whole = seconds({"logits": lambda: torch.mm(h, w.T, out=logits),
                     "grad_h": lambda: torch.mm(logits, w, out=grad_h),
                     "grad_w": lambda: torch.mm(logits.T, h, out=grad_w)}, args.repeats)
    del logits
    whole["total"] = sum(whole.values())
    print(f"whole N = {n}: " + "  ".join(f"{k} {s:6.2f} s" for k, s in whole.items()), flush=True)

    results = {}
    for c in map(int, args.chunks.split(",")):
        h_c, scale = h[:c].contiguous(), n / c
        buf, buf_t = torch.empty(c, v), torch.empty(v, c)
        gh, gh_t = torch.empty(c, d), torch.empty(d, c)
        pairs = {"logits": (lambda: torch.mm(h_c, w.T, out=buf), lambda: torch.mm(w, h_c.T, out=buf_t)),
                 "grad_h": (lambda: torch.mm(buf, w, out=gh), lambda: torch.mm(w.T, buf_t, out=gh_t)),
                 "grad_w": (lambda: grad_w.addmm_(buf.T, h_c), lambda: grad_w.addmm_(buf_t, h_c))}
        token, vocab = {}, {}
        for gemm, (token_fn, vocab_fn) in pairs.items():
            t = seconds({"token": token_fn, "vocab": vocab_fn}, args.repeats)
            token[gemm], vocab[gemm] = t["token"] * scale, t["vocab"] * scale
        for layout in (token, vocab):
            layout["total"] = sum(layout.values())
        targets, grad_out = torch.randint(0, v, (c,)), torch.randn(c)
        forward_kernel = ops._kernel(ops._chunk_logprobs, True)
        grad_kernel = ops._kernel(ops._chunk_grad_logits_, True)
        torch.mm(w, h_c.T, out=buf_t)
        lse = forward_kernel(buf_t, targets, 0.7)[1]
        passes = seconds({"forward": lambda: forward_kernel(buf_t, targets, 0.7),
                          "grad": lambda: grad_kernel(buf_t, targets, lse, grad_out, 0.7)}, args.repeats)
        vocab["softmax_passes"] = (passes["forward"] + passes["grad"]) * scale
        results[c] = {"token_major": token, "vocab_major": vocab,
                      "token_major_over_whole": token["total"] / whole["total"],
                      "vocab_major_over_whole": vocab["total"] / whole["total"]}
        for name, layout in (("token-major", token), ("vocab-major", vocab)):
            print(f"C = {c:5d} {name}: " + "  ".join(f"{k} {s:6.2f} s" for k, s in layout.items())
                  + f"  ({layout['total'] / whole['total']:.2f}x whole)", flush=True)
    print_json({"n": n, "d": d, "vocab": v, "repeats": args.repeats, "whole": whole,
                "chunks": {str(c): r for c, r in results.items()}})


if __name__ == "__main__":
    main()
