"""Shared windows: memory that every rank of a group reads and writes directly (ranks on one host).

Collectives designed for shared memory (`algorithms/windowed.py`) run on a window instead of send/recv.
Each rank owns `BUFFERS` buffers of `nbytes` that every member has mapped, one op word per buffer (what
the rank is doing, for mismatch checks) and one progress counter. A rank writes into its own buffer, then
publishes: word and payload stores first, the counter store last. Peers wait for the counter before
reading. Counters only grow over the group's life, so no two ops can confuse each other's steps; a peer
still in an earlier step is simply waited for.

Implementations: `shm_window.ShmWindow` (processes sharing POSIX shared memory) and
`memory.MemoryWindow` (threads of one process, for tests). This module holds what they share: waiting
with a deadline and the errors that name the late ranks.
"""
from __future__ import annotations

import abc
import time
from typing import Callable, Iterable

from ..errors import CollectiveTimeout

BUFFERS = 4
STEPS = 3  # counter values per round: a step is `round * STEPS + phase`, phase 1..STEPS (algorithms/windowed)


class Window(abc.ABC):
    """`world` ranks, each with BUFFERS buffers of `nbytes`; rank numbers are the group's."""

    def __init__(self, rank: int, world: int, nbytes: int) -> None:
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self.rounds = 0  # rounds completed by the ops run so far: the same on every rank between ops
        # A broadcast root's last round whose peers' op words are still to be checked: (round, word). The
        # root returns without waiting for its peers and checks them when it starts its next windowed op.
        self.unchecked: tuple[int, int] | None = None
        self.cache: dict = {}  # views the algorithm layer keeps across ops; dropped by release()

    # -- to implement ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def buffer(self, owner: int, k: int) -> memoryview:
        """Writable bytes of `owner`'s buffer `k` (this rank's own, or a peer's mapped one)."""

    @abc.abstractmethod
    def counter(self, owner: int) -> int:
        """The last value `owner` posted (loads after this one see everything stored before that post)."""

    @abc.abstractmethod
    def word(self, owner: int, k: int) -> int:
        """The op word `owner` stored with its buffer `k`."""

    @abc.abstractmethod
    def _publish(self, value: int, k: int | None, word: int) -> None:
        """Store `word` for buffer `k` (unless None), then `value` as this rank's counter; wake sleepers."""

    @abc.abstractmethod
    def _idle(self, ready: Callable[[], bool], timeout: float, behind: Callable[[int], bool], what: str) -> None:
        """Wait until `ready()` may hold, at most `timeout` s; raise the group's error if it broke, and
        MismatchError if a rank still `behind(rank)` is visibly in another collective."""

    @abc.abstractmethod
    def _check(self) -> None:
        """Raise the group's error if it broke or was closed (a broken group must not run more ops, even
        ones whose steps its peers happen to have posted already)."""

    def _release(self) -> None:
        """Unmap what the implementation mapped (after `cache` is cleared)."""

    # -- shared ---------------------------------------------------------------------------------------------
    def post(self, value: int, k: int | None = None, word: int = 0) -> None:
        self._check()
        self._publish(value, k, word)

    def wait(self, value: int, peers: Iterable[int], deadline: float, what: str) -> None:
        """Until every rank in `peers` posted at least `value`; CollectiveTimeout at `deadline`."""
        peers = list(peers)
        ready = lambda: all(self.counter(p) >= value for p in peers)  # noqa: E731
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                late = [p for p in peers if self.counter(p) < value]
                raise CollectiveTimeout(
                    f"rank {self.rank}: Timed out waiting in {what} (shared-memory window, step {value}); "
                    f"ranks that did not arrive: {late}")
            self._idle(ready, min(0.2, deadline - now), lambda p: p in peers and self.counter(p) < value, what)

    def started_beyond(self, owner: int) -> bool:
        """`owner` has posted a step of a round this rank has not started (between ops only: it has begun
        a windowed op this rank has not reached)."""
        return self.counter(owner) > STEPS * self.rounds

    def release(self) -> None:
        self.cache.clear()
        self._release()
