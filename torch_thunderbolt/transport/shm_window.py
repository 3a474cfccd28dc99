"""The window memory of the ranks of one host: where it sits in each rank's segment, and its store ordering.

Layout, after the rings (`shm_ring.rings_end`): a 4096-byte control block with the progress counter at
byte 0 and the op words at byte 64 (a cache line of their own), then BUFFERS buffers of `nbytes`.

A member waiting for a counter sleeps in its engine's poll() on the doorbell sockets with its "sleeping"
flag set (`Transport.progress` with `until`); `publish` rings the bell of every sleeper. So a window wait
keeps the rings moving (point-to-point traffic of other threads), notices a dead peer (EOF on its socket)
and an ABORT, exactly like a receive.
"""
from __future__ import annotations

from contextlib import suppress
from typing import Callable

from . import shm_ring as ring
from .window import BUFFERS, WindowMemory

CTL_BYTES = 4096
WORDS_OFFSET = 64


def area_bytes(nbytes: int) -> int:
    """Bytes a window of `nbytes` per buffer adds to each rank's segment (0: no window)."""
    return CTL_BYTES + BUFFERS * nbytes if nbytes > 0 else 0


class ShmWindowMemory(WindowMemory):
    """`areas[rank]`: each member's window area (its own and the peers' mapped segments)."""

    def __init__(self, members: list[int], me: int, areas: dict[int, memoryview], nbytes: int,
                 wake: Callable[[], None]) -> None:
        super().__init__(members, me, nbytes)
        self._wake = wake
        self._areas = [areas[p] for p in members]
        self._ctr = [mv[:8].cast("Q") for mv in self._areas]
        self._words = [mv[WORDS_OFFSET : WORDS_OFFSET + 8 * BUFFERS].cast("Q") for mv in self._areas]
        self._bufs = [[mv[CTL_BYTES + k * nbytes : CTL_BYTES + (k + 1) * nbytes] for k in range(BUFFERS)]
                      for mv in self._areas]

    def buffer(self, owner: int, k: int) -> memoryview:
        return self._bufs[owner][k]

    def counter(self, owner: int) -> int:
        value = self._ctr[owner][0]
        ring.publish_fence()  # arm64: the payload loads that follow must not move before this load
        return value

    def word(self, owner: int, k: int) -> int:
        return self._words[owner][k]

    def reached(self, peers: list[int], value: int, looks: int) -> bool:
        # A tight spin on the counters' loads (~0.1 us a look): a peer that posts within a few us is seen
        # at once, where a round through the engine's spin (lock, pump, poll set, yield) takes several us.
        ctr = self._ctr
        for _ in range(looks or 1):
            for p in peers:
                if ctr[p][0] < value:
                    break
            else:
                ring.publish_fence()  # arm64: the payload loads that follow must not move before these
                return True
        return False

    def publish(self, value: int, k: int | None, word: int) -> None:
        if k is not None:
            self._words[self.me][k] = word
        ring.publish_fence()  # arm64: payload and word stores before the counter store
        self._ctr[self.me][0] = value
        self._wake()

    def fence(self) -> None:
        ring.publish_fence()  # a no-op where loads are not reordered (x86), a full barrier on arm64

    def release(self) -> None:
        # A view can still be exported (a tensor kept alive by a traceback): then the unmap at exit frees it.
        views = [*self._ctr, *self._words, *(b for bufs in self._bufs for b in bufs), *self._areas]
        for v in views:
            with suppress(BufferError):
                v.release()
