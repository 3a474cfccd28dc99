"""Run one function per rank on threads over the in-memory transport (the fast test tier)."""
from __future__ import annotations

import threading
from typing import Any, Callable

from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.config import Config
from torch_thunderbolt.transport.memory import MemoryHub


def run_world(world: int, fn: Callable[[Communicator], Any], cfg: Config | None = None,
              timeout: float = 60.0, comm_timeout: float = 30.0, window_bytes: int = 0) -> list[Any]:
    """fn(comm) on every rank; returns the per-rank results or re-raises the first rank's exception.
    `window_bytes` > 0: the ranks share a window, so all_reduce and broadcast take the windowed path."""
    hub = MemoryHub(world, window_bytes)
    cfg = cfg or Config()
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(Communicator(hub.transports[rank], cfg, timeout=comm_timeout))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc
            hub.kill(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a rank thread hung")
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def all_reduce_on_threads(transports: dict, make: Callable[[int], "torch.Tensor"],
                          timeout: float = 30.0) -> dict:
    """One all_reduce of make(rank) on each transport of an already-connected group, one thread per rank;
    returns {rank: result} for the ranks that finished within `timeout`."""
    results: dict = {}

    def run(r: int) -> None:
        x = make(r)
        Communicator(transports[r], Config(), timeout=20).all_reduce(x)
        results[r] = x

    threads = [threading.Thread(target=run, args=(r,)) for r in sorted(transports)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results
