"""bench/paired.py through its command line: two checkpoints' predictions on one synthetic split, question by
question (fixed / broken, the sign test, and why an answer changed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import data

pytestmark = [pytest.mark.bench, pytest.mark.slow]   # each test runs bench/paired.py in a process

ROOT = Path(__file__).resolve().parent.parent
N, SEED = 24, 7                          # the split: 22 MCQs of the four kinds, 2 grounding questions


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(PARAVT_CACHE for paired.py, the split's records): the videos rendered once, where paired.py finds them."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, data.make_split(str(cache / "synthetic"), N, seed=SEED, duration=64.0)


def wrong(r: dict) -> str:
    return "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]


def row(r: dict, letter: str, **extra) -> dict:
    """A predictions row as eval.py writes it: the response (what it scores) and the answer span."""
    return {"id": r["id"], "response": f"<think>\nA shape.\n</think>\n<answer>{letter}</answer>", "answer": letter,
            **extra}


def paired(split, tmp_path, rows_a: list[dict], rows_b: list[dict], ok: bool = True):
    """Write the two predictions files, run `python bench/paired.py A B --n N --seed SEED`: its last-line JSON, or
    (ok=False) the finished process."""
    cache, _ = split
    files = [tmp_path / "sft.jsonl", tmp_path / "rl.jsonl"]
    for path, rows in zip(files, (rows_a, rows_b)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "paired.py"), *map(str, files), "--n", str(N),
                        "--seed", str(SEED)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PARAVT_CACHE": str(cache), "OMP_NUM_THREADS": "1"})
    if not ok:
        return r
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fixed, broken, p", [(12, 1, 14 / 4096), (1, 12, 14 / 4096), (5, 0, 2 / 32), (3, 3, 1.0)])
def test_sign_test_by_hand(split, tmp_path, fixed, broken, p):
    """The two-sided exact sign test over the changed answers (the unchanged ones are ties, dropped)."""
    mcq = [r for r in split[1] if r["task"] == "mcq"]
    rows_a = [row(r, wrong(r) if i < fixed else r["answer"]) for i, r in enumerate(mcq)]
    rows_b = [row(r, r["answer"] if i < fixed or i >= fixed + broken else wrong(r)) for i, r in enumerate(mcq)]
    out = paired(split, tmp_path, rows_a, rows_b)
    assert (out["fixed"], out["broken"]) == (fixed, broken) and out["sign_test_p"] == pytest.approx(p)


def test_fixed_broken_and_splits_counted_question_by_question(split, tmp_path):
    mcq = [r for r in split[1] if r["task"] == "mcq"]
    # A: right on all but the first two; B: right on all but the last one -> B fixed 2, broke 1
    rows_a = [row(r, wrong(r) if i < 2 else r["answer"], calls=1) for i, r in enumerate(mcq)]
    rows_b = [row(r, wrong(r) if i == len(mcq) - 1 else r["answer"], calls=0) for i, r in enumerate(mcq)]
    out = paired(split, tmp_path, rows_a, rows_b)
    n = len(mcq)
    assert (out["right_a"], out["right_b"], out["mcq"], out["fixed"], out["broken"]) == (n - 2, n - 1, n, 2, 1)
    assert out["sign_test_p"] == pytest.approx(1.0) and out["a"]["all"] == pytest.approx(100 * (n - 2) / n)
    kind = mcq[0]["meta"]["kind"]
    of_kind = [i for i, r in enumerate(mcq) if r["meta"]["kind"] == kind]
    assert out["a"][kind] == pytest.approx(100 * sum(i >= 2 for i in of_kind) / len(of_kind))
    need = [r for r in mcq if data.tool_needed(r, 8)]
    assert out["a"]["n"]["tool_needed"] == len(need) and 0 < len(need) < n
    assert out["a"]["tool_call_ratio_needed"] == 1.0 and out["b"]["tool_call_ratio_not_needed"] == 0.0


def test_a_missing_question_is_an_error_naming_the_file(split, tmp_path):
    rows = [row(r, r["answer"]) for r in split[1] if r["task"] == "mcq"]
    r = paired(split, tmp_path, rows, rows[1:], ok=False)
    assert r.returncode == 1 and "paired.py: " in r.stderr and "rl.jsonl: no prediction for 1 question" in r.stderr


def test_changed_answers_split_by_what_was_seen(split, tmp_path):
    """Why an answer changed: what the frames showed ("look"), the reading of the same evidence ("read"), a guess."""
    mcq = [r for r in split[1] if r["task"] == "mcq"]
    q0, q1, q2 = [r for r in mcq if data.tool_needed(r, 8) and len(r["meta"]["glyph_windows"]) == 1][:3]
    tight = lambda r: [[max(0.0, r["meta"]["glyph_windows"][0][0] - 2), r["meta"]["glyph_windows"][0][1] + 2]]
    # q0: A misses the glyph and guesses wrong, B crops it and is right (look); q1: both see it, B misreads (read);
    # q2: neither sees it, B's guess is right (guess); the other MCQs: both right, from the overview alone
    rows_a = {q0["id"]: (wrong(q0), []), q1["id"]: (q1["answer"], tight(q1)), q2["id"]: (wrong(q2), [])}
    rows_b = {q0["id"]: (q0["answer"], tight(q0)), q1["id"]: (wrong(q1), tight(q1)), q2["id"]: (q2["answer"], [])}
    pick = lambda side, r: side.get(r["id"], (r["answer"], []))
    rows = lambda side: [row(r, pick(side, r)[0], windows=pick(side, r)[1]) for r in mcq]
    out = paired(split, tmp_path, rows(rows_a), rows(rows_b))
    assert out["fixed_by"] == {"look": 1, "read": 0, "guess": 1} and out["broken_by"] == {"look": 0, "read": 1, "guess": 0}
    shown = sum(not data.tool_needed(r, 8) for r in mcq)         # the overview alone shows their glyphs
    assert out["a"]["n"]["seen"] == shown + 1 and out["b"]["n"]["seen"] == shown + 2


def test_right_is_what_eval_py_scores(split, tmp_path):
    """An answer span with words around its letter ("... I guess I D"), as a degenerate policy writes it: eval.py's
    extractor reads the letter, so paired.py counts it right too, and its accuracy is eval.py's; an empty answer,
    an errored row and a wrong letter are wrong on both."""
    import benchmarks
    mcq = [r for r in split[1] if r["task"] == "mcq"]
    noisy = lambda r: {"id": r["id"], "response": f"<answer>No the shape, not read not read I guess I {r['answer']}"
                       "</answer>", "answer": f"No the shape, not read not read I guess I {r['answer']}"}
    rows_b = [noisy(r) if i < 3 else {"id": r["id"], "response": "", "answer": ""} if i == 3
              else {**row(r, r["answer"]), "error": "decode failed"} if i == 4 else row(r, wrong(r)) if i == 5
              else row(r, r["answer"]) for i, r in enumerate(mcq)]
    out = paired(split, tmp_path, [row(r, r["answer"]) for r in mcq], rows_b)
    by_id = {r["id"]: r for r in rows_b}
    scored = sum(benchmarks.judge(r, by_id[r["id"]], "answer_tag_then_mcq")["score"] for r in mcq)
    assert out["right_b"] == scored == len(mcq) - 3 and (out["fixed"], out["broken"]) == (0, 3)
    assert out["b"]["all"] == pytest.approx(100 * (len(mcq) - 3) / len(mcq))
