"""The shared window of a shm group: where it sits in each rank's segment, and how ranks wait on it.

Layout, after the rings (`shm_ring.rings_end`): a 4096-byte control block with the progress counter at
byte 0 and the op words at byte 64 (a cache line of their own), then BUFFERS buffers of `nbytes`.

Waiting goes through the group's progress engine (`Transport.progress` with `until`): it spins
briefly, then sleeps in poll() on the doorbell sockets with its "sleeping" flag set; a rank that posts a
counter rings the bell of every sleeper. So a window wait keeps the rings moving (point-to-point traffic
of other threads), notices a dead peer (EOF on its socket) and an ABORT, exactly like a receive.
"""
from __future__ import annotations

from contextlib import suppress
from typing import Any, Callable

from ..errors import MismatchError
from ..protocol.signature import describe_sig
from . import shm_ring as ring
from .engine import Transport
from .window import BUFFERS, Window

CTL_BYTES = 4096
WORDS_OFFSET = 64


def area_bytes(nbytes: int) -> int:
    """Bytes a window of `nbytes` per buffer adds to each rank's segment (0: no window)."""
    return CTL_BYTES + BUFFERS * nbytes if nbytes > 0 else 0


class ShmWindow(Window):
    def __init__(self, engine: Transport, links: Any, areas: dict[int, memoryview], nbytes: int) -> None:
        """`links`: the engine's shared-memory links (shm.ShmLinks: wake_sleepers, parked_collective)."""
        super().__init__(engine.rank, engine.world, nbytes)
        self._t = engine
        self._links = links
        self._ctr = {p: mv[:8].cast("Q") for p, mv in areas.items()}
        self._words = {p: mv[WORDS_OFFSET : WORDS_OFFSET + 8 * BUFFERS].cast("Q") for p, mv in areas.items()}
        self._bufs = {(p, k): mv[CTL_BYTES + k * nbytes : CTL_BYTES + (k + 1) * nbytes]
                      for p, mv in areas.items() for k in range(BUFFERS)}
        self._areas = areas

    def buffer(self, owner: int, k: int) -> memoryview:
        return self._bufs[(owner, k)]

    def counter(self, owner: int) -> int:
        value = self._ctr[owner][0]
        ring.publish_fence()  # arm64: the payload loads that follow must not move before this load
        return value

    def word(self, owner: int, k: int) -> int:
        return self._words[owner][k]

    def _publish(self, value: int, k: int | None, word: int) -> None:
        if k is not None:
            self._words[self.rank][k] = word
        ring.publish_fence()  # arm64: payload and word stores before the counter store
        self._ctr[self.rank][0] = value
        self._links.wake_sleepers()

    def _check(self) -> None:
        self._t._check_usable()

    def _idle(self, ready: Callable[[], bool], timeout: float, behind: Callable[[int], bool], what: str) -> None:
        t = self._t
        if t.broken is not None:
            raise t.broken
        t.progress(timeout, until=ready)
        if t.broken is not None:
            raise t.broken
        # A rank we wait for that sends ring data of a collective has skipped this op: had it run it, it
        # would have posted the step we wait for before sending anything later (counters only grow). So
        # its counter is read again *after* its ring data was seen: a post that came first shows by then.
        stray = self._links.parked_collective([p for p in range(self.world) if p != self.rank and behind(p)])
        ring.publish_fence()
        if stray is not None and behind(stray[0]):
            peer, sig = stray
            raise MismatchError(
                f"rank {self.rank}: mismatched operation with rank {peer}: rank {peer} sent data of "
                f"{describe_sig(sig)}, but rank {self.rank} is in {what}")

    def _release(self) -> None:
        # A view can still be exported (a tensor kept alive by a traceback): then the unmap at exit frees it.
        views = [*self._ctr.values(), *self._words.values(), *self._bufs.values(), *self._areas.values()]
        for v in views:
            with suppress(BufferError):
                v.release()
