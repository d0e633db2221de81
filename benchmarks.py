"""
Benchmark files, answer parsers and official-style scorers: the papers' long-video benchmarks read
from their own distributed files and scored the way their official scorers score. eval.py runs the
agent on the records these loaders return; nothing here touches a model or a video.

    loaders       load(bench, path, ...) -> prompt records (docs/method.md §9), one per question;
                  sniff(path) -> which bench a file looks like (for "wrong file" messages)
    extraction    EXTRACTORS / TIME_EXTRACTORS: each official answer parser, selectable by name
    scoring       judge(record, row, extract) -> one row's score; score(bench, records, predictions,
                  extract) -> metrics dict; agent_stats(rows); format_report(metrics)

Formats, parsers and scorers follow docs/benchmarks.md (sources there, commit by commit):
VideoMME (+subtitles), LongVideoBench (val), LVBench, MLVU (dev), MMVU (val), VideoMMMU, Video-Holmes:
multiple-choice accuracy in %; Charades-STA: mIoU and R@{0.3,0.5,0.7} in % over ALL queries.
`records` is the project's own JSONL schema (data.read_valid_records), scored by task with the same rules:
mcq accuracy, tvg mIoU / R@k, oe by the open-ended rule. Papers: ParaVT arXiv 2605.20342, Video-o3
arXiv 2601.23224.

Decisions (each visible in the report that score() returns):
  * No random letter when parsing fails (LongVideoBench / MMMU / lmms-eval do draw one): unparsed
    answers are counted and scored wrong; `--random-fallback SEED` restores the draw, seeded per id.
  * Rows whose run failed (missing video, decode error) are error rows: in the totals, scored wrong.
  * An agentic response carries `<think>` / `<answer>` tags. The official letter and time parsers
    were written for bare answers, so they read the answer span (rewards.extract_answer) when the
    response has `<answer>` or `</think>`, the raw text otherwise. video_holmes_official, paravt,
    rewards_letter and answer_tag_then_mcq read their own tags from the raw text.
  * Open-ended items (MMVU all, VideoMMMU open, oe records) are scored by a rule (normalised exact
    match, or equal numbers); the official scorers are more lenient (an LLM judge for MMVU, MMMU's
    substring/number rule for VideoMMMU), so these numbers are a lower bound.
"""
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable

import data
import rewards

BENCHES = ("records", "videomme", "videomme_sub", "longvideobench", "lvbench", "mlvu", "mmvu", "videommmu",
           "video_holmes", "charades_sta", "synthetic")
NAMES = {"videomme": "Video-MME", "videomme_sub": "Video-MME", "longvideobench": "LongVideoBench", "lvbench": "LVBench",
         "mlvu": "MLVU", "mmvu": "MMVU", "videommmu": "VideoMMMU", "video_holmes": "Video-Holmes",
         "charades_sta": "Charades-STA"}


class WrongFormat(ValueError):
    """A file that is not of the kind a loader reads; the message says what was expected."""

# ----------------------------------------------------------------------------- reading files

def _drop_trailing_commas(text: str) -> str:
    """Remove commas that directly precede `}` or `]` outside strings (the VideoMME template is not
    strict JSON). A character scan that tracks strings and escapes, not eval."""
    out, in_str, escaped = [], False, False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "}]":
            j = len(out) - 1
            while j >= 0 and out[j].isspace():
                j -= 1
            if j >= 0 and out[j] == ",":
                del out[j]
        out.append(ch)
    return "".join(out)


def _jsonl(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _plain(value):
    """numpy arrays / scalars from parquet -> Python lists / numbers."""
    return value.tolist() if hasattr(value, "tolist") else value


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pandas
    except ImportError:
        try:
            import pyarrow.parquet
        except ImportError:
            raise ImportError(f"{path}: reading parquet needs pandas or pyarrow, neither is installed "
                              "(pip install pandas pyarrow, or export the rows to JSON/JSONL)") from None
        return pyarrow.parquet.read_table(path).to_pylist()
    return [{k: _plain(v) for k, v in row.items()} for row in pandas.read_parquet(path).to_dict("records")]


def read_rows(path) -> object:
    """Contents of an annotation file: parquet, JSON (trailing commas tolerated) or JSONL."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: annotation file not found")
    if path.suffix == ".parquet":
        return _read_parquet(path)
    text, err = path.read_text(encoding="utf-8-sig"), None
    for parse in (json.loads, _jsonl, lambda t: json.loads(_drop_trailing_commas(t))):
        try:
            return parse(text)
        except json.JSONDecodeError as e:
            err = err or e
    raise ValueError(f"{path}: not JSON, JSONL or parquet ({err})")

# ----------------------------------------------------------------------------- records

def make_record(id, video: str, question: str, answer, task: str = "mcq", options=None, clues=None,
                duration=None, subtitles=None, data_type=None, **meta) -> dict:
    """A prompt record (docs/method.md §9). meta holds task_type / duration_group / category breakdown keys."""
    return {"id": str(id), "video": video, "question": question, "options": options, "answer": answer,
            "task": task, "clues": clues, "data_type": rewards.infer_data_type(task, clues, data_type),
            "duration": None if duration is None else float(duration), "subtitles": subtitles,
            "meta": {k: v for k, v in meta.items() if v is not None}}


def _require(row, fields, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, expected an object with fields {list(fields)}")
    missing = [f for f in fields if row.get(f) is None]
    if missing:
        raise ValueError(f"{where} lacks field(s) {missing} (expected {list(fields)})")


def _rows_of(data, path, bench: str, expected: str, signature: Callable[[dict], bool]) -> list:
    """The top-level list of a row-format file, after checking its first row looks like `bench`."""
    if not (isinstance(data, list) and data and isinstance(data[0], dict) and signature(data[0])):
        raise WrongFormat(f"{path}: not a {bench} annotation file; expected {expected}")
    return data


def _strip_letter(option: str, letter: str) -> str:
    """'A. Apples.' -> 'Apples.' ('(A) x', 'A) x', 'A: x' too), only for the option's own letter."""
    return re.sub(rf"^\s*(?:\({letter}\)|{letter}[.:)])\s*", "", str(option), count=1)


_INLINE_OPTION = re.compile(r"^\s*\(([A-Z])\)\s*(.*?)\s*$")


def _split_inline_options(text: str) -> tuple[str, list[str]]:
    """'Q?\\n(A) x\\n(B) y' -> ('Q?', ['x', 'y']) (LVBench, MLVU HF rows)."""
    question, options = [], []
    for line in text.splitlines():
        m = _INLINE_OPTION.match(line)
        if m:
            options.append(m.group(2))
        elif not options:
            question.append(line)
    return "\n".join(question).strip(), options


def _clock(t: str) -> float:
    value = 0.0
    for part in t.split(":"):                      # ss, mm:ss, hh:mm:ss
        value = value * 60.0 + float(part)
    return value


def _time_reference(ref) -> list[list[float]] | None:
    """LVBench 'MM:SS-MM:SS' (also h:mm:ss, several ranges) -> [[s, e], ...] seconds; None if none."""
    if not isinstance(ref, str):
        return None
    spans = re.findall(r"(\d+(?::\d+){0,2}(?:\.\d+)?)\s*-\s*(\d+(?::\d+){0,2}(?:\.\d+)?)", ref)
    return [[_clock(s), _clock(e)] for s, e in spans] or None


def read_srt(path) -> str | None:
    """Subtitle text of an .srt file, one cue per line, `<font ...>` tags stripped; None if missing."""
    path = Path(path)
    if not path.is_file():
        return None
    lines = []
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8-sig", errors="replace").strip()):
        body = block.strip().splitlines()
        if body and body[0].strip().isdigit():
            body = body[1:]                         # cue number
        lines += [re.sub(r"</?font[^>]*>", "", l).strip() for l in body if "-->" not in l]
    return "\n".join(l for l in lines if l)

# ----------------------------------------------------------------------------- loaders

def load_videomme(path, video_root=None, subtitles: bool = False) -> list[dict]:
    """HF rows (parquet/JSON/JSONL) or the official nested template (trailing commas allowed).
    Options carry 'A. ', stripped here. Video `data/<videoID>.mp4` (the template has no videoID:
    its video_id is used); subtitles `<video_root>/subtitle/<videoID>.srt` when `subtitles`."""
    expected = ("rows {videoID, question_id, task_type, question, options, answer, duration, domain} "
                "or the nested template [{video_id, duration, questions: [{question_id, ...}]}]")
    data = _rows_of(read_rows(path), path, "videomme", expected, lambda r: "questions" in r or "question_id" in r)
    flat = []
    for i, row in enumerate(data):
        if "questions" in row:
            _require(row, ("video_id", "questions"), f"{path}: record {i}")
            flat += [(f"{path}: record {i} question {j}", {**row, **q} if isinstance(q, dict) else q)
                     for j, q in enumerate(row["questions"])]
        else:
            flat.append((f"{path}: record {i}", row))
    out = []
    for where, row in flat:
        _require(row, ("question_id", "question", "options", "answer"), where)
        vid = row.get("videoID") or row.get("video_id")
        if vid is None:
            raise ValueError(f"{where} lacks field(s) ['videoID'] (or 'video_id')")
        subs = read_srt(Path(video_root) / "subtitle" / f"{vid}.srt") if subtitles and video_root else None
        out.append(make_record(row["question_id"], f"data/{vid}.mp4", row["question"], str(row["answer"]).strip(),
                               options=[_strip_letter(o, chr(65 + k)) for k, o in enumerate(row["options"])],
                               subtitles=subs, task_type=row.get("task_type"), duration_group=row.get("duration"),
                               category=row.get("domain"), sub_category=row.get("sub_category"),
                               response=row.get("response")))
    return out


def load_longvideobench(path) -> list[dict]:
    """lvb_val.json (candidates) or HF parquet rows (option0..option4, 'N/A' = absent).
    GT letter = chr(65 + correct_choice); video `videos/<video_path>`."""
    expected = ("rows {id, video_path, question, candidates | option0..option4, correct_choice, "
                "duration_group, question_category}")
    data = _rows_of(read_rows(path), path, "longvideobench", expected,
                    lambda r: "correct_choice" in r and ("candidates" in r or "option0" in r))
    out = []
    for i, row in enumerate(data):
        where = f"{path}: record {i}"
        _require(row, ("id", "video_path", "question", "correct_choice"), where)
        options = (list(row["candidates"]) if row.get("candidates") is not None else
                   [row[f"option{k}"] for k in range(5) if row.get(f"option{k}") not in (None, "N/A")])
        choice = int(row["correct_choice"])
        if not 0 <= choice < len(options):
            raise ValueError(f"{where}: correct_choice {choice} outside its {len(options)} options")
        out.append(make_record(row["id"], f"videos/{row['video_path']}", row["question"], chr(65 + choice),
                               options=options, duration=row.get("duration"), task_type=row.get("question_category"),
                               duration_group=row.get("duration_group"), category=row.get("topic_category")))
    return out


def load_lvbench(path) -> list[dict]:
    """video_info.meta.jsonl (one video per line, nested `qa`) or HF flattened rows. Options are
    inline in the question ('(A) ...'); time_reference 'MM:SS-MM:SS' -> clues; video `<key>.mp4`."""
    expected = ("video_info.meta.jsonl {key, type, video_info, qa: [{uid, question, answer, question_type, "
                "time_reference}]} or rows {uid, question, answer, video_path}")
    data = _rows_of(read_rows(path), path, "lvbench", expected, lambda r: "qa" in r or "uid" in r)
    flat = []
    for i, row in enumerate(data):
        if "qa" in row:
            _require(row, ("key", "qa"), f"{path}: record {i}")
            minutes = (row.get("video_info") or {}).get("duration_minutes")
            base = {"video_path": f"{row['key']}.mp4", "type": row.get("type"),
                    "duration": None if minutes is None else 60.0 * minutes}
            flat += [(f"{path}: record {i} qa {j}", {**base, **qa} if isinstance(qa, dict) else qa)
                     for j, qa in enumerate(row["qa"])]
        else:
            flat.append((f"{path}: record {i}", row))
    out = []
    for where, row in flat:
        _require(row, ("uid", "question", "answer"), where)
        video = row.get("video_path") or (f"{row['key']}.mp4" if row.get("key") else None)
        if video is None:
            raise ValueError(f"{where} lacks field(s) ['video_path'] (or 'key')")
        question, options = _split_inline_options(row["question"])
        if row.get("options"):
            options = [_strip_letter(o, chr(65 + k)) for k, o in enumerate(row["options"])]
        if not options:
            raise ValueError(f"{where}: no '(A) ...' options in its question")
        answer = str(row["answer"]).strip().strip("()")
        out.append(make_record(row["uid"], video, question, answer, options=options,
                               clues=_time_reference(row.get("time_reference")), duration=row.get("duration"),
                               task_type=row.get("question_type"), category=row.get("type"),
                               time_reference=row.get("time_reference")))
    return out


def _mlvu_letter(answer, candidates: list, where: str) -> str:
    """GitHub answer = option text -> its letter; HF answer = a letter already."""
    answer = str(answer).strip()
    if answer in [str(c).strip() for c in candidates]:
        return chr(65 + [str(c).strip() for c in candidates].index(answer))
    m = re.fullmatch(r"\(?([A-Z])\)?", answer)
    if m and ord(m.group(1)) - 65 < len(candidates):
        return m.group(1)
    raise ValueError(f"{where}: answer {answer!r} is neither one of its candidates nor a letter")


def load_mlvu(path) -> list[dict]:
    """GitHub dev JSON (a task file's list, or {task_dir: list}; answer = option text) or HF rows
    (answer = letter, options inline in the question). The generation tasks (sub_scene, summary:
    no candidates) are not multiple choice and not in M-Avg: skipped. GitHub video `video/<task_dir>/<video>`."""
    expected = ("GitHub JSON [{video, duration, question, candidates, answer, question_type}] or "
                "{task_dir: [...]}, or HF rows {video_name, question, candidates, answer, task_type, question_id}")
    data = read_rows(path)
    groups = list(data.items()) if isinstance(data, dict) else [(Path(path).stem, data)]
    ok = lambda r: isinstance(r, dict) and "question" in r and ("video" in r or "video_name" in r)
    if not (groups and all(isinstance(g, list) for _, g in groups) and groups[0][1] and ok(groups[0][1][0])):
        raise WrongFormat(f"{path}: not a mlvu annotation file; expected {expected}")
    out = []
    for task_dir, rows in groups:
        for j, row in enumerate(rows):
            where = f"{path}: record {task_dir}[{j}]" if isinstance(data, dict) else f"{path}: record {j}"
            hf = isinstance(row, dict) and "video_name" in row
            _require(row, ("question", "answer", "video_name" if hf else "video"), where)
            if row.get("candidates") is None:
                if "scoring_points" in row or row.get("question_type") in ("subPlot", "summary"):
                    continue                           # generation task, not multiple choice
                raise ValueError(f"{where} lacks field(s) ['candidates']")
            question, _ = _split_inline_options(row["question"])
            out.append(make_record(row["question_id"] if hf and row.get("question_id") else f"{task_dir}_{j}",
                                   row["video_name"] if hf else f"video/{task_dir}/{row['video']}", question,
                                   _mlvu_letter(row["answer"], row["candidates"], where),
                                   options=[str(c) for c in row["candidates"]], duration=row.get("duration"),
                                   task_type=row.get("task_type") or row.get("question_type")))
    return out


def load_mmvu(path, subset: str = "mc") -> list[dict]:
    """validation.json / HF rows; choices {A..E} ('' for open-ended). subset 'mc' = the 625
    multiple-choice items (Video-R1 / Video-o3 tables), 'all' = all 1,000 (open-ended task 'oe')."""
    if subset not in ("mc", "all"):
        raise ValueError(f"mmvu subset must be 'mc' or 'all', got {subset!r}")
    expected = "rows {id, video | video_path, question_type, question, choices {A..E}, answer, metadata {subject}}"
    data = _rows_of(read_rows(path), path, "mmvu", expected, lambda r: "choices" in r and "question_type" in r)
    out = []
    for i, row in enumerate(data):
        where = f"{path}: record {i}"
        _require(row, ("id", "question", "question_type", "choices", "answer"), where)
        choices = json.loads(row["choices"]) if isinstance(row["choices"], str) else row["choices"]
        video = row.get("video_path") or str(row.get("video", ""))
        video = video[video.find("videos/"):] if "videos/" in video else video
        subject = (row.get("metadata") or {}).get("subject") or Path(video).parent.name or None
        if row["question_type"] == "multiple-choice":
            task, options = "mcq", [choices[k] for k in sorted(choices) if choices[k] not in ("", None)]
        elif row["question_type"] == "open-ended":
            if subset == "mc":
                continue
            task, options = "oe", None
        else:
            raise ValueError(f"{where}: question_type {row['question_type']!r} is not multiple-choice / open-ended")
        out.append(make_record(row["id"], video, row["question"], str(row["answer"]).strip(), task=task,
                               options=options, category=subject, task_type=row["question_type"], subset=subset))
    return out


VIDEOMMMU_DISCIPLINE = {  # subject -> video folder (lmms-eval videommmu get_cache_dir)
    **dict.fromkeys(["Art", "Art_Theory", "Design", "Music"], "Art"),
    **dict.fromkeys(["Biology", "Chemistry", "Geography", "Math", "Physics"], "Science"),
    **dict.fromkeys(["History", "Literature", "Sociology", "Psychology"], "Humanities"),
    **dict.fromkeys(["Agriculture", "Architecture_and_Engineering", "Computer_Science", "Electronics",
                     "Energy_and_Power", "Materials", "Mechanical_Engineering"], "Engineering"),
    **dict.fromkeys(["Basic_Medical_Science", "Clinical_Medicine", "Diagnostics_and_Laboratory_Medicine",
                     "Pharmacy", "Public_Health"], "Medicine"),
    **dict.fromkeys(["Accounting", "Economics", "Finance", "Manage", "Marketing"], "Business"),
}


def load_videommmu(path) -> list[dict]:
    """GitHub nested {"Perception": {"0": {...}}} (ids become 'Track/id': one item id appears in
    every track) or HF rows of one config. MC unless question_type says otherwise ('open' -> oe).
    Video `<Discipline>/<id>.mp4`; Adaptation shows its question image in the LAST frame."""
    expected = ('GitHub nested {"Perception": {"0": {id, question, options, answer}}} or rows '
                '{id, question, options, answer, question_type}')
    data = read_rows(path)
    if isinstance(data, dict) and data and all(isinstance(g, dict) for g in data.values()):
        items = [(track, f"{path}: record {track}[{key}]", row) for track, g in data.items() for key, row in g.items()]
    elif isinstance(data, list):
        items = [(None, f"{path}: record {i}", row) for i, row in enumerate(data)]
    else:
        items = []
    if not items or not (isinstance(items[0][2], dict) and "question" in items[0][2] and "options" in items[0][2]):
        raise WrongFormat(f"{path}: not a videommmu annotation file; expected {expected}")
    out = []
    for track, where, row in items:
        _require(row, ("id", "question", "answer"), where)
        track = track or row.get("track") or row.get("config")
        subject = "_".join(str(row["id"]).split("_")[1:-1])
        if subject not in VIDEOMMMU_DISCIPLINE:
            raise ValueError(f"{where}: id {row['id']!r} names no known subject ('<split>_<Subject>_<n>')")
        options = [_strip_letter(o, chr(65 + k)) for k, o in enumerate(row.get("options") or [])]
        qtype = row.get("question_type") or ("multiple-choice" if options else "open")
        mc = qtype == "multiple-choice" and bool(options)
        out.append(make_record(f"{track}/{row['id']}" if track else row["id"],
                               f"{VIDEOMMMU_DISCIPLINE[subject]}/{row['id']}.mp4", row["question"],
                               str(row["answer"]).strip(), task="mcq" if mc else "oe", options=options if mc else None,
                               task_type=track, category=subject, question_type=qtype))
    return out


def load_video_holmes(path) -> list[dict]:
    """test_Video-Holmes.json (list of {"video ID", "Question ID", "Question Type", "Question",
    "Options" {A..F}, "Answer"}); video `videos/<video ID>.mp4`."""
    expected = 'a list of {"video ID", "Question ID", "Question Type", "Question", "Options", "Answer"}'
    data = _rows_of(read_rows(path), path, "video_holmes", expected, lambda r: "video ID" in r and "Options" in r)
    out = []
    for i, row in enumerate(data):
        _require(row, ("video ID", "Question ID", "Question", "Options", "Answer"), f"{path}: record {i}")
        opts = row["Options"]
        out.append(make_record(f"{row['video ID']}_{row['Question ID']}", f"videos/{row['video ID']}.mp4",
                               row["Question"], str(row["Answer"]).strip(), options=[opts[k] for k in sorted(opts)],
                               task_type=row.get("Question Type")))
    return out


def _timestamp_pair(ts, where: str) -> list[float]:
    """[start, end] in seconds of a benchmark row's timestamp pair; ValueError naming `where` if it is not one."""
    ts = _plain(ts)
    if not (isinstance(ts, (list, tuple)) and len(ts) == 2):
        raise ValueError(f"{where}: timestamp {ts!r} is not [start, end]")
    return [float(ts[0]), float(ts[1])]


def load_charades_sta(path) -> list[dict]:
    """Original TXT ('VID s e##sentence', id = 0-based row index), HF rows {video, caption,
    timestamp} (id = row index; float16 timestamps kept as stored, as lmms-eval scores them) or
    Video-o3 JSON {doc_id, video, problem, solution.clue[].timestamp, duration}. Task tvg."""
    expected = ("TXT lines 'VID START END##sentence', rows {video, caption, timestamp} or "
                "Video-o3 rows {doc_id, video, problem, solution: {clue: [{timestamp}]}, duration}")
    p = Path(path)
    if p.suffix != ".parquet" and p.is_file() and p.read_text(encoding="utf-8-sig").lstrip()[:1] not in ("[", "{"):
        out = []
        for i, line in enumerate(l for l in p.read_text(encoding="utf-8-sig").splitlines() if l.strip()):
            m = re.fullmatch(r"\s*(\S+)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s*##(.*)", line)
            if m is None:
                raise WrongFormat(f"{path}: row {i} is not a charades_sta line; expected {expected}")
            win = [float(m.group(2)), float(m.group(3))]
            out.append(make_record(i, f"{m.group(1)}.mp4", m.group(4).strip(), win, task="tvg", clues=[win]))
        return out
    data = _rows_of(read_rows(path), path, "charades_sta", expected,
                    lambda r: ("doc_id" in r and "solution" in r) or ("caption" in r and "timestamp" in r))
    out = []
    for i, row in enumerate(data):
        where = f"{path}: record {i}"
        if "doc_id" in data[0]:
            _require(row, ("doc_id", "video", "problem", "solution"), where)
            clues = [_timestamp_pair(c.get("timestamp"), where) for c in row["solution"].get("clue") or []]
            if not clues:
                raise ValueError(f"{where}: solution.clue holds no timestamp")
            out.append(make_record(row["doc_id"], row["video"], row["problem"], clues[0], task="tvg", clues=clues,
                                   duration=row.get("duration")))
        else:
            _require(row, ("video", "caption", "timestamp"), where)
            win = _timestamp_pair(row["timestamp"], where)
            out.append(make_record(i, row["video"], row["caption"], win, task="tvg", clues=[win]))
    return out


def synthetic_records(video_root: str, n: int, seed: int, duration: float, mix: str | None = None) -> list[dict]:
    """The generated task's records (data.make_split; seed SPLIT_SEEDS["held_out"] + s: train.py's held-out split)."""
    return data.make_split(video_root, n, seed=seed, mix=data.parse_mix(mix), duration=duration)


RECORDS_MAX_BAD_FRACTION = 0.5   # an evaluation's own records: past this fraction of bad lines the file is refused


def load_records(path, warn: Callable[[str], None]) -> list[dict]:
    """The project's own prompt records (JSONL, docs/method.md §9) via data.read_valid_records; each bad line is
    passed to `warn` ("file:line: reason") and skipped. Videos are not checked here: a record whose video
    is missing becomes an error row, with its reason, when the agent runs."""
    kind = sniff(path)
    if kind not in (None, "records"):
        raise WrongFormat(f"{path}: not a file of prompt records; {describe(kind)}")
    records, errors = data.read_valid_records(str(path), None, max_bad_fraction=RECORDS_MAX_BAD_FRACTION)
    for e in errors:
        warn(f"skipping {e}")
    return records


_CHARADES_LINE = re.compile(r"\s*\S+\s+\d+(?:\.\d+)?\s+\d+(?:\.\d+)?\s*##.*")
_ROW_KINDS = (  # (kind, signature of a file's first row); the first that matches names the file
    ("sft", lambda r: "messages" in r and "prompt" in r),
    ("predictions", lambda r: "response" in r and "id" in r and "question" not in r),
    ("records", lambda r: all(k in r for k in ("id", "video", "question", "answer", "task"))),
    ("videomme", lambda r: ("questions" in r and "video_id" in r)
                           or ("question_id" in r and "options" in r and ("videoID" in r or "video_id" in r))),
    ("longvideobench", lambda r: "correct_choice" in r),
    ("lvbench", lambda r: ("qa" in r and "key" in r) or "uid" in r),
    ("mmvu", lambda r: "choices" in r and "question_type" in r),
    ("video_holmes", lambda r: "video ID" in r and "Options" in r),
    ("charades_sta", lambda r: ("doc_id" in r and "solution" in r) or ("caption" in r and "timestamp" in r)),
    ("mlvu", lambda r: "candidates" in r and ("video" in r or "video_name" in r)),
    ("videommmu", lambda r: "question" in r and "options" in r and "id" in r),
)


def sniff(path) -> str | None:
    """What a file looks like: a bench name, "records", "sft" (train.py --sft-data), "predictions"
    (eval.py --out), or None (unreadable, empty, or nothing known)."""
    try:
        rows = read_rows(path)
    except (ValueError, OSError, ImportError):
        try:
            lines = [l for l in Path(path).read_text(encoding="utf-8-sig").splitlines() if l.strip()]
        except (OSError, UnicodeDecodeError):
            return None
        return "charades_sta" if lines and all(_CHARADES_LINE.fullmatch(l) for l in lines[:5]) else None
    if isinstance(rows, dict) and rows:           # MLVU {task: [...]}, VideoMMMU {track: {...}}, else one row
        group = next(iter(rows.values()))
        if all(isinstance(g, list) for g in rows.values()):
            rows = group
        elif all(isinstance(g, dict) for g in rows.values()):
            rows = list(group.values())
        else:
            rows = [rows]                          # a one-line JSONL file reads as its object
    first = rows[0] if isinstance(rows, list) and rows else None
    if not isinstance(first, dict):
        return None
    return next((kind for kind, signature in _ROW_KINDS if signature(first)), None)


def describe(kind: str) -> str:
    """A sentence saying what a file of this kind is and which command reads it."""
    if kind == "records":
        return "this is a file of prompt records (the project's JSONL schema); use eval.py --bench records"
    if kind == "sft":
        return "this is an SFT trajectory file (train.py --sft-data), not an evaluation set"
    if kind == "predictions":
        return ("this is a predictions file (eval.py --out); re-score it with --predictions FILE and the "
                "--bench / --annotations it was made from")
    return f"this is a {NAMES.get(kind, kind)} annotation file; use eval.py --bench {kind}"


def load(bench: str, path, video_root=None, mmvu_subset: str = "mc",
         warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> list[dict]:
    """Prompt records of one benchmark file (or, bench "records", of a JSONL of the project's own records;
    its bad lines go to `warn`); ids are checked unique. A file of another kind is refused with what it
    looks like."""
    loaders = {"records": lambda: load_records(path, warn),
               "videomme": lambda: load_videomme(path, video_root),
               "videomme_sub": lambda: load_videomme(path, video_root, subtitles=True),
               "longvideobench": lambda: load_longvideobench(path), "lvbench": lambda: load_lvbench(path),
               "mlvu": lambda: load_mlvu(path), "mmvu": lambda: load_mmvu(path, mmvu_subset),
               "videommmu": lambda: load_videommmu(path), "video_holmes": lambda: load_video_holmes(path),
               "charades_sta": lambda: load_charades_sta(path)}
    if bench not in loaders:
        raise ValueError(f"unknown bench {bench!r}; choose from {sorted(loaders)} (synthetic: synthetic_records)")
    try:
        records, seen = loaders[bench](), set()
    except WrongFormat as e:
        kind = sniff(path)
        if kind is None or kind == bench or bench.startswith(kind) or bench == "records":
            raise
        raise WrongFormat(f"{e}; {describe(kind)}") from None
    if not records:
        raise ValueError(f"{path}: holds no {bench} question to evaluate")
    for r in records:
        if r["id"] in seen:
            raise ValueError(f"{path}: question id {r['id']!r} occurs twice")
        seen.add(r["id"])
    return records

# ----------------------------------------------------------------------------- letter extraction
# Each strategy: (text, letters, options) -> letter | None. Results outside `letters` count as unparsed.

VIDEOMME_PREFIXES = ["The best answer is", "The correct answer is", "The answer is", "The answer",
                     "The best option is", "The correct option is", "Best answer:", "Best option:",
                     "Answer:", "Option:", "The correct answer", "The correct option"]
LMMS_LEGACY_PREFIXES = ["The best answer is", "The correct answer is", "The answer is", "The answer",
                        "The best option isThe correct option is",  # glued by a missing comma in lmms-eval <= v0.7
                        "Best answer:Best option:"]                 # (same); kept: it is what those numbers used
LVB_PREFIXES = VIDEOMME_PREFIXES[:8]


def _prefix_first_letter(text: str, prefixes: list[str], charset: str) -> str | None:
    """Extractor (A): delete answer prefixes, then the FIRST character in charset anywhere, else
    unanswered (the originals' '> 10 words and none' branch also ends there). 'Based on...' -> 'B'."""
    s = text.strip()
    for p in prefixes:
        s = s.replace(p, "")
    hit = re.search(f"[{charset}]", s)
    return hit.group(0) if hit else None


_PHRASES = ("the answer is", "answer is", "correct answer is", "correct option is", "best option is",
            "best answer is", "i choose", "my answer is", "answer:", "option:", "答案是", "答案为", "정답은", "答えは")


def _lmms_mcq(text: str, letters: list[str]) -> str | None:
    """Extractor (B), lmms-eval shared mcq_extract: candidates (letter, position, format), sorted by
    (priority, position) descending with priorities start 10, end 9, phrase 7, (X) 6, X. 5, X: 4,
    X) 3, 'X ' 2; only with no candidate, any occurrence (0). Our reading of two details: markers
    need a non-letter before X, and a phrase yields the first stand-alone letter after it."""
    s = text.strip().strip(",.!?;:'\"").strip()
    if not s:
        return None
    s, low, cands = f" {s} ", f" {s} ".lower(), []
    for x in letters:
        for prio, pat in ((6, rf"\({x}\)"), (5, rf"(?<![A-Za-z]){x}\."), (4, rf"(?<![A-Za-z]){x}:"),
                          (3, rf"(?<![A-Za-z(]){x}\)"), (2, rf"(?<![A-Za-z]){x} ")):
            hits = [m.start() for m in re.finditer(pat, s)]
            if hits:
                cands.append((prio, hits[-1], x))
    cls = "".join(letters)
    for phrase in _PHRASES:
        for m in re.finditer(re.escape(phrase), low):
            hit = re.search(rf"(?<![A-Za-z])([{cls}])(?![A-Za-z])", s[m.end():])
            if hit:
                cands.append((7, m.end() + hit.start(), hit.group(1)))
    core = s.strip()
    if core[0] in letters and (len(core) == 1 or not core[1].isalpha()):
        cands.append((10, 0, core[0]))
    if core[-1] in letters and (len(core) == 1 or not core[-2].isalpha()):
        cands.append((9, len(s), core[-1]))
    if not cands:
        cands = [(0, s.rfind(x), x) for x in letters if x in s]
    return max(cands)[2] if cands else None


_MARK = {"paren": "({})", "space": "{} ", "period": "{}.", "colon": "{}:"}


def _mmmu_style(text: str, letters: list[str], options, stages) -> str | None:
    """Extractor (C), MMMU-style parse_multi_choice_response: strip , . ! ? ; : ' at the ends, pad
    with spaces; stage by stage, letters whose marker occurs; then (> 5 words) option texts found in
    the response. Several -> the one whose marker (of the first kind that hit) occurs last."""
    s = text
    for ch in ",.!?;:'":
        s = s.strip(ch)
    s = f" {s} "
    for stage in stages:
        hits = [(kind, x) for kind in stage for x in letters if _MARK[kind].format(x) in s]
        if hits:
            kind, cands = hits[0][0], list(dict.fromkeys(x for _, x in hits))
            mark = " {} " if kind == "space" else _MARK[kind]
            return max(cands, key=lambda x: s.rfind(mark.format(x)))
    if options and len(s.split()) > 5:
        found = [(s.lower().rfind(str(o).lower()), x) for x, o in zip(letters, options) if str(o).lower() in s.lower()]
        if found:
            return max(found)[1]
    return None


def _video_holmes(text: str, letters) -> str | None:
    """Video-Holmes evaluate.py: the LAST <answer> block (else all), then the first of A..F with
    'X ', 'X:' or '[X' in it, else the first of A..F anywhere, else WRONG (None)."""
    blocks = re.findall(r"<answer>\s*(.*?)\s*</answer>", text, re.S)
    s = blocks[-1] if blocks else text
    return (next((x for x in "ABCDEF" if f"{x} " in s or f"{x}:" in s or f"[{x}" in s), None)
            or next((x for x in "ABCDEF" if x in s), None))


def _paravt(text: str, letters) -> str | None:
    """ParaVT utils.extract_letter (A-J): <answer> body (single letter, else first \\b[A-J]\\b); the
    whole text as one letter; 'answer is/: X'; first \\b[A-J]\\b; else the first character."""
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    if m:
        inner = m.group(1).strip()
        if re.fullmatch(r"[A-J]", inner):
            return inner
        if hit := re.search(r"\b([A-J])\b", inner):
            return hit.group(1)
    s = text.strip()
    if re.fullmatch(r"[A-J]", s):
        return s
    hit = re.search(r"(?:answer|Answer)\s*(?:is|:)\s*([A-J])", text) or re.search(r"\b([A-J])\b", text)
    return hit.group(1) if hit else (s[:1] or None)


def _mlvu_official(text: str, letters) -> str | None:
    """MLVU choice_bench check_ans: the character before the first ')', else the whole answer."""
    s = text.strip()
    if ")" in s:
        s = s[:s.index(")")][-1:]
    return s or None


def _lvbench_official(text: str, letters) -> str | None:
    """LVBench polish_answer: before the first ')', after '(' if any, first token, first character."""
    s = text.strip().split(")")[0]
    s = s.partition("(")[2] if "(" in s else s
    return s.split()[0][0] if s.split() else None


def _answer_tag_then_mcq(text: str, letters) -> str | None:
    """Our default: rewards.extract_answer (the <answer> body, else after </think>, else the last
    line), then extractor (B)."""
    span = rewards.extract_answer(text)
    return _lmms_mcq(span, letters) if span else None


EXTRACTORS: dict[str, Callable] = {
    "answer_tag_then_mcq": lambda t, l, o: _answer_tag_then_mcq(t, l),
    "videomme_official": lambda t, l, o: _prefix_first_letter(t, VIDEOMME_PREFIXES, "ABCD"),
    "lmms_legacy": lambda t, l, o: _prefix_first_letter(t, LMMS_LEGACY_PREFIXES, "ABCD"),
    "lmms_mcq": lambda t, l, o: _lmms_mcq(t, l),
    "mmmu": lambda t, l, o: _mmmu_style(t, l, o, [("paren",), ("space",), ("period",)]),
    "longvideobench": lambda t, l, o: _prefix_first_letter(t, LVB_PREFIXES, "ABCDE"),
    "videommmu": lambda t, l, o: _mmmu_style(t, l, o, [("period", "colon"), ("paren",), ("space",)]),
    "video_holmes_official": lambda t, l, o: _video_holmes(t, l),
    "paravt": lambda t, l, o: _paravt(t, l),
    "rewards_letter": lambda t, l, o: rewards.extract_letter(rewards.extract_answer(t), n_options=len(l)),
    "mlvu_official": lambda t, l, o: _mlvu_official(t, l),
    "lvbench_official": lambda t, l, o: _lvbench_official(t, l),
}
RAW_TEXT = {"answer_tag_then_mcq", "video_holmes_official", "paravt", "rewards_letter"}  # read their own tags

# ----------------------------------------------------------------------------- time extraction

def lmms_extract_time(paragraph: str) -> tuple[float, float] | None:
    """lmms-eval charades_sta extract_time (HEAD; docs/benchmarks.md, Charades-STA): lower-case, drop the prompt's
    example, replace every 'to' with '-' (inside words too), split sentences on [!?\\n], keep those
    with a time keyword (else all); the first rule that yields wins: clock ranges, 'a - b',
    clock times paired, the first number of each sentence paired, 'a s - b s'. First pair, ordered."""
    text = paragraph.lower().replace("a specific example is : 20.8 - 30.0 seconds", "").replace("to", "-")
    sentences = re.split(r"[!?\n]", text)
    keys = ("starts", "ends", "happens in", "start time", "end time", "start", "end", "happen")
    cands = [s for s in sentences if any(k in s for k in keys)] or sentences
    clock = r"\d{1,2}:\d{2}(?::\d{2})?"
    for s in cands:
        if m := re.findall(rf"\b({clock})\s*[–-]\s*({clock})\b", s):
            return _ordered(_clock(m[0][0]), _clock(m[0][1]))
    for s in cands:
        if m := re.findall(r"(\d+(?:\.\d+)?)\s*[–-]\s*(\d+(?:\.\d+)?)", s):
            return _ordered(float(m[0][0]), float(m[0][1]))
    times = [_clock(t) for s in cands for t in re.findall(rf"\b({clock})\b", s)]
    if len(times) >= 2:
        return _ordered(times[0], times[1])
    firsts = [float(m.group(1)) for s in cands if (m := re.search(r"\b(\d+(?:\.\d+)?)\b", s))]
    if len(firsts) >= 2:
        return _ordered(firsts[0], firsts[1])
    for s in cands:
        if m := re.findall(r"(\d+(?:\.\d+)?)\s*s?\s*[–-]\s*(\d+(?:\.\d+)?)\s*s?", s):
            return _ordered(float(m[0][0]), float(m[0][1]))
    return None


def _ordered(a: float, b: float) -> tuple[float, float]:
    return (a, b) if b > a else (b, a)


TIME_EXTRACTORS: dict[str, Callable] = {"paravt_time": rewards.extract_time_range, "lmms_time": lmms_extract_time}

DEFAULT_EXTRACT = {"videomme": "videomme_official", "videomme_sub": "videomme_official",
                   "longvideobench": "longvideobench", "lvbench": "lvbench_official", "mlvu": "mlvu_official",
                   "mmvu": "answer_tag_then_mcq", "videommmu": "videommmu", "video_holmes": "video_holmes_official",
                   "charades_sta": "paravt_time", "synthetic": "answer_tag_then_mcq", "records": "answer_tag_then_mcq"}

# ----------------------------------------------------------------------------- scoring

def _answer_span(text: str, extract: str) -> str:
    """What an official parser reads: the answer span of a tagged response, else the raw text."""
    if extract in RAW_TEXT or ("<answer>" not in text and "</think>" not in text):
        return text
    return rewards.extract_answer(text) or ""


def _letters(record: dict) -> list[str]:
    return [chr(65 + i) for i in range(len(record["options"]) if record.get("options") else 10)]


def _normalise(s: str) -> str:
    s = re.sub(r"[^\w\s.]|(?<!\d)\.|\.(?!\d)", " ", str(s).lower())
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def open_match(pred: str | None, gold: str) -> bool:
    """Open-ended rule: normalised exact match, or (numeric gold) a number in pred equal to 2 dp."""
    if not pred:
        return False
    if _normalise(pred) == _normalise(gold):
        return True
    try:
        value = float(str(gold).replace(",", ""))
    except ValueError:
        return False
    nums = re.findall(r"-?\d+(?:\.\d+)?", pred.replace(",", ""))
    return any(round(float(n), 2) == round(value, 2) for n in nums)


def judge(record: dict, row: dict, extract: str, random_fallback: int | None = None) -> dict:
    """One prediction row against its record -> {score in [0, 1], parsed, pred, error, random}."""
    out = {"score": 0.0, "parsed": False, "pred": None, "error": bool(row.get("error")), "random": False}
    if out["error"]:
        return out
    text = str(row.get("response") or "")
    if record["task"] == "tvg":   # a letter strategy on a mixed benchmark: its windows use paravt_time
        extract = extract if extract in TIME_EXTRACTORS else "paravt_time"
        pred = TIME_EXTRACTORS[extract](_answer_span(text, extract))
        if pred is not None:
            out.update(parsed=True, pred=list(pred), score=rewards.temporal_iou(pred, record["answer"]))
        return out
    if record["task"] == "oe":
        pred = _answer_span(text, "oe").strip()
        out.update(parsed=bool(pred), pred=pred, score=float(open_match(pred, record["answer"])))
        return out
    letters = _letters(record)
    pred = EXTRACTORS[extract](_answer_span(text, extract), letters, record.get("options"))
    if pred in letters:
        out.update(parsed=True, pred=pred)
    elif random_fallback is not None:
        out.update(random=True, pred=random.Random(f"{random_fallback}:{record['id']}").choice(letters))
    out["score"] = float(out["pred"] is not None and out["pred"] == str(record["answer"]).strip())
    return out


def _breakdown(items, key: str) -> dict:
    groups: dict = {}
    for rec, j in items:
        value = rec["meta"].get(key)
        for v in (value if isinstance(value, list) else [value]):
            if v is not None:
                g = groups.setdefault(str(v), [0, 0.0])
                g[0], g[1] = g[0] + 1, g[1] + j["score"]
    return {k: {"n": n, "correct": c, "accuracy": 100.0 * c / n} for k, (n, c) in sorted(groups.items())}


def agent_stats(rows: list[dict]) -> dict:
    """Mean turns, calls per turn, tool-failure rate (rewards.py's agent figures; turns = all assistant turns,
    the row's "turns"), mean seconds per sample, over the non-error rows that carry them."""
    ok = [r for r in rows if not r.get("error") and isinstance(r.get("turns"), (int, float))]
    turns = sum(r["turns"] for r in ok)
    calls = sum(r.get("calls") or 0 for r in ok)
    fails = sum(r.get("tool_failures") or 0 for r in ok)
    lat = [r["latency"] for r in ok if isinstance(r.get("latency"), (int, float))]
    return {"mean_turns": rewards.mean_turns(r["turns"] for r in ok),
            "calls_per_turn": rewards.calls_per_turn(calls, turns), "tool_failure_rate": rewards.tool_failure_rate(fails, calls), "mean_latency_s": rewards.mean_or_none(lat)}


def score(bench: str, records: list[dict], predictions: list[dict], extract: str | None = None,
          random_fallback: int | None = None) -> dict:
    """Metrics of `predictions` (rows with id + response, optionally error/turns/calls/...) on `records`.

    Accuracy (%) over every record that has a row (error rows included, scored wrong); records with
    no row are counted in n_missing_predictions. VideoMME adds the official denominator (answered
    only); MLVU's headline is M-Avg, the macro mean over task types; Charades-STA gives mIoU and
    R@{0.3,0.5,0.7} in % over all queries, a failed parse scoring IoU 0."""
    tasks = {r["task"] for r in records}
    extract = extract or ("paravt_time" if tasks == {"tvg"} else DEFAULT_EXTRACT[bench])
    if (tasks == {"tvg"} and extract not in TIME_EXTRACTORS) or ("mcq" in tasks and extract not in EXTRACTORS):
        raise ValueError(f"--extract {extract!r} does not fit {bench} ({sorted(tasks)}); letters: "
                         f"{sorted(EXTRACTORS)}; time windows: {sorted(TIME_EXTRACTORS)}")
    rows: dict = {}
    for row in predictions:
        if row.get("id") is None or str(row["id"]) in rows:
            raise ValueError(f"prediction row without id or with a repeated id: {str(row)[:120]}")
        rows[str(row["id"])] = row
    ids = {r["id"] for r in records}
    if rows and not ids & set(rows):
        raise ValueError(f"no prediction id matches a {bench} question id (wrong annotation file?)")
    items = [(r, judge(r, rows[r["id"]], extract, random_fallback)) for r in records if r["id"] in rows]
    m = {"bench": bench, "extract": extract, "n": len(items), "n_error": sum(j["error"] for _, j in items),
         "unparsed": sum(not j["parsed"] and not j["error"] for _, j in items),
         "random_fallback": random_fallback, "random_filled": sum(j["random"] for _, j in items),
         "n_missing_predictions": len(ids - set(rows)), "n_unknown_predictions": len(set(rows) - ids), "notes": []}
    qa = [(r, j) for r, j in items if r["task"] in ("mcq", "oe")]
    if qa:
        m["correct"] = sum(j["score"] for _, j in qa)
        m["accuracy"] = 100.0 * m["correct"] / len(qa)
        for key in ("task_type", "duration_group", "category"):
            if any(key in r["meta"] for r, _ in qa):
                m[f"by_{key}"] = _breakdown(qa, key)
        oe = [(r, j) for r, j in qa if r["task"] == "oe"]
        if oe:
            mc = [(r, j) for r, j in qa if r["task"] == "mcq"]
            m["n_oe"], m["oe_accuracy"] = len(oe), 100.0 * sum(j["score"] for _, j in oe) / len(oe)
            m["mc_accuracy"] = 100.0 * sum(j["score"] for _, j in mc) / len(mc) if mc else None
            judge_name = "an LLM judge (GPT-4o)" if bench == "mmvu" else "MMMU's eval_open (substring / number rule)"
            m["notes"].append(f"open-ended items scored by normalised exact or number match; the official scorer "
                              f"uses {judge_name}, so oe_accuracy is a lower bound")
    if bench == "mmvu" and records:
        m["mmvu_subset"] = records[0]["meta"].get("subset")
    if bench in ("videomme", "videomme_sub"):
        answered = [j for _, j in qa if j["parsed"]]
        m["answered"] = len(answered)
        m["accuracy_answered"] = 100.0 * sum(j["score"] for j in answered) / len(answered) if answered else None
        m["notes"].append("accuracy counts unparsed answers wrong (lmms-eval, ParaVT); accuracy_answered is the "
                          "official Video-MME scorer's denominator (unparsed answers excluded)")
    if bench == "mlvu" and "by_task_type" in m:
        per_task = m["by_task_type"]
        m["m_avg"] = sum(v["accuracy"] for v in per_task.values()) / len(per_task)
    tvg = [j for r, j in items if r["task"] == "tvg"]
    if tvg:
        m["miou"] = 100.0 * sum(j["score"] for j in tvg) / len(tvg)
        for k in (0.3, 0.5, 0.7):
            m[f"r@{k}"] = 100.0 * sum(j["score"] >= k for j in tvg) / len(tvg)
    if extract not in RAW_TEXT:
        m["notes"].append(f"{extract} reads the <answer> span (rewards.extract_answer) of a response with "
                          "<answer> or </think>, the raw text of any other")
    if bench == "charades_sta" and extract == "paravt_time":
        m["notes"].append("paravt_time (rewards.extract_time_range) is the default: lmms_time, lmms-eval's parser, "
                          "cannot read the '[s, e]' answer form")
    if random_fallback is None:
        m["notes"].append("no random letter for unparsed answers (they score 0); --random-fallback SEED draws one")
    m.update(agent_stats([rows[r["id"]] for r, _ in items]))
    m["headline_metric"] = "miou" if tvg else "m_avg" if "m_avg" in m else "accuracy"
    m["headline"] = m.get(m["headline_metric"])
    return m


def format_report(m: dict) -> str:
    """A few readable lines (the CLI prints the JSON object after them)."""
    f = lambda x: "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)
    lines = [f"{m['bench']} | extract {m['extract']} | n {m['n']} | {m['headline_metric']} {f(m['headline'])} | "
             f"unparsed {m['unparsed']} | errors {m['n_error']} | missing {m['n_missing_predictions']}"]
    for key in ("accuracy_answered", "mc_accuracy", "oe_accuracy", "r@0.3", "r@0.5", "r@0.7", "mmvu_subset"):
        if m.get(key) is not None:
            lines.append(f"  {key}: {f(m[key])}")
    for key in ("by_task_type", "by_duration_group", "by_category"):
        if key in m:
            lines.append(f"  {key}: " + ", ".join(f"{k} {f(v['accuracy'])} ({v['n']})" for k, v in m[key].items()))
    lines.append("  agent: " + " | ".join(f"{k} {f(m[k])}" for k in ("mean_turns", "calls_per_turn",
                                                                      "tool_failure_rate", "mean_latency_s")))
    figures = [k for k in ("r_acc", "format_compliance", "tool_call_ratio", "clue_score", "turns") if k in m]
    if figures:                                  # eval.evaluate's agent figures (the trainer's table)
        lines.append("  figures: " + " | ".join(f"{k} {f(m[k])}" for k in figures))
    lines += [f"  note: {n}" for n in m["notes"]]
    return "\n".join(lines)

