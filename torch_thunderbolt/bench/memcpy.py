"""Single-core memcpy bandwidth: the yardstick for shared-memory collectives, which are judged as a share of
single-core memcpy measured in the same run. Measured on rank 0 before and after the collectives, so drift
of the machine's memory bandwidth during the run shows up."""
from __future__ import annotations

import time

from .metrics import summarize

REPEATS = 9


def measure(nbytes: int, repeats: int = REPEATS) -> dict:
    """Copy an `nbytes` buffer into another with one thread; GB/s = bytes copied per second (median)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(max(1, nbytes), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of the destination pages is not part of the measurement
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            rates.append(src.numel() / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(threads)
    s = summarize(rates)
    return {"bytes": src.numel(), "threads": 1, "gbps": s.median, "gbps_min": s.minimum, "gbps_max": s.maximum}


def describe(before: dict, after: dict) -> str:
    return (f"# memcpy, 1 thread, {before['bytes']} B: {before['gbps']:.2f} GB/s before the collectives "
            f"[{before['gbps_min']:.2f}-{before['gbps_max']:.2f}], {after['gbps']:.2f} GB/s after "
            f"[{after['gbps_min']:.2f}-{after['gbps_max']:.2f}]")
