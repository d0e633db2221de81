"""
Evaluation: run the agent on a benchmark's questions, keep its predictions (resumable JSONL) and score
them with benchmarks.py's official-style scorers plus the agent figures of the trainer's table; or ask it
one question about one video. One evaluation path: train.py's held-out evaluations call evaluate() too.

    running       evaluate(model, processor, records, video_root, cfg, bench, rank=, world=) -> metrics;
                  predict() (resumable JSONL; rows that ended in an error are run again; with N processes
                  question i on rank i % N, one file per rank, merged by rank 0 in record order), Progress
                  (one bar over every rank's questions), agent_runner(), trajectory_row()
    figures       agent_figures(records, rows): format compliance, tool-call ratio, clue score, tool
                  turns, r_acc; error_reasons(rows)
    presets       preset_rollout_config(): each preset's evaluation protocol (recipes.PRESETS, shared with train.py);
                  preset_defaults(): the preset (recipes.model_preset) and the flags it sets (--batch-size, ...)
    ask           ask_record(video, question, options), ask(): each turn printed as it completes
                  (rollout.run_agent's on_turn, turn_lines), the answer alone on the last line
    CLI           python eval.py                                    # train.py's held-out synthetic split, tiny model
                  python eval.py --bench records --annotations my_records.jsonl --video-root DIR --model ckpt/
                  python eval.py --gpus 8 --bench mlvu --annotations MLVU/data/1_plotQA.json --video-root MLVU \
                      --model ckpt/ --preset videoo3 --out runs/eval/mlvu.jsonl
                  python eval.py --bench mlvu --annotations ... --predictions runs/eval/mlvu.jsonl  # re-score
                  python eval.py --model ckpt/ --video clip.mp4 --question "..." [--options "A. x|B. y"]

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
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import data
import recipes
import rewards
import runtime
import video
from benchmarks import (BENCHES, EXTRACTORS, TIME_EXTRACTORS, describe, format_report, load, score, sniff,
                        synthetic_records)


def say(message: str) -> None:
    """A progress message on stderr that never glues onto a progress bar."""
    tqdm.write(message, file=sys.stderr)

# ----------------------------------------------------------------------------- predictions (resumable, one file per rank)

def _rows_of(lines: list[str], path) -> list[dict]:
    rows = []
    for i, line in enumerate(lines):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
            if not isinstance(rows[-1], dict) or "id" not in rows[-1]:
                raise ValueError(f"{path}: line {i + 1} has no 'id'")
    return rows


def read_predictions(path) -> list[dict]:
    """Rows of a predictions JSONL file (each needs an id)."""
    return _rows_of(Path(path).read_text(encoding="utf-8").splitlines(), path)


def rank_path(out: Path, rank: int) -> Path:
    """The predictions file rank `rank` of a multi-process evaluation writes beside `out` (merged into it)."""
    return out.with_name(f"{out.name}.rank{rank}")


def _rank_files(out: Path) -> list[Path]:
    """Rank files of `out` left by a multi-process run (any number of ranks) that has not merged them yet."""
    if not out.parent.is_dir():
        return []
    return sorted(out.parent / n for n in os.listdir(out.parent) if re.fullmatch(re.escape(out.name) + r"\.rank\d+", n))


def remove_predictions(out) -> None:
    """Delete a predictions file and the rank files beside it (a fresh evaluation, nothing to resume)."""
    out = Path(out)
    for p in [out, *_rank_files(out)]:
        p.unlink(missing_ok=True)


def _answered(path: Path) -> list[dict]:
    """The answered rows of a predictions file, read only: a last line cut short by a crash is dropped, and so
    are rows that ended in an error (they are run again); each is said."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            say(f"{path}: dropping a truncated last line")
            lines.pop()
    rows = _rows_of(lines, path)
    failed = [r for r in rows if r.get("error")]
    if failed:
        say(f"{path}: {len(failed)} row(s) ended in an error last time; running them again")
    return [r for r in rows if not r.get("error")]


def _write_rows(path: Path, rows: list[dict]) -> None:
    data.atomic_write(str(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))


def error_row(record: dict, exc: BaseException) -> dict:
    """The row of a record whose run raised: scored wrong, with the reason."""
    return {"id": record["id"], "response": "", "answer": record["answer"], "turns": 0, "calls": 0,
            "windows": [], "tool_failures": 0, "latency": 0.0, "error": f"{type(exc).__name__}: {exc}",
            "text": "", "segments": [], "tool_turns": 0, "nframes": 0, "format_compliant": False, "calls_by_turn": []}


def _run_safely(run_batch: Callable, batch: list[dict]) -> list[dict]:
    """run_batch on a batch; if a record's video is missing/undecodable (OSError, ValueError incl.
    VideoError), rerun one by one so only that record becomes an error row. The reruns start after the failed
    call's frames are gone: its traceback holds them, and with them the engine and its K/V pool."""
    failure = None
    try:
        rows = run_batch(batch)
    except (OSError, ValueError) as exc:
        failure = exc.with_traceback(None)           # the error's text, not the failed call's frames
        failure.__context__ = failure.__cause__ = None
    if failure is not None:
        if len(batch) == 1:
            return [error_row(batch[0], failure)]
        del failure
        return [row for rec in batch for row in _run_safely(run_batch, [rec])]
    assert [str(r["id"]) for r in rows] == [r["id"] for r in batch], "run_batch must return one row per record, in order"
    for row, rec in zip(rows, batch):
        row.setdefault("answer", rec["answer"])
    return rows


class Progress:
    """One progress bar for the whole evaluation, drawn by rank 0: the questions answered by every rank (the
    counts summed over the ranks once per round, `runtime.all_sums`, so every rank calls update() as often),
    questions per minute, the error rows so far, and tqdm's time left."""

    def __init__(self, total: int, done: int, rank: int = 0, world: int = 1):
        done, = runtime.all_sums([done], world)
        self.world, self.new, self.errors, self.t0 = world, 0, 0, time.time()
        self.bar = tqdm(total=total, initial=int(done), desc="eval", file=sys.stderr, disable=rank != 0,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, answered: int, errors: int) -> None:
        answered, errors = map(int, runtime.all_sums([answered, errors], self.world))
        self.new, self.errors = self.new + answered, self.errors + errors
        per_minute = 60 * self.new / max(time.time() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{per_minute:.1f} q/min, {self.errors} error rows", refresh=False)
        self.bar.update(answered)

    def close(self) -> None:
        self.bar.close()


def predict(records: list[dict], run_batch: Callable, out_path, batch_size: int, rank: int = 0,
            world: int = 1) -> list[dict] | None:
    """Rows for every record, in record order, `batch_size` records a run_batch call. Resumes: answered ids already
    in out_path (None: no file) are kept, not redone (error rows are redone); each new row is appended to out_path
    as one JSON line and flushed.

    With `world` processes, rank r answers records[r::world] (question i -> rank i % world), appending to
    its own file rank_path(out_path, r); rank 0 gathers every rank's rows, writes out_path in record order
    and returns them (the other ranks return None), and the rank files go. Resume is per rank: a killed run
    leaves the rank files, and the next run, on any number of ranks, keeps every answered row of out_path
    and of all rank files. Rows of ids not in `records` stay in out_path (after the records' rows)."""
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError("records carry repeated ids")
    path = Path(out_path) if out_path else None
    mine = records[rank::world]
    done = {}
    if path:
        for p in [path, *_rank_files(path)]:         # every answered row, whichever rank or run wrote it
            done.update((str(r["id"]), r) for r in _answered(p))
        runtime.barrier(world)                       # every rank has read every file before any rank writes
        own = path if world == 1 else rank_path(path, rank)
        known = set(ids)
        order = ids + [i for i in done if i not in known] if world == 1 else [r["id"] for r in mine]
        _write_rows(own, [done[i] for i in order if i in done])
        if world == 1:
            for p in _rank_files(path):              # folded into out_path above
                p.unlink()
    todo = [r for r in mine if r["id"] not in done]
    rounds = -(-len(todo) // batch_size)
    rounds = runtime.all_max(rounds) if world > 1 else rounds   # the same number of rounds on every rank
    bar = Progress(len(records), len(mine) - len(todo), rank, world)
    with (open(own, "a", encoding="utf-8") if path else contextlib.nullcontext()) as f:
        for k in range(rounds):
            rows = _run_safely(run_batch, todo[k * batch_size:(k + 1) * batch_size]) if k * batch_size < len(todo) else []
            for row in rows:
                done[str(row["id"])] = row
                if f is not None:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    f.flush()
            bar.update(len(rows), sum(bool(r.get("error")) for r in rows))
    bar.close()
    if world == 1:
        return [done[i] for i in ids]
    shards = runtime.gather_objects([done[r["id"]] for r in mine], world)
    merged = None
    if rank == 0:
        by_id = {str(r["id"]): r for shard in shards for r in shard}
        merged = [by_id[i] for i in ids]
        if path:
            _write_rows(path, merged + [r for i, r in done.items() if i not in by_id])
    runtime.barrier(world)                           # out_path holds every row before the rank files go
    if path:
        own.unlink()
    return merged

# ----------------------------------------------------------------------------- the agent

def preset_rollout_config(preset: str, tool_mode: str | None = None, tiny: bool = False, **overrides):
    """rollout.RolloutConfig of a preset's evaluation (recipes.preset_values; on the tiny model with its frames):
    greedy, one sample a question, the preset's eval_max_turns tool rounds (Video-o3 trains with 6 and evaluates
    with 8), then `tool_mode` and `overrides`; names a field RolloutConfig lacks."""
    import rollout
    values = recipes.preset_values(preset, tiny=tiny)
    return rollout.RolloutConfig.of(values, **{"max_turns": values["eval_max_turns"], "temperature": 0.0,
                                               "group_size": 1, **({"tool_mode": tool_mode} if tool_mode else {}),
                                               **overrides})


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


def agent_figures(records: list[dict], rows: list[dict]) -> dict:
    """The trainer's table, over the records that have a row (None where no row carries the figure):
    format_compliance  fraction of non-error rows whose trajectory text passes rewards.format_compliant
    tool_call_ratio    fraction of non-error rows with >= 1 tool call
    clue_score         mean rewards.hybrid_clue_score of a row's crops vs its record's clues, over the
                       single_clue / multi_clue questions (H' for multi; an error row scores 0)
    turns              mean tool turns of the non-error rows
    r_acc              mean rewards.accuracy_reward of the response, every row (errors 0)
    (format_compliance, tool_call_ratio and turns are rewards.py's agent figures.)"""
    by_id = {str(r["id"]): r for r in rows}
    pairs = [(rec, by_id[rec["id"]]) for rec in records if rec["id"] in by_id]
    ok = [row for _, row in pairs if not row.get("error")]
    clue = []
    for rec, row in pairs:
        kind = rewards.infer_data_type(rec["task"], rec.get("clues"), rec.get("data_type"))
        if kind in ("single_clue", "multi_clue"):
            clue.append(rewards.hybrid_clue_score(row.get("windows") or [], rec.get("clues") or [],
                                                  multi_clue=kind == "multi_clue"))
    r_acc = [0.0 if row.get("error") else rewards.accuracy_reward(row.get("response") or "", rec["answer"], rec["task"])
             for rec, row in pairs]
    return {"format_compliance": rewards.format_compliance(r["text"] for r in ok if isinstance(r.get("text"), str)),
            "tool_call_ratio": rewards.tool_call_ratio(r.get("calls") or 0 for r in ok),
            "clue_score": rewards.mean_or_none(clue),
            "turns": rewards.mean_turns(r["tool_turns"] for r in ok if isinstance(r.get("tool_turns"), int)),
            "r_acc": rewards.mean_or_none(r_acc)}


def report(bench: str, records: list[dict], rows: list[dict], extract: str | None = None,
           random_fallback: int | None = None) -> dict:
    """score()'s official-style metrics plus agent_figures()."""
    return {**score(bench, records, rows, extract=extract, random_fallback=random_fallback),
            **agent_figures(records, rows)}


def evaluate(model, processor, records: list[dict], video_root: str, cfg, *, batch_size: int, bench: str = "records",
             out_path=None, seed: int = 0, extract: str | None = None, random_fallback: int | None = None,
             rank: int = 0, world: int = 1) -> dict:
    """The agent, greedy, on `records` (`batch_size` questions a rollout, resuming from out_path): report()'s
    official-style metrics and agent figures; a failed record is an error row scored wrong. Each of `world` ranks
    runs its share (predict); rank 0 scores the merged rows, every rank returns the metrics."""
    greedy = dataclasses.replace(cfg, temperature=0.0, group_size=1)
    rows = predict(records, agent_runner(model, processor, video_root, greedy, seed), out_path, batch_size, rank, world)
    metrics = report(bench, records, rows, extract=extract, random_fallback=random_fallback) if rank == 0 else None
    return runtime.broadcast_object(metrics, world)


def evaluate_held_out(model, processor, records: list, video_root: str, cfg, run: runtime.Run,
                      name: str, *, batch_size: int, report_questions: int = 8) -> dict:
    """train.py's held-out evaluation: the greedy agent on the held-out records through this runner (official-style scores plus format
    compliance, tool-call ratio, clue score, turns), split over the ranks as `eval.py --gpus N` splits them
    (question i on rank i % N); rank 0 merges the predictions into RUN_DIR/eval/<name>.jsonl, scores them once
    and writes a trajectory report of the first `report_questions` questions in RUN_DIR/report/<name>/index.html.
    `batch_size`: questions per batched rollout (the preset's eval_batch). Every rank returns rank 0's figures."""
    out = os.path.join(run.run_dir, "eval", f"{name}.jsonl")
    if run.rank == 0:                                  # new weights: never resume another evaluation's answers
        remove_predictions(out)
    runtime.barrier(run.world)
    with runtime.full_weights(model):
        m = evaluate(model, processor, records, video_root, cfg, batch_size=batch_size, bench="records", out_path=out,
                     rank=run.rank, world=run.world)
    if run.rank == 0 and report_questions:
        import report
        rows = read_predictions(out)
        report.write_report(os.path.join(run.run_dir, "report", name), records, rows, metrics=m, video_root=video_root,
                            title=f"held-out evaluation: {name}", max_questions=report_questions)
    keys = ("accuracy", "miou", "r_acc", "format_compliance", "tool_call_ratio", "clue_score", "turns")
    row = {k: float(m[k]) for k in keys if isinstance(m.get(k), (int, float))}
    runtime.print0(run.rank, f"eval {name}: " + json.dumps(row))
    return row


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

# ----------------------------------------------------------------------------- ask: one question on one video

def parse_options(text: str) -> list[str]:
    """--options "A. red|B. blue|C. green" (or "red|blue|green") -> ["red", "blue", "green"]: 2 to 26 options
    split on '|', lettered in order ("A. ", "A) " or "(A) ") or none lettered. ValueError naming what is wrong."""
    parts = [p.strip() for p in text.split("|")]
    example = 'e.g. --options "A. red|B. blue"'
    if not 2 <= len(parts) <= 26:
        raise ValueError(f"--options {text!r}: give 2 to 26 options separated by '|' ({example})")
    if not all(parts):
        raise ValueError(f"--options {text!r}: option {parts.index('') + 1} is empty ({example})")
    found = [re.fullmatch(r"\(?([A-Z])[.)]\s+(.+)", p, flags=re.S) for p in parts]
    if not any(found):
        return parts
    for k, (part, m) in enumerate(zip(parts, found)):
        if m is None or m[1] != chr(65 + k):
            raise ValueError(f"--options {text!r}: option {k + 1} ({part!r}) should start with {chr(65 + k)}. as the "
                             f"options before it are lettered; letter them all in order A, B, ... or none ({example})")
    return [m[2].strip() for m in found]


def ask_record(video_path: str, question: str, options: str | None = None) -> tuple[dict, str]:
    """(record, video_root) of one question about one video file (eval.py --video): an mcq record with the
    options, else an open-ended one; no gold answer. ValueError naming the flag and what is wrong: an empty
    question, a file that is missing or that PyAV cannot read, options in a shape parse_options refuses."""
    if not question or not question.strip():
        raise ValueError("--question is empty: ask something about the video")
    path = os.path.abspath(video_path)
    if not os.path.isfile(path):
        raise ValueError(f"--video {video_path}: " + ("not a file" if os.path.exists(path) else "no such file"))
    try:
        info = video.probe(path)
    except (ValueError, OSError) as e:                   # video.VideoError is a ValueError
        raise ValueError(f"--video {video_path}: not a video PyAV can read ({getattr(e, 'reason', e)})") from None
    opts = parse_options(options) if options is not None else None
    record = {"id": os.path.basename(path), "video": os.path.basename(path), "question": question.strip(),
              "options": opts, "answer": None, "task": "mcq" if opts else "oe", "clues": None, "data_type": "free_form",
              "duration": info.duration, "subtitles": None, "meta": {}}
    return record, os.path.dirname(path)


def _indent(text: str) -> str:
    return text.strip().replace("\n", "\n    ")


def turn_lines(traj, responses: list[str] | None) -> list[str]:
    """What eval.py --video prints as a turn completes (rollout.run_agent's on_turn): its thinking, each call
    with its window, then what the tool answered (a sub-agent's summary, an error, or a note that the clip
    was shown to the model), or, for the turn that ended the trajectory, its answer."""
    import rollout
    text = traj.turns[-1].removeprefix(rollout.THINK_PREFIX)
    thinking = text.split("</think>")[0] if "</think>" in text else re.split(r"<tool_call>|<answer>", text)[0]
    lines = [f"turn {len(traj.turns)}"] + ([f"  thinking: {_indent(thinking)}"] if thinking.strip() else [])
    for call in traj.calls[-1] if traj.calls else []:
        window = rewards.call_window(call)
        lines.append(f"  crop_video {window[0]:g}-{window[1]:g} s" if window else
                     f"  {call.name or 'call'}: {call.error or 'no time window'}")
    if responses is None:
        answer = rewards.extract_answer(traj.turns[-1])
        why = "cut at the token limit" if traj.truncated else \
            "calls after the last tool turn are not executed" if traj.calls and traj.calls[-1] else "no <answer> tag"
        lines.append(f"  answer: {_indent(answer)}" if answer is not None else f"  no answer ({why})")
    elif not responses:
        lines.append("  no call executed: the tool-turn budget is spent; the model is asked to answer")
    for k, response in enumerate(responses or [], 1):
        shown = re.match(r"(Clip [\d.]+-[\d.]+ s):\n<\|vision_start\|>", response)
        lines.append(f"  tool {k}: {shown[1]} shown to the model" if shown else f"  tool {k}: {_indent(response)}")
    return lines


def ask(model, processor, record: dict, video_root: str, cfg, report_dir: str | None = None, out=None) -> dict:
    """The greedy agent on one asked question: each turn printed to `out` as it completes (turn_lines), then
    the answer alone on the last line (whitespace folded to one line; empty when the final turn has none).
    `report_dir`: the trajectory report page of it. `out`: default sys.stdout. Returns the predictions row; a
    video that fails to decode raises ValueError with its reason."""
    import rollout
    out = out or sys.stdout
    greedy = dataclasses.replace(cfg, temperature=0.0, group_size=1)
    show = lambda traj, responses: print("\n".join(turn_lines(traj, responses)), file=out, flush=True)
    [traj] = rollout.run_agent(model, processor, [record], video_root, greedy, on_turn=show)
    if traj.error:
        raise ValueError(traj.error)
    row = trajectory_row(record, traj, processor)
    if report_dir:
        import report as trajectory_report
        page = trajectory_report.write_report(report_dir, [record], [row], video_root=video_root, title=record["question"])
        say(f"trajectory report: {page}")
    if row["answer"] is None:
        say("no answer: the final turn has no <answer>...</answer>")
    print(" ".join(str(row["answer"] or "").split()), file=out, flush=True)
    return row

# ----------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):                        # one line, as every other bad input (--help has the usage)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="eval.py", description="Evaluate the agent on long-video benchmarks or your own prompt "
                                            "records, ask it about one video, or re-score predictions.")
    g = p.add_argument_group("ask (one question about one video)")
    g.add_argument("--video", default=None, help="a video file (any format PyAV reads): the agent answers --question "
                   "about it, printing each turn as it completes and the answer alone on the last line")
    g.add_argument("--question", default=None, help="with --video: the question")
    g.add_argument("--options", default=None, help='with --video: multiple choice, "A. red|B. blue|C. green" (or '
                   '"red|blue|green"); without it the answer is free-form')
    g = p.add_argument_group("data")
    g.add_argument("--bench", choices=BENCHES, default=None,
                   help="records: your own JSONL of prompt records (docs/method.md §9); a benchmark name: its "
                        "annotation file (docs/benchmarks.md); default synthetic (held-out split, tiny model)")
    g.add_argument("--annotations", default=None, help="the --bench file (json/jsonl/txt/parquet); needs --bench")
    g.add_argument("--video-root", default=None, help="folder the records' relative video paths start from "
                   "(read only; links inside it are followed)")
    g.add_argument("--mmvu-subset", choices=("mc", "all"), default="mc", help="mmvu: 625 multiple-choice or all 1,000")
    g.add_argument("--limit", type=int, default=None, help="first N questions only")
    g.add_argument("--synthetic-n", type=int, default=None,
                   help="synthetic: questions in the split, the preset's n_eval (train.py --n-eval)" +
                        recipes.per_preset("n_eval") + "; videos go to $PARAVT_CACHE/synthetic (default "
                        "./cache/synthetic)")
    g.add_argument("--synthetic-seed", type=int, default=data.SPLIT_SEEDS["held_out"],
                   help=f"synthetic: the split's seed (default {data.SPLIT_SEEDS['held_out']}: with the default "
                        f"--synthetic-n the held-out split of train.py --seed 0); train.py draws "
                        f"{data.SPLIT_SEEDS['sft']} + --seed for training and {data.SPLIT_SEEDS['held_out']} + --seed "
                        "held out, so 3000 is a fresh split for a run of seed 0")
    g.add_argument("--synthetic-mix", default=None,
                   help="synthetic: question kinds, kind=weight,... (e.g. search=1; default: the preset's task_mix, "
                        "the training mix)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="checkpoint dir, a train.py run dir (its best checkpoint by "
                   "evaluation, else its newest), hub id or 'tiny' (default tiny unless --predictions)")
    g.add_argument("--preset", choices=sorted(recipes.PRESETS), default=None,
                   help="paravt: 64 frames, 3 turns, <=5 calls, subagent; videoo3: 2 fps <=768 frames, 8 turns, "
                        "interleaved; tiny: the embedded default's (default: tiny for the tiny model, else paravt)")
    g.add_argument("--tool-mode", choices=("subagent", "interleaved"), default=None,
                   help="override the preset's mode (the tiny model defaults to interleaved, as train.py trains it)")
    g.add_argument("--batch-size", type=int, default=None, help="questions per rollout.run_agent call (one batched "
                   "rollout), the preset's eval_batch" + recipes.per_preset("eval_batch"))
    g.add_argument("--overview-nframes", type=int, default=None,
                   help="exactly K overview frames (ParaVT's nFrames), the preset's overview_nframes (None: the fps "
                        "rule)" + recipes.per_preset("overview_nframes"))
    g.add_argument("--max-turns", type=int, default=None,
                   help="the tool-turn budget: tool calls are executed in at most this many turns, then the "
                        "forced-answer message (0: answer from the overview), the preset's eval_max_turns" +
                        recipes.per_preset("eval_max_turns"))
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="per assistant turn, the preset's max_new_tokens" + recipes.per_preset("max_new_tokens"))
    g.add_argument("--out", default=None, help="predictions JSONL (resumed if it exists, error rows run again; default "
                   "runs/eval/<bench>-<preset>-<model>.jsonl, the synthetic bench's name with its size and seed); "
                   "with --gpus N each rank writes OUT.rank<r> and rank 0 merges them into OUT; with --video: "
                   "the one row")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", type=int, default=None, help="processes, the questions split between them (question i "
                   "-> rank i %% N), one per GPU (default: the visible CUDA devices, or 1)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto = cuda when visible; cpu with --gpus N: N gloo processes")
    g.add_argument("--threads", type=int, default=0, help="CPU threads per process (0 = torch's default)")
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
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.video is not None:
        if args.question is None:
            p.error("--video needs --question (and --options for a multiple-choice question)")
        clash = [f for f in ("bench", "annotations", "predictions", "video_root", "limit") if getattr(args, f) is not None]
        if clash or (args.gpus or 1) > 1:
            p.error(f"--video asks one question; it takes no --{(clash or ['gpus'])[0].replace('_', '-')}")
        return args
    if args.question is not None or args.options is not None:
        p.error("--question and --options ask about a video: pass --video FILE with them")
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


def main(argv=None):
    """The command line; a bad input ends in one line, `eval.py: error: ...`, exit status 2 (--debug: the
    traceback). Returns the metrics (the asked question's row with --video; None on a spawned run)."""
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, ImportError) as e:
        if args.debug:
            raise
        print(f"eval.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def model_path(name: str) -> str:
    """--model as load_model takes it: 'tiny' / 'tiny-qwen' / a hub id / a checkpoint dir as they are, a
    train.py run dir as its best checkpoint by evaluation (best.json), else its newest complete one."""
    if name in ("tiny", "tiny-qwen") or not os.path.isdir(name) or os.path.isfile(os.path.join(name, "config.json")):
        return name
    best = os.path.join(name, "best.json")
    if os.path.isfile(best):
        ckpt = os.path.join(name, json.load(open(best))["checkpoint"])
        if os.path.isdir(ckpt):
            return ckpt
    found = runtime.latest_checkpoint(name)
    if found is None:
        raise ValueError(f"--model {name}: neither a checkpoint (no config.json) nor a train.py run dir (no ckpt-*)")
    return found


def load_agent(name: str, device, preset: str | None, tool_mode: str | None, max_new_tokens: int | None,
               max_turns: int | None, overview_nframes: int | None):
    """(model, processor, RolloutConfig) of --model under --preset (None: recipes.model_preset's, tiny for the tiny
    model, else paravt) and the flags that override it; the tiny model (fresh or trained) gets its frame sizes
    (recipes.TINY_FRAMES)."""
    import model as model_lib
    import rollout
    preset, tiny = recipes.model_preset(name, preset)
    model, processor = model_lib.load_model(name, device=device, tiny_corpus=rollout.prompt_corpus())
    overrides = {**({"max_new_tokens": max_new_tokens} if max_new_tokens else {}),
                 **({"max_turns": max_turns} if max_turns is not None else {}),
                 **({"overview_nframes": overview_nframes} if overview_nframes else {})}
    return model, processor, preset_rollout_config(preset, tool_mode, tiny, **overrides)


def _agent(args, device):
    return load_agent(model_path(args.model or "tiny"), device, args.preset, args.tool_mode, args.max_new_tokens,
                      args.max_turns, args.overview_nframes)


def run(args: argparse.Namespace):
    """Ask one question (--video), re-score (--predictions), or evaluate on --gpus processes (runtime.launch:
    each rank runs rank_main on job_of(args): the records are loaded, and synthetic videos rendered, once)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible (use --device cpu, or leave --device auto)")
    if args.video is not None:                     # load_agent picks the preset (recipes.model_preset)
        record, root = ask_record(args.video, args.question, args.options)     # before the model loads
        if args.threads:
            torch.set_num_threads(args.threads)
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        model, processor, cfg = _agent(args, torch.device("cuda" if use_cuda else "cpu"))
        row = ask(model, processor, record, root, cfg, args.report)
        if args.out:
            _write_rows(Path(args.out), [row])
        return row
    job = job_of(args)
    if args.predictions:
        rows = read_predictions(args.predictions)
        metrics = report(job.bench, job.records, rows, extract=args.extract, random_fallback=args.random_fallback)
        return show(metrics, job.bench, job.records, rows, job.video_root, args.preset, args.report)
    model_path(args.model or "tiny")                 # a bad --model is refused before any process starts
    return runtime.launch(rank_main, job)


def preset_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The flags a preset sets, where not given: --preset itself (recipes.model_preset: the tiny model, fresh or
    trained, is evaluated as train.py trains it), --batch-size (its eval_batch), --synthetic-n (its n_eval: train.py's
    held-out split) and --synthetic-mix (its task_mix)."""
    if args.preset is None:
        args.preset = recipes.model_preset(model_path(args.model or "tiny"), None)[0]
    values = recipes.preset_values(args.preset)
    for flag, key in (("batch_size", "eval_batch"), ("synthetic_n", "n_eval"), ("synthetic_mix", "task_mix")):
        if getattr(args, flag) is None:
            setattr(args, flag, values[key])
    return args


def job_of(args: argparse.Namespace) -> argparse.Namespace:
    """The flags (`preset_defaults` filled in) plus what every rank shares: bench, records (--limit applied),
    video_root, out (the predictions file; the default names the split, the preset and the model)."""
    preset_defaults(args)
    bench = args.bench or "synthetic"
    if bench == "synthetic":
        video_root = os.path.join(os.environ.get("PARAVT_CACHE", "cache"), "synthetic")
        duration = recipes.preset_values(args.preset)["task_duration"]
        records = synthetic_records(video_root, n=args.synthetic_n, seed=args.synthetic_seed, duration=duration,
                                    mix=args.synthetic_mix)
    else:
        video_root = args.video_root or ""
        records = load(bench, args.annotations, video_root=args.video_root, mmvu_subset=args.mmvu_subset, warn=say)
    records = records[:args.limit] if args.limit else records
    name = args.model or "tiny"
    tag = Path(str(name).rstrip("/")).name
    split = f"{bench}-n{args.synthetic_n}-seed{args.synthetic_seed}" if bench == "synthetic" else bench
    split += f"-mix{re.sub(r'[^A-Za-z0-9.=]+', '_', args.synthetic_mix)}" if bench == "synthetic" and args.synthetic_mix else ""
    split += f"-turns{args.max_turns}" if args.max_turns is not None else ""
    split += f"-k{args.overview_nframes}" if args.overview_nframes else ""
    out = args.out or Path("runs") / "eval" / f"{split}-{args.preset}-{tag}.jsonl"   # another split, another file
    return argparse.Namespace(**{**vars(args), "bench": bench, "records": records, "video_root": video_root,
                                 "out": str(args.predictions or out)})


def rank_main(rank: int, job: argparse.Namespace) -> dict:
    """One rank of an evaluation: the model on this rank's device, its share of the questions (evaluate), and
    on rank 0 the merged predictions scored and shown."""
    rank, world, device = runtime.setup_distributed(rank, job.gpus, job.device, job.threads)
    model, processor, cfg = _agent(job, device)
    metrics = evaluate(model, processor, job.records, job.video_root, cfg, batch_size=job.batch_size, bench=job.bench,
                       out_path=job.out, extract=job.extract, random_fallback=job.random_fallback, rank=rank,
                       world=world)
    if rank == 0:
        ids = {r["id"] for r in job.records}
        rows = [r for r in read_predictions(job.out) if str(r["id"]) in ids]
        show(metrics, job.bench, job.records, rows, job.video_root, job.preset, job.report)
    runtime.finish(world)
    return metrics


def show(metrics: dict, bench: str, records: list[dict], rows: list[dict], video_root: str, preset: str,
         report_dir: str | None) -> dict:
    """Print the scores (the JSON last), write the trajectory report page, name the commonest error reasons."""
    print(format_report(metrics))
    if report_dir:
        import report as trajectory_report      # (eval.report is the scorer)
        page = trajectory_report.write_report(report_dir, records, rows, metrics=metrics, video_root=video_root,
                                              title=f"{bench} ({preset})")
        say(f"trajectory report: {page}")
    reasons = error_reasons(rows)
    if reasons:
        print(f"{sum(bool(r.get('error')) for r in rows)} row(s) ended in an error; the commonest reasons:", file=sys.stderr)
        for n, _, example in reasons:
            print(f"  {n} x {example}", file=sys.stderr)
    print(json.dumps(metrics, ensure_ascii=False), flush=True)
    return metrics


# -----------------------------------------------------------------------------
# The RL step's row: the rollout's agent figures over every rank's share, and the update's

def rollout_metrics(trajs: list, comps: list[dict], records: dict | None = None) -> dict:
    """Means over a step's trajectories: accuracy, format compliance, tool use (ParaVT's curves; the figures are
    rewards.py's agent figures over the non-error trajectories, turns = tool turns, 0 where undefined); with the
    records by id, on the synthetic task, also sums and counts per tool need (data.tool_needed under the overview
    the rollout drew): on the questions that needed the tool and on those that did not, the accuracy and the
    tool-call ratio (a trajectory that ended in an error counts as no call). split_accuracy turns the all-rank
    sums into ratios, so a rank's share of the step weighs by its count, not as a rank mean."""
    ok = [t for t in trajs if t.error is None]
    n = max(1, len(ok))
    calls = sum(t.n_calls for t in ok)
    tool_turns = sum(t.n_tool_turns for t in ok)
    zero = lambda x: 0.0 if x is None else x           # a step without a finished trajectory logs 0
    out = {f"reward/{k}": sum(c[k] for c in comps) / max(1, len(comps)) for k in (comps[0] if comps else {})}
    out.update(accuracy=out.get("reward/acc", 0.0),
               format_compliance=zero(rewards.format_compliance(t.text for t in ok)),
               tool_call_ratio=zero(rewards.tool_call_ratio(t.n_calls for t in ok)),
               calls_per_turn=rewards.calls_per_turn(calls, max(1, tool_turns)),
               turns=zero(rewards.mean_turns(t.n_tool_turns for t in ok)),
               tool_failure_rate=rewards.tool_failure_rate(sum(t.tool_failures for t in ok), max(1, calls)),
               truncated=sum(t.truncated or t.hit_turn_limit for t in ok) / n,
               mean_k=sum(t.nframes for t in ok) / n, bad_samples=len(trajs) - len(ok))
    if records is not None:      # sums and counts, the same keys on every rank (split_accuracy divides)
        need = [data.tool_needed(records[t.record_id], t.nframes) if t.record_id in records else None for t in trajs]
        for name, want in (("tool_needed", True), ("tool_not_needed", False)):
            group = [(t, c) for t, c, nd in zip(trajs, comps, need) if nd is want]
            out.update({f"{name}_hits": sum(c["acc"] for _, c in group),
                        f"{name}_calls": sum(t.error is None and t.n_calls > 0 for t, _ in group),
                        f"{name}_n": len(group)})
    return out


SUMMED = ("_hits", "_calls", "_n")          # rollout_metrics' per-need sums and counts (the other keys are means)


def merge_figures(parts: list[tuple[int, dict]]) -> dict:
    """rollout_metrics' figures of several shares of a step, (n trajectories, figures) each, as one: the means
    weighted by n (a key a share lacks weighs 0 there; a key of one share as it is), the per-need sums summed and
    turned into split_accuracy's ratios, so a share weighs by its count, not as a rank mean."""
    out = {}
    for k in sorted(set().union(*(f for _, f in parts))):
        have = [(n, f[k]) for n, f in parts if k in f]
        if k.endswith(SUMMED):
            out[k] = float(sum(v for _, v in have))
        else:
            weight = sum(n for n, _ in have)
            out[k] = float(have[0][1]) if len(have) == 1 else sum(n * v for n, v in have) / max(1, weight)
    return split_accuracy(out)


def split_accuracy(m: dict) -> dict:
    """rollout_metrics' (all-rank) sums -> acc_tool_needed / acc_tool_not_needed and tool_call_ratio_needed /
    tool_call_ratio_not_needed (hits / n, calls / n), left out where no question was."""
    for name in ("tool_needed", "tool_not_needed"):
        hits, calls, n = (m.pop(f"{name}_{k}", 0.0) for k in ("hits", "calls", "n"))
        if n:
            m[f"acc_{name}"] = hits / n
            m[f"tool_call_ratio_{name.removeprefix('tool_')}"] = calls / n
    return m


def decode_figures(pool: video.DecodePool | None) -> dict:
    """The decode pool's seconds decoding and waited on since the last call, and the frame cache's hit rate."""
    if pool is None:
        return {}
    ps = pool.stats(reset=True)
    return dict(decode_s=ps["decode_seconds"], decode_wait_s=ps["wait_seconds"],
                frame_cache_hit_rate=pool.cache.stats()["hit_rate"] if pool.cache else 0.0)


# The update's mismatch figures (grpo.policy_update): the trainer's log-probs of the sampled tokens against the
# sampler's. A class '' is every token the figures see; the rest split them (mismatch_classes):
#     sub / main    the tokens of sub-agent rows (Trajectory.parent set) / of the others
#     early / late  early: a policy token with at most EARLY_TOKENS policy tokens (itself included) since the last
#                   ENV token before it (the prompt, the forced "<think>\n", a tool response, inserted frames, the
#                   forced answer), i.e. each turn's first 8 sampled tokens; late: the policy tokens after them
#     low_p         behaviour probability exp(logp_behav) < LOW_P
MISMATCH_CLASSES = ("", "sub", "main", "early", "late", "low_p")
EARLY_TOKENS = 8            # a turn's first policy tokens after an ENV span (mismatch_classes)
LOW_P = 1e-3                # behaviour probability below which a token is low_p
RATIO_BAND = (0.8, 1.25)    # r = pi_train / pi_behav outside it counts in ratio_out


def mismatch_classes(policy: torch.Tensor, sub: torch.Tensor, behav_lp: torch.Tensor) -> dict:
    """The classes (above) of (B, L-1) target positions, each (B, L-1) bool: policy, the next token is the
    policy's; sub (B,), the row is a sub-agent's; behav_lp the behaviour log-probs."""
    idx = torch.arange(policy.shape[1]).expand(policy.shape)
    last_env = torch.where(policy, -1, idx).cummax(1).values     # the last ENV target at or before (-1: token 0)
    early = policy & (idx - last_env <= EARLY_TOKENS)
    sub = sub.bool()[:, None].expand(policy.shape)
    return {"sub": policy & sub, "main": policy & ~sub, "early": early, "late": policy & ~early,
            "low_p": policy & (behav_lp < math.log(LOW_P))}


def _p99_tail(n: int) -> tuple[float, int]:
    """For n values: the linear-interpolation quantile's position h = 0.99 (n - 1) (numpy's default) and the
    k = n - floor(h) largest values that hold the sorted values at floor(h) and floor(h) + 1."""
    h = 0.99 * (n - 1)
    return h, n - math.floor(h)


def mismatch_figures(train_lp: torch.Tensor, behav_lp: torch.Tensor, mask: torch.Tensor, classes: dict | None = None,
                     world: int = 1, group=None) -> dict:
    """
    The trainer's log-probs of the sampled tokens against the sampler's, over the tokens of `mask` (any shape; the
    inputs and each class mask of `classes`, MISMATCH_CLASSES, that shape). With d = logp_train - logp_behav and
    r = exp(d), per class c ('' = all; keys mismatch/{c/}NAME):
        abs_diff_mean, abs_diff_p99, abs_diff_max   of |d| (p99: the linear-interpolation quantile, numpy's default)
        k3          mean of r - 1 - log r: the k3 estimate of KL(pi_behav || pi_train) from behaviour samples
                    (Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html)
        ratio_out   the fraction of tokens with r outside RATIO_BAND
        tokens      the count; a class without tokens reports 0 everywhere
    world > 1: over the tokens of every rank of `group`, exactly (one all-reduce of the sums, one all-gather of each
    class's largest |d|, the n - floor(0.99 (n - 1)) that decide p99 and the max).
    """
    m, classes = mask.bool(), classes or {}
    d = (train_lp.double() - behav_lp.double())[m]
    sel = {c: classes[c].bool()[m] if c in classes else torch.full_like(d, not c, dtype=torch.bool)
           for c in MISMATCH_CLASSES}                                # a class not given: none of the tokens
    ad, k3 = d.abs(), torch.expm1(d) - d
    out_band = (d < math.log(RATIO_BAND[0])) | (d > math.log(RATIO_BAND[1]))
    sums = torch.tensor([[float(s.sum()), float(ad[s].sum()), float(k3[s].sum()), float(out_band[s].sum())]
                         for s in sel.values()], dtype=torch.float64)
    if world > 1:
        import torch.distributed as dist
        device = runtime.collective_device(dist.get_backend_config(group))
        sums = sums.to(device)
        dist.all_reduce(sums, group=group)
        sums = sums.cpu()
    ks = [_p99_tail(int(n))[1] if n > 0 else 0 for n in sums[:, 0].tolist()]
    tails = [torch.full((k,), float("-inf"), dtype=torch.float64) for k in ks]
    for tail, s, k in zip(tails, sel.values(), ks):
        top = ad[s].topk(min(k, int(s.sum()))).values
        tail[:len(top)] = top
    tails = torch.cat(tails)
    if world > 1 and len(tails):
        parts = [torch.empty_like(tails, device=device) for _ in range(world)]
        dist.all_gather(parts, tails.to(device), group=group)
        tails = torch.stack(parts).cpu()                                       # (world, sum k)
    tails = tails[None] if tails.dim() == 1 else tails
    out, start = {}, 0
    for c, (n, s_abs, s_k3, s_out), k in zip(MISMATCH_CLASSES, sums.tolist(), ks):
        key = f"mismatch/{c + '/' if c else ''}"
        top = tails[:, start:start + k].flatten().topk(k).values.tolist()      # the k largest |d|, descending
        start += k
        p99 = mx = 0.0
        if n:
            h, _ = _p99_tail(int(n))
            lo = top[k - 1]                                         # sorted ascending, index floor(h)
            p99 = lo + (h - math.floor(h)) * (top[k - 2] - lo) if k >= 2 else lo
            mx = top[0]
        n_ = max(n, 1)
        out.update({f"{key}abs_diff_mean": s_abs / n_, f"{key}abs_diff_p99": p99, f"{key}abs_diff_max": mx,
                    f"{key}k3": s_k3 / n_, f"{key}ratio_out": s_out / n_, f"{key}tokens": int(n)})
    return out


def rollout_figures(g, records: dict) -> tuple[int, dict]:
    """(n trajectories, figures) of one rank's share of a step (g: grpo.Groups): rollout_metrics, the mean task
    reward, the zero-variance fraction and the KL folded into the reward; what step_row merges."""
    figures = rollout_metrics(g.trajs, g.comps, records)
    figures.update(reward=float(g.rewards.mean()) if g.trajs else 0.0, zero_var_frac=g.zero_var_frac,
                   reward_kl=float(g.seq_kl.mean()) if g.trajs else 0.0)
    return len(g.trajs), figures


def step_row(shares: list[tuple[int, dict]], update: dict, groups: int) -> dict:
    """An RL step's row, in both loops: every share's rollout figures merged, the update's figures, the groups."""
    return {**merge_figures(shares), **update, "groups": groups}


def step_line(step: int, steps: int, row: dict) -> str:
    """The step's progress line."""
    return (f"rl {step}/{steps} | R {row['reward']:.3f} | acc {row['accuracy']:.2f} | "
            f"fmt {row['format_compliance']:.2f} | tool {row['tool_call_ratio']:.2f} | turns {row['turns']:.2f} | "
            f"K {row['mean_k']:.1f} | zero-var {row['zero_var_frac']:.2f} | draws {row['draws']:.0f} | "
            f"clip {row['clip_frac']:.3f} | kl {row['kl']:.4f} | {row['step_time']:.1f}s")


if __name__ == "__main__":
    main()
