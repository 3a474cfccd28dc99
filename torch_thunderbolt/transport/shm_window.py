"""The window memory of the ranks of one host: where it sits in each rank's segment, and its store ordering.

Layout, after the rings (`shm_ring.rings_end`): a 4096-byte control block with the progress counter at
byte 0 and the op words at byte 64 (a cache line of their own), then BUFFERS buffers of `nbytes`.

A member waiting for a counter sleeps in its engine's poll() on the doorbell sockets with its "sleeping"
flag set (`Transport.progress` with `until`); `publish` rings the bell of every sleeper. So a window wait
keeps the rings moving (point-to-point traffic of other threads), notices a dead peer (EOF on its socket)
and an ABORT, exactly like a receive.

Ordering (`ordering.py` argues each fence): `publish` stores the word, then `release`, then the counter;
`reached` loads counters without a fence until they all reach the value, then one `acquire` covers the
reads of everything they published. It remembers, per owner, the highest value it has acquired so far:
counters only grow, so a later wait for a value at most that one is done without a load or a fence (a
round's buffer-free step is always below the previous round's arrival, so the one-shot all_reduce waits
with one fence per op). The ops on one window memory run one at a time, in issue order (a thread that
takes over from another does so through a lock, which orders the earlier thread's fence before it), so
the remembered values are only ever used by the op that runs.
"""
from __future__ import annotations

from contextlib import suppress
from typing import Callable

from . import ordering
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
        self._acquired = [0] * len(members)  # per owner: a value its counter showed before an acquire fence

    def buffer(self, owner: int, k: int) -> memoryview:
        return self._bufs[owner][k]

    def counter(self, owner: int) -> int:
        return self._ctr[owner][0]

    def word(self, owner: int, k: int) -> int:
        return self._words[owner][k]

    def reached(self, peers: list[int], value: int, looks: int) -> bool:
        # A tight spin on the counters' loads (~0.1 us a look): a peer that posts within a few us is seen
        # at once, where a round through the engine's spin (lock, pump, poll set, yield) takes several us.
        acquired, ctr = self._acquired, self._ctr
        for _ in range(looks or 1):
            loaded = False
            for p in peers:
                if acquired[p] < value:
                    if ctr[p][0] < value:
                        break
                    loaded = True
            else:
                if loaded:
                    ordering.acquire()  # the counter loads before the caller's reads of what they published
                    for p in peers:
                        if acquired[p] < value:
                            acquired[p] = value
                return True
        return False

    def publish(self, value: int, k: int | None, word: int) -> None:
        if k is not None:
            self._words[self.me][k] = word
        ordering.release()  # the payload and word stores before the counter store that publishes them
        self._ctr[self.me][0] = value
        self._wake()

    def fence(self) -> None:
        ordering.acquire()

    def release(self) -> None:
        # A view can still be exported (a tensor kept alive by a traceback): then the unmap at exit frees it.
        views = [*self._ctr, *self._words, *(b for bufs in self._bufs for b in bufs), *self._areas]
        for v in views:
            with suppress(BufferError):
                v.release()
