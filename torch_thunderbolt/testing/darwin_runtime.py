"""macOS's runtime behaviour, modelled for tests on Linux: what the GIL does around a ctypes call, what a
yield costs under XNU's scheduler, and IOKit's power assertions. (Sockets have their own model.)

Each model follows a source, named where it is defined, and is used with `Platform.for_system("darwin")`:
the code under test takes the platform and, where it calls into libSystem or IOKit, a lookup or library
object that a test replaces with the model.
"""
from __future__ import annotations

import ctypes
import sys
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
