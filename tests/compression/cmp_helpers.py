"""Test helpers: an in-process Exchange over threads, and a runner of real gloo ranks."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import threading
import traceback
from typing import Any, Callable

import torch

from torch_thunderbolt.transport.netif import loopback_ifname


class ThreadExchange:
    """W threads in one process play W ranks; each thread owns one ThreadExchange."""

    def __init__(self, rank: int, world_size: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._slots, self._barrier = rank, world_size, slots, barrier

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._slots[self.rank] = inp.clone()
        self._barrier.wait()
        for src in range(self.world_size):
            out[src] = self._slots[src][self.rank]
        self._barrier.wait()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._slots[self.rank] = inp.clone()
        self._barrier.wait()
        for src in range(self.world_size):
            out[src] = self._slots[src][0]
        self._barrier.wait()


def run_threads(world_size: int, fn: Callable[[ThreadExchange], Any], timeout: float = 20.0) -> list:
    """fn(exchange) on world_size threads; returns results by rank, re-raises the first error."""
    slots: list = [None] * world_size
    barrier = threading.Barrier(world_size, timeout=timeout)
    results: list = [None] * world_size
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadExchange(rank, world_size, slots, barrier))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "thread ranks hung"
    return results


def _to_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rank_main(fn, rank, world_size, init_file, backend, args, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname()  # keep gloo's traffic on loopback (lo0 on macOS)
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            # As bytes: a queued tensor would be shared by fd, which dies with this process.
            results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, tmp_path, *args, backend: str = "gloo", timeout: float = 60.0) -> list:
    """Run fn(rank, world_size, *args) in world_size spawned processes joined by a process group.
    Returns results by rank; raises AssertionError with the rank's traceback on failure; always
    terminates the processes it started."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(str(tmp_path), "pg-init")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, init_file, backend, args, results))
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} timed out") from None
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
