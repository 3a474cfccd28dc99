"""When a waiting rank should busy-poll instead of sleeping (the engine's `SpinGuard`, for every kind of link).

A cross-core wake-up costs tens of µs, more than a small message, so a waiter first spins for a short
while, yielding the CPU between looks. A yield that takes long means other runnable tasks wanted this core:
that spin ends at once (the waiter sleeps, and the scheduler serves its wake-up promptly). Only a core that
stays contended, spin after spin, makes the guard stop spinning for a while: a pause that starts short and
doubles while the contention lasts. A single slow yield is common and says little: another library's I/O
thread (gloo's, between our ops) or the launcher briefly taking the core. Pausing on it would turn the
spin off for the very ops that follow: a flat half-second pause after one slow yield puts a 4 KB
ping-pong over shared memory at 90 µs instead of 22 after each gloo op in the bench.
"""
from __future__ import annotations

import os
import time
from typing import Callable

SLOW_YIELD = 200e-6  # a yield that long means other runnable tasks took the core
CONTENDED_SPINS = 3  # spins in a row cut short by a slow yield before spinning pauses
FIRST_PAUSE = 0.005  # seconds of that first pause
MAX_PAUSE = 0.5      # ... doubling per further contended spin, up to this

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


class SpinGuard:
    """Spins `poll` for a bounded time and remembers whether the core is contended."""

    __slots__ = ("_until", "_pause", "_contended", "_clock", "_yield")

    def __init__(self, clock: Callable[[], float] = time.monotonic, yield_cpu: Callable[[], None] = _yield) -> None:
        self._until = 0.0
        self._pause = FIRST_PAUSE
        self._contended = 0  # spins in a row that a slow yield cut short
        self._clock = clock
        self._yield = yield_cpu

    def paused(self) -> bool:
        return self._clock() < self._until

    def spin(self, seconds: float, poll: Callable[[], bool]) -> bool:
        """Call `poll` between yields for up to `seconds`; True as soon as it returns True. False at once
        while paused, and on a slow yield (which may start or lengthen a pause)."""
        now = self._clock()
        if seconds <= 0 or now < self._until:
            return False
        end = now + seconds
        while now < end:
            self._yield()
            after = self._clock()
            if after - now > SLOW_YIELD:
                self._contended += 1
                if self._contended >= CONTENDED_SPINS:
                    self._until = after + self._pause
                    self._pause = min(self._pause * 2, MAX_PAUSE)
                return False
            now = after
            if poll():
                self._calm()
                return True
        self._calm()
        return False

    def _calm(self) -> None:
        """A spin without a slow yield: the core is ours again."""
        self._contended = 0
        self._pause = FIRST_PAUSE
