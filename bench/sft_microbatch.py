"""
Benchmark: one SFT step (forward + backward) on the embedded default, the batch as one forward vs as
length-sorted micro-batches (train.sft_micro_batches, `--sft-micro-batch`).

    python bench/sft_microbatch.py                 # batch 8, micro-batches of 2 rows, 1 thread
    python bench/sft_microbatch.py --rows 4 --threads 2

The SFT batch mixes trajectories of ~190 tokens (a direct answer) and ~620 (two crops); one forward
pads every row to the longest. Sorting the batch by length and running micro-batches of `rows` pads
each only to its own longest. The gradient is the same (each micro-batch's token mean weighted by its
share of the batch's policy tokens): the bench checks it (relative difference of the flattened
gradients) before timing. Both sides run the same --steps batches, interleaved A, B, A, B (bench/common.py);
time is the median over --repeats of the CPU seconds per step. The last line is one JSON object.
Target: micro-batches >= 1.15x faster per step, the same gradient (relative difference < 1e-5).
"""
import argparse
import random
import tempfile

import torch
from common import ab_times, median, print_json, set_threads, table

import data
import model as model_lib
import rollout
import runtime
import train


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=6, help="batches timed per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=None, help="synthetic video cache (default: a temp dir)")
    a = p.parse_args()
    threads = set_threads(a.threads)
    args = runtime.parse_args([])                                  # the embedded default's settings
    cfg = train.rollout_config_of_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        records, _, root = data.synthetic_data(args.seed, args.n_train, args.n_eval, args.task_duration,
                                                args.task_mix, a.cache or tmp)
        model, processor = model_lib.load_model("tiny", device="cpu", seed=0, tiny_corpus=rollout.prompt_corpus())
        items, _ = train.sft_examples(records, processor, root, cfg, sft_data=None, seed=args.seed, gated_choices=[])
    pad_id = processor.tokenizer.pad_token_id
    rng = random.Random(0)
    batches = [[items[rng.randrange(len(items))] for _ in range(a.batch)] for _ in range(a.steps)]

    def step(batch, rows):
        """Gradient of the batch's token-mean SFT loss, over micro-batches of `rows` (rows = batch: one forward)."""
        train.sft_backward(model, batch, rows, pad_id, compile=False)
        grad = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
        model.zero_grad(set_to_none=True)
        return grad

    g_one, g_micro = step(batches[0], a.batch), step(batches[0], a.rows)
    grad_diff = float((g_one - g_micro).norm() / g_one.norm())
    padded = {name: sum(len(mb["input_ids"].flatten()) for b in batches
                        for mb in train.sft_micro_batches(b, rows, model, pad_id))
              for name, rows in (("one", a.batch), ("micro", a.rows))}
    real = sum(len(t.token_ids) for b in batches for t in b)
    _, cpu = ab_times({"one": lambda: [step(b, a.batch) for b in batches],
                       "micro": lambda: [step(b, a.rows) for b in batches]}, a.repeats)
    per_step = {k: median(v) / a.steps for k, v in cpu.items()}
    print(table([[k, per_step[k], padded[k] / a.steps, real / a.steps] for k in ("one", "micro")],
                ["side", "cpu_s_per_step", "padded_tokens_per_step", "real_tokens_per_step"]))
    print_json({"batch": a.batch, "rows": a.rows, "threads": threads, "steps": a.steps, "repeats": a.repeats,
                "cpu_s_per_step": per_step, "padded_tokens_per_step": {k: v / a.steps for k, v in padded.items()},
                "real_tokens_per_step": real / a.steps, "speedup": per_step["one"] / per_step["micro"],
                "pad_ratio": padded["one"] / padded["micro"], "grad_rel_diff": grad_diff})


if __name__ == "__main__":
    main()
