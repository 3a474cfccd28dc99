"""In-memory links: ranks are threads of one process. Used by the fast test tier, and the smallest
example of a link kind (base.Link) in the one engine.

Sends are eager: copied into the receiver's posted buffer (or an unexpected buffer) under the one lock the
whole world shares, so a send never blocks; the receiver's engine is woken if it sleeps.
`MemoryHub.kill(rank)` emulates a dead peer: every other rank's transport breaks with PeerLostError, as a
TCP transport would.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..errors import PeerLostError
from ..protocol.framing import Frame, Kind, Space
from .base import Link, LinkKind, Request
from .engine import Transport
from .window import BUFFERS, Window


class MemoryHub:
    """The shared medium of one in-memory world; `window_bytes` > 0 gives every rank a shared window."""

    def __init__(self, world: int, window_bytes: int = 0) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.buffers = {(r, k): bytearray(window_bytes) for r in range(world) for k in range(BUFFERS)}
        self.counters = [0] * world
        self.words = [[0] * BUFFERS for _ in range(world)]
        self.transports: list[Transport] = [memory_transport(self, r) for r in range(world)]
        for t in self.transports:
            t.window = MemoryWindow(self, t) if window_bytes > 0 else None

    def kill(self, rank: int) -> None:
        with self.cv:
            for t in self.transports:
                if t.rank != rank and t.broken is None:
                    t.fail(PeerLostError(f"rank {t.rank}: lost rank {rank}", rank=t.rank, peer=rank),
                           tell_peers=False)
            self.transports[rank].closed = True
            self.cv.notify_all()


def memory_transport(hub: MemoryHub, rank: int) -> Transport:
    """Rank `rank`'s transport in `hub`'s world (one lock for the whole world keeps delivery atomic)."""
    return Transport(rank, hub.world, [MemoryLinks(hub, rank)], cv=hub.cv)


class MemoryLink(Link):
    """A peer in the same process: a send is a copy into its matcher."""

    def __init__(self, kind: "MemoryLinks", hub: MemoryHub, peer: int) -> None:
        self.kind, self.hub, self.peer = kind, hub, peer

    @property
    def address(self) -> str:
        return f"thread of rank {self.peer}"

    def post_send(self, req: Request) -> None:
        me = self.engine
        dst = self.hub.transports[self.peer]
        if dst.closed:
            raise PeerLostError(f"rank {me.rank}: rank {self.peer} is gone", rank=me.rank, peer=self.peer)
        space, tag, seq = req.key
        frame = Frame(Kind.DATA, Space(space), req.sig, tag, seq, 0, req.nbytes, req.nbytes)
        try:
            view, target = dst.matcher.match(me.rank, frame)
            view[:] = req.buf
            dst.matcher.part_done(me.rank, frame.key, target, req.nbytes)
        except Exception as exc:  # a mismatch breaks the receiver, as it would on the wire
            dst.fail(exc, tell_peers=False)
        self.kind.bytes_sent += req.nbytes
        dst.kinds[0].bytes_received += req.nbytes
        req.done = True
        dst.kinds[0].arrived += 1
        if dst._polling:
            dst._wake()
        self.hub.cv.notify_all()

    def pump(self) -> bool:
        return self.kind.news()

    def gone(self) -> bool:
        return self.hub.transports[self.peer].closed

    def queued(self) -> list[Request]:
        return []  # sends are eager: none is ever queued


class MemoryLinks(LinkKind):
    name = "memory"

    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub = hub
        self.links = {p: MemoryLink(self, hub, p) for p in range(hub.world) if p != rank}
        self.arrived = 0  # deliveries into this rank, counted by the senders
        self._seen = 0

    def ready(self) -> bool:
        return self.arrived != self._seen

    def news(self) -> bool:
        """Did a peer deliver something since the last look? (Its request completed in the sender's call,
        so the engine only needs to stop waiting.)"""
        fresh = self.arrived != self._seen
        self._seen = self.arrived
        return fresh


class MemoryWindow(Window):
    """The window of one rank of a MemoryHub: plain bytearrays, posts notify the hub's condition."""

    def __init__(self, hub: MemoryHub, transport: Transport) -> None:
        super().__init__(transport.rank, hub.world, len(hub.buffers[(0, 0)]))
        self.hub, self.t = hub, transport

    def buffer(self, owner: int, k: int) -> memoryview:
        return memoryview(self.hub.buffers[(owner, k)])

    def counter(self, owner: int) -> int:
        return self.hub.counters[owner]

    def word(self, owner: int, k: int) -> int:
        return self.hub.words[owner][k]

    def _publish(self, value: int, k: int | None, word: int) -> None:
        with self.hub.cv:
            if k is not None:
                self.hub.words[self.rank][k] = word
            self.hub.counters[self.rank] = value
            self.hub.cv.notify_all()

    def _check(self) -> None:
        self.t._check_usable()

    def _idle(self, ready: Callable[[], bool], timeout: float, behind: Callable[[int], bool], what: str) -> None:
        with self.hub.cv:
            self.hub.cv.wait_for(lambda: ready() or self.t.broken is not None, timeout)
            if self.t.broken is not None:
                raise self.t.broken

