"""When a waiting rank should busy-poll instead of sleeping (shared by the tcp, shm and hybrid engines).

A cross-core wake-up costs tens of µs, more than a small message, so a waiter first spins for a short
while, yielding the CPU between looks. A yield that takes long means other runnable tasks wanted this core:
then spinning only queues us behind them, and a blocking wake-up (which the scheduler serves promptly) is
better, so the guard stops spinning for a while. The pause starts short and doubles while slow yields
keep coming: one preemption of an otherwise quiet rank (a kernel thread, the launcher) costs a few ms of
sleeping wake-ups, not half a second of them, while a core that stays contended soon stops spinning for
long stretches.
"""
from __future__ import annotations

import os
import time
from typing import Callable

SLOW_YIELD = 200e-6  # a yield that long means other runnable tasks took the core
FIRST_PAUSE = 0.005  # seconds without spinning after the first slow yield
MAX_PAUSE = 0.5      # ... doubling per slow yield in a row, up to this

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


class SpinGuard:
    """Spins `poll` for a bounded time and remembers whether the core is contended."""

    __slots__ = ("_until", "_pause", "_clock", "_yield")

    def __init__(self, clock: Callable[[], float] = time.monotonic, yield_cpu: Callable[[], None] = _yield) -> None:
        self._until = 0.0
        self._pause = FIRST_PAUSE
        self._clock = clock
        self._yield = yield_cpu

    def paused(self) -> bool:
        return self._clock() < self._until

    def spin(self, seconds: float, poll: Callable[[], bool]) -> bool:
        """Call `poll` between yields for up to `seconds`; True as soon as it returns True. False at once
        while paused, or on the first slow yield (which starts or lengthens a pause)."""
        now = self._clock()
        if seconds <= 0 or now < self._until:
            return False
        end = now + seconds
        while now < end:
            self._yield()
            after = self._clock()
            if after - now > SLOW_YIELD:
                self._until = after + self._pause
                self._pause = min(self._pause * 2, MAX_PAUSE)
                return False
            now = after
            if poll():
                self._pause = FIRST_PAUSE
                return True
        self._pause = FIRST_PAUSE  # a whole spin without contention: the core is ours again
        return False
