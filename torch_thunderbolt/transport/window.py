"""Window memory: bytes that the ranks of one host read and write directly, for the shared-window collectives.

The transport only provides the memory and its ordering; the protocol that runs on it (rounds, steps,
waiting with a deadline, mismatch checks) is the algorithm layer's (`algorithms/window.py`). Each member
owns `BUFFERS` buffers of `nbytes`, one op word per buffer and one progress counter; every member has all
of them mapped. `publish` stores a word and then the counter with the ordering the platform needs (payload
and word stores visible before the counter store), then wakes members asleep in their engine's poll().

Members are the group ranks that share the memory, in ascending order; owners are indexed by position in
that list. A group all on one host has one window memory over every rank; a multi-host job has one per
host, over that host's ranks.

Implementations: `shm_window.ShmWindowMemory` (processes sharing POSIX shared memory) and
`memory.MemoryWindowMemory` (threads of one process, for tests).
"""
from __future__ import annotations

import abc

BUFFERS = 4  # buffers per member: the segment layout reserves this many (rendezvous sizes segments by it)


class WindowMemory(abc.ABC):
    """`members` (group ranks, ascending) each own BUFFERS buffers of `nbytes`; `me` is this rank's index."""

    def __init__(self, members: list[int], me: int, nbytes: int) -> None:
        self.members, self.me, self.nbytes = members, me, nbytes

    @abc.abstractmethod
    def buffer(self, owner: int, k: int) -> memoryview:
        """Writable bytes of member `owner`'s buffer `k` (this rank's own, or a peer's mapped one)."""

    @abc.abstractmethod
    def counter(self, owner: int) -> int:
        """The last value `owner` published, as a look: it orders nothing (wait with `reached` before reading
        what `owner` published)."""

    @abc.abstractmethod
    def word(self, owner: int, k: int) -> int:
        """The op word `owner` stored with its buffer `k`."""

    @abc.abstractmethod
    def publish(self, value: int, k: int | None, word: int) -> None:
        """Store `word` for our buffer `k` (unless None), then `value` as our counter; wake sleeping members."""

    def reached(self, peers: list[int], value: int, looks: int) -> bool:
        """Whether every owner in `peers` has published at least `value`, looking up to `looks` times in a
        row (at least once) without yielding; once True, loads after it see everything they stored before
        publishing it. Implementations whose loads are cheap spin; the default looks once."""
        return all(self.counter(p) >= value for p in peers)

    def fence(self) -> None:
        """An acquire fence: loads before it (a peer's ring, or its counter) are ordered before the loads
        after it (its counter, or its ring)."""

    def release(self) -> None:
        """Unmap what the implementation mapped (the transport calls this when it closes)."""
