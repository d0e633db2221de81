"""
Evaluation: run the agent on a benchmark's questions, keep its predictions (resumable JSONL) and score
them with benchmarks.py's official-style scorers plus the agent figures of the trainer's table. One
evaluation path: train.py's held-out evaluations call evaluate() too.

    running       evaluate(model, processor, records, video_root, cfg, bench) -> metrics;
                  predict() (resumable JSONL; rows that ended in an error are run again),
                  agent_runner(), trajectory_row()
    figures       agent_figures(records, rows): format compliance, tool-call ratio, clue score, tool
                  turns, r_acc; error_reasons(rows)
    presets       rollout_config(): each paper's protocol (rollout.PRESETS, shared with train.py) for evaluation
    CLI           python eval.py                                    # synthetic split, tiny model (CPU smoke)
                  python eval.py --bench records --annotations my_records.jsonl --video-root DIR --model ckpt/
                  python eval.py --bench mlvu --annotations MLVU/data/1_plotQA.json --video-root MLVU \
                      --model ckpt/ --preset videoo3 --out runs/eval/mlvu.jsonl
                  python eval.py --bench mlvu --annotations ... --predictions runs/eval/mlvu.jsonl  # re-score

Two accuracies, told apart by name: `accuracy` is the official-style figure in % over mcq / oe
questions (grounding questions report `miou`, R@k), as the papers print it; `r_acc` is the training
reward's R_acc (docs/method.md §4) averaged over all rows, in [0, 1], grounding IoU included.
Evaluation is greedy with one sample per question (the papers' protocol, docs/method.md §7), whatever
temperature / group size the given RolloutConfig was built with. Formats and scorers: docs/benchmarks.md.
"""
import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import data
import rewards
from benchmarks import (BENCHES, EXTRACTORS, TIME_EXTRACTORS, describe, format_report, load, score, sniff,
                        synthetic_records)
from rollout import PRESETS


def say(message: str) -> None:
    """A progress message on stderr that never glues onto a progress bar."""
    tqdm.write(message, file=sys.stderr)

# ----------------------------------------------------------------------------- predictions (resumable)

def read_predictions(path) -> list[dict]:
    """Rows of a predictions JSONL file (each needs an id)."""
    rows = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
            if not isinstance(rows[-1], dict) or "id" not in rows[-1]:
                raise ValueError(f"{path}: line {i + 1} has no 'id'")
    return rows


def _resume(path: Path) -> list[dict]:
    """Answered rows already written. A last line cut short by a crash is dropped, and so are rows that
    ended in an error (they are run again): the file is rewritten atomically without them."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    changed = False
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
            lines[-1] += "\n"
        except json.JSONDecodeError:
            say(f"{path}: dropping a truncated last line")
            lines.pop()
        changed = True
    if changed:
        data.atomic_write(str(path), "".join(lines).encode("utf-8"))
    rows = read_predictions(path)
    failed = [r for r in rows if r.get("error")]
    if failed:
        say(f"{path}: {len(failed)} row(s) ended in an error last time; running them again")
        rows = [r for r in rows if not r.get("error")]
        data.atomic_write(str(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    return rows


def error_row(record: dict, exc: BaseException) -> dict:
    """The row of a record whose run raised: scored wrong, with the reason."""
    return {"id": record["id"], "response": "", "answer": record["answer"], "turns": 0, "calls": 0,
            "windows": [], "tool_failures": 0, "latency": 0.0, "error": f"{type(exc).__name__}: {exc}",
            "text": "", "segments": [], "tool_turns": 0, "nframes": 0, "format_compliant": False, "calls_by_turn": []}


def _run_safely(run_batch: Callable, batch: list[dict]) -> list[dict]:
    """run_batch on a batch; if a record's video is missing/undecodable (OSError, ValueError incl.
    VideoError), rerun one by one so only that record becomes an error row."""
    try:
        rows = run_batch(batch)
    except (OSError, ValueError) as exc:
        if len(batch) == 1:
            return [error_row(batch[0], exc)]
        return [row for rec in batch for row in _run_safely(run_batch, [rec])]
    assert [str(r["id"]) for r in rows] == [r["id"] for r in batch], "run_batch must return one row per record, in order"
    for row, rec in zip(rows, batch):
        row.setdefault("answer", rec["answer"])
    return rows


def predict(records: list[dict], run_batch: Callable, out_path=None, batch_size: int = 1) -> list[dict]:
    """Rows for every record, in record order. Resumes: answered ids already in out_path are kept, not
    redone (error rows are redone); each new row is appended to out_path as one JSON line and flushed."""
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError("records carry repeated ids")
    path = Path(out_path) if out_path else None
    done = {str(r["id"]): r for r in (_resume(path) if path else [])}
    todo = [r for r in records if r["id"] not in done]
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
    with (open(path, "a", encoding="utf-8") if path else contextlib.nullcontext()) as f, \
            tqdm(total=len(records), initial=len(records) - len(todo), desc="eval", file=sys.stderr) as bar:
        for i in range(0, len(todo), batch_size):
            for row in _run_safely(run_batch, todo[i:i + batch_size]):
                done[str(row["id"])] = row
                if f is not None:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    f.flush()
                bar.update(1)
    return [done[i] for i in ids]

# ----------------------------------------------------------------------------- the agent

def tiny_overrides() -> dict:
    """The embedded tiny model on CPU: the small frames the synthetic task is designed for."""
    import rollout
    return dict(rollout.TINY_ROLLOUT)


def rollout_config(preset: str = "paravt", tool_mode: str | None = None, **overrides):
    """rollout.RolloutConfig of a preset (+ overrides); names a field RolloutConfig lacks."""
    import rollout
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]                 # the same protocol train.py trains with, its evaluation's turn budget
    values = {**p["rollout"], "max_turns": p["eval_max_turns"], "temperature": 0.0, "group_size": 1,
              **({"tool_mode": tool_mode} if tool_mode else {}), **overrides}
    fields = {f.name for f in dataclasses.fields(rollout.RolloutConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"preset {preset!r} sets {unknown}, which rollout.RolloutConfig does not have")
    return rollout.RolloutConfig(**values)


def segments(traj, tokenizer) -> list[list[str]]:
    """[[role, text], ...] of the trajectory after its prompt: each run of policy (sampled) or env
    (forced prefix, tool results) tokens, decoded; the texts joined are the trajectory's text."""
    import rollout
    ids, roles = traj.token_ids[traj.prompt_len:], traj.roles[traj.prompt_len:]
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or roles[k] != roles[start]:
            role = "policy" if roles[start] == rollout.POLICY else "env"
            out.append([role, tokenizer.decode(ids[start:k], skip_special_tokens=False)])
            start = k
    return out


def trajectory_row(record: dict, traj, processor) -> dict:
    """A predictions row from a rollout.Trajectory: the final assistant turn is the response, `answer` the
    answer parsed from it; `text` / `segments` the trajectory after the prompt (the model's view);
    `calls_by_turn` the windows each executed tool turn asked for (calls without a window left out)."""
    assert traj.record_id == record["id"], f"trajectory {traj.record_id!r} for record {record['id']!r}"
    windows = [[[float(s), float(e)] for s, e in filter(None, map(rewards.call_window, calls))]
               for calls in traj.calls[:traj.n_tool_turns]]
    return {"id": record["id"], "response": traj.turns[-1] if traj.turns else "", "answer": traj.answer,
            "turns": len(traj.turns), "calls": sum(len(c) for c in traj.calls),
            "windows": [[float(s), float(e)] for s, e in traj.windows], "tool_failures": traj.tool_failures,
            "latency": traj.latency, "error": traj.error, "text": traj.text,
            "segments": segments(traj, processor.tokenizer) if traj.token_ids else [],
            "tool_turns": traj.n_tool_turns, "nframes": traj.nframes,
            "format_compliant": traj.error is None and rewards.format_compliant(traj.text), "calls_by_turn": windows}


def agent_runner(model, processor, video_root: str, cfg, seed: int = 0) -> Callable[[list[dict]], list[dict]]:
    """run_batch(records) -> rows: rollout.run_agent on the batch under `cfg`, one row per trajectory."""
    import rollout

    def run_batch(records: list[dict]) -> list[dict]:
        trajs = rollout.run_agent(model, processor, records, video_root, cfg, seed=seed)
        return [trajectory_row(r, t, processor) for r, t in zip(records, trajs, strict=True)]
    return run_batch


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def agent_figures(records: list[dict], rows: list[dict]) -> dict:
    """The trainer's table, over the records that have a row (None where no row carries the figure):
    format_compliance  fraction of non-error rows whose trajectory text passes rewards.format_compliant
    tool_call_ratio    fraction of non-error rows with >= 1 tool call
    clue_score         mean rewards.hybrid_clue_score of a row's crops vs its record's clues, over the
                       single_clue / multi_clue questions (H' for multi; an error row scores 0)
    turns              mean tool turns of the non-error rows
    r_acc              mean rewards.score_answer of the response's answer span, every row (errors 0)"""
    by_id = {str(r["id"]): r for r in rows}
    pairs = [(rec, by_id[rec["id"]]) for rec in records if rec["id"] in by_id]
    ok = [row for _, row in pairs if not row.get("error")]
    clue = []
    for rec, row in pairs:
        kind = rewards.infer_data_type(rec["task"], rec.get("clues"), rec.get("data_type"))
        if kind in ("single_clue", "multi_clue"):
            clue.append(rewards.hybrid_clue_score(row.get("windows") or [], rec.get("clues") or [],
                                                  multi_clue=kind == "multi_clue"))
    r_acc = [0.0 if row.get("error") else rewards.score_answer(rewards.extract_answer(row.get("response") or ""),
                                                                rec["answer"], rec["task"]) for rec, row in pairs]
    return {"format_compliance": _mean(rewards.format_compliant(r["text"]) for r in ok if isinstance(r.get("text"), str)),
            "tool_call_ratio": _mean((r.get("calls") or 0) > 0 for r in ok), "clue_score": _mean(clue),
            "turns": _mean(r["tool_turns"] for r in ok if isinstance(r.get("tool_turns"), int)), "r_acc": _mean(r_acc)}


def report(bench: str, records: list[dict], rows: list[dict], extract: str | None = None,
           random_fallback: int | None = None) -> dict:
    """score()'s official-style metrics plus agent_figures()."""
    return {**score(bench, records, rows, extract=extract, random_fallback=random_fallback),
            **agent_figures(records, rows)}


def evaluate(model, processor, records: list[dict], video_root: str, cfg, bench: str = "records",
             out_path=None, batch_size: int = 8, seed: int = 0, extract: str | None = None,
             random_fallback: int | None = None) -> dict:
    """Run the agent greedily (cfg with temperature 0, one sample per question) on `records`, resuming
    from out_path, and return report(): the official-style metrics plus the agent figures. A record
    whose run fails is an error row with its reason, scored wrong."""
    greedy = dataclasses.replace(cfg, temperature=0.0, group_size=1)
    rows = predict(records, agent_runner(model, processor, video_root, greedy, seed), out_path, batch_size)
    return report(bench, records, rows, extract=extract, random_fallback=random_fallback)


def error_reasons(rows: list[dict], k: int = 5) -> list[tuple[int, str, str]]:
    """The k commonest error reasons as (count, reason, one full example); quoted names and paths are
    folded out of the reason, so one cause over many videos counts once."""
    errors = [str(r["error"]) for r in rows if r.get("error")]
    reason = lambda e: re.sub(r"'[^']*'|\"[^\"]*\"|\S*[/\\]\S*", "…", e)
    counts = collections.Counter(map(reason, errors))
    example = {}
    for e in errors:
        example.setdefault(reason(e), e)
    return [(n, r, example[r]) for r, n in counts.most_common(k)]

# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Evaluate the agent on long-video benchmarks or your own prompt "
                                            "records, or re-score predictions.")
    g = p.add_argument_group("data")
    g.add_argument("--bench", choices=BENCHES, default=None,
                   help="records: your own JSONL of prompt records (docs/method.md §9); a benchmark name: its "
                        "annotation file (docs/benchmarks.md); default synthetic (held-out split, tiny model)")
    g.add_argument("--annotations", default=None, help="the --bench file (json/jsonl/txt/parquet); needs --bench")
    g.add_argument("--video-root", default=None, help="folder the records' relative video paths start from "
                   "(read only; links inside it are followed)")
    g.add_argument("--mmvu-subset", choices=("mc", "all"), default="mc", help="mmvu: 625 multiple-choice or all 1,000")
    g.add_argument("--limit", type=int, default=None, help="first N questions only")
    g.add_argument("--synthetic-n", type=int, default=48,
                   help="synthetic: questions in the held-out split (train.py --n-eval); videos go to "
                        "$PARAVT_CACHE/synthetic (default ./cache/synthetic)")
    g.add_argument("--synthetic-seed", type=int, default=2000,
                   help="synthetic: the split's seed; train.py draws 1000 + --seed for training and 2000 + --seed "
                        "held out, so 3000 is a fresh split for a run of seed 0")
    g.add_argument("--synthetic-mix", default=None,
                   help="synthetic: question kinds, kind=weight,... (e.g. search=1; default: the training mix)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="checkpoint dir, hub id or 'tiny' (default tiny unless --predictions)")
    g.add_argument("--preset", choices=sorted(PRESETS), default="paravt",
                   help="paravt: 64 frames, 3 turns, <=5 calls, subagent; videoo3: 2 fps <=768 frames, 8 turns, interleaved")
    g.add_argument("--tool-mode", choices=("subagent", "interleaved"), default=None,
                   help="override the preset's mode (the tiny model defaults to interleaved, as train.py trains it)")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    g.add_argument("--batch-size", type=int, default=8, help="questions per rollout.run_agent call (one batched rollout)")
    g.add_argument("--overview-nframes", type=int, default=None,
                   help="exactly K overview frames (ParaVT's nFrames; default: the preset's rule, the tiny model's 8)")
    g.add_argument("--max-turns", type=int, default=None,
                   help="the tool-turn budget: tool calls are executed in at most this many turns, then the "
                        "forced-answer message (0: answer from the overview; default: the preset's)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="per assistant turn (default: 128 on the tiny model, as train.py; else RolloutConfig's)")
    g.add_argument("--out", default=None, help="predictions JSONL (resumed if it exists, error rows run again; default "
                   "runs/eval/<bench>-<preset>-<model>.jsonl, the synthetic bench's name with its size and seed)")
    g = p.add_argument_group("scoring")
    g.add_argument("--predictions", default=None, help="re-score this predictions JSONL (no model is run)")
    g.add_argument("--extract", choices=sorted(EXTRACTORS) + sorted(TIME_EXTRACTORS), default=None,
                   help="answer parser (default: the benchmark's official one)")
    g.add_argument("--random-fallback", type=int, default=None, metavar="SEED",
                   help="draw a seeded random letter for unparsed answers (as LongVideoBench/MMMU do); off by default")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="also write DIR/index.html: each question's overview, crops on a timeline, turns and rewards")
    p.add_argument("--debug", action="store_true", help="show the traceback of a bad input instead of one line")
    args = p.parse_args(argv)
    if args.overview_nframes is not None and args.overview_nframes < 2:
        p.error(f"--overview-nframes must be >= 2, got {args.overview_nframes}")
    if args.max_turns is not None and args.max_turns < 0:
        p.error(f"--max-turns must be >= 0, got {args.max_turns}")
    if args.predictions and args.model:
        p.error("--predictions re-scores a file; to run a model write with --out instead")
    if args.annotations and not args.bench:
        kind = sniff(args.annotations)
        p.error(f"--annotations needs --bench, one of: {', '.join(b for b in BENCHES if b != 'synthetic')}"
                + (f" ({describe(kind)})" if kind else ""))
    if (args.bench or "synthetic") != "synthetic" and not args.annotations:
        p.error(f"--bench {args.bench} needs --annotations")
    if (args.bench or "synthetic") == "synthetic" and args.video_root:
        p.error("--video-root is for --bench/--annotations: the synthetic bench renders its videos into the cache "
                "($PARAVT_CACHE/synthetic, default ./cache/synthetic), never into a folder you name")
    return args


def main(argv=None) -> dict:
    """The command line; a bad input ends in one line saying what and where (--debug: the traceback)."""
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, ImportError) as e:
        if args.debug:
            raise
        raise SystemExit(f"eval.py: {e}") from None


def run(args: argparse.Namespace) -> dict:
    bench = args.bench or "synthetic"
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible (use --device cpu, or leave --device unset)")
    if bench == "synthetic":
        video_root = os.path.join(os.environ.get("PARAVT_CACHE", "cache"), "synthetic")
        records = synthetic_records(video_root, n=args.synthetic_n, seed=args.synthetic_seed, mix=args.synthetic_mix)
    else:
        video_root = args.video_root or ""
        records = load(bench, args.annotations, video_root=args.video_root, mmvu_subset=args.mmvu_subset, warn=say)
    records = records[:args.limit] if args.limit else records
    if args.predictions:
        rows = read_predictions(args.predictions)
        metrics = report(bench, records, rows, extract=args.extract, random_fallback=args.random_fallback)
    else:
        import model as model_lib
        import rollout
        name = args.model or "tiny"
        model, processor = model_lib.load_model(name, device=args.device, tiny_corpus=rollout.prompt_corpus())
        tiny = hasattr(model.config, "tiny_model_config")      # the embedded default, fresh or trained
        overrides = {**(tiny_overrides() if tiny else {}),
                     **({"max_new_tokens": args.max_new_tokens or 128} if tiny or args.max_new_tokens else {}),
                     **({"max_turns": args.max_turns} if args.max_turns is not None else {}),
                     **({"overview_nframes": args.overview_nframes} if args.overview_nframes else {})}
        tool_mode = args.tool_mode or ("interleaved" if tiny else None)   # the mode `python train.py` trains
        cfg = rollout_config(args.preset, tool_mode, **overrides)
        tag = Path(str(name).rstrip("/")).name
        split = f"{bench}-n{args.synthetic_n}-seed{args.synthetic_seed}" if bench == "synthetic" else bench
        split += f"-mix{re.sub(r'[^A-Za-z0-9.=]+', '_', args.synthetic_mix)}" if bench == "synthetic" and args.synthetic_mix else ""
        split += f"-turns{args.max_turns}" if args.max_turns is not None else ""
        split += f"-k{args.overview_nframes}" if args.overview_nframes else ""
        out = args.out or Path("runs") / "eval" / f"{split}-{args.preset}-{tag}.jsonl"   # another split, another file
        metrics = evaluate(model, processor, records, video_root, cfg, bench, out, args.batch_size,
                           extract=args.extract, random_fallback=args.random_fallback)
        ids = {r["id"] for r in records}
        rows = [r for r in read_predictions(out) if str(r["id"]) in ids]
    print(format_report(metrics))
    if args.report:
        import report as trajectory_report      # (eval.report is the scorer)
        page = trajectory_report.write_report(args.report, records, rows, metrics=metrics, video_root=video_root,
                                   title=f"{bench} ({args.preset})")
        say(f"trajectory report: {page}")
    reasons = error_reasons(rows)
    if reasons:
        print(f"{sum(bool(r.get('error')) for r in rows)} row(s) ended in an error; the commonest reasons:", file=sys.stderr)
        for n, _, example in reasons:
            print(f"  {n} x {example}", file=sys.stderr)
    print(json.dumps(metrics, ensure_ascii=False))
    return metrics


if __name__ == "__main__":
    main()
