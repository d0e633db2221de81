"""Tests for benchmarks.py: loaders on the real benchmark files, what a file looks like (sniff), answer
extraction, metric arithmetic. No model, no video.

    pytest tests/test_benchmarks.py -q
"""
import importlib.util
import json
from pathlib import Path

import pytest

import benchmarks as ev

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "benchmark_samples"
VIDEOMME = SAMPLES / "videomme_output_test_template.json.txt"
LVB = SAMPLES / "longvideobench_lvb_val_sample.json"
MLVU = SAMPLES / "mlvu_dev_github_json_sample.json"
MMVU = SAMPLES / "mmvu_validation_sample.json"
VIDEOMMMU = SAMPLES / "videommmu_github_nested_sample.json"
HOLMES = SAMPLES / "video_holmes_example_questions_RSmjqss0XKQ.json"
CHARADES = SAMPLES / "charades_sta_test_videoo3_format_sample.json"


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path

# ----------------------------------------------------------------------------- loaders, real files

def test_videomme_template_loads_with_trailing_commas():
    recs = ev.load("videomme", VIDEOMME)
    assert [r["id"] for r in recs] == ["001-1", "001-2", "001-3", "002-1", "002-2", "002-3", "003-1", "003-2", "003-3"]
    assert [r["answer"] for r in recs] == ["C", "A", "D", "C", "D", "B", "B", "C", "D"]
    first = recs[0]
    # "A. Apples." -> plain text, never re-prefixed
    assert first["options"] == ["Apples.", "Candles.", "Berries.", "The three kinds are of the same number."]
    assert first["meta"]["task_type"] == "Counting Problem" and first["meta"]["duration_group"] == "short"
    assert first["meta"]["category"] == "Knowledge" and first["meta"]["response"] == "C. Berries."
    assert first["video"] == "data/001.mp4" and first["task"] == "mcq"


def test_longvideobench_val_json():
    recs = ev.load("longvideobench", LVB)
    assert [r["id"] for r in recs] == ["86CxyhFV9MI_0", "QJ6sjg7SXOQ_0"]
    assert [r["answer"] for r in recs] == ["B", "E"]               # chr(65 + correct_choice)
    assert [len(r["options"]) for r in recs] == [4, 5]
    assert recs[1]["options"][4] == "Extending his palm forward while facing the camera"
    assert recs[0]["video"] == "videos/86CxyhFV9MI.mp4" and recs[0]["duration"] == 190.16
    assert recs[0]["meta"]["task_type"] == "TOS" and recs[0]["meta"]["duration_group"] == 600


def test_mlvu_github_json_answers_text_to_letter():
    recs = ev.load("mlvu", MLVU)
    # 7 MCQ task files x 2 records; sub_scene / summary (generation) are not multiple choice
    assert len(recs) == 14
    assert [r["answer"] for r in recs] == ["A", "B", "A", "D", "A", "C", "B", "B", "D", "A", "C", "A", "A", "B"]
    assert recs[3]["id"] == "2_needle_1" and recs[3]["options"][3] == "Fishing"
    assert recs[0]["video"] == "video/1_plotQA/movie101_66.mp4"
    assert {r["meta"]["task_type"] for r in recs} == {"plotQA", "findNeedle", "ego", "count", "order",
                                                      "anomaly_reco", "topic_reasoning"}


@pytest.mark.parametrize("subset, ids, answers", [
    ("mc", ["validation_1", "validation_3"], ["A", "B"]),        # default: the 625-style MC subset
    ("all", ["validation_1", "validation_3", "validation_0", "validation_2"],
     ["A", "B", "Dolly Zoom", "Depth-First Search (DFS)"]),     # open-ended kept as task oe
])
def test_mmvu_subsets(subset, ids, answers):
    recs = ev.load("mmvu", MMVU, mmvu_subset=subset)
    assert [r["id"] for r in recs] == ids and [r["answer"] for r in recs] == answers
    assert recs[0]["options"] == ["10.0", "5.0", "12.0", "15.0", "20.0"]
    assert recs[0]["video"] == "videos/Chemistry/0.mp4" and recs[0]["meta"]["category"] == "Chemistry"
    assert [r["task"] for r in recs[2:]] == ["oe"] * (len(recs) - 2)
    assert all(r["options"] is None for r in recs[2:])


def test_videommmu_github_nested():
    recs = ev.load("videommmu", VIDEOMMMU)
    assert [r["id"] for r in recs] == [
        "Perception/dev_Biology_3", "Perception/dev_Geography_5", "Comprehension/dev_Biology_3",
        "Comprehension/dev_Geography_5", "Adaptation/dev_Biology_3", "Adaptation/dev_Geography_5",
        "Adaptation/validation_Chemistry_13"]
    assert [r["answer"] for r in recs] == ["G", "H", "F", "J", "A", "A", "12.97"]
    assert [r["task"] for r in recs] == ["mcq"] * 6 + ["oe"]
    assert recs[0]["video"] == "Science/dev_Biology_3.mp4" and len(recs[0]["options"]) == 10
    assert recs[6]["options"] is None and recs[6]["meta"]["task_type"] == "Adaptation"


def test_video_holmes_example_questions():
    recs = ev.load("video_holmes", HOLMES)
    assert [r["id"] for r in recs] == [f"RSmjqss0XKQ_{i}" for i in range(1, 9)]
    assert [r["answer"] for r in recs] == ["A", "B", "C", "A", "B", "A", "C", "F"]
    assert recs[0]["options"][0] == "Cleaners" and len(recs[0]["options"]) == 6
    assert recs[0]["meta"]["task_type"] == "SR" and recs[0]["video"] == "videos/RSmjqss0XKQ.mp4"


def test_charades_videoo3_json():
    recs = ev.load("charades_sta", CHARADES)
    assert [r["id"] for r in recs] == ["charades_3MSZA_1", "charades_3MSZA_2", "charades_3MSZA_3",
                                       "charades_3MSZA_4", "charades_AMT7R_1", "charades_YVKIV_1"]
    assert [r["answer"] for r in recs] == [[24.3, 30.4]] * 4 + [[4.3, 12.5], [4.4, 9.2]]
    assert recs[0]["task"] == "tvg" and recs[0]["data_type"] == "grounding" and recs[0]["clues"] == [[24.3, 30.4]]
    assert recs[0]["question"] == "person turn a light on." and recs[4]["duration"] == 30.08

@pytest.mark.parametrize("bench, path", [("videomme", VIDEOMME), ("longvideobench", LVB), ("mlvu", MLVU),
                                         ("mmvu", MMVU), ("videommmu", VIDEOMMMU), ("video_holmes", HOLMES),
                                         ("charades_sta", CHARADES)])
def test_records_pass_the_shared_record_check(bench, path):
    data = pytest.importorskip("data")
    for rec in ev.load(bench, path, mmvu_subset="all"):
        assert data.validate_record(rec, None, f"{bench} {rec['id']}")["answer"] == rec["answer"]

# ----------------------------------------------------------------------------- loaders, fixtures from docs/benchmarks.md

VIDEOMME_ROW = {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
                "url": "https://www.youtube.com/watch?v=fFjv93ACGo8", "videoID": "fFjv93ACGo8", "question_id": "001-1",
                "task_type": "Counting Problem",
                "question": "When demonstrating the Germany modern Christmas tree is initially decorated with apples, "
                            "candles and berries, which kind of the decoration has the largest number?",
                "options": ["A. Apples.", "B. Candles.", "C. Berries.", "D. The three kinds are of the same number."],
                "answer": "C"}


def test_videomme_rows_and_subtitles(tmp_path):
    rows = [VIDEOMME_ROW, {**VIDEOMME_ROW, "videoID": "noSubs", "question_id": "002-1"}]
    path = write_jsonl(tmp_path / "videomme.jsonl", rows)
    (tmp_path / "subtitle").mkdir()
    (tmp_path / "subtitle" / "fFjv93ACGo8.srt").write_text(
        '1\n00:00:01,000 --> 00:00:02,000\n<font color="white" size=".72c">Merry Christmas</font>\n\n'
        '2\n00:00:03,000 --> 00:00:04,000\n<font color="white" size=".72c">apples and candles</font>\n', encoding="utf-8")
    plain = ev.load("videomme", path, video_root=tmp_path)
    assert plain[0]["video"] == "data/fFjv93ACGo8.mp4" and plain[0]["subtitles"] is None
    assert plain[0]["options"][2] == "Berries." and plain[0]["answer"] == "C"
    subs = ev.load("videomme_sub", path, video_root=tmp_path)
    assert subs[0]["subtitles"] == "Merry Christmas\napples and candles"   # font tags stripped
    assert subs[1]["subtitles"] is None                                     # no .srt for that video


def test_longvideobench_hf_rows(tmp_path):
    row = {"video_id": "86CxyhFV9MI", "id": "86CxyhFV9MI_0", "video_path": "86CxyhFV9MI.mp4",
           "question": "Which subtitles appear?", "option0": "a", "option1": "b", "option2": "c", "option3": "d",
           "option4": "N/A", "correct_choice": 2, "duration": 190.16, "duration_group": 600, "question_category": "TOS"}
    recs = ev.load("longvideobench", write_json(tmp_path / "lvb.json", [row]))
    assert recs[0]["options"] == ["a", "b", "c", "d"] and recs[0]["answer"] == "C"   # "N/A" = absent option


LVBENCH_QA = {"uid": "55", "question": "What year appears in the opening caption of the video?\n(A) 1636\n(B) 1366\n(C) 1363\n(D) 1633",
              "answer": "D", "question_type": ["key information retrieval"], "time_reference": "00:15-00:19"}


def test_lvbench_nested_jsonl(tmp_path):
    videos = [{"key": "Cm73ma6Ibcs", "type": "documentary",
               "video_info": {"duration_minutes": 72.5, "fps": 25.0, "resolution": {"width": 1280, "height": 720}},
               "qa": [LVBENCH_QA]},
              {"key": "other", "type": "sport", "video_info": {"duration_minutes": 90.0},
               "qa": [{"uid": "56", "question": "Who scores?\n(A) x\n(B) y", "answer": "(B)",
                       "question_type": ["reasoning", "temporal grounding"], "time_reference": "1:02:03-1:02:10"}]}]
    recs = ev.load("lvbench", write_jsonl(tmp_path / "video_info.meta.jsonl", videos))
    assert [r["id"] for r in recs] == ["55", "56"] and [r["answer"] for r in recs] == ["D", "B"]
    assert recs[0]["question"] == "What year appears in the opening caption of the video?"
    assert recs[0]["options"] == ["1636", "1366", "1363", "1633"]
    assert recs[0]["clues"] == [[15.0, 19.0]] and recs[1]["clues"] == [[3723.0, 3730.0]]   # h:mm:ss too
    assert recs[0]["video"] == "Cm73ma6Ibcs.mp4" and recs[0]["duration"] == 72.5 * 60
    assert recs[1]["meta"]["task_type"] == ["reasoning", "temporal grounding"]


def test_lvbench_hf_rows(tmp_path):
    row = {**LVBENCH_QA, "video_path": "Cm73ma6Ibcs.mp4", "key": "Cm73ma6Ibcs"}
    recs = ev.load("lvbench", write_json(tmp_path / "lvbench.json", [row]))
    assert recs[0]["options"][3] == "1633" and recs[0]["clues"] == [[15.0, 19.0]] and recs[0]["answer"] == "D"


def test_mlvu_hf_rows(tmp_path):
    row = {"video_name": "movie101_66.mp4", "duration": 246.0,
           "question": "What color is the main male character in the video?\n(A) Yellow\n(B) Red\n(C) Green\n(D) Blue\n",
           "candidates": ["Yellow", "Red", "Green", "Blue"], "answer": "A", "task_type": "plotQA", "question_id": "Q1113"}
    rec = ev.load("mlvu", write_json(tmp_path / "mlvu.json", [row]))[0]
    assert rec["id"] == "Q1113" and rec["answer"] == "A" and rec["options"] == ["Yellow", "Red", "Green", "Blue"]
    assert rec["question"] == "What color is the main male character in the video?"   # inline options removed


def test_videommmu_hf_rows(tmp_path):
    rows = [{"id": "test_Geography_8", "question": "Which diagrams represent the case where \\Delta U = 0? ",
             "options": ["A. 1, 2", "B. 1, 2, 3", "C. 3, 4"], "answer": "B", "question_type": "multiple-choice"},
            {"id": "validation_Chemistry_13", "question": "What mass?", "options": [], "answer": "12.97",
             "question_type": "open"}]
    recs = ev.load("videommmu", write_json(tmp_path / "adaptation.json", rows))
    assert [r["id"] for r in recs] == ["test_Geography_8", "validation_Chemistry_13"]
    assert recs[0]["options"] == ["1, 2", "1, 2, 3", "3, 4"] and recs[1]["task"] == "oe"


def test_charades_txt_and_hf_rows(tmp_path):
    txt = tmp_path / "charades_sta_test.txt"
    txt.write_text("3MSZA 24.3 30.4##person turn a light on.\n3MSZA 24.3 30.4##person flipped the light switch near the door.\n"
                   "AMT7R 4.3 12.5##a person is putting a picture onto the wall.\n", encoding="utf-8")
    recs = ev.load("charades_sta", txt)
    assert [r["id"] for r in recs] == ["0", "1", "2"]                        # 0-based row index
    assert recs[2]["answer"] == [4.3, 12.5] and recs[2]["video"] == "AMT7R.mp4"
    assert recs[0]["question"] == "person turn a light on."
    hf = write_json(tmp_path / "charades.json", [{"video": "3MSZA.mp4", "caption": "person turn a light on",
                                                  "timestamp": [24.3, 30.40625]}])   # float16 as stored
    rec = ev.load("charades_sta", hf)[0]
    assert rec["id"] == "0" and rec["answer"] == [24.3, 30.40625] and rec["task"] == "tvg"

# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bench, path", [
    ("videomme", MLVU),          # a dict of task lists, not rows / template
    ("longvideobench", HOLMES),  # no correct_choice / candidates
    ("lvbench", LVB),            # no qa / uid
    ("mlvu", VIDEOMMMU),         # dict of dicts (VideoMMMU nesting)
    ("mmvu", CHARADES),          # no choices / question_type
    ("videommmu", MLVU),         # dict of lists (MLVU nesting)
    ("video_holmes", MMVU),      # no "video ID" / "Options"
    ("charades_sta", VIDEOMME),  # JSON rows without caption/timestamp or doc_id/solution
])
def test_wrong_format_names_file_and_fields(bench, path):
    with pytest.raises(ValueError, match="expected") as err:
        ev.load(bench, path)
    assert str(path) in str(err.value)


def test_wrong_format_txt_and_missing_field(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not an annotation file\n", encoding="utf-8")
    with pytest.raises(ValueError, match="notes.txt.*expected"):
        ev.load("charades_sta", bad)
    rows = json.loads(LVB.read_text())
    del rows[1]["correct_choice"]
    with pytest.raises(ValueError, match=r"lvb.json: record 1 lacks field\(s\) \['correct_choice'\]"):
        ev.load("longvideobench", write_json(tmp_path / "lvb.json", rows))
    template = [{"video_id": "001", "questions": [{"question_id": "001-1", "question": "q", "options": ["A. x"]}]}]
    with pytest.raises(ValueError, match="record 0 question 0 lacks"):
        ev.load("videomme", write_json(tmp_path / "t.json", template))


def test_no_question_left(tmp_path):
    mmvu_open_only = [r for r in json.loads(MMVU.read_text()) if r["question_type"] == "open-ended"]
    with pytest.raises(ValueError, match="holds no mmvu question"):
        ev.load("mmvu", write_json(tmp_path / "open.json", mmvu_open_only))       # subset mc keeps none
    summary_only = {"9_summary": json.loads(MLVU.read_text())["9_summary"]}
    with pytest.raises(ValueError, match="holds no mlvu question"):
        ev.load("mlvu", write_json(tmp_path / "summary.json", summary_only))     # generation task only


def test_repeated_id_and_parquet_without_pandas(tmp_path):
    rows = json.loads(HOLMES.read_text())
    with pytest.raises(ValueError, match="occurs twice"):
        ev.load("video_holmes", write_json(tmp_path / "h.json", rows + rows[:1]))
    if importlib.util.find_spec("pandas") or importlib.util.find_spec("pyarrow"):
        pytest.skip("pandas/pyarrow installed: the missing-package message cannot be shown")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="x.parquet.*pandas or pyarrow"):
        ev.load("videomme", tmp_path / "x.parquet")


@pytest.mark.parametrize("text, expected", [
    ('[{"a": 1,},]', [{"a": 1}]),                        # trailing commas in object and list
    ('{"s": "x,]", "l": [1, 2,\n ],}', {"s": "x,]", "l": [1, 2]}),   # ",]" inside a string is kept
    ('{"s": "quote \\" ,}"}', {"s": 'quote " ,}'}),      # escaped quote does not end the string
])
def test_lenient_json(tmp_path, text, expected):
    assert ev.read_rows(write_text(tmp_path / "f.json", text)) == expected


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path

# ----------------------------------------------------------------------------- letter extraction

def mcq(options=4):
    return {"id": "q", "task": "mcq", "options": [f"option {i}" for i in range(options)], "answer": "A", "meta": {}}


def extract(name: str, text: str, options=4, texts=None):
    rec = mcq(options)
    if texts:
        rec["options"] = texts
    return ev.judge(rec, {"id": "q", "response": text}, name)["pred"]


HOLMES_OPTIONS = ["Cleaners", "Colleagues from the same department", "Siblings",
                  "Strangers who collided accidentally", "Undercover police officers", "Office coworkers"]


@pytest.mark.parametrize("name, text, options, expected", [
    ("videomme_official", "C. Berries.", 4, "C"),                   # letter + text
    ("videomme_official", "(B)", 4, "B"),                           # parenthesised
    ("videomme_official", "The best answer is D", 4, "D"),          # prefix removed
    ("videomme_official", "Answer: C. Jade.", 4, "C"),              # official list removes "Answer:"
    ("videomme_official", "Based on the video, A", 4, "B"),         # first A-D anywhere: the official quirk
    ("videomme_official", "I cannot tell from the frames shown here, sorry about that one", 4, None),  # unanswered
    ("videomme_official", "<think>Because of X</think><answer>D</answer>", 4, "D"),  # tagged: answer span read
    ("videomme_official", "", 4, None),                             # empty
    ("lmms_legacy", "Answer: C. Jade.", 4, "A"),                    # "Answer:" not in the lmms list -> 'A'nswer
    ("lmms_legacy", "Best option: C", 4, "B"),                      # glued prefix never matches -> 'B'est
    ("lmms_legacy", "D", 4, "D"),                                   # bare letter
    ("lmms_mcq", "B", 4, "B"),                                      # start
    ("lmms_mcq", "(C)", 4, "C"),                                    # parentheses
    ("lmms_mcq", "The answer is D.", 4, "D"),                       # end beats phrase
    ("lmms_mcq", "I choose A because it fits", 4, "A"),             # phrase
    ("lmms_mcq", "Answer: B. The frames show it", 4, "B"),          # phrase 'answer:' + period
    ("lmms_mcq", "Based on the video", 4, "B"),                     # fallback: any occurrence
    ("lmms_mcq", "b", 4, None),                                     # lowercase is not a letter answer
    ("lmms_mcq", "the video shows it", 4, None),                    # nothing
    ("mmmu", "(B) Colleagues", 6, "B"),                             # parentheses first
    ("mmmu", "The answer is C because", 6, "C"),                    # "X " marker
    ("mmmu", "A. Cleaners", 6, "A"),                                # "X." marker
    ("mmmu", "(A) or rather (C)", 6, "C"),                          # several: marker occurring last
    ("mmmu", "nothing", 6, None),                                   # no random letter
    ("longvideobench", "E", 5, "E"),                                # 5 options
    ("longvideobench", "The correct answer is B", 5, "B"),          # prefix removed
    ("longvideobench", "D. A book", 5, "D"),                        # the doc's own example
    ("longvideobench", "none of these", 5, None),                   # unparsed, not random
    ("videommmu", "J.", 10, "J"),                                   # period, 10 options
    ("videommmu", "(H)", 10, "H"),                                  # parentheses
    ("videommmu", "The answer is G", 10, "G"),                      # "X " marker
    ("videommmu", "A: first, B: second", 10, "B"),                  # colon, last occurrence
    ("videommmu", "", 10, None),                                    # "API Error" -> unparsed here
    ("video_holmes_official", "<think>x</think><answer>B</answer>", 6, "B"),      # any occurrence in the block
    ("video_holmes_official", "<answer>A</answer> then <answer>C</answer>", 6, "C"),  # LAST answer block
    ("video_holmes_official", "[D]", 6, "D"),                       # "[X"
    ("video_holmes_official", "I think E: the black hole", 6, "E"), # "X:"
    ("video_holmes_official", "The answer", 6, None),               # WRONG
    ("paravt", "<answer>C</answer>", 4, "C"),                       # tag body
    ("paravt", "<answer>Option (B)</answer>", 4, "B"),              # first \b letter in the body
    ("paravt", "The answer is D", 4, "D"),                          # 'answer is X'
    ("paravt", "J", 10, "J"),                                       # whole text, 10 options
    ("paravt", "maybe", 4, None),                                   # first char 'm' is no option
    ("mlvu_official", "A) Yellow", 4, "A"),                         # char before the first ')'
    ("mlvu_official", "(B) Red", 4, "B"),
    ("mlvu_official", "C", 4, "C"),                                 # whole answer
    ("mlvu_official", "Yellow", 4, None),                           # text is not a letter
    ("lvbench_official", "(D) 1633", 4, "D"),                       # polish_answer
    ("lvbench_official", "B. 1366", 4, "B"),
    ("lvbench_official", "", 4, None),
    ("answer_tag_then_mcq", "<think>\nthe second one</think>\n<answer>B</answer>", 4, "B"),  # tag body
    ("answer_tag_then_mcq", "<think>\nhm</think>\nThe answer is (C).", 4, "C"),             # after </think>
    ("answer_tag_then_mcq", "<think>\nunfinished", 4, None),                               # nothing usable
    ("rewards_letter", "<answer>B</answer>", 4, "B"),               # same parser as training
    ("rewards_letter", "<answer>the answer is a cat</answer>", 4, None),
])
def test_letter_extraction(name, text, options, expected):
    assert extract(name, text, options) == expected


def test_mmmu_option_text_match():
    # more than 5 words and no letter marker: the option text named in the response wins
    assert extract("mmmu", "It is clearly the office coworkers in the scene", texts=HOLMES_OPTIONS) == "F"


def test_random_fallback_is_seeded_and_counted():
    recs = ev.load("videomme", VIDEOMME)
    rows = [{"id": r["id"], "response": "no idea at all"} for r in recs]   # nothing parses
    a = ev.score("videomme", recs, rows, random_fallback=3)
    b = ev.score("videomme", recs, rows, random_fallback=3)
    assert a["unparsed"] == b["unparsed"] == 9 and a["random_filled"] == 9
    assert a["correct"] == b["correct"] and a["accuracy_answered"] is None    # same draws; none answered
    off = ev.score("videomme", recs, rows)
    assert off["random_filled"] == 0 and off["accuracy"] == 0.0

# ----------------------------------------------------------------------------- time extraction

@pytest.mark.parametrize("text, expected", [
    ("The event happens in the 24.3 - 30.4 seconds.", (24.3, 30.4)),        # the prompt's format
    ("The event happens from 24.3 to 30.4 seconds", (24.3, 30.4)),          # 'to' -> '-'
    ("It starts at 0:15 and ends at 0:19", (15.0, 19.0)),                   # clock times paired
    ("00:01:05 - 00:01:10", (65.0, 70.0)),                                  # clock range
    ("starts at 5.0 seconds\nends at 9.5 seconds", (5.0, 9.5)),             # first number per sentence
    ("The event happens in 30.4 - 24.3", (24.3, 30.4)),                     # reversed pair ordered
    ("A specific example is : 20.8 - 30.0 seconds. It happens in the 1.0 - 2.0 seconds", (1.0, 2.0)),  # example dropped
    ("The event happens 5s - 10s", (5.0, 10.0)),                            # last rule: 'a s - b s'
    ("[12.5, 20.0]", None),                                                 # lmms-eval cannot read a bracket pair
    ("no time here", None),
])
def test_lmms_time(text, expected):
    got = ev.TIME_EXTRACTORS["lmms_time"](text)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("[12.5, 20.0]", (12.5, 20.0)),                                         # docs/method.md §7 answer form
    ("The event happens in the 12.5 - 20.0 seconds", (12.5, 20.0)),         # docs/method.md §7 sentence form
    ("from 12.5 to 20.0", (12.5, 20.0)),                                    # 'to'
    ("1:05 - 1:10", (65.0, 70.0)),                                          # m:ss (ParaVT)
    ("no window", None),
])
def test_paravt_time_forms(text, expected):
    got = ev.TIME_EXTRACTORS["paravt_time"](text)
    assert got == (pytest.approx(expected) if expected else None)


@pytest.mark.parametrize("text, paravt_iou, lmms_iou", [
    ("<think>\nmaybe 3 - 4?</think>\n<answer>[12.5, 20.0]</answer>", 1.0, 0.0),   # our answer form; think ignored
    ("The event happens in the 12.5 - 20.0 seconds", 1.0, 1.0),                   # both read it
    ("<answer>The event happens in the 16.25 - 20.0 seconds</answer>", 0.5, 0.5),  # half the window
    ("<answer>never</answer>", 0.0, 0.0),                                         # unparsed = IoU 0
])
def test_time_extractors_through_judge(text, paravt_iou, lmms_iou):
    rec = {"id": "t", "task": "tvg", "options": None, "answer": [12.5, 20.0], "meta": {}}
    for name, iou in (("paravt_time", paravt_iou), ("lmms_time", lmms_iou)):
        assert ev.judge(rec, {"id": "t", "response": text}, name)["score"] == pytest.approx(iou)

# ----------------------------------------------------------------------------- metrics

def test_mlvu_macro_mean_differs_from_micro():
    recs = [r for r in ev.load("mlvu", MLVU) if r["id"] != "4_count_1"]      # count task keeps 1 record
    gold = {r["id"]: r["answer"] for r in recs}
    wrong = {"3_ego_1": "B) in my pocket", "5_order_1": "(C)", "4_count_0": "I am not sure"}   # last: unparsed
    rows = [{"id": i, "response": wrong.get(i, f"{g}) text")} for i, g in gold.items()]
    m = ev.score("mlvu", recs, rows)
    # per task: plotQA 2/2, findNeedle 2/2, ego 1/2, count 0/1, order 1/2, anomaly 2/2, topic 2/2
    assert m["accuracy"] == pytest.approx(100 * 10 / 13)
    assert m["m_avg"] == pytest.approx((100 + 100 + 50 + 0 + 50 + 100 + 100) / 7)
    assert m["headline_metric"] == "m_avg" and m["headline"] == m["m_avg"]
    assert m["unparsed"] == 1 and m["by_task_type"]["count"]["n"] == 1 and m["extract"] == "mlvu_official"


def test_videomme_two_denominators_and_error_row():
    recs = ev.load("videomme", VIDEOMME)
    rows = [{"id": r["id"], "response": r["meta"]["response"]} for r in recs]
    rows[1]["response"] = ""                                   # 001-2 (was wrong): unparsed
    rows[5] = {"id": "002-3", "response": "", "error": "VideoError: data/002.mp4: no such file"}   # was wrong
    m = ev.score("videomme", recs, rows)
    assert m["n"] == 9 and m["n_error"] == 1 and m["unparsed"] == 1 # the error row stays in the total
    assert m["accuracy"] == pytest.approx(100 * 7 / 9)              # lmms-eval / ParaVT denominator
    assert m["answered"] == 7 and m["accuracy_answered"] == pytest.approx(100.0)   # official: answered only
    assert m["by_task_type"]["Counting Problem"] == {"n": 4, "correct": 3.0, "accuracy": 75.0}
    legacy = ev.score("videomme", recs, rows, extract="lmms_legacy")
    assert legacy["correct"] == 6                              # "Answer: C. Jade." -> 'A'


def test_charades_miou_and_recall():
    recs = ev.load("charades_sta", CHARADES)
    responses = ["<answer>[24.3, 30.4]</answer>",                 # IoU 1
                 "The event happens in the 20.0 - 30.4 seconds.",  # 6.1 / 10.4
                 "<think>x</think><answer>[24.3, 26.5]</answer>",  # 2.2 / 6.1
                 "no idea",                                        # unparsed -> 0
                 "<answer>6.0 - 12.5</answer>"]                    # 6.5 / 8.2 (GT 4.3-12.5)
    rows = [{"id": r["id"], "response": t} for r, t in zip(recs, responses)]
    rows.append({"id": recs[5]["id"], "response": "", "error": "FileNotFoundError: YVKIV.mp4"})   # -> 0
    m = ev.score("charades_sta", recs, rows)
    ious = [1.0, 6.1 / 10.4, 2.2 / 6.1, 0.0, 6.5 / 8.2, 0.0]
    assert m["miou"] == pytest.approx(100 * sum(ious) / 6)
    assert (m["r@0.3"], m["r@0.5"], m["r@0.7"]) == pytest.approx((100 * 4 / 6, 100 * 3 / 6, 100 * 2 / 6))
    assert m["unparsed"] == 1 and m["n_error"] == 1 and m["headline_metric"] == "miou"


def test_open_ended_rule_and_lower_bound_note():
    recs = ev.load("videommmu", VIDEOMMMU)
    responses = ["G.", "H.", "F.", "A.", "(A)", "(C)", "<answer>about 12.97 g</answer>"]   # 4/6 MC right, OE right
    m = ev.score("videommmu", recs, [{"id": r["id"], "response": t} for r, t in zip(recs, responses)])
    assert m["accuracy"] == pytest.approx(100 * 5 / 7) and m["mc_accuracy"] == pytest.approx(100 * 4 / 6)
    assert m["oe_accuracy"] == 100.0 and m["n_oe"] == 1
    assert m["by_task_type"]["Adaptation"]["n"] == 3
    assert any("lower bound" in n for n in m["notes"])


@pytest.mark.parametrize("gold, pred, expected", [
    ("Dolly Zoom", "dolly zoom.", True),                               # case and punctuation
    ("Depth-First Search (DFS)", "depth-first search (DFS)", True),
    ("12.97", "The mass is about 12.97 g", True),                      # number match
    ("12.97", "12.9", False),                                          # different number
    ("Dolly Zoom", "a zoom", False),                                   # partial text is not exact
    ("Dolly Zoom", "", False),                                         # empty
])
def test_open_match(gold, pred, expected):
    assert ev.open_match(pred, gold) is expected


def test_score_rejects_bad_predictions():
    recs = ev.load("charades_sta", CHARADES)
    rows = [{"id": r["id"], "response": "1 - 2"} for r in recs]
    with pytest.raises(ValueError, match="does not fit"):
        ev.score("charades_sta", recs, rows, extract="lmms_mcq")     # a letter parser on windows
    with pytest.raises(ValueError, match="repeated id"):
        ev.score("charades_sta", recs, rows + rows[:1])
    with pytest.raises(ValueError, match="no prediction id matches"):
        ev.score("charades_sta", recs, [{"id": "elsewhere", "response": "1 - 2"}])


# ----------------------------------------------------------------------------- what a file looks like; --bench records

def record(id, task="mcq", **change):
    rec = {"id": id, "video": f"{id}.mp4", "question": "What colour?", "options": ["red", "green", "blue"],
           "answer": "B", "task": task}
    if task == "tvg":
        rec.update(options=None, answer=[10.0, 20.0], question="When?")
    if task == "oe":
        rec.update(options=None, answer="a red ball")
    return {**rec, **change}


def test_sniff_names_each_kind(tmp_path):
    txt = tmp_path / "charades_sta_test.txt"
    txt.write_text("3MSZA 24.3 30.4##person turn a light on.\n", encoding="utf-8")
    kinds = {VIDEOMME: "videomme", LVB: "longvideobench", MLVU: "mlvu", MMVU: "mmvu", VIDEOMMMU: "videommmu",
             HOLMES: "video_holmes", CHARADES: "charades_sta", txt: "charades_sta",
             write_jsonl(tmp_path / "lvbench.jsonl", [{"key": "k", "qa": []}]): "lvbench",
             write_jsonl(tmp_path / "r.jsonl", [record("a")]): "records",
             write_jsonl(tmp_path / "sft.jsonl", [{"id": "a", "video": "a.mp4", "prompt": record("a"), "messages": []}]): "sft",
             write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "response": "<answer>B</answer>"}]): "predictions",
             write_json(tmp_path / "other.json", {"hello": 1}): None, tmp_path / "absent.json": None}
    assert {p.name: ev.sniff(p) for p in kinds} == {p.name: k for p, k in kinds.items()}


@pytest.mark.parametrize("bench, path, says", [
    ("videomme", CHARADES, "this is a Charades-STA annotation file; use eval.py --bench charades_sta"),
    ("longvideobench", MLVU, "this is a MLVU annotation file; use eval.py --bench mlvu"),
    ("records", HOLMES, "this is a Video-Holmes annotation file; use eval.py --bench video_holmes"),
    ("charades_sta", MMVU, "this is a MMVU annotation file; use eval.py --bench mmvu"),
])
def test_wrong_bench_says_what_the_file_is(bench, path, says):
    with pytest.raises(ValueError) as err:
        ev.load(bench, path)
    assert says in str(err.value) and str(path) in str(err.value)


def test_records_file_given_to_a_benchmark(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [record("a"), record("b")])
    with pytest.raises(ValueError, match="prompt records .*use eval.py --bench records"):
        ev.load("videomme", path)
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"id": "a", "video": "a.mp4", "prompt": record("a"), "messages": []}])
    with pytest.raises(ValueError, match=r"SFT trajectory file \(train.py --sft-data\)"):
        ev.load("records", sft)


def test_records_bench_loads_and_scores_by_task(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join([json.dumps(record("m1")), json.dumps(record("m2")), '{"id": "broken"',
                               json.dumps(record("o1", "oe")), json.dumps(record("t1", "tvg")),
                               json.dumps(record("t2", "tvg"))]) + "\n", encoding="utf-8")
    warnings = []
    recs = ev.load("records", path, warn=warnings.append)
    assert [r["id"] for r in recs] == ["m1", "m2", "o1", "t1", "t2"]
    assert len(warnings) == 1 and f"{path}:3: not valid JSON" in warnings[0]
    responses = {"m1": "<think>\nhm</think>\n<answer>B</answer>", "m2": "<answer>C</answer>",
                 "o1": "<answer>A red ball.</answer>", "t1": "<answer>[15.0, 20.0]</answer>", "t2": "<answer>never</answer>"}
    m = ev.score("records", recs, [{"id": i, "response": t} for i, t in responses.items()])
    assert m["extract"] == "answer_tag_then_mcq" and m["n"] == 5
    assert m["accuracy"] == pytest.approx(100 * 2 / 3)                 # m1 right, m2 wrong, o1 right (open rule)
    assert m["oe_accuracy"] == 100.0 and m["mc_accuracy"] == 50.0
    assert m["miou"] == pytest.approx(100 * (0.5 + 0.0) / 2) and m["r@0.5"] == 50.0 and m["r@0.7"] == 0.0
    tvg_only = ev.score("records", recs[3:], [{"id": i, "response": responses[i]} for i in ("t1", "t2")])
    assert tvg_only["extract"] == "paravt_time" and tvg_only["headline"] == pytest.approx(25.0)
