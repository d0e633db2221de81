"""
What RL can move on the held-out questions: each MCQ's greedy answer against its accuracy sampled as RL samples.

The evaluation is greedy (eval.py: temperature 0), so a held-out answer changes only where RL changes the policy's
mode. GRPO raises the probability of the sampled answers that beat their group's mean: on a question where the right
answer already holds more than half the samples but greedy decoding misses it (rare: the greedy path is not the
answer's mode), sharpening alone fixes it; on one where the right answer holds less than half, RL must move mass
from a wrong behaviour the policy prefers, which takes many more steps the lower the sampled accuracy p is; at p = 0
the reward has nothing to raise. Greedy-right questions with p < 1/2 are the ones sharpening can break.

Per question: greedy right or wrong, and p over `--group` samples at `--temperature` (the default's RL: 16 at 0.7),
the evaluation's overview (K = 8); an answer is the final turn's, scored as eval.py scores it (R_acc reads the first
<answer> of the whole trajectory: the two differ only where an earlier turn holds an answer, a format error).
Printed: the counts by (greedy, p bin), the greedy accuracy, the mean sampled accuracy, and the accuracy of the
sampled mode (p > 1/2 counted right): the held-out accuracy an RL that only sharpened the policy's present
preferences would reach.

    python bench/headroom.py --model runs/default/ckpt-sft-000500 --seed 0
    python bench/headroom.py --model RUN/ckpt-rl-000020 --seed 2 --group 8

--seed picks the held-out split a run of that seed evaluates on (records seed 2000 + seed). The last line is one
JSON object.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import benchmarks  # noqa: E402
import eval as evaluation  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
from bench.common import checkpoint_or_exit, synthetic_root  # noqa: E402

BINS = ((0.0, "p = 0"), (0.25, "0 < p < 1/4"), (0.5, "1/4 <= p < 1/2"), (0.75, "1/2 <= p < 3/4"), (1.0, "3/4 <= p < 1"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/default", help="a checkpoint dir, or a run dir (its newest checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: its held-out split, records seed 2000 + seed")
    p.add_argument("--n", type=int, default=192, help="questions in that split (the default run's 192)")
    p.add_argument("--group", type=int, default=16, help="samples per question (the default's RL group)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the default's RL)")
    p.add_argument("--nframes", type=int, default=8, help="overview frames (the evaluation's K)")
    p.add_argument("--max-turns", type=int, default=3, help="tool rounds (the default's)")
    p.add_argument("--batch", type=int, default=32, help="questions rolled out together")
    p.add_argument("--sample-seed", type=int, default=1, help="seeds the sampling")
    args = p.parse_args(argv)
    if args.group < 2 or args.batch < 1:
        p.error("--group must be >= 2 and --batch >= 1")
    return args


def p_bin(p: float) -> str:
    """The label of a sampled accuracy's bin (BINS; p = 1 its own)."""
    if p >= 1.0:
        return "p = 1"
    return next(label for top, label in BINS if (p == 0.0 if top == 0.0 else p < top))


def headroom(greedy: dict[str, bool], sampled: dict[str, float]) -> dict:
    """Counts by (greedy right / wrong, p bin); greedy accuracy, mean sampled accuracy and the sampled mode's
    accuracy (p > 1/2), over the questions of `greedy` (every one needs a p)."""
    missing = [q for q in greedy if q not in sampled]
    if missing:
        raise ValueError(f"headroom: no sampled accuracy for {len(missing)} question(s), e.g. {missing[0]}")
    n = len(greedy)
    if n == 0:
        raise ValueError("headroom: no questions")
    counts: dict[str, int] = {}
    for q, right in greedy.items():
        key = f"{'right' if right else 'wrong'}, {p_bin(sampled[q])}"
        counts[key] = counts.get(key, 0) + 1
    return {"questions": n, "greedy_accuracy": sum(greedy.values()) / n,
            "sampled_accuracy": sum(sampled[q] for q in greedy) / n,
            "mode_accuracy": sum(sampled[q] > 0.5 for q in greedy) / n,
            "wrong_with_p_above_half": sum(not r and sampled[q] > 0.5 for q, r in greedy.items()),
            "right_with_p_below_half": sum(r and sampled[q] < 0.5 for q, r in greedy.items()),
            "wrong_with_p_below_quarter": sum(not r and sampled[q] < 0.25 for q, r in greedy.items()),
            "counts": dict(sorted(counts.items()))}


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    ckpt = checkpoint_or_exit(args.model, "headroom.py")
    torch.manual_seed(args.sample_seed)
    root = synthetic_root()
    records = [r for r in benchmarks.synthetic_records(root, n=args.n, seed=2000 + args.seed) if r["task"] == "mcq"]
    if not records:
        raise SystemExit(f"headroom.py: the split of seed {2000 + args.seed} (n = {args.n}) has no MCQ")
    model, processor, cfg = evaluation.load_agent(ckpt, "cpu", "paravt", None, None, args.max_turns, None)
    modes = {"greedy": dataclasses.replace(cfg, temperature=0.0, group_size=1),
             "sampled": dataclasses.replace(cfg, temperature=args.temperature, group_size=args.group)}
    right = {name: {} for name in modes}
    for i in range(0, len(records), args.batch):      # every chunk reuses the per-position sampling seeds
        chunk = records[i:i + args.batch]             # (rollout.row_seed): different prompts, so counts are unbiased
        for name, c in modes.items():
            trajs = rollout.run_agent(model, processor, chunk, root, c, seed=args.sample_seed,
                                      nframes=[args.nframes] * len(chunk))
            for j, rec in enumerate(chunk):
                group = trajs[j * c.group_size:(j + 1) * c.group_size]
                right[name][rec["id"]] = sum(rewards.score_answer(t.answer, rec["answer"], rec["task"]) > 0
                                             for t in group) / len(group)     # the final turn's, as eval.py scores
    greedy = {q: p > 0 for q, p in right["greedy"].items()}
    result = {"model": ckpt, "seed": args.seed, "group": args.group, "temperature": args.temperature,
              "nframes": args.nframes, **headroom(greedy, right["sampled"]), "seconds": round(time.time() - t0, 1)}
    for key, n in result["counts"].items():
        print(f"greedy {key}: {n}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
