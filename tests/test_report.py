"""Tests for report.py: the trajectory page built from a small synthetic evaluation.

Records come from data.make_split (real mp4s, 32 s); rows are written by hand (`demo_rows`: every
branch of the page) or come from the tiny model run through rollout.run_agent with scripted turns.
The page is parsed with html.parser and checked for structure, not for looks.

    python -m pytest tests/test_report.py -q
"""
import json
import os
import re
from html.parser import HTMLParser

import pytest

import data
import report
import rewards
import rollout
from conftest import TEST_ROLLOUT

DURATION = 32.0


# ----------------------------------------------------------------------------- a small evaluation

def _call(s: float, e: float) -> str:
    return "<tool_call>\n" + json.dumps({"name": "crop_video", "arguments": {"start_time": s, "end_time": e}}) + "\n</tool_call>"


def _response_env(parts: list[str]) -> str:
    return rollout.response_chunk_text(parts, forced=False)


def _clip(s: float, e: float) -> str:
    return rollout.clip_part((s, e))


def demo_rows(records: list[dict]) -> list[dict]:
    """One hand-written row per record, in the rows format eval.py writes (+ the optional fields):
    0 right after one crop, 1 two parallel crops then a second turn, 2 a tool failure and a wrong
    answer, 3 truncated (no answer), the rest answered off the overview with no crop."""
    rows = []
    for i, rec in enumerate(records):
        (s, e), gold = rec["clues"][0], rec["answer"]
        wrong = "ABCD"[("ABCD".index(gold) + 1) % 4] if rec["task"] == "mcq" else "[0.0, 4.0]"
        think = "<think>\n"
        if i == 0:
            segs = [("env", think), ("policy", f"I see a mark near {s + 4:.1f} seconds; the shape is too small.\n"
                                               f"</think>\n{_call(s, e)}<|im_end|>"),
                    ("env", _response_env([_clip(s, e)])),
                    ("policy", f"The clip shows the shape.\n</think>\n<answer>{gold}</answer><|im_end|>")]
            windows, by_turn = [[s, e]], [[[s, e]], []]
        elif i == 1:
            w1, w2, w3 = [0.0, 12.0], [max(0.0, s - 2), min(DURATION, e + 2)], [s + 1, s + 5]
            segs = [("env", think), ("policy", f"Two places may hold it.\n</think>\n{_call(*w1)}\n{_call(*w2)}<|im_end|>"),
                    ("env", _response_env([_clip(*w1), _clip(*w2)])),
                    ("policy", f"Closer look.\n</think>\n{_call(*w3)}<|im_end|>"),
                    ("env", _response_env([_clip(*w3)])),
                    ("policy", f"Seen it.\n</think>\n<answer>{gold}</answer><|im_end|>")]
            windows, by_turn = [w1, w2, w3], [[w1, w2], [w3], []]
        elif i == 2:
            segs = [("env", think), ("policy", f"Look late in the video.\n</think>\n{_call(70.0, 80.0)}\n"
                                               f"{_call(s, s + 2)}<|im_end|>"),
                    ("env", _response_env([f"Error: start_time 70.0 is past the end of the video ({DURATION} s)",
                                           _clip(s, s + 2)])),
                    ("policy", f"Not sure.\n</think>\n<answer>{wrong}</answer><|im_end|>")]
            windows, by_turn = [[s, s + 2]], [[[s, s + 2]], []]
        elif i == 3:
            segs = [("env", think), ("policy", "The shape is small and I keep thinking about it " * 3)]
            windows, by_turn = [], [[]]
        else:
            segs = [("env", think), ("policy", f"Visible in the overview.\n</think>\n<answer>{gold}</answer><|im_end|>")]
            windows, by_turn = [], [[]]
        text = "".join(t for _, t in segs)
        turns = len(by_turn)
        rows.append({"id": rec["id"], "response": think + text.rsplit(think, 1)[-1], "answer": rewards.extract_answer(text),
                     "turns": turns, "calls": {0: 1, 1: 3, 2: 2}.get(i, 0), "windows": windows,
                     "tool_failures": int(i == 2), "latency": 0.5, "error": None, "text": text, "segments": segs,
                     "tool_turns": sum(bool(c) for c in by_turn), "nframes": 8,
                     "format_compliant": rewards.format_compliant(text), "calls_by_turn": by_turn,
                     "truncated": i == 3})
    return rows


def build_demo(out_dir: str, cache: str, n: int = 6) -> tuple[str, list[dict], list[dict]]:
    """(index.html, records, rows) of a hand-written evaluation on n synthetic questions (also makes the
    screenshot in docs/report.md)."""
    records = data.make_split(cache, n, seed=7, duration=DURATION)
    rows = demo_rows(records)
    metrics = {"bench": "synthetic", "n": len(rows), "accuracy": 100.0 * sum(not report.row_flags(r, w)["wrong"]
                                                                            for r, w in zip(records, rows)) / len(rows)}
    return report.write_report(out_dir, records, rows, metrics, video_root=cache, title="synthetic demo"), records, rows


class Page(HTMLParser):
    """The parts of a report page the tests look at: sections, timeline rects, trajectory segments,
    img sources and every attribute value."""

    def __init__(self, text: str):
        super().__init__()
        self.sections, self.attrs, self.imgs = [], [], []
        self._seg = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        cls = a.get("class", "").split()
        if tag == "section" and "q" in cls:
            self.sections.append({"id": a["data-id"], "classes": cls, "crops": [], "clues": [], "segs": [], "imgs": 0})
        elif tag == "rect" and ("crop" in cls or "clue" in cls):
            key = "crops" if "crop" in cls else "clues"
            self.sections[-1][key].append((float(a["data-start"]), float(a["data-end"]), a.get("data-turn")))
        elif tag == "pre" and "seg" in cls:
            self._seg = [a["data-role"], cls, ""]
            self.sections[-1]["segs"].append(self._seg)
        elif tag == "img":
            self.imgs.append(a.get("src", ""))
            if self.sections:
                self.sections[-1]["imgs"] += 1

    def handle_endtag(self, tag):
        if tag == "pre":
            self._seg = None

    def handle_data(self, d):
        if self._seg is not None:
            self._seg[2] += d


def remote_resources(text: str, page: Page) -> list[str]:
    """Everything in a page that would make a browser fetch something from elsewhere."""
    bad = [f"{tag} {k}={v[:60]}" for tag, k, v in page.attrs
           if k in ("src", "href", "srcset", "data", "action", "poster", "xlink:href")
           and not (v.startswith("#") or v.startswith("data:image/jpeg;base64,"))]
    bad += [m.group(0) for m in re.finditer(r"@import|url\(|<link\b|<script\b|<iframe\b", text)]
    return bad


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    out = str(tmp_path_factory.mktemp("report"))
    path, records, rows = build_demo(out, cache)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text, Page(text), records, rows, cache


# ----------------------------------------------------------------------------- the hand-written evaluation

def test_one_section_per_question_in_record_order(demo):
    text, page, records, rows, _ = demo
    assert [s["id"] for s in page.sections] == [r["id"] for r in records]


def test_timeline_windows_equal_the_rows_windows_with_turns(demo):
    _, page, records, rows, _ = demo
    for sec, rec, row in zip(page.sections, records, rows):
        crops = sorted(sec["crops"], key=lambda c: (c[0], c[1]))
        assert [(s, e) for s, e, _ in crops] == sorted(tuple(w) for w in row["windows"]), rec["id"]
        assert [(s, e) for s, e, _ in sec["clues"]] == [tuple(c) for c in rec["clues"]]
    # row 1: two parallel calls in turn 1, one in turn 2 (read off calls_by_turn)
    assert [t for _, _, t in page.sections[1]["crops"]] == ["1", "1", "2"]


def test_env_and_policy_text_are_separate_elements(demo):
    _, page, records, rows, _ = demo
    for sec, row in zip(page.sections, rows):
        assert [(role, t) for role, _, t in sec["segs"]] == [tuple(s) for s in row["segments"]]
        for role, cls, t in sec["segs"]:
            assert role in cls                                   # the class that styles it apart
            if role == "policy":
                assert "<tool_response>" not in t and "<|im_start|>user" not in t
    env = [t for role, _, t in page.sections[2]["segs"] if role == "env"]
    assert any("Error: start_time 70.0" in t for t in env)       # the tool's error is environment text


def test_page_loads_no_remote_resource(demo):
    text, page, *_ = demo
    assert page.imgs and all(src.startswith("data:image/jpeg;base64,") for src in page.imgs)
    assert remote_resources(text, page) == []
    assert "http://" not in text and "https://" not in text


def test_thumbnails_overview_k_and_crop_frames(demo):
    _, page, records, rows, _ = demo
    for sec, row in zip(page.sections, rows):
        # K = 8 overview frames, and 2 to 4 frames for each crop window
        assert 8 + 2 * len(row["windows"]) <= sec["imgs"] <= 8 + 4 * len(row["windows"]), sec["id"]


def test_filter_classes(demo):
    _, page, records, rows, _ = demo
    classes = [set(s["classes"]) for s in page.sections]
    assert "wrong" not in classes[0] and "wrong" not in classes[1]
    assert {"wrong", "fail"} <= classes[2] and "trunc" not in classes[2]
    assert {"wrong", "trunc"} <= classes[3] and "fail" not in classes[3]
    for name in ("#wrong", "#failures", "#truncated"):
        assert f'href="{name}"' in demo[0]


def test_recomputed_rewards_match_rewards_py(demo):
    text, page, records, rows, _ = demo
    rec, row = records[1], rows[1]
    comps = report.reward_components(rec, row)
    assert comps["clue"] == (rewards.hybrid_clue_score(row["windows"], rec["clues"],
                                                       multi_clue=rec["data_type"] == "multi_clue"), "recomputed")
    assert comps["turn_decay"] == (rewards.turn_decay(2), "recomputed")
    assert comps["acc"] == (1.0, "recomputed") and report.reward_components(records[2], rows[2])["acc"][0] == 0.0
    assert comps["format"][0] == rewards.format_reward(row["text"], rewards.ANCHOR_WEIGHT)
    # logged components win over recomputed ones
    logged = report.reward_components(rec, {**row, "rewards": {"acc": 0.25, "tool": 0.5}})
    assert logged["acc"] == (0.25, "logged") and logged["tool"] == (0.5, "logged")


# ----------------------------------------------------------------------------- fallbacks and bad input

def test_rows_without_the_new_fields(demo, tmp_path):
    """Old-style rows (no text, segments, calls_by_turn, nframes): grey windows, response as policy text."""
    _, _, records, rows, cache = demo
    old = [{k: r[k] for k in ("id", "response", "answer", "turns", "calls", "windows", "tool_failures", "latency", "error")}
           for r in rows]
    page = Page(open(report.write_report(str(tmp_path), records, old, video_root=cache), encoding="utf-8").read())
    for sec, row in zip(page.sections, old):
        assert [(s, e) for s, e, _ in sec["crops"]] == [tuple(w) for w in row["windows"]]
        assert all(t == "" for *_, t in sec["crops"])             # turn unknown
        assert [role for role, *_ in sec["segs"]] == ["policy"]
        assert sec["imgs"] >= report.DEFAULT_K


def test_split_roles_of_a_text_without_segments():
    text = "".join(t for _, t in demo_rows_sample())
    assert report.split_roles(text) == [tuple(s) for s in demo_rows_sample()]


def demo_rows_sample():
    return [("env", "<think>\n"), ("policy", f"look\n</think>\n{_call(1.0, 5.0)}<|im_end|>"),
            ("env", _response_env([_clip(1.0, 5.0)])), ("policy", "ok\n</think>\n<answer>A</answer><|im_end|>")]


def test_missing_and_broken_videos_give_notes_not_crashes(demo, tmp_path):
    _, _, records, rows, cache = demo
    broken = os.path.join(cache, "videos", "broken.mp4")
    with open(broken, "wb") as f:
        f.write(b"\x00not a video" * 10)
    recs = [{**records[0], "video": "videos/missing.mp4"}, {**records[1], "video": "videos/broken.mp4"},
            {**records[2], "video": "../outside.mp4"}]
    text = open(report.write_report(str(tmp_path), recs, rows[:3], video_root=cache), encoding="utf-8").read()
    page = Page(text)
    assert len(page.sections) == 3 and page.imgs == []
    assert "missing.mp4: no such file" in text and "broken.mp4: not a readable video" in text
    assert "outside the video root" in text
    for sec, row in zip(page.sections, rows):                    # the timeline is still drawn from the row
        assert [(s, e) for s, e, _ in sec["crops"]] == [tuple(w) for w in row["windows"]]


def test_escaping_and_max_questions(demo, tmp_path):
    _, _, records, rows, cache = demo
    evil = [{**rows[0], "segments": [["env", "<think>\n"], ["policy", "<script>alert(1)</script><img src=http://x>"]]},
            *rows[1:]]
    text = open(report.write_report(str(tmp_path), records, evil, video_root=None, max_questions=2), encoding="utf-8").read()
    page = Page(text)
    assert len(page.sections) == 2 and "<script>" not in text and "&lt;script&gt;" in text
    assert remote_resources(text, page) == []
    assert "showing the first 2 of 6 questions" in text and "no video root given" in text


@pytest.mark.parametrize("records, rows, message", [
    ([], [{"response": "x"}], "rows[0] lacks id"),
    ([{"id": "a", "video": "v.mp4", "answer": "A", "task": "mcq"}], [], "records[0] lacks question"),
    ([], [{"id": "a"}, {"id": "a"}], "rows[1] repeats id"),
    ({"id": "a"}, [], "must be lists"),
])
def test_bad_inputs_are_named(tmp_path, records, rows, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        report.write_report(str(tmp_path), records, rows)


# ----------------------------------------------------------------------------- rows from a real rollout

@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """conftest's `tiny` model, decoded on one thread (token-by-token decoding is latency-bound)."""


def rollout_row(record: dict, traj: rollout.Trajectory, tokenizer) -> dict:
    """A predictions row with the optional fields, from a rollout.Trajectory (segments: runs of one role)."""
    segs, ids, roles = [], traj.token_ids[traj.prompt_len:], traj.roles[traj.prompt_len:]
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or roles[k] != roles[start]:
            segs.append(["policy" if roles[start] == rollout.POLICY else "env",
                         tokenizer.decode(ids[start:k], skip_special_tokens=False)])
            start = k
    return {"id": record["id"], "response": traj.turns[-1] if traj.turns else "", "answer": traj.answer,
            "turns": len(traj.turns), "calls": sum(len(c) for c in traj.calls),
            "windows": [[float(s), float(e)] for s, e in traj.windows], "tool_failures": traj.tool_failures,
            "latency": traj.latency, "error": traj.error, "text": traj.text, "segments": segs,
            "tool_turns": traj.n_tool_turns, "nframes": traj.nframes,
            "calls_by_turn": [[list(w) for w in map(rewards.call_window, calls) if w] for calls in traj.calls],
            "truncated": traj.truncated, "hit_turn_limit": traj.hit_turn_limit}


def test_report_of_a_scripted_rollout(tiny, tmp_path, monkeypatch):
    """The tiny model through rollout.run_agent (turns scripted, every forward pass real) on 2 records:
    the page's windows are the trajectory's executed windows, and the text the policy sampled sits in
    policy elements only."""
    from test_rollout import Scripted  # the scripted sampler of the rollout tests
    model, processor = tiny
    cache = str(tmp_path / "cache")
    records = data.make_split(cache, 2, seed=7, duration=DURATION)
    (s, e) = records[0]["clues"][0]
    scripts = {(0, 0): [f"a mark\n</think>\n{_call(s, e)}\n{_call(40.0, 50.0)}", "seen\n</think>\n<answer>B</answer>"],
               (1, 0): ["from the overview\n</think>\n<answer>C</answer>"]}
    monkeypatch.setattr(rollout, "sample_tokens", Scripted(processor, scripts, seed=0))
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 160, "temperature": 1.0})
    trajs = rollout.run_agent(model, processor, records, cache, cfg, seed=0)
    rows = [rollout_row(r, t, processor.tokenizer) for r, t in zip(records, trajs)]
    assert rows[0]["windows"] == [[s, e]] and rows[0]["tool_failures"] == 1    # 40-50 s is past a 32 s video
    text = open(report.write_report(str(tmp_path / "out"), records, rows, video_root=cache), encoding="utf-8").read()
    page = Page(text)
    assert [sec["id"] for sec in page.sections] == [r["id"] for r in records]
    for sec, row in zip(page.sections, rows):
        assert [(a, b) for a, b, _ in sec["crops"]] == [tuple(w) for w in row["windows"]]
        policy = "".join(t for role, _, t in sec["segs"] if role == "policy")
        env = "".join(t for role, _, t in sec["segs"] if role == "env")
        assert "<tool_response>" not in policy and "<think>\n" not in policy
        assert "</answer>" in policy and env.startswith("<think>\n")
    assert [t for *_, t in page.sections[0]["crops"]] == ["1"]
    assert "fail" in page.sections[0]["classes"] and remote_resources(text, page) == []
    assert rows[0]["nframes"] + 2 <= page.sections[0]["imgs"] <= rows[0]["nframes"] + 4   # K + one crop's frames


REAL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "real_videos")


@pytest.mark.skipif(not os.path.isdir(REAL), reason="needs ../shared/real_videos")
def test_real_videos_of_other_codecs(tmp_path):
    """AV1 in Matroska, 10-bit H.264, H.265: thumbnails for the overview and each crop, data_type inferred."""
    names = ["av1_video.mkv", "h264_10bits.mp4", "h265_video.mp4"]
    records = [{"id": n, "video": n, "question": "What is shown?", "answer": "A", "task": "mcq", "options": ["x", "y"],
                "clues": [[0.2, 0.6]]} for n in names]
    rows = [{"id": n, "response": "<think>\nlook\n</think>\n<answer>B</answer>", "turns": 2, "calls": 1,
             "windows": [[0.1, 0.9]], "tool_failures": 0, "nframes": 4} for n in names]
    text = open(report.write_report(str(tmp_path), records, rows, video_root=REAL), encoding="utf-8").read()
    page = Page(text)
    assert [s["id"] for s in page.sections] == names
    assert all(4 + 2 <= s["imgs"] <= 4 + 4 for s in page.sections), [s["imgs"] for s in page.sections]
    assert all("wrong" in s["classes"] for s in page.sections) and 'class="note">video not shown' not in text
    assert text.count("mcq · single_clue") == 3


@pytest.mark.parametrize("windows, by_turn, expected", [
    ([[1, 2], [3, 4], [5, 6]], [[[1, 2], [3, 4]], [[5, 6]], []], [1, 1, 2]),     # parallel calls, then one
    ([[3, 4]], [[[70, 80], [3, 4]], []], [1]),                                  # a failed call is skipped
    ([[0, 4]], [[[-2, 4]]], [1]),                                               # clamped window: by position
    ([[1, 2], [9, 9.5]], [[[1, 2]], [[50, 60], [70, 80]]], [1, None]),          # no match, counts differ
    ([[1, 2]], None, [None]),                                                   # not recorded
])
def test_window_turns(windows, by_turn, expected):
    assert report.window_turns({"windows": windows, "calls_by_turn": by_turn}) == expected


def test_a_question_asked_without_a_gold_answer(demo, tmp_path):
    """`eval.py --video FILE --question ...` has no gold answer: the page shows the question as asked (not
    wrong), the predicted answer, and no accuracy reward (nothing to score against)."""
    _, _, records, rows, cache = demo
    record = {**records[0], "answer": None, "task": "oe", "options": None}
    text = open(report.write_report(str(tmp_path), [record], [rows[0]], video_root=cache), encoding="utf-8").read()
    page = Page(text)
    [sec] = page.sections
    assert "wrong" not in sec["classes"] and "v-asked" in text and "no gold answer" in text
    assert f"predicted <b>{rows[0]['answer']}</b>" in text and sec["imgs"] >= rows[0]["nframes"]
    assert report.reward_components(record, rows[0])["acc"] == (None, "no gold answer")
