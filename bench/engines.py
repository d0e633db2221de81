"""The rollout engine as the benches measure it: rollout.Engine with a clock, and fixed waves, the baseline of its
continuous batching. Neither is used in training or evaluation.

    Timed     counts into STATS: decode steps; seconds on the engine's thread in the model (admit's prefills and the
              decode steps); seconds while tool work was in progress (jobs side by side count once); seconds in run.
              The overlap of tools and decoding: (decode_s + tool_s - wall_s) / min(decode_s, tool_s), 0 when every
              tool call stalls the batch (Waves), 1 when the shorter of the two is hidden entirely.
    Waves     Timed, in fixed waves: new groups only into an empty engine, each admitted on its whole worst case (a
              static batch cannot pause a row for memory), the tool work done in the loop itself (every row waits),
              and a turn's responses join only once every row of the batch has ended its turn.
    swapped   `with swapped(Waves):` run_agent and run_subagents build that engine (rollout.Engine replaced).

A row's tokens depend only on its seed and draw counter, so both give the plain engine's trajectories.
"""
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

from common import ROOT  # noqa: F401 (bench/common.py puts the repo on sys.path)

import rollout

STATS = {"decode_steps": 0, "decode_s": 0.0, "tool_s": 0.0, "wall_s": 0.0}


@contextmanager
def clock(key: str):
    """The seconds spent inside, added to STATS[key]."""
    t = time.perf_counter()
    try:
        yield
    finally:
        STATS[key] += time.perf_counter() - t


class Timed(rollout.Engine):
    """rollout.Engine counting into STATS (the module docstring)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.busy = [threading.Lock(), 0, 0.0]   # tool jobs running: (lock, how many, since when)

    def run(self) -> None:
        with clock("wall_s"):
            super().run()

    def admit(self) -> None:
        with clock("decode_s"):
            super().admit()

    def step(self) -> list:
        with clock("decode_s"):
            ended = super().step()
        STATS["decode_steps"] += 1
        return ended

    def send(self, r, work, then) -> None:
        super().send(r, partial(self.timed, work), then)

    def timed(self, work):
        """work(), counted in STATS["tool_s"]: the seconds while at least one tool job runs (in any thread)."""
        lock = self.busy[0]
        with lock:
            if not self.busy[1]:
                self.busy[2] = time.perf_counter()
            self.busy[1] += 1
        try:
            return work()
        finally:
            with lock:
                self.busy[1] -= 1
                if not self.busy[1]:
                    STATS["tool_s"] += time.perf_counter() - self.busy[2]


class Waves(Timed):
    """Fixed waves (the module docstring): the scheduler's hooks overridden, the rest the engine's own."""

    def send(self, r, work, then) -> None:
        job = Future()                           # the tool work here, at once: the whole batch waits for it
        job.set_result(self.timed(work))
        self.away.append((r, job, then))

    def admit(self) -> None:
        if self.active:
            return                               # nothing joins a running batch
        if not self.kv.rows:
            return super().admit()
        queued, self.queued = self.queued, deque()   # rows of this wave remain: no new group yet
        try:
            super().admit()
        finally:
            self.queued = queued

    def turn_grant(self, r, prompt_len: int, held: int, turns: int) -> int:
        return r.reserve                         # a row holds its whole worst case from the start

    def grant(self, who: tuple, blocks: int) -> bool:
        """Whole worst cases side by side, as long as they fit the pool; always into an empty engine."""
        return self.kv.reserve(blocks, force=not self.kv.reserved or blocks <= 0)

    def respond(self, r, c) -> None:
        super().respond(r, c)                    # the grant comes down to the blocks held ...
        if not r.traj.done:                      # ... and back up to the row's (tightened) worst case
            self.kv.reserve(r.reserve - r.grant, force=True)
            r.grant = r.reserve


@contextmanager
def swapped(engine: type):
    """rollout.run_agent and rollout.run_subagents build `engine` (a rollout.Engine subclass) while inside."""
    plain, rollout.Engine = rollout.Engine, engine
    try:
        yield
    finally:
        rollout.Engine = plain
