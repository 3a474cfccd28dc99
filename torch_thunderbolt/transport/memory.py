"""In-memory transport: ranks are threads of one process. Used by the fast test tier.

Sends are eager (copied into the receiver's posted buffer, or into an unexpected buffer), so a send never
blocks. `MemoryHub.kill(rank)` emulates a dead peer: every other rank's transport breaks with
PeerLostError, as a TCP transport would.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..errors import PeerLostError
from ..protocol.framing import Frame, Kind, Space
from .base import Request, Transport
from .matching import Matcher
from .window import BUFFERS, Window


class MemoryHub:
    """The shared medium of one in-memory world; `window_bytes` > 0 gives every rank a shared window."""

    def __init__(self, world: int, window_bytes: int = 0) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.buffers = {(r, k): bytearray(window_bytes) for r in range(world) for k in range(BUFFERS)}
        self.counters = [0] * world
        self.words = [[0] * BUFFERS for _ in range(world)]
        self.transports: list[MemoryTransport] = [MemoryTransport(self, r, world) for r in range(world)]
        for t in self.transports:
            t.window = MemoryWindow(self, t) if window_bytes > 0 else None

    def kill(self, rank: int) -> None:
        with self.cv:
            for t in self.transports:
                if t.rank != rank and t.broken is None:
                    t._fail(PeerLostError(f"rank {t.rank}: lost rank {rank}", rank=t.rank, peer=rank))
            self.transports[rank].closed = True
            self.cv.notify_all()


class MemoryTransport(Transport):
    def __init__(self, hub: MemoryHub, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.hub = hub
        self._cv = hub.cv  # one lock for the whole world keeps delivery atomic
        self.matcher = Matcher(rank)

    def _post_send(self, req: Request) -> None:
        dst = self.hub.transports[req.peer]
        space, tag, seq = req.key
        frame = Frame(Kind.DATA, Space(space), req.sig, tag, seq, 0, req.nbytes, req.nbytes)
        with self.hub.cv:
            if dst.closed:
                raise PeerLostError(f"rank {self.rank}: rank {req.peer} is gone", rank=self.rank, peer=req.peer)
            try:
                view, target = dst.matcher.match(self.rank, frame)
                view[:] = req.buf
                dst.matcher.part_done(self.rank, frame.key, target, req.nbytes)
            except Exception as exc:  # a mismatch breaks the receiver, as it would on the wire
                dst._fail(exc)
            self.bytes_sent += req.nbytes
            dst.bytes_received += req.nbytes
            req.done = True
            self.hub.cv.notify_all()

    def _post_recv(self, req: Request) -> None:
        with self.hub.cv:
            self.matcher.post(req)

    def _progress(self, timeout: float) -> None:
        with self.hub.cv:
            if timeout > 0:
                self.hub.cv.wait(timeout)

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self._enter_broken(exc, ())  # sends are eager: none is ever queued
        self.hub.cv.notify_all()

    def _shutdown(self) -> None:
        with self.hub.cv:
            self.hub.cv.notify_all()


class MemoryWindow(Window):
    """The window of one rank of a MemoryHub: plain bytearrays, posts notify the hub's condition."""

    def __init__(self, hub: MemoryHub, transport: MemoryTransport) -> None:
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

