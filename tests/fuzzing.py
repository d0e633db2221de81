"""The reward parsers' fuzzer (tests/test_fuzz.py): seeded random and mutated model outputs, and each parser's
range check.

A seeded generator builds valid agent trajectories (both tool-call syntaxes, parallel calls, tool responses,
mcq/oe/tvg answers), then mutates them: truncation, dropped or duplicated spans, splices of two trajectories,
inserted and nested tags, JSON with wrong types, huge numbers (1e400, 5000-digit ints), NaN/Infinity, deep
nesting, unicode, and rare 1 MB strings. Every parser must return, never raise, and stay in its documented
range (`check_all`). Not collected by pytest (no test_ prefix): a helper module, imported as `fuzzing`.
"""
import math
import random

from rewards import (ANCHOR_WEIGHT, DATA_TYPES, ToolCall, call_window, extract_answer, extract_letter, extract_time_range,
                     format_anchor, format_compliant, format_reward, grounding_format_reward, parse_tool_calls,
                     paravt_reward, vtgr_reward)

TARGETS = {"mcq": "B", "oe": "a red car", "tvg": [10.0, 20.0]}
UNICODE = "é答案🎬\u200b\u202e\U0001f600ß Ω ١٢٣ \ud800"          # accents, CJK, emoji, zero-width, RTL, lone surrogate
JSON_VALUES = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" * 5000, "true", "null", '"12"', "[]", "{}",
               "[1, 2]", "0", "3.5", "-2", '"\\ud800"', '"' + UNICODE + '"', "[" * 200 + "]" * 200]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<grounding>", "</grounding>", "<answer>",
        "</answer>", "<tool_response>", "</tool_response>", "<|im_start|>", "<|im_end|>", "<|im_start|>assistant\n"]


def _call(rng: random.Random) -> str:
    """One call block: valid or with wrong types / torture values, in either syntax."""
    s, e = (rng.choice(JSON_VALUES) if rng.random() < 0.3 else f"{rng.uniform(0, 100):.1f}" for _ in range(2))
    level = rng.choice(['"coarse"', '"medium"', '"fine"', '"ultra"', "3", "null"])
    if rng.random() < 0.3:
        return f'<grounding>{{"temporal_segment": [{s}, {e}], "sampling_strategy": {level}}}</grounding>'
    body = rng.choice([f'{{"name": "crop_video", "arguments": {{"start_time": {s}, "end_time": {e}, "resolution": {level}}}}}',
                       f'{{"name": "crop_video", "arguments": {{"start_time": {s}, "end_time": {e}}}}}',
                       f'{{"name": {rng.choice(JSON_VALUES)}, "arguments": {rng.choice(JSON_VALUES)}}}',
                       rng.choice(JSON_VALUES), "{not json", "", '{"name": "search", "arguments": {}}'])
    return f"<tool_call>\n{body}\n</tool_call>"


def _answer(rng: random.Random) -> str:
    return rng.choice(["B", "(C)", "The answer is A", "Option D", "B. a red car", "a red car", "[12.5, 20.0]",
                       "The event happens in the 20.0 - 12.5 seconds", "1:05 to 1:30", UNICODE, ""])


def trajectory(rng: random.Random) -> str:
    """A well-formed trajectory text: 0-3 tool turns (1-3 parallel calls each), then an answer turn."""
    parts = []
    for _ in range(rng.randint(0, 3)):
        calls = "\n".join(_call(rng) for _ in range(rng.randint(1, 3)))
        responses = "\n".join("<tool_response>\nA clip of a red car.\n</tool_response>" for _ in range(rng.randint(1, 3)))
        parts.append(f"<think>\nI should crop the part with the car.\n</think>\n{calls}<|im_end|>\n"
                     f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n")
    parts.append(f"<think>\nThe crop shows the car.\n</think>\n<answer>{_answer(rng)}</answer><|im_end|>")
    return "".join(parts)


def _mutate(text: str, rng: random.Random) -> str:
    i, j = sorted(rng.randint(0, len(text)) for _ in range(2))
    kind = rng.randrange(6)
    if kind == 0:
        return text[:j]                                                  # truncated mid-tag or mid-JSON
    if kind == 1:
        return text[:i] + text[j:]                                       # a span dropped
    if kind == 2:
        return text[:j] + text[i:]                                       # a span duplicated
    if kind == 3:
        return text[:i] + rng.choice(TAGS) + text[i:]                    # a stray or nested tag
    if kind == 4:
        other = trajectory(rng)
        return text[:i] + other[rng.randint(0, len(other)):]             # splice of two trajectories
    return text[:i] + "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 20))) + text[i:]


def huge(rng: random.Random, size: int = 1 << 20) -> str:
    """A ~1 MB pathological string (repeated openers, digits, keywords, one giant JSON body...)."""
    unit = rng.choice(["<tool_call>", "<think>", "</think>", "<answer>", "1", "1:", "1 - ", "answer is ", "<|",
                       "<grounding>{", "[", " ", "(", "é", "<tool_call>{\"name\": \"crop_video\"}</tool_call>"])
    body = unit * (size // len(unit))
    if rng.random() < 0.3:
        body = "<tool_call>" + body + "</tool_call>"                      # one enormous block
    return body


def random_output(rng: random.Random) -> str:
    """One fuzz input: random text, a (mutated) trajectory, or rarely a 1 MB string."""
    r = rng.random()
    if r < 0.002:
        return huge(rng)
    if r < 0.15:
        alphabet = "".join(TAGS) + UNICODE + "{}[]\":,0123456789.-e \n"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
    text = trajectory(rng)
    for _ in range(rng.choice([0, 1, 1, 2, 4])):
        text = _mutate(text, rng)
    return text


def split_turns(text: str) -> list[str]:
    """Assistant turns of a trajectory text: chunks after each `<|im_start|>assistant`, cut at the next user message."""
    return [chunk.split("<|im_start|>user", 1)[0] for chunk in text.split("<|im_start|>assistant\n")]


def _in(x, lo: float, hi: float, what: str) -> None:
    assert isinstance(x, float) and math.isfinite(x) and lo - 1e-9 <= x <= hi + 1e-9, f"{what} = {x!r} not in [{lo}, {hi}]"


def _check_calls(calls) -> None:
    assert isinstance(calls, list) and all(isinstance(c, ToolCall) for c in calls)
    for c in calls:
        w = call_window(c)
        assert w is None or all(math.isfinite(x) for x in w), c
        assert (c.error is None) or isinstance(c.error, str)


def _task(text: str) -> str:
    return list(TARGETS)[len(text) % 3]                       # varies the task with the input, one call each


def _paravt(text: str) -> tuple:
    return paravt_reward(text, TARGETS[_task(text)], _task(text), ANCHOR_WEIGHT)


def _check_paravt(result) -> None:
    total, parts = result
    _in(total, -0.15, 2.8, "paravt_reward")
    assert set(parts) == {"acc", "format", "anchor", "tool", "degenerate"}, parts


def _vtgr(text: str) -> tuple:
    task, turns = _task(text), split_turns(text)
    windows = [w for w in map(call_window, parse_tool_calls(text)) if w is not None]
    data_type = "grounding" if task == "tvg" else DATA_TYPES[len(text) % 4]
    clues = [[10.0, 20.0], [40.0, 45.0]][: 1 + (data_type == "multi_clue")]
    return vtgr_reward(turns, text, TARGETS[task], task, data_type, windows, clues, len(turns) - 1)


def _check_vtgr(result) -> None:
    total, parts = result
    _in(total, 0.0, 3.0, "vtgr_reward")
    for key in ("acc", "format", "tool", "clue"):
        _in(parts[key], 0.0, 1.0, f"vtgr_reward.{key}")


def _check_range(r) -> None:
    assert r is None or (r[0] <= r[1] and all(isinstance(x, float) and math.isfinite(x) for x in r)), r


def _check_optional_str(r) -> None:
    assert r is None or isinstance(r, str), r


def _check_letter(r) -> None:
    assert r is None or (isinstance(r, str) and len(r) == 1 and r in "ABCDEFGHIJ"), r


def _check_bool(r) -> None:
    assert isinstance(r, bool), r


# parser name -> (call on the text, check of the result); each check raises AssertionError when out of range
CHECKS = {
    "parse_tool_calls": (parse_tool_calls, _check_calls),
    "extract_answer": (extract_answer, _check_optional_str),
    "extract_letter": (lambda t: extract_letter(extract_answer(t)), _check_letter),
    "extract_time_range": (extract_time_range, _check_range),
    "format_reward": (lambda t: format_reward(t, ANCHOR_WEIGHT), lambda r: _in(r, -0.15, 1.0, "format_reward")),
    "format_anchor": (format_anchor, lambda r: _in(r, -0.3, 0.7, "format_anchor")),
    "format_compliant": (format_compliant, _check_bool),
    "grounding_format_reward": (lambda t: grounding_format_reward(split_turns(t)),
                                lambda r: _in(r, 0.0, 1.0, "grounding_format_reward")),
    "paravt_reward": (_paravt, _check_paravt),
    "vtgr_reward": (_vtgr, _check_vtgr),
}


def check_all(text: str) -> None:
    """Run every parser on `text` and check its result; an AssertionError names the parser and the input."""
    for name, (call, check) in CHECKS.items():
        try:
            check(call(text))
        except AssertionError as e:
            raise AssertionError(f"{name} on input {text[:200]!r} (len {len(text)}): {e}") from None


def fuzz(n: int, seed: int = 0) -> int:
    """Check n seeded random inputs (random_output); returns the number checked."""
    rng = random.Random(seed)
    for _ in range(n):
        check_all(random_output(rng))
    return n
