#!/usr/bin/env python3
"""What keeping the GIL costs a fence call: a libc function that does no work, called through ctypes.CDLL
(drops the GIL for the call) and through ctypes.PyDLL (keeps it), as `transport/ordering.py` argues.

    python scripts/fence_call_cost.py [--repeats 21]

Prints, as medians of interleaved repeats: the cost of one call of each kind (and of an empty Python
function) with nothing else running; then, beside one Python thread that never blocks, the calls a
second each kind makes and the share of the loop's time spent in steps that waited over 1 ms for the GIL.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from typing import Callable


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
