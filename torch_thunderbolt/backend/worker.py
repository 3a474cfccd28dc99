"""One worker thread per group runs collectives in issue order, so async ops overlap the caller's compute.

Small ops issued while the worker is idle run inline in the caller's thread: two thread hand-offs cost
more than a 4 KB all_reduce itself on a machine whose cross-core wake-up is ~40 µs.

An op on device tensors (mps) reaches the worker as the CPU op on host copies: the worker never touches a
device tensor, nor completes a device op's future (device.py).
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Callable

from ..transport.base import CountedCondition
from .work import Work


class Worker:
    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = CountedCondition(self._lock)  # signalled whenever _busy drops to 0
        self._busy = 0  # ops queued or running
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopped = False

    def submit(self, work: Work, fn: Callable[[], None], inline_ok: bool = False) -> Work:
        if inline_ok:
            ran, exc = self.run_if_idle(fn)
            if ran:
                work.finish(exc)
                return work
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._name}: the process group has been shut down")
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._q.put((work, fn))
        return work

    def run_if_idle(self, fn: Callable[..., None], *args: object) -> tuple[bool, BaseException | None]:
        """Run `fn(*args)` in the caller's thread if no op is queued or running: (whether it ran, the error
        it raised). The small all_reduce calls this itself, with no closure, and builds the finished work
        after it (`Work.completed`); `submit` calls it for every op that may run inline."""
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._name}: the process group has been shut down")
            if self._busy:
                return False, None
            self._busy = 1
        exc: BaseException | None = None
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - delivered through the work
            exc = e
        self._done()
        return True, exc

    def _run(self, work: Work, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - delivered through the work
            self._done()
            work.finish(exc)
            return
        self._done()
        work.finish()

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1
            if not self._busy:
                self._idle.signal()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            # The issuing thread is usually still returning from the call that queued this op (an op on
            # device tensors has just copied its inputs out). Where cores are fewer than busy threads, the
            # freshly woken worker would take the core from it and the caller's "async" call would return
            # late: let it go first. One system call, immediate where nothing else waits for the core.
            os.sched_yield()
            self._run(*item)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._q.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)
