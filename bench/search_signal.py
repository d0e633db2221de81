"""
What the GRPO reward says about finding a mark: groups sampled as RL samples them, on held-out search questions.

A search question's 4 s mark is usually missed by the 8-frame overview; the recorded behaviour (data.oracle_turns)
crops the whole video (16 frames, 4 s apart: eight printed patch times), names the patch time that shows the
mark ("The whole-video clip shows a mark near 20.0 seconds") and crops close around it. Whether RL can teach that
localisation depends on two numbers this script measures: how often a group's samples name the right time (the
exploration RL has to work with; chance is one patch time in eight), and whether naming it earns a higher reward
than naming a wrong one (the group advantage, A = (R - mean) / std over the group's rewards, under the default's
recipe). If right and wrong localisations get the same advantage on average, the outcome reward has nothing to
climb, however many steps RL takes.

    python bench/search_signal.py --model runs/default/ckpt-sft-000500 --seed 0
    python bench/search_signal.py --model RUN --seed 1 --questions 24 --group 16 --temperature 0.7

--seed picks the held-out split a run of that seed evaluates on (records seed 2000 + seed). Prints one line per
question and, last, one JSON object.
"""
import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import benchmarks  # noqa: E402
import data  # noqa: E402
import eval as evaluation  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
from bench.common import checkpoint_or_exit, synthetic_root  # noqa: E402

STATED = re.compile(r"shows a mark near ([0-9]+(?:\.[0-9]+)?) seconds")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/default", help="a checkpoint dir, or a run dir (its newest checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: its held-out split, records seed 2000 + seed")
    p.add_argument("--n", type=int, default=192, help="questions in that split (the default run's 192)")
    p.add_argument("--questions", type=int, default=12, help="search questions sampled (the split's first ones)")
    p.add_argument("--group", type=int, default=16, help="samples per question (the default's RL group)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the default's RL)")
    p.add_argument("--nframes", type=int, default=8, help="overview frames (the evaluation's K)")
    p.add_argument("--max-turns", type=int, default=3, help="tool rounds (the default's RL)")
    p.add_argument("--recipe", default="para_grpo", help="the reward whose group advantage is reported")
    p.add_argument("--sample-seed", type=int, default=1, help="seeds the sampling")
    args = p.parse_args(argv)
    if args.group < 2 or args.questions < 1:
        p.error("--group must be >= 2 and --questions >= 1")
    return args


def sample_stats(rec: dict, trajs: list, adv: torch.Tensor, crop_fps: float, crop_max_frames: int,
                 nframes: int = 8) -> list[dict]:
    """Per sample: the time its think names for the mark (None if it names none), the patch time the whole-video
    crop printed for the mark, whether a frame it was shown held the glyph (its overview or executed crops,
    data.glyphs_seen), whether the answer is right, and its group advantage."""
    duration = float(rec["duration"])
    true = data.seen_at(rec["clues"][0], data.crop_patch_times(0.0, duration, duration, crop_fps, crop_max_frames))
    out = []
    for t, a in zip(trajs, adv.tolist()):
        m = STATED.search(t.text)
        out.append({"stated": float(m.group(1)) if m else None, "true": true, "advantage": a,
                    "seen": bool(data.glyphs_seen(rec, nframes, t.windows, crop_fps, crop_max_frames)),
                    "right": rewards.accuracy_reward(t.text, rec["answer"], rec["task"]) > 0})
    return out


def summary(samples: list[dict], n_patch_times: int) -> dict:
    named = [s for s in samples if s["stated"] is not None]
    right = lambda s: s["true"] is not None and abs(s["stated"] - s["true"]) < 0.05   # None: the crop missed it
    hit = [s for s in named if right(s)]
    miss = [s for s in named if not right(s)]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {"samples": len(samples), "named": len(named), "named_right": len(hit), "chance": 1 / n_patch_times,
            "glyph_seen_given_right_time": mean([s["seen"] for s in hit]),
            "glyph_seen_given_wrong_time": mean([s["seen"] for s in miss]),
            "answer_right_given_right_time": mean([s["right"] for s in hit]),
            "answer_right_given_wrong_time": mean([s["right"] for s in miss]),
            "advantage_right_time": mean([s["advantage"] for s in hit]),
            "advantage_wrong_time": mean([s["advantage"] for s in miss])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    ckpt = checkpoint_or_exit(args.model, "search_signal.py")
    torch.manual_seed(args.sample_seed)
    root = synthetic_root()
    records = [r for r in benchmarks.synthetic_records(root, n=args.n, seed=2000 + args.seed)
               if r.get("meta", {}).get("kind") == "search"][:args.questions]
    if not records:
        raise SystemExit(f"search_signal.py: the split of seed {2000 + args.seed} (n = {args.n}) has no search question")
    model, processor, cfg = evaluation.load_agent(ckpt, "cpu", "paravt", None, None, args.max_turns, None)
    cfg = dataclasses.replace(cfg, temperature=args.temperature, group_size=args.group)
    trajs = rollout.run_agent(model, processor, records, root, cfg, seed=args.sample_seed,
                              nframes=[args.nframes] * len(records))
    G, samples = args.group, []
    for i, rec in enumerate(records):
        group = trajs[i * G:(i + 1) * G]
        R = torch.tensor([rewards.score_trajectory(t, rec, args.recipe)[0] for t in group])
        stats = sample_stats(rec, group, rewards.group_advantages(R, G), cfg.crop_fps, cfg.crop_max_frames,
                             args.nframes)
        samples += stats
        named = [s["stated"] for s in stats if s["stated"] is not None]
        print(f"{rec['id']}: mark at {rec['clues'][0]}, printed {stats[0]['true']} s; right answers "
              f"{sum(s['right'] for s in stats)}/{G}; times named {sorted(named)}")
    n_patch = len(data.crop_patch_times(0.0, float(records[0]["duration"]), float(records[0]["duration"]),
                                        cfg.crop_fps, cfg.crop_max_frames))
    result = {"model": ckpt, "seed": args.seed, "questions": len(records), "group": G,
              "temperature": args.temperature, "nframes": args.nframes, "recipe": args.recipe,
              **summary(samples, n_patch), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
