"""When a waiting rank should busy-poll instead of sleeping (the engine's `SpinGuard`, for every kind of link).

A cross-core wake-up costs tens of µs, more than a small message, so a waiter first spins for a short
while, yielding the CPU between looks. A yield that takes long means other runnable tasks wanted this core:
that spin ends at once (the waiter sleeps, and the scheduler serves its wake-up promptly). Only a core that
stays contended, spin after spin, makes the guard stop spinning for a while: a pause that starts short and
doubles while the contention lasts. A single slow yield is common and says little: another library's I/O
thread (gloo's, between our ops) or the launcher briefly taking the core. Pausing on it would turn the
spin off for the very ops that follow: a flat half-second pause after one slow yield puts a 4 KB
ping-pong over shared memory at 90 µs instead of 22 after each gloo op in the bench.

The yield itself (`yield_for`): Linux's `sched_yield`. macOS's `sched_yield` is the Mach trap
`swtch_pri(0)` (libpthread), which on a core with other runnable threads first *depresses* the caller to
priority 0 for one quantum (`thread_depress_abstime(thread_depress_time)`, osfmk/kern/syscall_subr.c;
about 10 ms): the caller then waits behind every runnable thread, background ones included, until they
block or the quantum ends. So there the yield is `thread_switch(MACH_PORT_NULL, SWITCH_OPTION_NONE, 0)`,
the same trap without the depression: the caller goes to the back of its own priority's queue, as a
Linux yield does. `time.sleep(0)` is no substitute: CPython sleeps through `select` (3.11) or `nanosleep`
(3.12+) there, neither of which XNU defines as giving the core to another thread. The call goes through
`ctypes.CDLL`, which drops the GIL for it as `os.sched_yield` does, since a yield that kept it would keep
this process's other Python threads from running in the time it gives them.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
from typing import Callable

from ..platform import Platform, current

SLOW_YIELD = 200e-6  # a yield that long means other runnable tasks took the core
CONTENDED_SPINS = 3  # spins in a row cut short by a slow yield before spinning pauses
FIRST_PAUSE = 0.005  # seconds of that first pause
MAX_PAUSE = 0.5      # ... doubling per further contended spin, up to this

MACH_PORT_NULL = 0
SWITCH_OPTION_NONE = 0  # mach/thread_switch.h: yield, neither depressing the caller nor waiting

Yield = Callable[[], None]
Lookup = Callable[[str], "Callable[..., int] | None"]


def _mach_trap(name: str) -> Callable[..., int] | None:
    """libSystem's `thread_switch(mach_port_name_t, int option, mach_msg_timeout_t)`, or None."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_uint32, ctypes.c_int, ctypes.c_uint32]
    return fn


def yield_for(plat: Platform | None = None, lookup: Lookup = _mach_trap) -> Yield:
    """The yield of `plat` between a spin's looks (see the module docstring): on macOS `thread_switch`
    without depression (looked up with `lookup`, for tests), elsewhere `os.sched_yield`."""
    plat = plat or current()
    if plat.name == "darwin":
        switch = lookup("thread_switch")
        if switch is not None:
            return functools.partial(switch, MACH_PORT_NULL, SWITCH_OPTION_NONE, 0)
    return getattr(os, "sched_yield", lambda: time.sleep(0))


yield_cpu: Yield = yield_for()  # chosen once; each engine and worker calls it


class SpinGuard:
    """Spins `poll` for a bounded time and remembers whether the core is contended."""

    __slots__ = ("_until", "_pause", "_contended", "_clock", "_yield")

    def __init__(self, clock: Callable[[], float] = time.monotonic, yield_cpu: Callable[[], None] = yield_cpu) -> None:
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
                self.slow(after)
                return False
            now = after
            if poll():
                self.calm()
                return True
        self.calm()
        return False

    def slow(self, now: float) -> None:
        """A yield took longer than SLOW_YIELD (ending at `now`): one more contended spin, which may start or
        lengthen a pause. For a caller running its own spin loop (the engine's take)."""
        self._contended += 1
        if self._contended >= CONTENDED_SPINS:
            self._until = now + self._pause
            self._pause = min(self._pause * 2, MAX_PAUSE)

    def calm(self) -> None:
        """A spin without a slow yield: the core is ours again."""
        self._contended = 0
        self._pause = FIRST_PAUSE
