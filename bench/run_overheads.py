"""
Benchmark: the default run's work outside the SFT and RL steps, before and after two changes that leave every
result as it was: the SFT trajectories encoded a thread per core (`train.sft_examples(workers=...)`) and the
held-out evaluation in batches of 64 questions (`--eval-batch`, the tiny model's default) instead of 8.

    python bench/run_overheads.py                  # 64 SFT records, 96 held-out questions, torch's threads
    python bench/run_overheads.py --records 256 --questions 192 --model runs/default/ckpt-sft-000500

Each pair runs interleaved A, B, A, B (bench/common.py) and is checked to give the same output: the same encoded
trajectories (token ids and pixels), the same greedy answers. Wall seconds, median over --repeats. The last line
is one JSON object. Target: each change faster (ratio > 1.0) with the same output.
"""
import argparse
import os
import tempfile

import torch
from common import ab_times, checkpoint_dir, median, print_json, set_threads, table

import data
import eval as evaluation
import model as model_lib
import rollout
import runtime
import train


def same_items(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and x.roles == y.roles
        and all(torch.equal(p[0], q[0]) for p, q in zip(x.videos, y.videos)) for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=64, help="SFT records encoded (two trajectories or more each)")
    p.add_argument("--questions", type=int, default=96, help="held-out questions evaluated")
    p.add_argument("--model", default="tiny", help="'tiny' (untrained) or a trained checkpoint / run dir")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="0: torch's default (the run's)")
    p.add_argument("--cache", default=None, help="synthetic video cache (default: a temp dir)")
    a = p.parse_args()
    threads = set_threads(a.threads)
    args = runtime.parse_args([])                                  # the embedded default's settings
    cache = a.cache or tempfile.mkdtemp(prefix="overheads-")
    train_recs, held, root = data.synthetic_data(0, max(a.records, 1), a.questions, args.task_duration, None, cache)
    cfg = train.rollout_config_of_args(args)
    source = a.model if a.model == "tiny" else checkpoint_dir(a.model)
    model, processor = model_lib.load_model(source, device=torch.device("cpu"), dtype=torch.float32, seed=0,
                                            tiny_corpus=rollout.prompt_corpus())
    model.eval()

    def examples(workers):
        return train.sft_examples(train_recs[:a.records], processor, root, cfg, sft_data=None, seed=0,
                                  gated_choices=args.gating_choices, direct_crop=args.direct_crop,
                                  budget_fraction=args.sft_budget_fraction, tool_free=args.sft_tool_free,
                                  workers=workers, log=lambda m: None)[0]

    def answers(batch):
        out = os.path.join(cache, f"eval-{batch}.jsonl")
        if os.path.exists(out):
            os.unlink(out)                                          # eval.py resumes from an existing file
        evaluation.evaluate(model, processor, held, root, cfg, bench="records", out_path=out, batch_size=batch)
        return [(r["id"], r["text"]) for r in evaluation.read_predictions(out)]

    workers = torch.get_num_threads()
    ex = {"serial": lambda: examples(1), f"{workers} threads": lambda: examples(workers)}
    ev = {"batch 8": lambda: answers(8), "batch 64": lambda: answers(64)}
    same_ex = same_items(*(fn() for fn in ex.values()))
    same_ev = [fn() for fn in ev.values()]
    same_ev = same_ev[0] == same_ev[1]
    wall_ex, _ = ab_times(ex, a.repeats, warmup=False)
    wall_ev, _ = ab_times(ev, a.repeats, warmup=False)
    rows = [[k, median(v)] for k, v in {**wall_ex, **wall_ev}.items()]
    print(table(rows, ["side", "wall s (median)"]))
    (s1, s2), (e8, e64) = [median(v) for v in wall_ex.values()], [median(v) for v in wall_ev.values()]
    print_json({"threads": threads or torch.get_num_threads(), "records": a.records, "questions": a.questions,
                "sft_examples_s": {"serial": s1, "threads": s2}, "sft_examples_speedup": s1 / s2,
                "sft_examples_same": same_ex, "eval_s": {"batch8": e8, "batch64": e64}, "eval_speedup": e8 / e64,
                "eval_same_answers": same_ev, "target_met": bool(s1 / s2 > 1 and e8 / e64 > 1 and same_ex and same_ev)})


if __name__ == "__main__":
    main()
