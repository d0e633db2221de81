"""
Accuracy against the tool-turn budget (Video-o3's finding, arXiv 2601.23224: accuracy rises with the tool turns
allowed), on the embedded default's synthetic task: each budget B runs `eval.py --max-turns B` on the same held-out
split (calls executed in at most B turns, then the forced-answer message; B = 0: the answer from the overview).

    python bench/turn_budget.py --model runs/default              # a run dir (its newest checkpoint) or a checkpoint
    python bench/turn_budget.py --model runs/default --budgets 0,1,2,4 --n 240 --seed 3000

Prints a table (MCQ accuracy in %, overall and by question kind; mean tool turns) and, last, one JSON object.
"""
import argparse
import collections
import json
import os
import time
from pathlib import Path

from common import checkpoint_dir, synthetic_right, synthetic_root  # bench/common.py (puts the repo on sys.path)

import benchmarks
import eval as evaluation
import recipes

KINDS = ("single_clue", "multi_clue", "search", "direct")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/default", help="a checkpoint dir, or a run dir (its newest checkpoint)")
    p.add_argument("--budgets", default="0,1,2,4", help="tool-turn budgets, comma-separated")
    p.add_argument("--n", type=int, default=240, help="questions in the held-out split")
    p.add_argument("--seed", type=int, default=3000, help="the split's seed (3000: no run of seed 0 draws it)")
    p.add_argument("--out", default="runs/turn_budget", help="predictions files go here")
    args = p.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets: expected comma-separated integers, got {args.budgets!r}")
    if any(b < 0 for b in args.budgets):
        p.error("--budgets must be >= 0")
    return args


def by_kind(records: list[dict], rows: list[dict]) -> dict:
    """MCQ accuracy (%) overall and per kind, each answer scored as eval.py scores it (common.synthetic_right), and the
    mean number of executed tool turns."""
    rows = {str(r["id"]): r for r in rows}
    hits = collections.defaultdict(list)
    for rec in records:
        if rec["task"] != "mcq":
            continue
        right = synthetic_right(rec, rows[rec["id"]])
        hits["all"].append(right)
        hits[rec["meta"]["kind"]].append(right)
    out = {k: 100.0 * sum(v) / len(v) for k, v in hits.items()}
    out["n"] = {k: len(v) for k, v in hits.items()}
    out["tool_turns"] = sum(r.get("tool_turns", 0) for r in rows.values()) / max(1, len(rows))
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    ckpt = checkpoint_dir(args.model, "turn_budget.py")
    root = synthetic_root()
    records = benchmarks.synthetic_records(root, n=args.n, seed=args.seed, duration=recipes.TINY["task_duration"])
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for b in args.budgets:
        out = os.path.join(args.out, f"{Path(ckpt).name}-n{args.n}-seed{args.seed}-turns{b}.jsonl")
        evaluation.run(evaluation.parse_args(["--model", ckpt, "--synthetic-n", str(args.n), "--synthetic-seed",
                                              str(args.seed), "--max-turns", str(b), "--out", out]))
        results[b] = by_kind(records, [json.loads(l) for l in open(out) if l.strip()])
    n = results[args.budgets[0]]["n"]
    head = ["budget", f"all ({n.get('all', 0)})"] + [f"{k} ({n.get(k, 0)})" for k in KINDS] + ["tool turns"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for b, r in results.items():
        print(f"| {b} | {r.get('all', 0):.1f} | " + " | ".join(f"{r.get(k, float('nan')):.1f}" for k in KINDS)
              + f" | {r['tool_turns']:.2f} |")
    result = {"model": ckpt, "n": args.n, "seed": args.seed, "budgets": {str(b): r for b, r in results.items()},
              "seconds": round(time.time() - t0, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
