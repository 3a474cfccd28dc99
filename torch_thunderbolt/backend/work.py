"""Work objects handed back to torch: wait / get_future / is_completed, errors propagated faithfully.

Facts this relies on (torch 2.13): C++ callers (DDP) only reach `wait` and `get_future`; a zero timedelta
passed to `wait` means "no timeout"; an exception set with `Future.set_exception` from Python looks like
success to C++, so the future we hand out is chained with `.then` and *raises* inside the callback.
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout


class Work(dist._Work):
    # Defaults as class attributes, set on the instance only when they change: a small op builds one Work,
    # and each attribute set on this pybind subclass costs about as much as the op's own steps.
    _event: threading.Event | None = None  # made only for a waiter that must sleep (an Event costs ~2 µs)
    _exc: BaseException | None = None
    _source = -1
    # Touches a tensor on another device (mps, cuda): completed, and its future's callbacks run, only in
    # a thread that issued or waits on it (collectives: device.DeviceWork; a p2p work: its waiter).
    device = False
    # p2p works make progress themselves when waited on. The work is passed in rather than captured, so
    # a finished work is freed by reference counting: a cycle (work -> closure -> work) would keep its
    # buffers alive until the garbage collector runs, and make it run every few dozen ops (a 4 KB
    # ping-pong's p90 was 89-102 µs with the cycle, 62 µs with the collector off).
    _wait_fn: "Callable[[Work, float | None], None] | None" = None
    # Futures are made on demand: most works are only waited on, and a Future costs tens of µs.
    _raw: torch.futures.Future | None = None
    _fut: torch.futures.Future | None = None

    def __init__(self, what: str, result: Any = None,
                 wait_fn: "Callable[[Work, float | None], None] | None" = None) -> None:
        super().__init__()
        self.what = what
        self._result = result if result is not None else []
        self._lock = threading.Lock()
        self._finished = False
        if wait_fn is not None:
            self._wait_fn = wait_fn

    @classmethod
    def completed(cls, what: str, result: Any, exc: BaseException | None = None) -> "Work":
        """A work whose op already ran (inline, in the caller's thread), finished with `exc` (None:
        success). Nobody else holds it yet, so it needs none of `finish`'s locking."""
        work = cls(what, result)
        work._finished = True
        if exc is not None:
            work._exc = exc
        return work

    # -- completion (from the worker thread or a waiter) ------------------------------------------------
    def finish(self, exc: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._exc = exc
            # The future first, then waiters: a waiter may tear the group down right after waking.
            if self._raw is not None:
                self._raw.set_result(self._result)
            self._finished = True
            if self._event is not None:
                self._event.set()

    def _sleep_until_finished(self, seconds: float | None) -> bool:
        with self._lock:
            if self._finished:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(seconds)

    def _unwrap(self, fut: torch.futures.Future) -> Any:
        if self._exc is not None:
            raise self._exc
        return fut.value()

    # -- torch's Work API ----------------------------------------------------------------------------------
    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._finished and self._exc is None:  # every blocking small op: torch waits on a finished work
            return True
        seconds = None
        if timeout is not None and timeout.total_seconds() > 0:
            seconds = timeout.total_seconds()
        if self._wait_fn is not None and not self._finished:
            try:
                self._wait_fn(self, seconds)
            except CollectiveTimeout:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to torch via the future as well
                self.finish(exc)
        if not self._finished and not self._sleep_until_finished(seconds):
            raise CollectiveTimeout(f"{self.what}: Timed out after {seconds:.1f}s waiting for it to finish")
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._raw = torch.futures.Future()
                self._fut = self._raw.then(self._unwrap)
                if self._finished:
                    self._raw.set_result(self._result)
                elif self._wait_fn is not None and not self.device:
                    # p2p works progress when waited on; a future alone must complete by itself too
                    threading.Thread(target=self._complete, name="tb-p2p-complete", daemon=True).start()
        if self.device and not self._finished:
            self._complete()  # device results are copied back in this thread, never in one of ours
        return self._fut

    def _complete(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - the error reaches the future through finish()
            self.finish(exc)

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        self.wait()


class WaitedWork(Work):
    """The work of a group's blocking calls (torch's `async_op=False`) that succeeded in the caller's thread.
    torch waits on it at once and drops it, so one per group serves them all: making a Work costs a small
    blocking op about 1 µs, a tenth of it. `result()` and a future hold the last such op's tensors."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self._finished = True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()  # a new one each time: the result changes
        fut.set_result(self._result)
        return fut
