"""Fuzz the reward parsers: random and mutated model outputs never raise and stay in range.

    python -m pytest tests/test_fuzz.py -q            # 2,000 seeded cases
    python -m pytest tests/test_fuzz.py -q -m soak    # 100,000 cases (a soak test, not in CI)

The generator and the per-parser range checks live in tests/fuzzing.py.
"""
import random
import time

import pytest

from fuzzing import CHECKS, check_all, fuzz, huge, random_output, trajectory


@pytest.mark.parametrize("n", [
    pytest.param(2_000, marks=pytest.mark.slow),    # the default count: seconds
    pytest.param(100_000, marks=pytest.mark.soak),  # the full count (docs/experiments.md's figure)
])
def test_fuzz_never_raises_and_stays_in_range(n):
    assert fuzz(n, seed=0) == n                # raises AssertionError naming the parser and the input


def test_generator_is_seeded_and_covers_its_kinds():
    rng_a, rng_b = random.Random(7), random.Random(7)
    texts = [random_output(rng_a) for _ in range(300)]
    assert texts == [random_output(rng_b) for _ in range(300)]                 # same seed, same inputs
    assert any("<tool_call>" in t for t in texts) and any("<grounding>" in t for t in texts)
    assert any(t.endswith("<|im_end|>") for t in texts) and any(not t.endswith("<|im_end|>") for t in texts)


MB = 1 << 20


@pytest.mark.parametrize("text", [
    "<tool_call>" * (MB // 11),                           # a million openers, no closer: one unclosed call
    "<tool_call>{}</tool_call>" * (MB // 25),             # ~40k calls, each a JSON object without a name
    "<think>" * (MB // 7) + "</think>" * (MB // 8),       # think scans and rfind-based suffix logic
    "<answer>" * (MB // 8),                               # answer openers, never closed
    "1" * MB,                                             # one 1 MB number: no quadratic backtracking
    "1:" * (MB // 2),                                     # colon-separated digits for the m:ss parser
    "1 " * (MB // 2),                                     # half a million numbers, no range
    "1" + " " * MB,                                       # a number then 1 MB of spaces (adjacent \s* trap)
    "answer is " * (MB // 10),                            # keyword hits for the letter regex
    "<|" * (MB // 2),                                     # half chat markers
    "<tool_call>" + "[" * MB + "</tool_call>",            # deep JSON nesting inside one block
    "<tool_call>" + " " * MB + "</tool_call>",            # one enormous block of whitespace
])
def test_one_megabyte_inputs_are_linear(text):
    """Guard against algorithmic blow-ups (catastrophic regex, quadratic scans): each parser handles
    a 1 MB pathological input in well under a second of CPU time (process time, so that other jobs
    on the machine do not count). Linear code takes < 0.4 s here; a quadratic scan takes minutes."""
    for name, (call, check) in CHECKS.items():
        t0 = time.process_time()
        check(call(text))
        assert time.process_time() - t0 < 1.0, f"{name} took > 1 s of CPU on 1 MB starting {text[:30]!r}"


def test_huge_and_spliced_inputs():
    rng = random.Random(3)
    for _ in range(3):
        check_all(huge(rng))                   # random 1 MB strings from the generator
    for _ in range(200):
        a, b = trajectory(rng), trajectory(rng)
        check_all(a[: rng.randint(0, len(a))] + b[rng.randint(0, len(b)):])  # splice of two trajectories
