"""
Two checkpoints on the same questions, question by question: did RL fix or break answers of its SFT warm start?

From two predictions files of one synthetic split: each side's MCQ accuracy overall, by kind, by tool need
(data.tool_needed) with the tool-call ratio, and by whether every glyph the answer reads was in a frame shown
(data.glyphs_seen); the answers B fixed and broke, the two-sided exact sign test of fixed against broken, and the
changes split by what was seen ("look": one side's frames showed the glyphs, the other's not; "read": both saw
them; "guess": neither).

    python eval.py --model runs/s0/ckpt-sft-000500 --synthetic-n 432 --synthetic-seed 3000 --out runs/eval/s0-sft.jsonl
    python eval.py --model runs/s0/ckpt-rl-000020 --synthetic-n 432 --synthetic-seed 3000 --out runs/eval/s0-rl.jsonl
    python bench/paired.py runs/eval/s0-sft.jsonl runs/eval/s0-rl.jsonl --n 432 --seed 3000

The last line is one JSON object.
"""
import argparse
import json
import math

from common import synthetic_right, synthetic_root, table  # bench/common.py (puts the repo on sys.path)

import benchmarks
import data
import eval as evaluation
import recipes

KINDS = ("single_clue", "multi_clue", "search", "direct")


def sign_test(fixed: int, broken: int) -> float:
    """Two-sided exact sign test: P(a split at least as uneven as fixed / broken | each change is a fair coin)."""
    n, k = fixed + broken, min(fixed, broken)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def correct(records: list[dict], rows: list[dict], where: str) -> dict[str, bool]:
    """MCQ id -> answered right, as eval.py scores it (common.synthetic_right), so `all` is eval.py's accuracy. A
    question missing from the file is an error naming it."""
    by_id = {str(r["id"]): r for r in rows}
    missing = [r["id"] for r in records if r["task"] == "mcq" and r["id"] not in by_id]
    if missing:
        raise ValueError(f"{where}: no prediction for {len(missing)} question(s), e.g. {missing[0]} (another split?)")
    return {r["id"]: synthetic_right(r, by_id[r["id"]]) for r in records if r["task"] == "mcq"}


def seen(records: list[dict], rows: list[dict], nframes: int) -> dict[str, bool]:
    """MCQ id -> every glyph its answer reads fell in a frame shown (the K-frame overview, the crops of `windows`
    as the tiny default's rollout samples them: recipes.TINY's crop_fps and crop_max_frames)."""
    by_id = {str(r["id"]): r for r in rows}
    fps, cap = recipes.TINY["crop_fps"], recipes.TINY["crop_max_frames"]
    return {r["id"]: bool(data.glyphs_seen(r, nframes, by_id[r["id"]].get("windows"), fps, cap))
            for r in records if r["task"] == "mcq"}


def summary(records: list[dict], rows: list[dict], right: dict[str, bool], shown: dict[str, bool], nframes: int
            ) -> dict:
    """MCQ accuracy (%) overall, by kind, by tool need at K = nframes and by whether the glyphs were seen
    (`shown`: `seen`'s map); tool-call ratio by tool need."""
    by_id = {str(r["id"]): r for r in rows}
    groups = {"all": [], **{k: [] for k in KINDS}, "tool_needed": [], "tool_not_needed": [], "seen": [],
              "unseen": []}
    calls = {"tool_needed": [], "tool_not_needed": []}
    for rec in records:
        if rec["task"] != "mcq":
            continue
        need = "tool_needed" if data.tool_needed(rec, nframes) else "tool_not_needed"
        for g in ("all", rec["meta"]["kind"], need, "seen" if shown[rec["id"]] else "unseen"):
            groups[g].append(right[rec["id"]])
        calls[need].append(by_id[rec["id"]].get("calls", 0) > 0)
    out = {g: 100.0 * sum(v) / len(v) for g, v in groups.items() if v}
    out.update({f"tool_call_ratio_{g.removeprefix('tool_')}": sum(v) / len(v) for g, v in calls.items() if v})
    out["n"] = {g: len(v) for g, v in groups.items()}
    return out


def compare(records: list[dict], rows_a: list[dict], rows_b: list[dict], nframes: int = 8,
            where: tuple[str, str] = ("A", "B")) -> dict:
    a, b = correct(records, rows_a, where[0]), correct(records, rows_b, where[1])
    fixed = sum(b[i] and not a[i] for i in a)
    broken = sum(a[i] and not b[i] for i in a)
    seen_a, seen_b = seen(records, rows_a, nframes), seen(records, rows_b, nframes)
    why = lambda i: "read" if seen_a[i] and seen_b[i] else "look" if seen_a[i] != seen_b[i] else "guess"
    split = lambda changed: {w: sum(changed(i) and why(i) == w for i in a) for w in ("look", "read", "guess")}
    return {"a": summary(records, rows_a, a, seen_a, nframes), "b": summary(records, rows_b, b, seen_b, nframes),
            "right_a": sum(a.values()), "right_b": sum(b.values()), "mcq": len(a),
            "fixed": fixed, "broken": broken, "sign_test_p": sign_test(fixed, broken),
            "fixed_by": split(lambda i: b[i] and not a[i]), "broken_by": split(lambda i: a[i] and not b[i])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="predictions JSONL of the first checkpoint (e.g. after SFT)")
    p.add_argument("b", help="predictions JSONL of the second (e.g. after RL)")
    p.add_argument("--n", type=int, required=True, help="the split's size (eval.py --synthetic-n)")
    p.add_argument("--seed", type=int, required=True, help="the split's seed (eval.py --synthetic-seed)")
    p.add_argument("--nframes", type=int, default=8, help="the evaluation overview's K (the tiny model's: 8)")
    args = p.parse_args(argv)
    records = benchmarks.synthetic_records(synthetic_root(), n=args.n, seed=args.seed,
                                           duration=recipes.TINY["task_duration"])
    try:
        result = compare(records, evaluation.read_predictions(args.a), evaluation.read_predictions(args.b),
                         args.nframes, (args.a, args.b))
    except (ValueError, OSError) as e:
        raise SystemExit(f"paired.py: {e}") from None
    nan, n = float("nan"), result["a"]["n"]
    cols = ["all", *KINDS, "tool_needed", "tool_not_needed", "seen", "unseen"]     # MCQ accuracy (%) of each group
    print(table([[path, *(result[side].get(c, nan) for c in cols), result[side]["n"]["seen"],
                  result[side].get("tool_call_ratio_needed", nan), result[side].get("tool_call_ratio_not_needed", nan)]
                 for side, path in (("a", args.a), ("b", args.b))],
                ["checkpoint", *(f"{c} ({n[c]})" for c in cols[:-2]), "glyphs seen", "not seen", "n seen",
                 "calls where needed", "where not"]))
    print(f"MCQs right: {result['right_a']} -> {result['right_b']} of {result['mcq']}; fixed {result['fixed']}, "
          f"broken {result['broken']}, sign test p = {result['sign_test_p']:.3g}; fixed by {result['fixed_by']}, "
          f"broken by {result['broken_by']} (look: what the frames showed changed; read: both saw the glyphs; "
          "guess: neither did)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
