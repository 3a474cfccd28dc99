"""macOS's runtime behaviour, modelled for tests on Linux: what the GIL does around a ctypes call, what a
yield costs under XNU's scheduler, and IOKit's power assertions. (Sockets have their own model.)

Each model follows a source, named where it is defined, and is used with `Platform.for_system("darwin")`:
the code under test takes the platform and, where it calls into libSystem or IOKit, a lookup or library
object that a test replaces with the model.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


def releases_gil(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` drops the GIL for the call. CPython's `_ctypes/callproc.c`
    (`_call_function_pointer`) wraps a foreign call in Py_BEGIN_ALLOW_THREADS unless the function carries
    `_FUNCFLAG_PYTHONAPI` (functions of `ctypes.PyDLL` and `ctypes.pythonapi`). A Python function keeps it
    (it may switch at the interpreter's own switch points, as any Python code does)."""
    flags = getattr(fn, "_flags_", None)
    if flags is None:
        return False
    return not flags & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def with_gil_handoff(fn: Callable[[], None], busy_thread: bool = True,
                     switch_interval: float | None = None) -> Callable[[], None]:
    """`fn` as it behaves beside a Python thread that never blocks, in the worst case: where the call drops
    the GIL, that thread takes it and keeps it until the caller's next switch request, one switch interval
    (`sys.getswitchinterval()`, 5 ms by default) later. Without a busy thread, or for a call that keeps the
    GIL, `fn` itself."""
    if not busy_thread or not releases_gil(fn):
        return fn
    wait = sys.getswitchinterval() if switch_interval is None else switch_interval

    def call() -> None:
        fn()
        time.sleep(wait)

    return call


# XNU's priorities (osfmk/kern/sched.h): a user thread runs at BASEPRI_DEFAULT (31); background QoS work
# (Spotlight's indexer, Time Machine, a `nice`d build) at MAXPRI_THROTTLE (4); a depressed thread at 0.
BASEPRI_DEFAULT = 31
MAXPRI_THROTTLE = 4
QUANTUM = 0.010  # std_quantum_us (osfmk/kern/sched_prim.c): also thread_depress_time


@dataclass
class XnuCore:
    """One core as XNU's scheduler gives it to a thread that yields, with `others` (their priorities)
    runnable on it, each of which keeps the core for `burst` seconds (at most a quantum) once given it.
    `advance` lets the time pass (real sleep by default; a fake clock's for unit tests).

    - `sched_yield` is libSystem's: `swtch_pri(0)` (libpthread), which when another thread is runnable
      depresses the caller to priority 0 for a quantum (`thread_depress_abstime(thread_depress_time)`,
      osfmk/kern/syscall_subr.c): every runnable thread goes first, whatever its priority, until the
      depression times out.
    - `thread_switch(MACH_PORT_NULL, SWITCH_OPTION_NONE, 0)` blocks with AST_YIELD and no depression: only
      threads of the caller's priority or above go first.
    """

    others: list[int] = field(default_factory=list)
    priority: int = BASEPRI_DEFAULT
    burst: float = QUANTUM
    advance: Callable[[float], None] = time.sleep
    yields: list[tuple[str, float]] = field(default_factory=list)  # (which call, seconds it cost)

    def sched_yield(self) -> None:
        cost = min(QUANTUM, self.burst * len(self.others)) if self.others else 0.0
        self._spend("sched_yield", cost)

    def thread_switch(self, port: int, option: int, ms: int) -> int:
        if port != 0 or option != 0:
            raise ValueError(f"the model knows thread_switch(MACH_PORT_NULL, SWITCH_OPTION_NONE), not {port}, {option}")
        ahead = [p for p in self.others if p >= self.priority]
        self._spend("thread_switch", min(self.burst, QUANTUM) * len(ahead))
        return 0  # KERN_SUCCESS

    def lookup(self, name: str) -> Callable[..., int] | None:
        """libSystem's functions by name, as `spin.yield_for` looks them up."""
        return self.thread_switch if name == "thread_switch" else None

    def _spend(self, call: str, seconds: float) -> None:
        self.yields.append((call, seconds))
        if seconds:
            self.advance(seconds)


K_IORETURN_BAD_ARGUMENT = -536870206  # kIOReturnBadArgument (0xE00002C2) as the int32 IOReturn


class FakeIOKit:
    """IOKit's and CoreFoundation's power-assertion functions as `backend.keep_awake` calls them, recording
    each call. A CFString is an integer handle to a Python string here; `live` holds the assertions taken
    and not yet released (as `pmset -g assertions` would list them), `strings` the CFStrings not yet
    released. `create_error`: what IOPMAssertionCreateWithName returns (0: success)."""

    def __init__(self, create_error: int = 0) -> None:
        self.calls: list[tuple] = []
        self.live: dict[int, tuple[str, int, str]] = {}
        self.strings: dict[int, str] = {}
        self.create_error = create_error
        self._next = 0x100

    def libraries(self) -> tuple["FakeIOKit", "FakeIOKit"]:
        """(IOKit, CoreFoundation), as `KeepAwake`'s `libraries` returns them."""
        return self, self

    def _handle(self) -> int:
        self._next += 1
        return self._next

    # CoreFoundation
    def CFStringCreateWithCString(self, allocator: Any, text: bytes, encoding: int) -> int:  # noqa: N802
        handle = self._handle()
        self.strings[handle] = text.decode()
        return handle

    def CFRelease(self, handle: int) -> None:  # noqa: N802
        if handle not in self.strings:
            raise AssertionError(f"CFRelease of {handle:#x}, which is not a live CFString")
        del self.strings[handle]

    # IOKit
    def IOPMAssertionCreateWithName(self, kind: int, level: int, name: int, out: Any) -> int:  # noqa: N802
        self.calls.append(("create", self.strings[kind], level, self.strings[name]))
        if self.create_error:
            return self.create_error
        assertion = self._handle()
        self.live[assertion] = (self.strings[kind], level, self.strings[name])
        out.contents.value = assertion
        return 0

    def IOPMAssertionRelease(self, assertion: int) -> int:  # noqa: N802
        self.calls.append(("release", assertion))
        return 0 if self.live.pop(assertion, None) is not None else K_IORETURN_BAD_ARGUMENT


# -- the fence call's cost (python -m torch_thunderbolt.testing.darwin_runtime) -----------------------------
def libc_call(kind: type) -> Callable[[], None]:
    fn = kind(None).getpid  # takes nothing, does (almost) nothing: the shape of OSMemoryBarrier
    fn.restype, fn.argtypes = None, []
    return fn


def per_call_ns(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e9


def beside_busy_thread(fn: Callable[[], None], seconds: float) -> tuple[float, float]:
    """(calls a second, share of the time in steps that waited over 1 ms)."""
    clock = time.perf_counter
    end = clock() + seconds
    calls, waited = 0, 0.0
    while True:
        a = clock()
        fn()
        b = clock()
        calls += 1
        if b - a > 1e-3:
            waited += b - a
        if b > end:
            return calls / seconds, waited / seconds


def main() -> None:
    """What keeping the GIL costs a fence call: a libc function that does no work, called through ctypes.CDLL
    (drops the GIL for the call) and through ctypes.PyDLL (keeps it), as `transport/ordering.py` argues.
    Prints medians of interleaved repeats: one call of each kind (and an empty Python function) alone; then,
    beside one Python thread that never blocks, calls a second and the share of time in steps that waited
    over 1 ms for the GIL."""
    ap = argparse.ArgumentParser(prog="python -m torch_thunderbolt.testing.darwin_runtime",
                                 description=main.__doc__)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--calls", type=int, default=20_000)
    args = ap.parse_args()
    kinds = {"CDLL": libc_call(ctypes.CDLL), "PyDLL": libc_call(ctypes.PyDLL), "empty Python": lambda: None}
    alone: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for name, fn in kinds.items():
            alone[name].append(per_call_ns(fn, args.calls))
    for name, values in alone.items():
        print(f"alone, {name}: {statistics.median(values):.0f} ns a call (min {min(values):.0f})")

    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        busy_runs: dict[str, list[tuple[float, float]]] = {"CDLL": [], "PyDLL": []}
        for _ in range(5):
            for name in busy_runs:
                busy_runs[name].append(beside_busy_thread(kinds[name], 0.3))
    finally:
        stop.set()
        thread.join()
    for name, runs in busy_runs.items():
        print(f"beside a busy thread, {name}: {statistics.median(r[0] for r in runs):.0f} calls a second, "
              f"{100 * statistics.median(r[1] for r in runs):.0f} % of the time in steps that waited > 1 ms")


if __name__ == "__main__":
    main()
