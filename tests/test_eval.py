"""Tests for eval.py: resumable prediction (error rows run again), trajectory rows and the agent
figures (fake rollout), presets, and the command line end to end on the tiny model and tiny synthetic
records (--bench records, symlinked roots, retried errors, one-line errors).

    pytest tests/test_eval.py -q
"""
import dataclasses
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import data
import eval as ev
import rewards
import rollout
import recipes
from benchmarks import load, score

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "benchmark_samples"
MLVU = SAMPLES / "mlvu_dev_github_json_sample.json"
CHARADES = SAMPLES / "charades_sta_test_videoo3_format_sample.json"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path

# ----------------------------------------------------------------------------- predict: resume, errors

def five_records():
    return [{"id": f"r{i}", "video": f"v{i}.mp4", "question": "q", "options": ["x", "y"], "answer": "A",
             "task": "mcq", "clues": None, "data_type": "free_form", "duration": None, "subtitles": None,
             "meta": {}} for i in range(5)]


@pytest.mark.parametrize("batch_size", [1, 2])   # 2: a failing batch is rerun record by record
def test_predict_resumes_and_reruns_error_rows(tmp_path, batch_size, monkeypatch):
    records, seen, said, broken = five_records(), [], [], {"r3"}
    monkeypatch.setattr(ev.tqdm, "write", lambda msg, file=None: said.append(msg))   # never a bare print
    out = tmp_path / "preds.jsonl"
    out.write_text(json.dumps({"id": "r0", "response": "<answer>A</answer>"}) + "\n"
                   + json.dumps({"id": "r2", "response": "<answer>A</answer>"}) + "\n"
                   + '{"id": "r4", "respo', encoding="utf-8")        # a line cut short by a crash

    def run_batch(batch):
        seen.extend(r["id"] for r in batch)
        if any(r["id"] in broken for r in batch):
            raise FileNotFoundError("v3.mp4: no such file")
        return [{"id": r["id"], "response": "<answer>A</answer>", "turns": 2, "calls": 1,
                 "tool_failures": 0, "latency": 0.1, "error": None} for r in batch]

    rows = ev.predict(records, run_batch, out, batch_size=batch_size)
    assert set(seen) == {"r1", "r3", "r4"}                            # only the missing ids ran
    assert said == [f"{out}: dropping a truncated last line"]
    written = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert sorted(written) == ["r0", "r1", "r2", "r3", "r4"]          # each once, none duplicated
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]
    assert rows[3]["error"] == "FileNotFoundError: v3.mp4: no such file" and rows[3]["answer"] == "A"
    m = score("synthetic", records, rows)
    assert m["n"] == 5 and m["n_error"] == 1 and m["accuracy"] == pytest.approx(80.0)
    assert m["mean_turns"] == 2.0                                     # over the non-error rows that carry it
    seen.clear(), said.clear(), broken.clear()                        # the video is fixed: r3 runs again
    again = ev.predict(records, run_batch, out, batch_size=batch_size)
    assert seen == ["r3"] and said == [f"{out}: 1 row(s) ended in an error last time; running them again"]
    assert again[3]["error"] is None and again[:3] == rows[:3] and again[4] == rows[4]
    on_disk = ev.read_predictions(out)
    assert sorted(r["id"] for r in on_disk) == ["r0", "r1", "r2", "r3", "r4"] and not any(r.get("error") for r in on_disk)
    seen.clear()
    assert ev.predict(records, run_batch, out, batch_size=batch_size) == again and seen == []   # nothing left


def test_predict_lets_programming_errors_through():
    def broken(batch):
        raise TypeError("bug in the runner")
    with pytest.raises(TypeError):
        ev.predict(five_records(), broken, None, 1)


def test_error_reasons_fold_paths():
    rows = [{"id": "a", "error": "VideoError: 'videos/a.mp4' not found under /data/root"},
            {"id": "b", "error": "VideoError: 'videos/b.mp4' not found under /data/root"},
            {"id": "c", "error": "OSError: disk full"}, {"id": "d", "error": None}]
    assert ev.error_reasons(rows) == [(2, "VideoError: … not found under …", rows[0]["error"]),
                                      (1, "OSError: disk full", "OSError: disk full")]

# ----------------------------------------------------------------------------- agent runner (fake rollout)

@dataclasses.dataclass
class FakeConfig:
    tool_mode: str = "subagent"
    overview_nframes: int | None = 64
    overview_fps: float = 1.0
    overview_max_frames: int = 64
    max_turns: int = 3
    max_calls_per_turn: int = 5
    temperature: float = 1.0
    group_size: int = 1


CALL = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": %s, "end_time": %s}}\n</tool_call>'
PIECES = []                                   # the fake tokenizer's vocabulary: one token per piece


def fake_traj(rid, segments, nframes=8, error=None):
    """A trajectory whose tokens after a 2-token prompt are one token per (role, text) segment."""
    ids, roles = [0, 0], [0, 0]
    for role, text in segments:
        PIECES.append(text)
        ids.append(len(PIECES) - 1)
        roles.append(1 if role == "policy" else 0)
    turns = [t for r, t in segments if r == "policy"]
    turns = ["<think>\n" + t for t in turns]
    calls = [rewards.parse_tool_calls(t) for t in turns]
    windows = [rewards.call_window(c) for cs in calls for c in cs]
    text = "".join(t for _, t in segments)
    return types.SimpleNamespace(
        record_id=rid, turns=turns if not error else [], calls=calls if not error else [], windows=windows if not error else [],
        tool_failures=0, latency=0.5, answer=rewards.extract_answer(turns[-1]) if turns and not error else None,
        error=error, token_ids=[] if error else ids, roles=[] if error else roles, prompt_len=2,
        n_tool_turns=sum(bool(c) for c in calls) if not error else 0, nframes=0 if error else nframes,
        text="" if error else text)


FAKE_SEGMENTS = {   # r0: one crop, right; r1: two crops, no think (not compliant), wrong; r2: grounding, IoU 0.5
    "r0": [("env", "<think>\n"), ("policy", "look</think>\n" + CALL % (1, 2)), ("env", "<tool_response>clip</tool_response>"
           "<think>\n"), ("policy", "ok</think>\n<answer>A</answer>")],
    "r1": [("env", "<think>\n"), ("policy", CALL % (1, 2) + CALL % (5, 6)), ("env", "<tool_response>2 clips</tool_response>"),
           ("policy", "<answer>A</answer>")],
    "r2": [("env", "<think>\n"), ("policy", "when</think>\n<answer>[15, 20]</answer>")],
}


def fake_rollout(configs):
    def run_agent(model, processor, records, video_root, cfg, seed=0):
        configs.append(cfg)
        return [fake_traj(r["id"], FAKE_SEGMENTS.get(r["id"], FAKE_SEGMENTS["r0"]),
                          error="VideoError: v3.mp4: no such file" if r["id"] == "r3" else None) for r in records]
    return types.SimpleNamespace(RolloutConfig=FakeConfig, run_agent=run_agent, POLICY=1, ENV=0)


FAKE_PROCESSOR = types.SimpleNamespace(tokenizer=types.SimpleNamespace(
    decode=lambda ids, skip_special_tokens=True: "".join(PIECES[i] for i in ids)))


def figure_records():
    recs = five_records()[:4]
    recs[0].update(clues=[[1.0, 3.0]], data_type="single_clue")
    recs[1].update(clues=[[1.0, 2.0], [5.0, 6.0]], data_type="multi_clue", answer="B")
    recs[2].update(task="tvg", options=None, answer=[10.0, 20.0], data_type="grounding")
    recs[3].update(clues=[[0.0, 4.0]], data_type="single_clue")    # its video fails: an error row
    return recs


def test_evaluate_reports_official_metrics_and_agent_figures(monkeypatch, tmp_path):
    configs = []
    monkeypatch.setitem(sys.modules, "rollout", fake_rollout(configs))
    train_cfg = FakeConfig(tool_mode="interleaved", temperature=1.0, group_size=4)   # as a trainer builds it
    m = ev.evaluate(None, FAKE_PROCESSOR, figure_records(), "videos", train_cfg, batch_size=8,
                    out_path=tmp_path / "p.jsonl")
    assert configs[0].temperature == 0.0 and configs[0].group_size == 1 and configs[0].tool_mode == "interleaved"
    assert m["bench"] == "records" and m["n"] == 4 and m["n_error"] == 1
    assert m["accuracy"] == pytest.approx(100 / 3) and m["miou"] == pytest.approx(50.0)   # official, in %
    assert m["format_compliance"] == pytest.approx(2 / 3)          # r1 has no think block
    assert m["tool_call_ratio"] == pytest.approx(2 / 3) and m["turns"] == pytest.approx(2 / 3)
    h_r0 = (0.5 + 1.0 + 0.5 + (0.5 - 0.5 ** 2 / 2 ** 2 + 1) / 2) / 4  # IoU, IoP, IoG, DIoU of [1,2] vs [1,3]
    assert m["clue_score"] == pytest.approx((h_r0 + 1.0 + 0.0) / 3)  # r1: H' = 1; r3 (error): 0
    assert m["r_acc"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)   # 0-1, grounding IoU included
    rows = {r["id"]: r for r in ev.read_predictions(tmp_path / "p.jsonl")}
    r0 = rows["r0"]
    assert r0["segments"] == [[role, text] for role, text in FAKE_SEGMENTS["r0"]]
    assert "".join(t for _, t in r0["segments"]) == r0["text"] and r0["format_compliant"] is True
    assert r0["tool_turns"] == 1 and r0["nframes"] == 8 and r0["calls_by_turn"] == [[[1.0, 2.0]]]
    assert rows["r1"]["calls_by_turn"] == [[[1.0, 2.0], [5.0, 6.0]]] and rows["r1"]["format_compliant"] is False
    assert rows["r2"]["calls_by_turn"] == [] and rows["r3"]["error"] == "VideoError: v3.mp4: no such file"
    assert rows["r0"]["answer"] == "A"                  # the parsed answer, not the ground truth


@pytest.mark.parametrize("preset", sorted(recipes.PRESETS))
def test_presets_match_the_real_rollout_config(preset):
    rollout = pytest.importorskip("rollout")
    cfg = ev.preset_rollout_config(preset, tiny=True)     # every preset / tiny field exists there
    assert isinstance(cfg, rollout.RolloutConfig) and cfg.temperature == 0.0 and cfg.group_size == 1


def test_an_override_rollout_config_lacks_is_refused():
    """eval's overrides name RolloutConfig fields; a misspelt one is an error, not silently dropped."""
    with pytest.raises(ValueError, match="has no field"):
        ev.preset_rollout_config("paravt", max_turn=3)

# ----------------------------------------------------------------------------- CLI: scoring and bad input

def test_cli_rescore_prints_final_json(tmp_path, capsys):
    recs = load("mlvu", MLVU)
    preds = write_jsonl(tmp_path / "preds.jsonl", [{"id": r["id"], "response": f"({r['answer']})"} for r in recs[:7]]
                        + [{"id": r["id"], "response": "(D)" if r["answer"] != "D" else "(A)"} for r in recs[7:]])
    metrics = ev.main(["--bench", "mlvu", "--annotations", str(MLVU), "--predictions", str(preds)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    printed = json.loads(last)
    assert printed["n"] == 14 and printed["accuracy"] == pytest.approx(50.0)
    assert printed["m_avg"] == pytest.approx(metrics["m_avg"]) and printed["extract"] == "mlvu_official"
    assert printed["tool_call_ratio"] == 0.0 and printed["r_acc"] == pytest.approx(0.5)


def test_cli_requires_annotations():
    with pytest.raises(SystemExit):
        ev.parse_args(["--bench", "mlvu"])


def test_annotations_without_bench_lists_the_benches(tmp_path, capsys):
    """Issue 21.1: --annotations alone used to run the synthetic bench silently."""
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"id": "a", "video": "a.mp4", "question": "q?", "options": ["x", "y"],
                                                  "answer": "A", "task": "mcq"}])
    with pytest.raises(SystemExit):
        ev.main(["--annotations", str(mine), "--video-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--annotations needs --bench, one of: records, videomme," in err
    assert "use eval.py --bench records" in err


def test_synthetic_bench_never_writes_into_a_video_root(tmp_path, capsys):
    root = tmp_path / "my_videos"
    root.mkdir()
    with pytest.raises(SystemExit):
        ev.main(["--video-root", str(root), "--limit", "1"])
    assert "renders its videos into the cache" in capsys.readouterr().err and list(root.iterdir()) == []


def one_line_error(argv, capsys) -> str:
    """eval.main's exit status 2 and its one stderr line `eval.py: error: ...` (returned without the prefix)."""
    with pytest.raises(SystemExit) as err:
        ev.main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert err.value.code == 2 and len(lines) == 1 and lines[0].startswith("eval.py: error: "), lines
    return lines[0].removeprefix("eval.py: error: ")


def test_bad_input_is_one_line_unless_debug(tmp_path, capsys):
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": "0", "response": "x"}])
    argv = ["--bench", "mlvu", "--annotations", str(tmp_path / "nope.json"), "--predictions", str(preds)]
    assert one_line_error(argv, capsys) == f"{tmp_path / 'nope.json'}: annotation file not found"
    with pytest.raises(FileNotFoundError):
        ev.main([*argv, "--debug"])


def test_wrong_kind_of_file_says_what_it_is(tmp_path, capsys):
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": "0", "response": "x"}])
    said = one_line_error(["--bench", "videomme", "--annotations", str(CHARADES), "--predictions", str(preds)], capsys)
    assert said.startswith(f"{CHARADES}: not a videomme annotation file")
    assert said.endswith("this is a Charades-STA annotation file; use eval.py --bench charades_sta")


def test_device_cuda_without_a_gpu(monkeypatch, cache_env, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert one_line_error(["--device", "cuda", "--limit", "1"], capsys) == \
        "--device cuda but no CUDA device is visible (use --device cpu, or leave --device auto)"

# ----------------------------------------------------------------------------- CLI: the tiny model end to end

def fake_runner_factory(seen: dict, ran: list):
    def fake_runner(model, processor, video_root, cfg, seed=0):
        seen.update(max_new_tokens=cfg.max_new_tokens, tool_mode=cfg.tool_mode, temperature=cfg.temperature)

        def run(records):
            ran.extend(r["id"] for r in records)
            return [{"id": r["id"], "response": "", "answer": None, "turns": 1, "calls": 0, "windows": [],
                     "tool_failures": 0, "latency": 0.0, "error": None} for r in records]
        return run
    return fake_runner


@pytest.mark.slow
def test_synthetic_end_to_end_on_the_tiny_model(tmp_path, capsys, cache_env, one_thread):
    """`python eval.py` path: synthetic records -> tiny model -> rollout -> predictions -> score."""
    out = tmp_path / "preds.jsonl"
    argv = ["--limit", "4", "--max-new-tokens", "8", "--out", str(out)]
    metrics = ev.main(argv)
    rows = ev.read_predictions(out)
    assert [r["id"] for r in rows] == [f"syn-2000-{i:05d}" for i in range(4)] and metrics["n"] == 4
    assert all(r["error"] is None and r["latency"] > 0 for r in rows)
    for r in rows:                                        # the trajectory view a report is built from
        assert "".join(t for _, t in r["segments"]) == r["text"] and r["segments"][0] == ["env", "<think>\n"]
        assert {role for role, _ in r["segments"]} <= {"policy", "env"} and "policy" in {role for role, _ in r["segments"]}
        assert r["nframes"] == 8 and len(r["calls_by_turn"]) == r["tool_turns"]
        assert r["format_compliant"] is rewards.format_compliant(r["text"])
    assert 0.0 <= metrics["r_acc"] <= 1.0 and metrics["format_compliance"] is not None
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 4
    again = ev.main(argv)                       # resumes: nothing is re-run, nothing duplicated
    assert len(ev.read_predictions(out)) == 4 and again["n"] == 4


def test_tiny_model_gets_train_py_turn_budget(tmp_path, monkeypatch, cache_env):
    """The tiny model's turns are evaluated with train.py's --max-new-tokens default (a turn with two
    parallel calls needs ~100 tokens: 96 cut them), and --synthetic-n sets the held-out split's size."""
    seen, ran = {}, []
    monkeypatch.setattr(ev, "agent_runner", fake_runner_factory(seen, ran))
    metrics = ev.main(["--synthetic-n", "6", "--out", str(tmp_path / "p.jsonl")])
    assert seen["max_new_tokens"] == recipes.parse_train_args([]).max_new_tokens == 128
    assert seen["tool_mode"] == "interleaved" and seen["temperature"] == 0.0 and metrics["n"] == 6


def test_synthetic_seed_picks_another_split(tmp_path, monkeypatch, cache_env):
    """--synthetic-seed evaluates a split no training run of seed 0 drew (ids carry the split's seed)."""
    ran = []
    monkeypatch.setattr(ev, "agent_runner", fake_runner_factory({}, ran))
    ev.main(["--synthetic-n", "4", "--out", str(tmp_path / "a.jsonl")])
    ev.main(["--synthetic-n", "4", "--synthetic-seed", "3000", "--out", str(tmp_path / "b.jsonl")])
    assert ran == [f"syn-2000-{i:05d}" for i in range(4)] + [f"syn-3000-{i:05d}" for i in range(4)]


def test_synthetic_defaults_are_train_py_held_out_split(monkeypatch):
    """`python eval.py --model runs/default` scores the split train.py --seed 0 holds out: its size (n_eval), seed,
    duration and mix, read from recipes.py and data.SPLIT_SEEDS; the batch is the preset's eval_batch."""
    asked = {}
    monkeypatch.setattr(ev, "synthetic_records", lambda root, **kw: asked.update(kw) or [])
    job = ev.job_of(ev.parse_args([]))
    train_args = recipes.parse_train_args([])
    assert asked == dict(n=train_args.n_eval, seed=data.SPLIT_SEEDS["held_out"] + train_args.seed,
                         duration=train_args.task_duration, mix=train_args.task_mix)
    assert (job.preset, job.batch_size) == ("tiny", train_args.eval_batch)
    assert ev.preset_defaults(ev.parse_args(["--preset", "paravt"])).batch_size == recipes.PRESETS["paravt"]["eval_batch"]
    assert ev.preset_defaults(ev.parse_args(["--batch-size", "3"])).batch_size == 3


def test_synthetic_default_out_names_the_split(tmp_path, monkeypatch, cache_env):
    """The default predictions file of a synthetic split names its size and seed: split 4 and split 6 share
    ids with different questions, so resuming one from the other's file would score stale answers."""
    monkeypatch.setattr(ev, "agent_runner", fake_runner_factory({}, []))
    monkeypatch.chdir(tmp_path)
    for argv in (["--synthetic-n", "4"], ["--synthetic-n", "6"], ["--synthetic-n", "4", "--synthetic-seed", "3000"]):
        assert ev.main(argv)["n"] == int(argv[1])
    assert sorted(p.name for p in (tmp_path / "runs" / "eval").iterdir()) == [
        "synthetic-n4-seed2000-tiny-tiny.jsonl", "synthetic-n4-seed3000-tiny-tiny.jsonl",
        "synthetic-n6-seed2000-tiny-tiny.jsonl"]             # the tiny model's own preset


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_own_records_through_a_symlinked_root(tmp_path, capsys, one_thread):
    """Issue 21 items 1, 3, 4, 9 through the command line: `--bench records` on a JSONL of the project's
    own records whose video root is made of links; the root is only read; a missing video is an error row
    with its reason, counted at the end; once the video is there, re-running with the same --out runs
    that row again and keeps only answered rows."""
    store, root = tmp_path / "store", tmp_path / "root"
    recs = data.make_split(str(store), 3, seed=5, mix={"single_clue": 1}, duration=64.0)
    root.mkdir()
    os.symlink(store / "videos", root / "clips")          # a folder link, pointing outside the root
    mine = [{k: r[k] for k in ("id", "question", "options", "answer", "task", "clues", "duration")}
            | {"video": r["video"].replace("videos/", "clips/")} for r in recs]
    mine[2]["video"] = "clips/later.mp4"                    # not there yet
    annotations = write_jsonl(tmp_path / "mine.jsonl", mine)
    out = tmp_path / "preds.jsonl"
    argv = ["--bench", "records", "--annotations", str(annotations), "--video-root", str(root),
            "--max-new-tokens", "8", "--out", str(out)]
    before = tree(tmp_path / "store") + tree(root)
    first = ev.main(argv)
    assert tree(tmp_path / "store") + tree(root) == before  # nothing written under the video root
    rows = {r["id"]: r for r in ev.read_predictions(out)}
    assert rows[recs[0]["id"]]["error"] is None and rows[recs[1]["id"]]["error"] is None   # links followed
    assert "later.mp4" in rows[recs[2]["id"]]["error"]                                     # the reason
    assert first["n"] == 3 and first["n_error"] == 1 and first["bench"] == "records"
    err = capsys.readouterr().err
    assert "1 row(s) ended in an error; the commonest reasons:" in err and "  1 x " in err and "later.mp4" in err
    os.symlink(store / recs[2]["video"], store / "videos" / "later.mp4")   # the user fixes the video
    second = ev.main(argv)
    assert "1 row(s) ended in an error last time; running them again" in capsys.readouterr().err
    written = ev.read_predictions(out)
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in recs) and not any(r["error"] for r in written)
    assert second["n_error"] == 0 and second["n"] == 3

# ----------------------------------------------------------------------------- ask: one question about one video

REAL = Path(__file__).resolve().parents[2] / "shared" / "real_videos"
NASA = REAL / "nasa_13013.mp4"                 # 13 s of real footage, two video streams, B-frames
REPO = Path(__file__).resolve().parents[1]
needs_real = pytest.mark.skipif(not NASA.is_file(), reason="needs the shared real_videos folder")


@pytest.mark.slow
@needs_real
def test_ask_a_real_video_end_to_end(tmp_path, cache_env):
    """`python eval.py --model tiny --video FILE --question ... --options ... --report DIR`: exit 0, the turns
    printed, the answer alone on the last line (the one in the row and on the page), the page with the
    overview's frames."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "eval.py", "--model", "tiny", "--video", str(NASA), "--question", "What is launched?",
           "--options", "A. a rocket|B. a balloon", "--threads", "1", "--max-new-tokens", "24",
           "--report", str(tmp_path / "page"), "--out", str(tmp_path / "row.jsonl")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[-1] == "" and lines[0] == "turn 1" and "  thinking: " in proc.stdout
    [row] = ev.read_predictions(tmp_path / "row.jsonl")
    assert row["error"] is None and row["id"] == NASA.name and row["nframes"] == 8
    assert lines[-2] == " ".join(str(row["answer"] or "").split())
    assert sum(l.startswith("turn ") for l in lines) == row["turns"]
    page = (tmp_path / "page" / "index.html").read_text(encoding="utf-8")
    assert "What is launched?" in page and "no gold answer" in page and "video not shown" not in page
    assert page.count("data:image/jpeg;base64,") >= row["nframes"]          # the overview's frames, embedded


@needs_real
@pytest.mark.parametrize("tool_mode", ["interleaved", "subagent"])
def test_ask_prints_each_turn_as_it_completes(tool_mode, tiny, monkeypatch, tmp_path, one_thread):
    """Scripted turns on the real file: turn 1 (thinking, two crop calls: one shown, one past the end) is on
    the screen before turn 2 is sampled; the tool's answers as the model got them; the answer last."""
    from test_rollout import Scripted
    model, processor = tiny
    call = lambda s, e: CALL % (s, e)
    scripted = Scripted(processor, {(0, 0): [f"a launch\n</think>\n{call(2, 6)}\n{call(20, 30)}",
                                             "the rocket\n</think>\n<answer>A</answer>"]}, seed=0)
    out, seen_at, row_seed = io.StringIO(), [], rollout.row_seed(0, 0, 0)

    def sample(logits, seeds, counters, temperature, top_p):       # what was printed when turn 2 began
        if row_seed in seeds.tolist() and scripted.state.get(row_seed) == (1, 0):
            seen_at.append(out.getvalue())
        return scripted(logits, seeds, counters, temperature, top_p)
    monkeypatch.setattr(rollout, "sample_tokens", sample)
    record, root = ev.ask_record(str(NASA), "What is launched?", "A. a rocket|B. a balloon")
    cfg = ev.preset_rollout_config("paravt", tool_mode, tiny=True, max_new_tokens=160)
    row = ev.ask(model, processor, record, root, cfg, report_dir=str(tmp_path / "page"), out=out)
    text = out.getvalue()
    turn1, turn2 = text.split("turn 2\n")
    tool1 = "Clip 2.0-6.0 s shown to the model" if tool_mode == "interleaved" else "A red square in the centre."
    lines = turn1.splitlines()
    assert lines[:-1] == ["turn 1", "  thinking: a launch", "  crop_video 2-6 s", "  crop_video 20-30 s", f"  tool 1: {tool1}"]
    assert lines[-1].startswith("  tool 2: Error: ") and "13" in lines[-1]     # the error names the video's end
    assert turn2.splitlines() == ["  thinking: the rocket", "  answer: A", "A"]
    assert seen_at == [turn1]                         # turn 1 was on the screen when turn 2's first token was drawn
    assert row["answer"] == "A" and row["windows"] == [[2.0, 6.0]] and row["tool_failures"] == 1
    assert (tmp_path / "page" / "index.html").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--video", "{missing}", "--question", "q"], "--video {missing}: no such file"),
    (["--video", "{text}", "--question", "q"], "--video {text}: not a video PyAV can read"),
    (["--video", "{tmp}", "--question", "q"], "--video {tmp}: not a file"),
    (["--video", "{real}", "--question", "  "], "--question is empty"),
    (["--video", "{real}", "--question", "q", "--options", "just one"], "give 2 to 26 options separated by '|'"),
    (["--video", "{real}", "--question", "q", "--options", "A. x||B. y"], "option 2 is empty"),
    (["--video", "{real}", "--question", "q", "--options", "A. x|C. y"], "option 2 ('C. y') should start with B."),
    (["--video", "{real}", "--question", "q", "--options", "A. x|y"], "option 2 ('y') should start with B."),
    (["--video", "{real}"], "--video needs --question"),
    (["--question", "q"], "pass --video FILE with them"),
    (["--video", "{real}", "--question", "q", "--gpus", "2"], "--video asks one question; it takes no --gpus"),
])
def test_ask_bad_input_is_one_line(argv, message, tmp_path, capsys, monkeypatch):
    """Each refused before a model loads: one line `eval.py: error: ...`, exit status 2."""
    monkeypatch.setattr(ev, "load_agent", lambda *a: pytest.fail("the model was loaded"))
    (tmp_path / "notes.mp4").write_text("not a video")
    fill = dict(missing=str(tmp_path / "nope.mp4"), text=str(tmp_path / "notes.mp4"), tmp=str(tmp_path), real=str(NASA))
    if "{real}" in argv and not NASA.is_file():
        pytest.skip("needs the shared real_videos folder")
    said = one_line_error([a.format(**fill) for a in argv], capsys)
    assert message.format(**fill) in said, said


def test_parse_options_lettered_or_not():
    assert ev.parse_options("A. red|B) blue|(C) green") == ["red", "blue", "green"]
    assert ev.parse_options(" red | blue ") == ["red", "blue"]
    assert ev.parse_options("U.S. flag|Canada") == ["U.S. flag", "Canada"]     # a full stop is not a letter's


def test_a_failed_batch_is_rerun_after_its_engine_is_gone():
    """_run_safely reruns a failed batch record by record only after the failed call's frames are released: its
    traceback held them, and with them the engine's K/V pool (a real run's tens of GB), alive through every rerun."""
    import gc
    import weakref

    class Pool:                                       # stands for the engine's K/V pool
        pass
    pools = []

    def run_batch(batch):
        pool = Pool()                                 # a local of the failing call's frame
        pools.append(weakref.ref(pool))
        if len(batch) > 1 or batch[0]["id"] == "bad":
            raise ValueError("cannot decode bad.mp4")
        alive = [p for p in pools[:-1] if p() is not None]
        assert not alive, f"{len(alive)} failed engines still alive during the rerun"
        return [{"id": batch[0]["id"], "response": "<answer>A</answer>"}]

    gc.disable()                                      # released by reference counting, not by a later collection
    try:
        rows = ev._run_safely(run_batch, [{"id": "a", "answer": "A"}, {"id": "bad", "answer": "A"},
                                          {"id": "c", "answer": "A"}])
    finally:
        gc.enable()
    assert [r["id"] for r in rows] == ["a", "bad", "c"]
    assert rows[1]["error"] == "ValueError: cannot decode bad.mp4" and rows[0]["response"] == "<answer>A</answer>"
