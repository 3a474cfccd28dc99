"""In-memory transport: ranks are threads of one process. Used by the fast test tier.

Sends are eager (copied into the receiver's posted buffer, or into an unexpected buffer), so a send never
blocks. `MemoryHub.kill(rank)` emulates a dead peer: every other rank's transport breaks with
PeerLostError, as a TCP transport would.
"""
from __future__ import annotations

import threading

from ..errors import PeerLostError
from ..protocol.framing import Frame, Kind, Space
from .base import Request, Transport
from .matching import Matcher


class MemoryHub:
    """The shared medium of one in-memory world."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.transports: list[MemoryTransport] = [MemoryTransport(self, r, world) for r in range(world)]

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
            self.broken = exc
            for r in self.matcher.pending():
                r.error = exc
        self.hub.cv.notify_all()

    def _shutdown(self) -> None:
        with self.hub.cv:
            self.hub.cv.notify_all()
