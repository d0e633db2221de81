"""Tests for data.py: record validation and I/O, question text, the synthetic task and its oracle.

Run: python -m pytest tests/test_data.py -q
"""
import json
import os
from collections import Counter

import numpy as np
import pytest

import data
import video
from data import PALETTE, RecordError
from rewards import call_window, extract_answer, extract_time_range, parse_tool_calls
from conftest import ORACLE, TEST_ROLLOUT, oracle_turns

ONE_ROUND_MIX = {"single_clue": 0.5, "multi_clue": 0.2, "direct": 0.2, "grounding": 0.1}


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """8 records of the four one-round kinds: 4 single_clue, 2 multi_clue, 1 direct, 1 grounding (largest
    remainder). The search kind (two rounds) is tested in tests/test_turn_budget.py."""
    root = str(tmp_path_factory.mktemp("syn"))
    return root, data.make_split(root, 8, seed=0, mix=ONE_ROUND_MIX, duration=64.0)


def _mark_on(frame) -> bool:
    """Is the white block in the top-left corner? frame (3, H, W) of a 64x64 video, maybe resized."""
    k = frame.shape[-1] / 64
    level = frame[:, round(2 * k): round(14 * k), round(2 * k): round(14 * k)].float().mean().item()
    assert level > 220 or level < 170, f"ambiguous mark level {level}"  # background <= 135, mark 255
    return level > 220


def _glyph(frame, top: bool = False, left: bool = False) -> str | None:
    """Palette colour of a quadrant: bottom-right, or top-right (`top`): every glyph covers both; or
    top-left (`left`, the mark's), which only a big glyph covers. None when it shows anything else."""
    k = frame.shape[-1] / 64
    y, x = (8, 8) if left else (8 if top else 40, 40)
    rgb = frame[:, round(y * k): round((y + 16) * k), round(x * k): round((x + 16) * k)].float().mean((1, 2)).numpy()
    dist = {name: np.abs(rgb - np.array(c)).max() for name, c in PALETTE.items()}
    name = min(dist, key=dist.get)
    return name if dist[name] < 40 else None


# ----------------------------------------------------------------------------- resolve_video

def test_resolve_video_refuses_escapes_as_written(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside.mp4"
    (root / "videos").mkdir(parents=True)
    (root / "videos" / "a.mp4").write_bytes(b"x")
    outside.write_bytes(b"x")
    for rel, reason in [("../outside.mp4", "'..' component"),               # parent escape
                        ("videos/../../outside.mp4", "'..' component"),     # escape hidden after a real folder
                        ("videos/../a.mp4", "'..' component"),              # even one that comes back in
                        (str(outside), "absolute"),                         # absolute path outside the root
                        (str(root / "videos" / "a.mp4"), "absolute")]:      # absolute, even inside
        with pytest.raises(ValueError, match=reason):
            data.resolve_video(str(root), rel)
    assert data.resolve_video(str(root), "videos/a.mp4") == str(root / "videos" / "a.mp4")


def test_symlinked_dataset_layout_is_followed(tmp_path):
    """A video root made of links (a file link, a folder link, both pointing outside the root) is the
    user's layout: train and eval read through it, via validate_record / read_valid_records and resolve_video."""
    store, root = tmp_path / "store", tmp_path / "root"
    (store / "clips").mkdir(parents=True)
    (store / "clips" / "b.mp4").write_bytes(b"x")
    (store / "a.mp4").write_bytes(b"x")
    root.mkdir()
    os.symlink(store / "a.mp4", root / "a.mp4")
    os.symlink(store / "clips", root / "clips")
    assert os.path.realpath(data.resolve_video(str(root), "clips/b.mp4")) == str((store / "clips" / "b.mp4").resolve())
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(_good(id="a")) + "\n" + json.dumps(_good(id="b", video="clips/b.mp4")) + "\n"
                    + json.dumps(_good(id="c", video="../store/a.mp4")) + "\n", encoding="utf-8")
    records, errors = data.read_valid_records(str(path), str(root), max_bad_fraction=0.5)
    assert [r["id"] for r in records] == ["a", "b"]
    assert len(errors) == 1 and errors[0].startswith(f"{path}:3:") and "'..' component" in errors[0]


# ----------------------------------------------------------------------------- validate_record / read_valid_records

def _good(**change) -> dict:
    rec = {"id": "r1", "video": "a.mp4", "question": "What colour?", "options": ["red", "green", "blue", "yellow"],
           "answer": "B", "task": "mcq", "clues": [[2, 10]], "duration": 64}
    rec.update(change)
    return {k: v for k, v in rec.items() if v is not None}


@pytest.mark.parametrize("rec, reason", [
    ({k: v for k, v in _good().items() if k != "id"}, "missing field(s) id"),    # no id
    (_good(answer=None, question=None), "missing field(s) question, answer"),   # both named
    (_good(task="qa"), "unknown task 'qa'"),                                     # task outside mcq/oe/tvg
    (_good(answer="E"), "not a letter among the options (A-D)"),               # letter past the options
    (_good(answer="red"), "not a letter among the options"),                   # option text, not a letter
    (_good(options=None), "needs 2 to 26 options"),                              # mcq without options
    (_good(options="A. red"), "options must be a list of strings"),             # a string, not a list
    (_good(task="tvg", answer=[5, 3]), "needs 0 <= start < end"),               # reversed window
    (_good(task="tvg", answer="5-10"), "must be a [start, end] pair"),          # not a pair
    (_good(clues=[[60, 70]]), "ends after the video's duration 64.0"),          # clue past the end
    (_good(clues=[[3]]), "clue 0 must be a [start, end] pair"),                 # malformed clue
    (_good(clues=[[-1, 4]]), "needs 0 <= start < end"),                         # negative start
    (_good(clues=[[1, float("nan")]]), "must be a [start, end] pair"),          # NaN is not a time
    (_good(duration=-3), "duration must be a positive number"),                 # nonsense duration
    (_good(data_type="weird"), "data_type must be one of"),                     # unknown data_type
    (_good(video="../x.mp4"), "outside the video root"),                        # path escape
    (_good(video="missing.mp4"), "not found under"),                            # no file on disk
    ([1, 2], "must be a JSON object"),                                           # not an object
])
def test_validate_record_errors(tmp_path, rec, reason):
    (tmp_path / "a.mp4").write_bytes(b"x")
    with pytest.raises(RecordError) as e:
        data.validate_record(rec, str(tmp_path), "f.jsonl:7")
    assert str(e.value).startswith("f.jsonl:7: ") and reason in str(e.value), str(e.value)


@pytest.mark.parametrize("change, data_type", [
    ({"task": "tvg", "answer": [1, 9], "options": None}, "grounding"),   # tvg -> grounding
    ({}, "single_clue"),                                                  # one clue
    ({"clues": [[1, 5], [20, 30]]}, "multi_clue"),                        # several clues
    ({"clues": None}, "free_form"),                                       # no clue
    ({"data_type": "direct"}, "direct"),                                  # given: kept
])
def test_validate_record_infers_data_type(change, data_type):
    assert data.validate_record(_good(**change), None, "x")["data_type"] == data_type


def test_validate_record_normalises_and_keeps_extra_keys():
    rec = data.validate_record(_good(id=17, answer=" b ", extra={"k": 1}), None, "x")
    assert rec["id"] == "17" and rec["answer"] == "B" and rec["extra"] == {"k": 1}
    assert rec["clues"] == [[2.0, 10.0]] and all(isinstance(v, float) for v in rec["clues"][0])
    assert rec["duration"] == 64.0 and rec["meta"] == {}


def test_read_valid_records_keeps_good_lines_and_lists_errors(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    lines = [json.dumps(_good(id="g1")),                      # 1 good
             "{not json",                                     # 2 bad JSON
             json.dumps({"id": "m", "video": "a.mp4"}),       # 3 missing fields
             json.dumps(_good(id="g2")),                      # 4 good
             json.dumps(_good(id="b1", answer="F")),          # 5 answer not among the options
             "",                                              # 6 blank: skipped, not counted
             json.dumps(_good(id="b2", clues=[[60, 65]])),    # 7 clue past the duration
             json.dumps(_good(id="b3", video="nope.mp4")),    # 8 video missing
             json.dumps(_good(id="g1")),                      # 9 duplicate id
             json.dumps(_good(id="g3", task="oe", answer="a red square", options=None)),  # 10 good
             json.dumps(_good(id="g4")), json.dumps(_good(id="g5")), json.dumps(_good(id="g6"))]  # 11-13
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, errors = data.read_valid_records(str(path), str(tmp_path), max_bad_fraction=0.5)
    assert [r["id"] for r in records] == ["g1", "g2", "g3", "g4", "g5", "g6"]
    assert [e.split(": ")[0] for e in errors] == [f"{path}:{n}" for n in (2, 3, 5, 7, 8, 9)]
    for e, why in zip(errors, ["not valid JSON", "missing field", "not a letter", "duration", "not found",
                               "duplicate id 'g1' (first on line 1)"]):
        assert why in e, e


def test_read_valid_records_too_many_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_good()) + "\n[]\n{\n")
    with pytest.raises(ValueError, match=r"2 of 3 lines are bad.*bad.jsonl:2: a record must be a JSON object"):
        data.read_valid_records(str(path), max_bad_fraction=0.5)
    assert len(data.read_valid_records(str(path), max_bad_fraction=0.7)[1]) == 2  # a looser limit passes
    with pytest.raises(ValueError, match="missing.jsonl: cannot read"):
        data.read_valid_records(str(tmp_path / "missing.jsonl"), max_bad_fraction=0.5)


def test_write_records_round_trip_and_atomic(tmp_path):
    path = str(tmp_path / "out" / "r.jsonl")
    recs = [data.validate_record(_good(id=f"r{i}", question="Qué color? ✓"), None, "x") for i in range(3)]
    data.write_records(path, recs)
    assert data.read_valid_records(path, max_bad_fraction=0.5) == (recs, [])
    with pytest.raises(TypeError):               # unserialisable record: the old file must survive
        data.write_records(path, [{"id": {1, 2}}])
    assert data.read_valid_records(path, max_bad_fraction=0.5) == (recs, [])
    assert os.listdir(tmp_path / "out") == ["r.jsonl"]  # no temp file left behind


# ----------------------------------------------------------------------------- format_question

MCQ = "Answer with the option letter inside <answer></answer>."


@pytest.mark.parametrize("rec, text", [
    # plain options get letters
    ({"task": "mcq", "question": "Q?", "options": ["red", "blue"]}, f"Question: Q?\nOptions:\nA. red\nB. blue\n{MCQ}"),
    # benchmark options that already carry their letter are not prefixed twice
    ({"task": "mcq", "question": "Q?", "options": ["A. red", "B. blue"]},
     f"Question: Q?\nOptions:\nA. red\nB. blue\n{MCQ}"),
    # an option that merely starts with a capital letter is still prefixed
    ({"task": "mcq", "question": "Q?", "options": ["A cat", "Big dog"]},
     f"Question: Q?\nOptions:\nA. A cat\nB. Big dog\n{MCQ}"),
    # open-ended: no options block
    ({"task": "oe", "question": "Q?", "options": None}, "Question: Q?\nAnswer briefly inside <answer></answer>."),
    # grounding instruction
    ({"task": "tvg", "question": "When?"},
     "Question: When?\nAnswer with the time window as <answer>[start, end]</answer> in seconds."),
    # subtitles come first
    ({"task": "oe", "question": "Q?", "subtitles": "hi\nthere"},
     "Subtitles:\nhi\nthere\nQuestion: Q?\nAnswer briefly inside <answer></answer>."),
])
def test_format_question(rec, text):
    assert data.format_question(rec) == text


# ----------------------------------------------------------------------------- make_split

def test_make_split_records_are_valid_and_consistent(split):
    root, recs = split
    assert Counter(r["data_type"] for r in recs) == {"single_clue": 4, "multi_clue": 2, "direct": 1, "grounding": 1}
    assert [r["id"] for r in recs] == [f"syn-0-{i:05d}" for i in range(8)]
    for r in recs:
        assert data.validate_record(r, root, r["id"]) == r   # already normalised, video inside root
        m, clues = r["meta"], r["clues"]
        assert m["kind"] == r["data_type"] and len(set(m["colours"])) == len(m["colours"]) == len(clues)
        for (s, e), (g0, g1) in zip(clues, m["glyph_windows"]):
            assert e - s == 8 and s == int(s) and 0 <= s and e <= r["duration"]
            assert (g0, g1) == ((s, e) if r["data_type"] == "direct" else (s + data.NEEDLE[0], s + data.NEEDLE[1]))
        if len(clues) == 2:
            assert clues[1][0] >= clues[0][1] + 4                          # >= 4 s apart, time order
        if r["data_type"] != "grounding":   # options: the palette; the answer: the (earlier) glyph's colour
            assert r["options"] == list(PALETTE) and r["answer"] == "ABCD"[list(PALETTE).index(m["colours"][0])]
        if r["data_type"] == "multi_clue":  # the question names both colours, in either order
            assert r["question"] in [f"Which came first, the {a} shape or the {b} shape?"
                                     for a, b in (m["colours"], m["colours"][::-1])]
        if r["data_type"] == "grounding":
            assert r["task"] == "tvg" and r["answer"] == clues[0]


def test_make_split_deterministic_and_cached(split, tmp_path):
    """Same seed -> same records and the same video BYTES. Regression: letting PyAV convert rgb24 to
    yuv420p implicitly inside encode() made some videos differ run to run (x264 got different input)."""
    root, recs = split
    again = data.make_split(str(tmp_path), 8, seed=0, mix=ONE_ROUND_MIX, duration=64.0)
    assert again == recs
    for r in recs:
        assert (tmp_path / r["video"]).read_bytes() == open(os.path.join(root, r["video"]), "rb").read()
    mtimes = [os.stat(tmp_path / r["video"]).st_mtime_ns for r in recs]
    assert data.make_split(str(tmp_path), 8, seed=0, mix=ONE_ROUND_MIX, duration=64.0) == recs
    assert [os.stat(tmp_path / r["video"]).st_mtime_ns for r in recs] == mtimes  # cache hit: not rewritten
    assert data.make_split(str(tmp_path), 8, seed=1, duration=64.0) != recs                     # another seed differs


def test_make_split_cache_follows_content(tmp_path):
    """Same id, other mix: the video is never reused with the old marks; both splits' videos live side by
    side (another file name), so runs with different splits can share one cache at the same time."""
    a = data.make_split(str(tmp_path / "a"), 2, seed=3, mix={"direct": 1.0}, duration=24.0)
    a_bytes = [(tmp_path / "a" / r["video"]).read_bytes() for r in a]
    b = data.make_split(str(tmp_path / "a"), 2, seed=3, mix={"multi_clue": 1.0}, duration=24.0)
    fresh = data.make_split(str(tmp_path / "b"), 2, seed=3, mix={"multi_clue": 1.0}, duration=24.0)
    assert [r["id"] for r in a] == [r["id"] for r in b] and b == fresh
    assert all(ra["video"] != rb["video"] for ra, rb in zip(a, b))
    for r, old in zip(a, a_bytes):
        assert (tmp_path / "a" / r["video"]).read_bytes() == old          # the first split's videos are intact
    for r in b:
        assert (tmp_path / "a" / r["video"]).read_bytes() == (tmp_path / "b" / r["video"]).read_bytes()


def test_make_split_mix_proportions(tmp_path):
    recs = data.make_split(str(tmp_path), 40, seed=5, mix={"single_clue": 3, "grounding": 1}, duration=24.0)
    assert Counter(r["data_type"] for r in recs) == {"single_clue": 30, "grounding": 10}
    kinds = [r["data_type"] for r in recs]
    assert kinds != sorted(kinds)                                    # shuffled, not in blocks


@pytest.mark.parametrize("kwargs, match", [
    ({"mix": {"bogus": 1.0}, "duration": 64.0}, "mix must map"),     # unknown kind
    ({"mix": {"direct": 0.0}, "duration": 64.0}, "mix must map"),    # no positive weight
    ({"mix": {"multi_clue": 1.0}, "duration": 16.0}, "cannot hold 2 mark"),  # 2 marks + gap need 20 s
])
def test_make_split_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.make_split(str(tmp_path), 2, seed=0, **kwargs)


def test_videos_show_marks_and_glyphs_exactly_when_scheduled(split):
    """Every frame at 2 fps: the block is on iff inside a mark window, the glyph iff inside its glyph window."""
    root, recs = split
    for r in recs:
        path = os.path.join(root, r["video"])
        info = video.probe(path)
        assert (info.duration, info.fps, info.width, info.height) == (64.0, 2.0, 64, 64)
        clip = video.sample_overview(path, nframes=128)
        assert np.allclose(clip.times, np.arange(128) / 2)
        for frame, t in zip(clip.frames, clip.times):
            want_mark = any(s <= t < e for s, e in r["clues"])
            want_glyph = [c for c, (g0, g1) in zip(r["meta"]["colours"], r["meta"]["glyph_windows"]) if g0 <= t < g1]
            big = bool(want_glyph) and r["data_type"] == "direct"        # a big glyph also covers the mark
            assert _mark_on(frame) == (want_mark and not big), (r["id"], t)
            assert _glyph(frame) == (want_glyph[0] if want_glyph else None), (r["id"], t)
            assert _glyph(frame, top=True) == (want_glyph[0] if want_glyph else None), (r["id"], t)
            assert _glyph(frame, left=True) == (want_glyph[0] if big else None), (r["id"], t)


def test_crop_of_mark_window_shows_glyph_and_overview_shows_mark(split):
    root, recs = split
    for r in recs:
        path = os.path.join(root, r["video"])
        for (s, e), colour in zip(r["clues"], r["meta"]["colours"]):
            clip = video.crop(path, s, e, level="medium", fps=2.0, max_frames=128)   # 2 fps clip of the mark window
            assert colour in [_glyph(f) for f in clip.frames], (r["id"], s)
        ov = video.sample_overview(path, nframes=16, max_pixels=32 * 32)   # sparse, 32x32 overview
        assert ov.frames.shape[-2:] == (32, 32)
        for frame, t in zip(ov.frames, ov.times):   # the mark, or a big glyph over it, shows its window
            shown = _mark_on(frame) or _glyph(frame, left=True) is not None
            assert shown == any(s <= t < e for s, e in r["clues"]), (r["id"], t)


# ----------------------------------------------------------------------------- oracle trajectories

def _check_oracle(r, msgs, n_calls, noise=1.0):
    """Structure shared by every kind; returns the crop windows of the first assistant turn."""
    assistant = [m for m in msgs if m["role"] == "assistant"]
    assert all(m["content"].startswith("<think>\n") and "</think>\n" in m["content"] for m in assistant)
    assert extract_answer(assistant[-1]["content"]) is not None and not parse_tool_calls(assistant[-1]["content"])
    if n_calls == 0:
        assert len(msgs) == 1
        return []
    calls = parse_tool_calls(assistant[0]["content"])
    windows = [call_window(c) for c in calls]
    assert len(calls) == n_calls and None not in windows and len(assistant) == 2
    tools = msgs[1:-1]
    assert [(m["role"], m["content"][0]["video_start"], m["content"][0]["video_end"], m["content"][0]["video"])
            for m in tools] == [("tool", a, b, r["video"]) for a, b in windows]
    for (a, b), (g0, g1) in zip(windows, r["meta"]["glyph_windows"]):
        # the oracle crops around what the 8-frame overview shows; the crop must hold >= 1 s of the glyph slot
        assert a < b and a * 2 == int(a * 2) and b * 2 == int(b * 2)
        assert min(b, g1) - max(a, g0) >= 1.0, (r["id"], (a, b), (g0, g1))
    return windows


@pytest.mark.parametrize("clue, expected", [
    ([25.0, 33.0], 24.0),   # frame 28 of the (20, 28) patch shows the mark -> printed 24.0
    ([13.0, 21.0], 24.0),   # frame 20 only
    ([5.0, 13.0], 8.0),     # frame 12 of the first patch (4, 12)
    ([0.0, 3.0], None),     # no overview frame inside: the overview misses it
])
def test_seen_at_uses_the_printed_patch_time(clue, expected):
    patches = data.overview_patch_times(64.0, 8)
    assert [t for t, _, _ in patches] == [8.0, 24.0, 40.0, 56.0]
    assert data.seen_at(clue, patches) == expected


def test_glyphs_seen_counts_the_frames_a_crop_samples_not_its_span():
    """data.glyphs_seen: the overview alone misses a needle between its frames (the tool is needed), a tight crop
    shows it, a crop elsewhere does not, and a wide crop that covers the glyph's slot may still miss it between
    its frames: decided by the frames it samples (data.crop_patch_times), not by its span."""
    recs = [data._make_one(f"q{i}", "single_clue", np.random.default_rng(i), 64.0)[0] for i in range(12)]
    rec = next(r for r in recs if data.tool_needed(r, 8))
    (g0, g1), duration = rec["meta"]["glyph_windows"][0], rec["duration"]
    assert data.glyphs_seen(rec, 8, None) is False
    assert data.glyphs_seen(rec, 8, [(max(0.0, g0 - 2), min(duration, g1 + 2))], 1.0, 16) is True
    far = (0.0, 8.0) if g0 > 20 else (duration - 8.0, duration)
    assert data.glyphs_seen(rec, 8, [far], 1.0, 16) is False
    with pytest.raises(ValueError, match="crop_fps"):                    # a crop's frames need its sampling
        data.glyphs_seen(rec, 8, [far])
    wide = (0.0, duration)
    frames = [f for _, f0, f1 in data.crop_patch_times(*wide, duration, 1.0, 16) for f in (f0, f1)]
    assert data.glyphs_seen(rec, 8, [wide], 1.0, 16) == any(g0 <= f < g1 for f in frames)
    assert data.glyphs_seen({"task": "grounding", "meta": {}}, 8, None) is None


def test_oracle_turns_by_kind(split):
    _, recs = split
    rng = np.random.default_rng(0)
    for r in recs:
        kind = r["data_type"]
        msgs = oracle_turns(r, rng)
        answer = extract_answer(msgs[-1]["content"])
        if kind == "grounding":   # no crop; the 8 s window centred on the overview frame inside the mark
            _check_oracle(r, msgs, 0)
            (s, e), (a, b) = r["answer"], extract_time_range(answer)
            f = (a + b) / 2 if 0 < a and b < 64 else (b - 4 if a == 0 else a + 4)
            assert b - a <= 8 and s <= f < e and f % 4 == 0 and (f / 4) % 2 == 1, (r["answer"], answer)
            assert answer == f"[{a:.1f}, {b:.1f}]"
        else:
            assert answer == r["answer"]
            windows = _check_oracle(r, msgs, {"single_clue": 1, "multi_clue": 2, "direct": 0}[kind])
            assert windows == sorted(windows)                                       # calls in time order
            assert all(c in msgs[-1]["content"] for c in r["meta"]["colours"])      # final think names colours
        if kind == "direct":
            _check_oracle(r, oracle_turns(r, rng, always_call=True), 1)       # always_call: one crop


@pytest.mark.parametrize("nframes", [4, 8, 16, 32, 64])
def test_oracle_acts_on_what_a_k_frame_overview_shows(split, nframes):
    """For every gating K: a seen needle is cropped around its patch time and the crop holds >= 1 s of the
    glyph; a mark the overview misses (only K = 4 misses any) is searched with a whole-video crop; a big
    glyph the overview shows is answered directly, or cropped when direct_crop = 1."""
    _, recs = split
    rng = np.random.default_rng(0)
    patches = data.overview_patch_times(64.0, nframes)
    for r in recs:
        if r["data_type"] == "grounding":
            continue
        seen = [data.seen_at(c, patches) for c in r["clues"]]
        assert nframes == 4 or None not in seen
        for direct_crop in (0.0, 1.0):
            msgs = oracle_turns(r, rng, nframes=nframes, direct_crop=direct_crop)
            assert extract_answer(msgs[-1]["content"]) == r["answer"]
            calls = [call_window(c) for c in parse_tool_calls(msgs[0]["content"])]
            if r["data_type"] == "direct" and seen[0] is not None and direct_crop == 0.0:
                assert calls == [] and len(msgs) == 1
                continue
            assert len(calls) == len(r["clues"])
            for (a, b), t, (g0, g1) in zip(calls, seen, r["meta"]["glyph_windows"]):
                if t is None:
                    assert (a, b) == (0.0, 64.0)
                else:
                    assert a <= t <= b and min(b, g1) - max(a, g0) >= 1.0, (r["id"], nframes, (a, b), (g0, g1))


@pytest.mark.parametrize("nframes, worst_iou", [(8, 1 / 3), (16, 1 / 3), (64, 0.75)])
def test_grounding_oracle_answers_what_the_overview_shows(nframes, worst_iou):
    """Grounding: no crop; an 8 s window centred on the overview frames inside the mark, so its IoU with
    the truth is >= 1/3 when one frame (K = 8: spacing 8 s) shows it and near 1 for a dense overview;
    a mark the overview misses (K = 4 only) gets the whole video."""
    for s in range(0, 57):
        r = {"id": "g", "video": "v.mp4", "data_type": "grounding", "task": "tvg", "clues": [[s, s + 8.0]],
             "answer": [s, s + 8.0], "duration": 64.0, "meta": {"colours": [], "glyph_windows": []}}
        msgs = oracle_turns(r, np.random.default_rng(0), nframes=nframes)
        a, b = extract_time_range(extract_answer(msgs[0]["content"]))
        iou = max(0.0, min(b, s + 8) - max(a, s)) / (max(b, s + 8) - min(a, s))
        assert len(msgs) == 1 and 0 <= a < b <= 64 and iou >= worst_iou - 1e-9, (s, a, b, iou)
    patches4 = data.overview_patch_times(64.0, 4)
    missed = next(s for s in range(57) if data.seen_at([s, s + 8.0], patches4) is None)
    r["clues"] = [[missed, missed + 8.0]]
    assert extract_answer(oracle_turns(r, np.random.default_rng(0), nframes=4)[0]["content"]) == "[0.0, 64.0]"


def test_oracle_windows_clamped_to_the_video():
    r = {"id": "x", "video": "v.mp4", "data_type": "single_clue", "clues": [[0.0, 8.0]], "duration": 8.0,
         "answer": "A", "meta": {"colours": ["red"], "glyph_windows": [[2.0, 6.0]]}}
    rng = np.random.default_rng(1)
    for _ in range(50):
        (a, b), = _check_oracle(r, oracle_turns(r, rng, window_noise=3.0), 1, noise=3.0)
        assert 0.0 <= a < b <= 8.0


def test_write_sft_records(split, tmp_path):
    _, recs = split
    path = str(tmp_path / "sft.jsonl")
    data.write_sft_records(path, recs, seed=4, **ORACLE)
    rows = [json.loads(line) for line in open(path)]
    rng = np.random.default_rng(4)
    assert rows == [{"id": r["id"], "video": r["video"], "prompt": r, "messages": oracle_turns(r, rng)}
                    for r in recs]


def test_parse_mix():
    assert data.parse_mix(None) is None and data.parse_mix("") is None
    assert data.parse_mix("single_clue=2, direct=1") == {"single_clue": 2.0, "direct": 1.0}
    for bad, message in [("direct", "kind=weight"), ("direct=x", "kind=weight"), ("colour=1", "mix must map"),
                         ("direct=-1", "mix must map")]:
        with pytest.raises(ValueError, match=message):
            data.parse_mix(bad)


def _needle(rid: str, kind: str, starts: list[float]) -> dict:
    """A hand-made synthetic colour question (metadata only: the oracle never opens the video)."""
    colours = ["red", "blue"][:len(starts)]
    return {"id": rid, "video": "v.mp4", "data_type": kind, "task": "mcq", "duration": 64.0, "answer": "B",
            "clues": [[s, s + 8.0] for s in starts], "meta": {"kind": kind, "colours": colours,
                                                              "glyph_windows": [[s + 2.0, s + 6.0] for s in starts]}}


def test_call_prior_leaves_when_to_call_to_a_coin():
    """call_prior < 1: where the answer needs a crop (a small glyph, a mark the overview misses, two marks), the
    oracle crops with that chance and otherwise says what it saw and guesses a letter in one turn, the same words
    up to "I will" (the decision is one continuation); the coin ignores the question (the same share on every
    kind); a big glyph the overview shows is untouched; call_prior = 1 draws nothing extra (the SFT data of a run
    without the option is unchanged)."""
    patches = data.overview_patch_times(64.0, 4)
    missed = next(float(s) for s in range(49) if data.seen_at([s, s + 8.0], patches) is None)
    shown = next(float(s) for s in range(49) if data.seen_at([s, s + 8.0], patches) is not None)
    needs = [_needle("a", "single_clue", [shown]), _needle("b", "search", [missed]),
             _needle("c", "multi_clue", sorted([missed, shown])), _needle("e", "direct", [missed])]
    assert [data.seen_at(c, patches) is None for r in needs for c in r["clues"]] == [False, True, True, False, True]
    big = _needle("d", "direct", [shown])
    for prior in (0.0, 1.0):
        for r in needs + [big]:
            msgs = oracle_turns(r, np.random.default_rng(0), nframes=4, call_prior=prior)
            oracle = oracle_turns(r, np.random.default_rng(0), nframes=4)
            if prior == 0.0 and r is not big:
                assert len(msgs) == 1 and not parse_tool_calls(msgs[0]["content"]), r["id"]
                said, did = msgs[0]["content"].split("</think>")[0], oracle[0]["content"].split("</think>")[0]
                assert said.endswith(" I will guess.\n") and said.rsplit(" I will ", 1)[0] == did.rsplit(" I will ", 1)[0]
                assert extract_answer(msgs[0]["content"]) in tuple("ABCD")
            else:
                assert msgs == oracle, (r["id"], prior)
    for r in needs[1:2] + needs[3:]:  # prior 1 draws no coin (a whole-video search draws nothing at all)
        rng = np.random.default_rng(3)
        oracle_turns(r, rng, nframes=4, call_prior=1.0)
        assert rng.random() == np.random.default_rng(3).random()
    rng, n = np.random.default_rng(1), 400
    for r in needs:
        called = sum(len(oracle_turns(r, rng, nframes=4, call_prior=0.4)) > 1 for _ in range(n))
        assert abs(called / n - 0.4) < 0.08, (r["id"], called)
    letters = Counter(extract_answer(oracle_turns(needs[0], rng, nframes=4, call_prior=0.0)[0]["content"])
                      for _ in range(n))
    assert set(letters) == set("ABCD") and min(letters.values()) > n / 8             # a guess, not the answer


def test_tool_free_recordings_beside_the_oracles():
    """oracle_sft_pairs(tool_free=g): each recording that calls the tool gets, with chance g, a twin recorded as a
    tool-free teacher answers it (no call; a guess where a crop is needed, the overview's reading of a big glyph),
    tagged "(tool-free)"; recordings without a call get none; g = 0 leaves the pairs of a run without the option."""
    import rollout
    cfg = rollout.RolloutConfig(**TEST_ROLLOUT)
    recs = [_needle(f"n{i}", kind, [float(8 * i % 48)]) for i, kind in enumerate(["single_clue", "search", "direct"] * 8)]
    mix = dict(always_call=False, direct_crop=0.0, budget_fraction=0.0)
    base, _ = data.oracle_sft_pairs(recs, cfg, seed=0, gated_choices=[4, 8], **mix, tool_free=0.0)
    pairs, errors = data.oracle_sft_pairs(recs, cfg, seed=0, gated_choices=[4, 8], **mix, tool_free=1.0)
    twins = [(r, msgs, k) for r, msgs, where, k, _ in pairs if where.endswith("(tool-free)")]
    callers = [p for p in pairs if not p[2].endswith("(tool-free)") and data.oracle_rounds(p[1])]
    assert not errors and len(twins) == len(callers) > 0
    for r, msgs, k in twins:
        assert len(msgs) == 1 and not parse_tool_calls(msgs[0]["content"])
        big = r["data_type"] == "direct" and data.seen_at(r["clues"][0], data.overview_patch_times(64.0, k)) is not None
        assert msgs[0]["content"].split("</think>")[0].endswith(".\n") and ("I will guess." in msgs[0]["content"]) != big
        assert not big or extract_answer(msgs[0]["content"]) == r["answer"]
    always = data.oracle_sft_pairs(recs, cfg, seed=0, gated_choices=[4, 8], **dict(mix, always_call=True),
                                   tool_free=1.0)[0]
    assert not any(p[2].endswith("(tool-free)") for p in always)          # a teacher that always calls has no twin
    some = data.oracle_sft_pairs(recs, cfg, seed=0, gated_choices=[4, 8], **mix, tool_free=0.5)[0]
    assert 0 < sum(p[2].endswith("(tool-free)") for p in some) < len(twins)
