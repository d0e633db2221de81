"""Tests for rollout.py: the batched multi-turn engine on the embedded tiny Qwen3-VL and real mp4s.

The random tiny model does not write tool calls by itself, so most tests script it: `Scripted`
replaces `rollout.sample_tokens` (the engine calls it once per decode step, for all rows) and emits the
tokens of given turn texts, row by row. The engine still runs every forward pass, so the recorded
log-probs are real and can be checked against a full recompute.

    python -m pytest tests/test_rollout.py -q
"""
import json
import time
import re
import warnings
import weakref

import pytest
import torch

import data
import kvcache
import model as model_lib
import recipes
import rollout
import sft
import video
from model import load_model
from conftest import TEST_ROLLOUT, bench_module

def schedules():
    """bench/engines.py (fixed waves: Waves; the engine's clock: Timed, STATS), for the tests marked bench only."""
    return bench_module("engines")

SEED = 0


# ----------------------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def tiny():
    # One thread: token-by-token decoding of a 4 M model is latency-bound, and on a shared CPU two
    # OpenMP threads waiting on each other make each small matmul ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """4 synthetic 64 s videos: [multi_clue, single_clue, single_clue, direct] for seed 0."""
    root = str(tmp_path_factory.mktemp("rollout"))
    return root, data.make_split(root, 4, seed=0, duration=64.0)


def config(**kw) -> rollout.RolloutConfig:
    """The tests' rollout: log-probs recorded at sampling time (record_logprobs), to check against a recompute."""
    return rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": 96, "temperature": 1.0, "record_logprobs": True,
                                    **kw})


def call(start, end, **extra) -> str:
    return "<tool_call>\n" + json.dumps({"name": "crop_video", "arguments": {"start_time": start,
                                                                            "end_time": end, **extra}}) + "\n</tool_call>"


def turn(think: str, body: str) -> str:
    """A policy turn after the environment's forced "<think>\\n"."""
    return f"{think}\n</think>\n{body}"


ANSWER = turn("done", "<answer>B</answer>")


class Scripted:
    """Stand-in for `rollout.sample_tokens`: row (record i, sample s) emits the tokens of
    scripts[(i, s)][t] + <|im_end|> in its turn t (the last turn repeats); any other row (a sub-agent)
    emits `sub`. Rows are told apart by their seed (`rollout.row_seed`). `log[(i, s)]` collects every
    token it emitted for that row."""

    def __init__(self, processor, scripts: dict, seed: int = SEED, sub: str = "A red square in the centre."):
        tok = processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        enc = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [end]
        self.keys = {rollout.row_seed(seed, i, s): (i, s) for i, s in scripts}
        self.turns = {key: [enc(t) for t in texts] for key, texts in scripts.items()}
        self.sub = [enc(sub)]
        self.state, self.log = {}, {}

    def one(self, seed: int) -> int:
        key = self.keys.get(seed, "sub")
        turns = self.turns.get(key, self.sub)
        t, p = self.state.get(seed, (0, 0))
        toks = turns[min(t, len(turns) - 1)]
        self.state[seed] = (t + 1, 0) if p + 1 == len(toks) else (t, p + 1)
        self.log.setdefault(key, []).append(toks[p])
        return toks[p]

    def __call__(self, logits, seeds, counters, temperature, top_p):
        assert logits.shape[0] == len(seeds) == len(counters)
        return torch.tensor([self.one(s) for s in seeds.tolist()], device=logits.device)


@pytest.fixture
def script(monkeypatch, tiny):
    def install(scripts: dict, **kw) -> Scripted:
        s = Scripted(tiny[1], scripts, **kw)
        monkeypatch.setattr(rollout, "sample_tokens", s)
        return s
    return install


def responses(text: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, flags=re.S)


def user_messages(text: str) -> list[str]:
    return re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, flags=re.S)


def recomputed_logprobs(model, trajs, pad_id: int) -> list[torch.Tensor]:
    """log p(token | everything before it) at each POLICY token, from ONE forward over whole sequences."""
    batch = rollout.collate(trajs, model, pad_id)
    roles = batch.pop("roles")
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1].float()                          # (B, L-1, V)
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    policy = roles[:, 1:] == rollout.POLICY
    return [lp[b][policy[b]] for b in range(len(trajs))]


def _record_engines(monkeypatch) -> list:
    """Every rollout.Engine that runs, in order (the rollout's own first)."""
    engines, run = [], rollout.Engine.run
    monkeypatch.setattr(rollout.Engine, "run", lambda self: (engines.append(self), run(self))[1])
    return engines


# ----------------------------------------------------------------------------- one scripted trajectory

def test_parallel_calls_windows_order_roles(tiny, split, script):
    model, processor = tiny
    root, recs = split
    turns = [turn("two marks, look closer", call(30.0, 34.0) + "\n" + call(10.0, 14.0)), ANSWER]
    s = script({(0, 0): turns})
    [t] = rollout.run_agent(model, processor, recs[1:2], root, config(), seed=SEED)
    assert t.error is None and not t.truncated and not t.hit_turn_limit
    assert t.windows == [(30.0, 34.0), (10.0, 14.0)]
    assert (t.n_tool_turns, t.n_calls, t.tool_failures) == (1, 2, 0)
    assert t.answer == "B"
    # responses come back in call order, each clip's frame timestamps inside its own window
    parts = responses(t.text)
    assert [p.split(" s:")[0] for p in parts] == ["Clip 30.0-34.0", "Clip 10.0-14.0"]
    for part, (a, b) in zip(parts, t.windows):
        stamps = [float(x) for x in re.findall(r"<(\d+\.\d) seconds>", part)]
        assert stamps and all(a <= x <= b for x in stamps), (part, stamps)
    # exactly the sampled tokens are POLICY, in order; prompt, forced prefixes, responses are ENV
    sampled = s.log[(0, 0)]
    policy = [tid for tid, role in zip(t.token_ids, t.roles) if role == rollout.POLICY]
    assert policy == sampled and len(t.logprobs) == len(sampled)
    tok = processor.tokenizer
    assert set(t.roles[:t.prompt_len]) == {rollout.ENV}
    env_text = tok.decode([tid for tid, r in zip(t.token_ids[t.prompt_len:], t.roles[t.prompt_len:])
                           if r == rollout.ENV], skip_special_tokens=False)
    assert env_text.startswith(rollout.THINK_PREFIX + "\n<|im_start|>user\n<tool_response>\nClip 30.0-34.0 s:")
    assert env_text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n" + rollout.THINK_PREFIX)
    assert env_text.count("<tool_response>") == 2 and "<tool_call>" not in env_text and "<answer>" not in env_text
    assert t.text.startswith(rollout.THINK_PREFIX + turns[0] + "<|im_end|>")
    assert t.turns == [rollout.THINK_PREFIX + turns[0], rollout.THINK_PREFIX + turns[1]]


# ----------------------------------------------------------------------------- cache reuse is exact

# Two records of different prompt lengths (multi_clue vs single_clue question), G = 2, rows that
# answer at once, call once, call twice (one call failing), so rows finish turns at different steps
# and the batched cache has holes in the middle of rows.
EXACT_SCRIPTS = {
    (0, 0): [turn("two marks", call(28.0, 36.0) + "\n" + call(50.0, 58.0)), turn("again", call(30.0, 33.0)), ANSWER],
    (0, 1): [ANSWER],
    (1, 0): [turn("one mark", call(29.0, 37.0)), ANSWER],
    (1, 1): [turn("m", call(70.0, 80.0) + "\n" + call(2.0, 6.0)), turn("once more", call(40.0, 30.0)), ANSWER],
}   # (1, 1)'s 2nd response is an error only: a text-only chunk next to chunks with clips


@pytest.mark.parametrize("mode", ["interleaved", "subagent"])   # clips in context vs summaries in context
def test_cached_logprobs_equal_full_recompute(tiny, split, script, mode, small_thresholds, monkeypatch):
    """Shrunk (conftest.SMALL_THRESHOLDS): rows cross 4-token blocks inside their turns, attention runs in many small blocks,
    and the memory budget holds about one group: the second waits until the first has retired."""
    model, processor = tiny
    root, recs = split
    script(EXACT_SCRIPTS, sub="A blue square.")
    engines = _record_engines(monkeypatch)
    trajs = rollout.run_agent(model, processor, recs[:2], root, config(tool_mode=mode, group_size=2), seed=SEED)
    main = engines[0]
    assert main.kv.pool.peak <= main.kv.pool.n_blocks and not main.kv.pool.free[main.kv.pool.n_blocks:]
    assert (main.kv.pool.n_blocks < main.need) == bool(small_thresholds)   # the budget bit only when shrunk
    assert [(t.record_id, t.sample) for t in trajs] == [(recs[0]["id"], 0), (recs[0]["id"], 1),
                                                         (recs[1]["id"], 0), (recs[1]["id"], 1)]
    assert [t.n_tool_turns for t in trajs] == [2, 0, 1, 2]
    assert [t.answer for t in trajs] == ["B"] * 4
    assert [t.tool_failures for t in trajs] == [0, 0, 0, 2] and len({len(t.token_ids) for t in trajs}) == 4
    assert trajs[0].prompt_len != trajs[2].prompt_len                    # the prompts differ in length too
    if mode == "interleaved":
        assert [len(t.videos) for t in trajs] == [3, 1, 2, 2]            # overview + one per turn with a clip
        assert "Clip 28.0-36.0 s:" in trajs[0].text
    else:
        assert all(len(t.videos) == 1 for t in trajs) and "A blue square." in trajs[0].text
        assert [len(t.subagents) for t in trajs] == [3, 0, 1, 1]
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    full = recomputed_logprobs(model, trajs, pad)
    for t, ref in zip(trajs, full):
        assert len(t.logprobs) == len(ref) == sum(t.roles)
        torch.testing.assert_close(torch.tensor(t.logprobs), ref, atol=1e-4, rtol=0)
    if mode == "subagent":   # the batched sub-agent generation is exact too
        subs = [st for t in trajs for st in t.subagents]
        for st, ref in zip(subs, recomputed_logprobs(model, subs, pad)):
            torch.testing.assert_close(torch.tensor(st.logprobs), ref, atol=1e-4, rtol=0)


# Three records, G = 2, turn lengths varying ~6x (a few tokens to a long think), calls in some turns: under a
# budget of one group's worst case and another's first turns (two worst cases do not fit side by side) rows
# finish, groups wait and are admitted while other rows decode, and a row waits for its next turn's blocks.
LONG = turn("a much longer chain of thought " * 6, "<answer>B</answer>")
BUDGET_SCRIPTS = {
    (0, 0): [turn("look", call(28.0, 36.0)), LONG], (0, 1): [ANSWER],
    (1, 0): [LONG], (1, 1): [turn("m", call(2.0, 6.0) + "\n" + call(40.0, 44.0)), turn("again", call(30.0, 33.0)), ANSWER],
    (2, 0): [ANSWER], (2, 1): [turn("x", call(10.0, 14.0)), ANSWER],
}


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_budget_and_schedule_leave_trajectories_unchanged(tiny, split, script, mode, shrunk_thresholds, monkeypatch):
    """The same trajectories (tokens, roles, answers, windows, recorded log-probs) with an unbounded budget, with
    a budget of one group's worst case and another's first turns (continuous batching: groups are admitted on
    their turns' grants, so two run side by side where their worst cases would not fit; a group is admitted
    while other rows decode; a row waits for its next turn's blocks (refused once, as an unsafe grant would be);
    the pool never holds more than the budget, every row within its grant), and in fixed waves (one group at a
    time); and the budgeted run's log-probs equal a full recompute."""
    model, processor = tiny
    root, recs = split
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg = config(tool_mode=mode, group_size=2, memory_budget_bytes=1 << 40)
    lens = [len(rollout.encode_prompt(processor, r, root, cfg)[2].ids) + 3 for r in recs[:3]]
    factor, turns = rollout.video_factor(processor), rollout.assistant_turns(cfg)
    group = max(kvcache.blocks_for(n) + 2 * rollout.row_blocks(cfg, n, factor) for n in lens)
    opening = max(kvcache.blocks_for(n) + 2 * rollout.row_blocks(cfg, n, factor, 0, turns, this_turn=True) for n in lens)
    blocks = group + opening                            # one group's worst case and another's first turns
    budget = blocks * kvcache.BLOCK * kvcache.kv_bytes_per_token(model)
    engines, joined, side_by_side, refused = _record_engines(monkeypatch), [], [], []
    add_prompts, step, grant = kvcache.GroupKV.add_prompts, rollout.Engine.step, rollout.Engine.grant

    def watched(self, model, chunks, pad_id):          # a group admitted while rows of others are decoding
        joined.append(sum(r.tools for r in engines[-1].active))
        return add_prompts(self, model, chunks, pad_id)

    def watched_step(self):                            # groups in flight; every row within its grant
        side_by_side.append((not isinstance(self, schedules().Waves), len({r.prompt for r in self.active if r.tools})))
        assert all(len(self.kv.rows[r.kv].blocks) <= r.grant for r in self.active if r.tools)
        assert self.kv.reserved <= self.kv.pool.n_blocks
        return step(self)

    def watched_grant(self, who, blocks):              # under the budget, the first row to ask for its next turn
        if (not isinstance(self, schedules().Waves) and self.kv.pool.n_blocks < self.need and isinstance(who[0], int)
                and blocks > 0 and not refused):                      # is refused once: it waits while the others decode
            refused.append(len(self.active))
            return False
        return grant(self, who, blocks)

    monkeypatch.setattr(kvcache.GroupKV, "add_prompts", watched)
    monkeypatch.setattr(rollout.Engine, "step", watched_step)
    monkeypatch.setattr(rollout.Engine, "grant", watched_grant)
    runs = {}
    for name, kw, engine in [("unbounded", {}, rollout.Engine), ("budget", dict(memory_budget_bytes=budget), rollout.Engine),
                             ("waves", dict(memory_budget_bytes=budget), schedules().Waves)]:
        script(BUDGET_SCRIPTS, sub="A blue square.")
        first = len(engines)
        with schedules().swapped(engine):
            runs[name] = rollout.run_agent(model, processor, recs[:3], root, config(**{**cfg.__dict__, **kw}), seed=SEED)
        pool = engines[first].kv.pool
        assert pool.peak <= pool.n_blocks
        if name != "unbounded":
            assert pool.n_blocks <= blocks < engines[first].need
        if name == "budget":
            assert max(joined) > 0                      # continuous: admitted beside decoding rows
            assert max(n for cont, n in side_by_side if cont) >= 2 and refused[0] > 0
            side_by_side.clear()
    assert max(n for _, n in side_by_side) == 1         # waves: one group's worst case at a time
    ref = runs["unbounded"]
    turn_lengths = [len(x) for t in ref for x in t.turns]
    assert [t.n_tool_turns for t in ref] == [1, 0, 0, 2, 0, 1] and max(turn_lengths) >= 4 * min(turn_lengths)
    for name in ("budget", "waves"):
        for t, r in zip(runs[name], ref):
            assert (t.token_ids, t.roles, t.answer, t.windows) == (r.token_ids, r.roles, r.answer, r.windows), name
            torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
    for t, full in zip(runs["budget"], recomputed_logprobs(model, runs["budget"], pad)):
        torch.testing.assert_close(torch.tensor(t.logprobs), full, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_a_budget_below_one_group_holds_one_group(tiny, split, script, mode, shrunk_thresholds, monkeypatch):
    """A budget below one group's worst case: the group runs as parts of its rows that fit, each with its own copy
    of the prompt (here a row a part: a Video-o3 group at its full context is ~400 GiB at 8B, a row ~30 GiB); a row
    above the budget alone makes the pool hold its worst case instead (a warning says so); the pool never grows,
    and the trajectories equal an unbounded run's."""
    model, processor = tiny
    root, recs = split
    cfg = config(tool_mode=mode, group_size=2)
    engines, runs, parts, split = _record_engines(monkeypatch), [], [], rollout.split_group
    monkeypatch.setattr(rollout, "split_group", lambda *a: (lambda out: parts.append(len(out)) or out)(split(*a)))
    for budget in (1 << 40, 4 * kvcache.BLOCK * kvcache.kv_bytes_per_token(model)):
        script(BUDGET_SCRIPTS, sub="A blue square.")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(rollout.run_agent(model, processor, recs[:3], root,
                                          config(**{**cfg.__dict__, "memory_budget_bytes": budget}), seed=SEED))
    messages = [str(w.message) for w in caught]
    assert any("below one prompt group's worst case" in m for m in messages)
    assert not any("pool grew" in m for m in messages)
    pool = engines[-1].kv.pool
    assert pool.n_blocks < engines[-1].need and pool.peak <= pool.n_blocks
    assert [t.n_tool_turns for t in runs[1]] == [1, 0, 0, 2, 0, 1]
    assert parts == [1, 1, 1, 2, 2, 2]                  # unbounded: whole groups; then each group of 2 in its rows
    for t, r in zip(runs[1], runs[0]):
        assert (t.token_ids, t.roles, t.answer, t.windows) == (r.token_ids, r.roles, r.answer, r.windows)
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_safe_is_the_bankers_rule():
    """`safe` tries one order (what each group still may need, smallest first); with one resource that order
    succeeds whenever any order does: checked against every order of random states."""
    import itertools
    import random
    rng = random.Random(0)

    def any_order(groups, free):
        for order in itertools.permutations(groups):
            f = free
            for held, need in order:
                if need - held > f:
                    break
                f += held
            else:
                return True
        return False
    answers = []
    for _ in range(400):
        groups = [(h, h + rng.randint(0, 9)) for h in (rng.randint(0, 6) for _ in range(rng.randint(1, 4)))]
        free = rng.randint(0, 8)
        answers.append(rollout.safe(groups, free))
        assert answers[-1] == any_order(groups, free), (groups, free)
    assert 50 < sum(answers) < 350                         # both answers occur
    assert rollout.safe([(3, 10), (2, 5)], 5) and not rollout.safe([(6, 10), (2, 5)], 2)


@pytest.mark.bench
@pytest.mark.parametrize("continuous", [True, False])
def test_engine_grants_only_what_keeps_it_safe(tiny, continuous):
    """Engine.grant on a hand-made state: a pool of 10 blocks, group 1 holding 3 of a worst case of 10, group 2
    holding 2 of 5, 5 free. Continuous batching grants group 1 two more blocks (group 2 can still finish with the
    3 left, and its 5 then carry group 1 to its end) but not three (then neither can finish: a deadlock could
    come), and group 2 three; a new group only where the engine stays safe. Fixed waves (bench/engines.py) grant
    whole worst cases side by side and nothing past the pool."""
    model, processor = tiny
    engine = (rollout.Engine if continuous else schedules().Waves)(model, processor, config(),
                                                                 rollout.special_token_ids(processor))
    engine.kv = kvcache.GroupKV(model, "cpu", 10)

    def state():
        engine.groups = {1: ([rollout._Row(None, "", grant=2, reserve=9)], 1), 2: ([rollout._Row(None, "", grant=1, reserve=4)], 1)}
        engine.kv.reserved = 5
    queued = lambda grant, reserve: [(None, [rollout._Row(None, "", grant=grant, reserve=reserve)], 1)]
    if continuous:
        state()
        assert not engine.grant((1,), 3) and engine.kv.reserved == 5
        assert engine.grant((1,), 2) and engine.kv.reserved == 7
        state()
        assert engine.grant((2,), 3) and engine.kv.reserved == 8
        state()                                            # a new group holding 2 of a worst case of 3
        assert engine.grant(queued(1, 2), 2) and engine.kv.reserved == 7
        state()                                            # ... of 8: then group 2 alone could finish
        assert not engine.grant(queued(1, 7), 2) and engine.kv.reserved == 5
    else:
        state()
        assert engine.grant(queued(4, 4), 5) and engine.kv.reserved == 10
        state()
        assert not engine.grant(queued(5, 5), 6) and engine.kv.reserved == 5
    engine.kv.reserved = 0                                 # into an empty engine: always
    engine.groups = {}
    assert engine.grant(queued(20, 20), 21) and engine.kv.reserved == 21


@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_a_turns_end_tightens_the_rows_promise(tiny, split, script, mode, shrunk_thresholds, monkeypatch, recwarn):
    """A row is admitted on its worst case (row_blocks: every turn max_new_tokens long); when a turn ends, what it
    wrote and the response it will read are known, so the promise shrinks to the worst case of the turns left and
    the difference goes back to the scheduler. The promise still covers every block the row holds at every step
    (the pool never grows), and every promise is returned at the end."""
    model, processor = tiny
    root, recs = split
    engines = _record_engines(monkeypatch)
    promises, checked = [], []
    respond, step = rollout.Engine.respond, rollout.Engine.step

    def watched_respond(self, r, chunk):
        before = r.reserve
        respond(self, r, chunk)
        promises.append((before, r.reserve))

    def watched_step(self):
        for r in self.active:
            if r.tools:
                assert len(self.kv.rows[r.kv].blocks) <= r.reserve
                checked.append(r)
        return step(self)

    monkeypatch.setattr(rollout.Engine, "respond", watched_respond)
    monkeypatch.setattr(rollout.Engine, "step", watched_step)
    script({(0, 0): [turn("look", call(28.0, 36.0)), turn("again", call(2.0, 6.0)), ANSWER], (0, 1): [ANSWER]},
           sub="A blue square.")
    cfg = config(tool_mode=mode, group_size=2, max_turns=3)
    trajs = rollout.run_agent(model, processor, recs[:1], root, cfg, seed=SEED)
    assert [t.n_tool_turns for t in trajs] == [2, 0] and checked
    assert len(promises) == 2 and all(after < before for before, after in promises)
    assert promises[1][0] == promises[0][1]                            # the second turn starts from the tightened one
    assert engines[0].kv.reserved == 0 and not engines[0].kv.rows and not engines[0].kv.prompts
    assert not [w for w in recwarn if "pool grew" in str(w.message)]


def test_rollout_memory_flag_reaches_the_engine(capsys):
    import train
    assert train.rollout_config_of_args(recipes.parse_train_args(["--rollout-memory-gb", "1.5"])).memory_budget_bytes == 3 * 2 ** 29
    assert train.rollout_config_of_args(recipes.parse_train_args([])).memory_budget_bytes is None      # the default: memory_budget
    assert kvcache.memory_budget(None, "cpu") == kvcache.CPU_BUDGET_GB * 2 ** 30
    with pytest.raises(SystemExit):
        recipes.parse_train_args(["--rollout-memory-gb", "0"])
    assert "--rollout-memory-gb must be > 0" in capsys.readouterr().err


class _KeptCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Elements of the fp32 -> bf16 casts made while active that are still alive (weakrefs)."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and out.dtype == torch.bfloat16:
            self.casts.append((weakref.ref(out), out.numel()))
        return out

    @property
    def alive(self) -> int:
        return sum(n for ref, n in self.casts if ref() is not None)


def test_default_budget_counts_autocast_weight_copies(monkeypatch):
    """Under autocast (--precision bf16 on fp32 master weights) the default budget leaves room for the weights' bf16
    copies autocast keeps through the rollout (2 bytes a cast weight: 16 GB at 8B); without autocast there are none
    (FSDP2's shards and a rollout rank's bf16 weights: tests/test_release_layout.py). The
    count is autocast's: after a bf16 autocast forward of the tiny model (vision tower frozen) the casts still alive
    are exactly `autocast_copies`' elements, the frozen tower's not among them. The default took 80 % of the free
    memory whatever the precision."""
    GB = 2 ** 30
    assert kvcache.default_budget(10 * GB, GB // 2, torch.bfloat16) == int(0.8 * 9 * GB)
    assert kvcache.default_budget(10 * GB, GB // 2, None) == int(0.8 * 10 * GB)              # fp32: no autocast
    assert kvcache.default_budget(GB, GB, torch.bfloat16) == 0
    model, _ = load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
    whole = kvcache.autocast_copies(model)
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    text = kvcache.autocast_copies(model)
    assert 0 < text < whole < sum(p.numel() for p in model.parameters())
    ids = torch.randint(300, model.get_input_embeddings().weight.shape[0], (1, 16))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        with _KeptCasts() as kept:
            model(input_ids=ids)
        assert kept.alive == text
    # the wiring: memory_budget on a GPU with 10 GB free under bf16 autocast, one process
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: GB)
    monkeypatch.setattr(kvcache, "autocast_dtype", lambda device: torch.bfloat16)
    assert kvcache.memory_budget(None, "cuda", model) == int(0.8 * (10 * GB - 2 * text))


def test_bf16_rollout_keeps_pixels_in_the_model_dtype(split, script, monkeypatch):
    """A bf16 model's trajectories hold the overview and clip pixels in bf16 (the values the model saw), not in the
    processor's fp32 (twice the host memory for the whole step); the G rows share one overview tensor; the
    recorded log-probs are those of a bf16 recompute up to bf16 rounding."""
    model, processor = load_model("tiny", device="cpu", dtype=torch.bfloat16, tiny_corpus=rollout.prompt_corpus())
    root, recs = split
    script({(0, s): [turn("look", call(28.0, 36.0)), ANSWER] for s in (0, 1)})
    trajs = rollout.run_agent(model, processor, recs[:1], root, config(group_size=2), seed=SEED)
    assert [len(t.videos) for t in trajs] == [2, 2] and trajs[0].videos[0][0] is trajs[1].videos[0][0]
    assert {p.dtype for t in trajs for p, _ in t.videos} == {torch.bfloat16}
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for t, ref in zip(trajs, recomputed_logprobs(model, trajs, pad)):
        torch.testing.assert_close(torch.tensor(t.logprobs), ref, atol=0.1, rtol=0)


# ----------------------------------------------------------------------------- seeds

def test_seeded_sampling_reproducible_and_greedy_deterministic(tiny, split):
    model, processor = tiny
    root, recs = split
    run = lambda seed, **kw: [t.token_ids for t in rollout.run_agent(
        model, processor, recs[:1], root, config(max_turns=1, max_new_tokens=8, group_size=2, **kw), seed=seed)]
    a, b, c = run(0), run(0), run(1)
    assert a == b                      # same seed, same tokens
    assert a[0] != c[0] and a[1] != c[1]   # another seed, other tokens
    assert a[0] != a[1]                # the two group samples draw from different streams
    g1, g2 = run(0, temperature=0.0), run(5, temperature=0.0)
    assert g1 == g2 and g1[0] == g1[1]     # greedy: no randomness at all


# ----------------------------------------------------------------------------- turn limit

def test_turn_limit_forces_answer_and_drops_last_calls(tiny, split, script):
    model, processor = tiny
    root, recs = split
    script({(0, 0): [turn("look", call(10.0, 14.0))]})                 # calls a tool every turn
    [t] = rollout.run_agent(model, processor, recs[1:2], root, config(max_turns=2), seed=SEED)
    assert t.hit_turn_limit and t.error is None
    assert len(t.turns) == 3 and [len(c) for c in t.calls] == [1, 1, 1]
    assert t.n_tool_turns == 2 and t.windows == [(10.0, 14.0)] * 2    # the 3rd turn's call is not run
    users = user_messages(t.text)
    assert len(users) == 2 and len(responses(t.text)) == 2
    assert rollout.FORCED_ANSWER not in users[0] and rollout.FORCED_ANSWER in users[1]
    assert t.text.endswith(call(10.0, 14.0) + "<|im_end|>")             # nothing after the last turn


# ----------------------------------------------------------------------------- bad calls are observations

OTHER = "videos/syn-0-00000.mp4"    # a model-written video_path: it must not be used
GOOD = call(2.0, 6.0)                # every case's turn is `first` + this good call
CLIP = "Clip 2.0-6.0 s:"
BAD_CALLS = [
    # (name, first call(s) of the turn, failures, windows run, how each response starts)
    ("malformed_json", '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 1.0,\n</tool_call>',
     1, [(2.0, 6.0)], ["Error: invalid JSON", CLIP]),
    ("unknown_tool", '<tool_call>\n{"name": "zoom", "arguments": {"start_time": 1.0, "end_time": 5.0}}\n</tool_call>',
     1, [(2.0, 6.0)], ["Error: unknown tool 'zoom'", CLIP]),
    ("past_end", call(70.0, 80.0), 1, [(2.0, 6.0)], ["Error: start_time 70.0 is past the end of the video", CLIP]),
    ("start_after_end", call(20.0, 10.0), 1, [(2.0, 6.0)], ["Error: start_time 20.0 must be smaller", CLIP]),
    ("shorter_than_1s", call(10.0, 10.5), 1, [(2.0, 6.0)], ["Error: window [10.0, 10.5] is 0.5 s long", CLIP]),
    # 5 valid calls, 44 empty blocks, the good call: 50 calls; only max_calls_per_turn = 5 run, one
    # error observation about the other 45 (not 45 errors, and the good 50th call is not run)
    ("fifty_calls", "\n".join(call(float(k), k + 2.0) for k in range(5)) + "<tool_call>{}</tool_call>" * 44,
     1, [(float(k), k + 2.0) for k in range(5)],
     [f"Clip {k}.0-{k + 2}.0 s:" for k in range(5)] + ["Error: only 5 calls per turn are executed; 45 were dropped"]),
    ("video_path_ignored", call(2.0, 6.0, video_path=OTHER), 0, [(2.0, 6.0), (2.0, 6.0)], [CLIP, CLIP]),
]


@pytest.fixture(scope="module")
def bad_call_trajs(tiny, split):
    """All BAD_CALLS cases as one batch (one record copy per case), interleaved mode."""
    model, processor = tiny
    root, recs = split
    scripts = {(i, 0): [turn("x", case[1] + "\n" + GOOD), ANSWER] for i, case in enumerate(BAD_CALLS)}
    records = [{**recs[1], "id": case[0]} for case in BAD_CALLS]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "sample_tokens", Scripted(processor, scripts))
        trajs = rollout.run_agent(model, processor, records, root, config(max_new_tokens=400), seed=SEED)
    return {t.record_id: t for t in trajs}


@pytest.mark.parametrize("name,first,failures,windows,starts", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_become_error_observations(bad_call_trajs, name, first, failures, windows, starts):
    t = bad_call_trajs[name]
    assert t.error is None and not t.truncated and t.answer == "B" and t.n_tool_turns == 1
    assert t.tool_failures == failures and t.windows == windows and t.n_calls == len(t.calls[0])
    parts = responses(t.text)
    assert len(parts) == len(starts) and all(p.startswith(s) for p, s in zip(parts, starts)), parts
    if name == "video_path_ignored":   # both calls cropped the sample's own video: identical pixels
        pixels, grid = t.videos[1]
        assert grid.tolist() == [grid[0].tolist()] * 2
        half = len(pixels) // 2
        torch.testing.assert_close(pixels[:half], pixels[half:], atol=0, rtol=0)


def test_subagent_mode_allows_short_windows_and_ignores_video_path(tiny, split, script):
    model, processor = tiny
    root, recs = split
    other_video = recs[0]["video"]                     # another record's real video
    body = "\n".join([call(10.0, 10.5), call(2.0, 6.0, video_path=other_video), call(2.0, 6.0)])
    script({(0, 0): [turn("x", body), ANSWER]})
    [t] = rollout.run_agent(model, processor, recs[1:2], root, config(tool_mode="subagent", max_new_tokens=200),
                            seed=SEED)
    assert t.tool_failures == 0 and t.windows == [(10.0, 10.5), (2.0, 6.0), (2.0, 6.0)]
    subs = t.subagents
    assert [st.parent for st in subs] == [(0, 0), (0, 1), (0, 2)]
    torch.testing.assert_close(subs[1].videos[0][0], subs[2].videos[0][0], atol=0, rtol=0)
    own = video.crop(f"{root}/{recs[1]['video']}", 2.0, 6.0, level=None, fps=1.0, max_frames=16, max_pixels=64 * 64)
    other = video.crop(f"{root}/{other_video}", 2.0, 6.0, level=None, fps=1.0, max_frames=16, max_pixels=64 * 64)
    assert not torch.equal(own.frames, other.frames)   # so equal pixels above do say "own video"


# ----------------------------------------------------------------------------- a broken record

def test_missing_video_sets_error_others_roll_out(tiny, split, script):
    model, processor = tiny
    root, recs = split
    records = [recs[1], {**recs[2], "video": "videos/missing.mp4"}, recs[3]]
    script({(i, s): [turn("look", call(29.0, 37.0)), ANSWER] for i in (0, 2) for s in (0, 1)})
    trajs = rollout.run_agent(model, processor, records, root, config(group_size=2), seed=SEED)
    assert [t.record_id for t in trajs] == [r["id"] for r in records for _ in range(2)]
    for t in trajs[2:4]:
        assert "missing.mp4" in t.error and t.token_ids == [] and t.answer is None
    for t in trajs[:2] + trajs[4:]:
        assert t.error is None and t.answer == "B" and t.windows == [(29.0, 37.0)]


def test_sft_records_as_the_papers_write_them(tiny, split):
    """The papers' trajectory format (a system and user prompt recorded, `content: null` with `tool_calls`, tool
    results as user messages of <tool_response> blocks) encodes to the same tokens as the project's own format;
    a recording longer than the rollout's turn limit gets no forced-answer request in the middle."""
    model, processor = tiny
    root, records = split
    rec = records[1]
    cfg = rollout.RolloutConfig(**{**TEST_ROLLOUT, "max_turns": 1})
    args = {"start_time": 1.0, "end_time": 9.0}
    call = {"type": "function", "function": {"name": "crop_video", "arguments": json.dumps(args)}}
    ours = [{"role": "assistant", "content": data.message_text({"content": "<think>\nlook\n</think>",
                                                                   "tool_calls": [call, call]})},
            {"role": "tool", "content": "a red square"}, {"role": "tool", "content": "nothing"},
            {"role": "assistant", "content": "<think>\nagain\n</think>", "tool_calls": [call]},
            {"role": "tool", "content": "still red"},
            {"role": "assistant", "content": "<think>\nred\n</think>\n<answer>A</answer>"}]
    papers = [{"role": "system", "content": "recorded system prompt"}, {"role": "user", "content": "recorded question"},
              {"role": "assistant", "content": None, "tool_calls": [call, call]}, *ours[1:]]
    papers[2]["content"] = "<think>\nlook\n</think>"
    papers[3:5] = [{"role": "user", "content": "<tool_response>\na red square\n</tool_response>\n"
                                               "<tool_response>\nnothing\n</tool_response>"}]
    a = sft.encode_messages(processor, rec, ours, root, cfg)
    b = sft.encode_messages(processor, rec, papers, root, cfg)
    assert a.token_ids == b.token_ids and a.roles == b.roles and a.n_tool_turns == b.n_tool_turns == 2
    assert [len(c) for c in a.calls] == [2, 1, 0]
    assert a.text.count(rollout.FORCED_ANSWER) == 1                      # after the last tool turn only
    assert a.text.index(rollout.FORCED_ANSWER) > a.text.index("still red")


@pytest.mark.parametrize("tokenizer", ["tiny", "qwen"])
def test_target_chars_leaves_the_rest_of_a_turn_as_context(tiny, split, tokenizer):
    """An assistant message with target_chars = N: the same tokens as without it (on Qwen's tokenizer too, whose
    ">C" joins the tag's end and the letter), POLICY (SFT targets) where a token ends by character N, ENV
    (context, as a recorded guess's letter is) from there on, its <|im_end|> included; a bad N is a clear error."""
    model, processor = tiny
    if tokenizer == "qwen":
        processor = model_lib.build_processor(model_lib.qwen_tokenizer(), model_lib.ModelConfig())
    root, records = split
    cfg = rollout.RolloutConfig(**TEST_ROLLOUT)
    text = "<think>\nI cannot read it. I will guess.\n</think>\n<answer>C</answer>"
    cut = text.index("<answer>") + len("<answer>")
    full = sft.encode_messages(processor, records[0], [{"role": "assistant", "content": text}], root, cfg)
    part = sft.encode_messages(processor, records[0], [{"role": "assistant", "content": text, "target_chars": cut}],
                                   root, cfg)
    assert part.token_ids == full.token_ids and part.text == full.text and part.answer == full.answer == "C"
    tok = processor.tokenizer
    roles = part.roles[part.prompt_len:]
    policy = [t for t, r in zip(part.token_ids, part.roles) if r == rollout.POLICY]
    context = [t for t, r in zip(part.token_ids[part.prompt_len:], roles) if r == rollout.ENV]
    target = text[len(rollout.THINK_PREFIX):cut]
    expected = target if tokenizer == "tiny" else target[:-1]          # Qwen: ">C" is one token, context
    assert tok.decode(policy) == expected
    assert tok.decode(context) == rollout.THINK_PREFIX + text[len(rollout.THINK_PREFIX) + len(expected):] + "<|im_end|>"
    after = roles[roles.index(rollout.POLICY):]                         # the message's tokens, after <think>\n
    assert after == sorted(after, key=lambda r: r != rollout.POLICY)     # one cut: targets, then context
    assert sum(r == rollout.POLICY for r in full.roles) == len(after)    # without target_chars: all targets
    for bad in (-1, len(text) + 1, "12", 3.0, True):
        with pytest.raises(ValueError, match="target_chars"):
            sft.encode_messages(processor, records[0], [{"role": "assistant", "content": text, "target_chars": bad}],
                                    root, cfg)


# ----------------------------------------------------------------------------- tools beside the decoding

def _slow_tools(monkeypatch, seconds: float, decode_steps) -> list:
    """rollout.run_calls made slow (`seconds` a turn, before the real work); returns a list that gets, per turn's
    tool work, the decode steps the engine made while it ran (`decode_steps`: conftest's spy)."""
    during, run_calls = [], rollout.run_calls

    def slow(*a, **kw):
        before = decode_steps()
        time.sleep(seconds)
        out = run_calls(*a, **kw)
        during.append(decode_steps() - before)
        return out
    monkeypatch.setattr(rollout, "run_calls", slow)
    return during


def _same(runs: dict, ref: str) -> None:
    for name, trajs in runs.items():
        for t, r in zip(trajs, runs[ref]):
            assert (t.token_ids, t.roles, t.answer, t.windows, t.draws, t.tool_failures) == \
                (r.token_ids, r.roles, r.answer, r.windows, r.draws, r.tool_failures), name
            torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
            assert [s.token_ids for s in t.subagents] == [s.token_ids for s in r.subagents], name


TOOL_S = 0.15     # a tool turn's work: shorter than the other rows' decoding, which then covers it


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_tools_run_beside_the_decoding(tiny, split, script, mode, monkeypatch, decode_steps):
    """Slow tool work (TOOL_S a turn) on the rows that call: with continuous batching the other rows decode
    meanwhile (the engine's steps go on during the tool work), the overlap of the bench clock's (bench/engines.py)
    decode_s and tool_s ((decode_s + tool_s - wall_s) / min(decode_s, tool_s)) is large, and the listener hears each
    trajectory's turns in the same order; fixed waves run the tools in the loop (no step during them, no overlap).
    The trajectories are the same either way."""
    model, processor = tiny
    root, recs = split
    during = _slow_tools(monkeypatch, TOOL_S, decode_steps)
    runs, heard, overlap, steps_during = {}, {}, {}, {}
    for name, engine in [("overlapped", schedules().Timed), ("waves", schedules().Waves)]:
        script(BUDGET_SCRIPTS, sub="A blue square.")
        during.clear()
        heard[name] = {}
        listen = lambda t, parts, h=heard[name]: h.setdefault((t.record_id, t.sample), []).append((t.turns[-1], parts))
        before = dict(schedules().STATS)
        with schedules().swapped(engine):
            runs[name] = rollout.run_agent(model, processor, recs[:3], root, config(tool_mode=mode, group_size=2),
                                           seed=SEED, on_turn=listen)
        d = {k: schedules().STATS[k] - before[k] for k in ("decode_s", "tool_s", "wall_s")}
        overlap[name] = (d["decode_s"] + d["tool_s"] - d["wall_s"]) / min(d["decode_s"], d["tool_s"])
        assert len(during) == 4                                           # 4 tool turns (BUDGET_SCRIPTS)
        assert d["tool_s"] >= TOOL_S * (1 if name == "overlapped" else 4)   # side by side, tool work counts once
        steps_during[name] = list(during)
    assert max(steps_during["overlapped"]) > 0 and max(steps_during["waves"]) == 0
    assert overlap["overlapped"] > 0.5 and overlap["waves"] < 0.1, overlap
    assert heard["overlapped"] == heard["waves"] and len(heard["waves"]) == 6
    _same(runs, "waves")


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "subagent"])
def test_overlapped_tools_exact_across_budgets_and_waves(tiny, split, script, mode, shrunk_thresholds, monkeypatch):
    """Tool work of uneven length (rows come back out of the order they left) under an unbounded budget, a budget
    of about one group (the default CPU budget shrunk), and in fixed waves: the same trajectories, log-probs and
    sub-agents; every engine returns every block; the default step records no log-probs (record_logprobs off)
    but counts its draws, and samples the same tokens."""
    model, processor = tiny
    root, recs = split
    engines, run_calls = _record_engines(monkeypatch), rollout.run_calls
    delays = iter([0.2, 0.0, 0.1, 0.05] * 20)
    monkeypatch.setattr(rollout, "run_calls", lambda *a, **kw: (time.sleep(next(delays)), run_calls(*a, **kw))[1])
    runs = {}
    for name, kw in [("unbounded", dict(memory_budget_bytes=1 << 40)), ("budget", {}), ("waves", {}),
                     ("no_logprobs", dict(record_logprobs=False))]:
        script(BUDGET_SCRIPTS, sub="A blue square.")
        first = len(engines)
        with schedules().swapped(schedules().Waves if name == "waves" else rollout.Engine):
            runs[name] = rollout.run_agent(model, processor, recs[:3], root, config(tool_mode=mode, group_size=2, **kw),
                                           seed=SEED)
        kv = engines[first].kv
        assert kv.reserved == 0 and not kv.rows and not kv.prompts and kv.pool.peak <= kv.pool.n_blocks
        assert not engines[first].away and engines[first].tools is None
    assert engines[1].kv.pool.n_blocks < engines[1].need                # the budget bit
    assert [t.n_tool_turns for t in runs["unbounded"]] == [1, 0, 0, 2, 0, 1]
    plain = runs.pop("no_logprobs")
    _same(runs, "unbounded")
    for t, r in zip(plain, runs["unbounded"]):
        assert t.logprobs == [] and t.draws == len(r.logprobs) == sum(r.roles) and t.token_ids == r.token_ids


def test_tool_responses_keep_call_order(tiny, split, script, monkeypatch, decode_steps):
    """A turn's crops decode in parallel in a DecodePool and finish in reverse call order (the first call's crop is
    the slowest): the responses, windows and clips still come in call order; the one row's engine waits on its
    tool work without spinning (a few loop turns, not one per millisecond)."""
    model, processor = tiny
    root, recs = split
    finished, crop = [], video.crop

    def slow_crop(path, start, end, **kw):
        time.sleep(0.1 * (3 - start // 10))               # calls at 10, 20, 30 s: 0.2, 0.1, 0.0 s
        finished.append(start)
        return crop(path, start, end, **kw)
    monkeypatch.setattr(video, "crop", slow_crop)
    admits, admit = [], rollout.Engine.admit
    monkeypatch.setattr(rollout.Engine, "admit", lambda self: (admits.append(1), admit(self))[1])
    body = "\n".join(call(s, s + 4.0) for s in (10.0, 20.0, 30.0))
    script({(0, 0): [turn("three", body), ANSWER]})
    with video.DecodePool(workers=3, timeout=60) as pool:
        before = decode_steps()
        [t] = rollout.run_agent(model, processor, recs[1:2], root, config(max_new_tokens=400), seed=SEED,
                                       pool=pool)
        steps = decode_steps() - before
    assert finished == [30.0, 20.0, 10.0]
    assert t.windows == [(10.0, 14.0), (20.0, 24.0), (30.0, 34.0)] and t.answer == "B"
    assert [p.split(" s:")[0] for p in responses(t.text)] == ["Clip 10.0-14.0", "Clip 20.0-24.0", "Clip 30.0-34.0"]
    assert len(admits) <= steps + 5
