"""One worker thread per group runs collectives in issue order, so async ops overlap the caller's compute.

An op may instead run inline, in the caller's thread, when no earlier op is queued or running: a small op
(two thread hand-offs cost more than a 4 KB all_reduce itself on a machine whose cross-core wake-up is
~40 µs), or one the caller waits for at once. Both ways take the group's *turn* (one lock): the caller holds
it for its one op; the worker thread takes it for as long as it has ops queued, and gives it back once its
queue is empty. So an inline op costs one non-blocking lock acquisition, and ops stay in issue order.

An op on device tensors (mps) reaches the worker as the CPU op on host copies: the worker never touches a
device tensor, nor completes a device op's future (device.py).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from ..transport import spin
from .work import Work


class Worker:
    def __init__(self, name: str, yield_cpu: spin.Yield | None = None) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending, _thread and _stopped
        self._turn = threading.Lock()  # held while one of this group's ops runs (inline, or the worker's)
        self._pending = 0  # ops queued on the worker thread or running there
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._yield = yield_cpu or spin.yield_cpu  # (tests pass a scheduler model's)

    def try_inline(self) -> bool:
        """Take the group's turn to run one op in the caller's thread, if no op is queued or running: True
        then, and the caller must call `end_inline` after its op; False: queue it instead (`submit`)."""
        if self._stopped:
            raise RuntimeError(f"{self._name}: the process group has been shut down")
        if not self._turn.acquire(False):
            return False
        if self._pending:  # queued, and the worker thread has not taken the turn yet: it goes first
            self._turn.release()
            return False
        return True

    def end_inline(self) -> None:
        self._turn.release()

    def submit(self, work: Work, fn: Callable[[], None], inline_ok: bool = False) -> Work:
        if inline_ok and self.try_inline():
            exc: BaseException | None = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - delivered through the work
                exc = e
            finally:
                self._turn.release()
            work.finish(exc)
            return work
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._name}: the process group has been shut down")
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._q.put((work, fn))
        return work

    def _loop(self) -> None:
        turn = False  # this thread holds the group's turn
        while True:
            item = self._q.get()
            if item is None:
                if turn:
                    self._turn.release()
                return
            if not turn:
                self._turn.acquire()  # an inline op of another thread may be running: it finishes first
                turn = True
            # The issuing thread is usually still returning from the call that queued this op (an op on
            # device tensors has just copied its inputs out). Where cores are fewer than busy threads, the
            # freshly woken worker would take the core from it and the caller's "async" call would return
            # late: let it go first. One system call, immediate where nothing else waits for the core; a
            # yield that does not depress this thread's priority (spin.py), or it would wait behind
            # every runnable thread for a quantum on macOS.
            self._yield()
            work, fn = item
            exc: BaseException | None = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - delivered through the work
                exc = e
            with self._lock:
                self._pending -= 1
                if not self._pending:  # (given back under the lock: an inline op sees no queue and the turn)
                    self._turn.release()
                    turn = False
            work.finish(exc)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._q.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)
