"""In-memory links: ranks are threads of one process. Used by the fast test tier, and the smallest
example of a link kind (base.Link) in the one engine.

Sends are eager: copied into the receiver's posted buffer (or an unexpected buffer) under the one lock the
whole world shares, so a send never blocks; the receiver's engine is woken if it sleeps. An ABORT is
delivered the same way: the receiver fails at once with the sender's reason, and tells its own peers.
`MemoryHub.kill(rank)` emulates a dead peer: every other rank's transport breaks with PeerLostError, as a
TCP transport would.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import peer_lost
from ..protocol import control
from ..protocol.framing import AbortInfo, Frame, Kind
from .base import CountedCondition, Key, Link, LinkKind, Request
from .engine import Transport
from .window import BUFFERS, WindowMemory


class MemoryHub:
    """The shared medium of one in-memory world. `window_bytes` > 0 gives the ranks of each host window
    memory; `hosts` lists the ranks of each pretend host (default: one host holding every rank)."""

    def __init__(self, world: int, window_bytes: int = 0, hosts: "Sequence[Sequence[int]] | None" = None) -> None:
        self.world = world
        self.cv = CountedCondition()  # reentrant: one lock for the whole world (see memory_transport)
        self.buffers = {(r, k): bytearray(window_bytes) for r in range(world) for k in range(BUFFERS)}
        self.counters = [0] * world
        self.words = [[0] * BUFFERS for _ in range(world)]
        self.transports: list[Transport] = [memory_transport(self, r) for r in range(world)]
        if window_bytes > 0:
            for members in ([sorted(h) for h in hosts] if hosts is not None else [list(range(world))]):
                for r in members:
                    self.transports[r].window_memory = MemoryWindowMemory(self, members, r, window_bytes)

    def kill(self, rank: int) -> None:
        with self.cv:
            for t in self.transports:
                if t.rank == rank:
                    continue
                for g in list(t.engine.groups.values()):  # every group over its engine that held the rank
                    gr = g.rank_of.get(rank)
                    if gr is not None and g.broken is None:
                        g.fail(peer_lost(g.rank, gr, f"lost rank {gr} (its thread died)"), tell_peers=False)
                t.engine._dead.add(rank)
            self.transports[rank].closed = True
            self.transports[rank].engine.closed = True
            self.cv.signal()


def memory_transport(hub: MemoryHub, rank: int) -> Transport:
    """Rank `rank`'s transport in `hub`'s world (one lock for the whole world keeps delivery atomic)."""
    return Transport(rank, hub.world, [MemoryLinks(hub, rank)], cv=hub.cv)


class MemoryLink(Link):
    """A peer in the same process: a send is a copy into its matcher, a control message a call of its
    engine's `said`."""

    def __init__(self, kind: "MemoryLinks", hub: MemoryHub, peer: int) -> None:
        self.kind, self.hub, self.peer = kind, hub, peer
        self.address = f"thread of rank {peer}"

    def send(self, key: Key, sig: int, buf: memoryview) -> None:
        me = self.sink.rank
        dst = self.hub.transports[self.peer]
        if dst.closed:
            raise peer_lost(me, self.peer, f"rank {self.peer} is gone (its transport closed) before this "
                            f"rank's send ({Request(self.peer, key, sig, buf, True).describe()})")
        space, tag, seq = key
        n = len(buf)
        dst.engine.delivered_whole(me, Frame(Kind.DATA, space, sig, tag, seq, 0, n, n), buf)
        self.kind.bytes_sent += n
        dst.kinds[0].bytes_received += n
        dst.kinds[0].arrived += 1
        dst.wake_sleeper()
        self.hub.cv.signal()
        return None  # delivered at once: no Request

    def pump(self, woken: bool = False) -> bool:
        return self.kind.news()

    def say(self, msg: "control.Message") -> None:
        dst = self.hub.transports[self.peer].engine
        if not dst.closed:
            dst.said(self.sink.rank, msg)
            dst.wake_sleeper()

    def abort(self, err: BaseException, body: "AbortInfo | None", group: int) -> None:
        """Sends are eager (none is ever queued); the ABORT is delivered at once, like a send."""
        if body is not None:
            self.say(control.Abort(body))

    def close(self, bye: bool) -> None:
        """Nothing to release; with `bye`, the peer learns at once that this rank left (a wait for its data
        fails then, as one over a wire does on BYE)."""
        if bye:
            self.say(control.Bye())


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


class MemoryWindowMemory(WindowMemory):
    """Window memory of one rank of a MemoryHub: plain bytearrays; a publish wakes the members' engines."""

    def __init__(self, hub: MemoryHub, members: list[int], rank: int, nbytes: int) -> None:
        super().__init__(members, members.index(rank), nbytes)
        self.hub, self.rank = hub, rank

    def buffer(self, owner: int, k: int) -> memoryview:
        return memoryview(self.hub.buffers[(self.members[owner], k)])

    def counter(self, owner: int) -> int:
        return self.hub.counters[self.members[owner]]

    def word(self, owner: int, k: int) -> int:
        return self.hub.words[self.members[owner]][k]

    def publish(self, value: int, k: int | None, word: int) -> None:
        # Under the world's one lock: a member checks its wait condition and goes to sleep under it too, so
        # it either sees this store or is asleep by now and gets woken.
        with self.hub.cv:
            if k is not None:
                self.hub.words[self.rank][k] = word
            self.hub.counters[self.rank] = value
            for p in self.members:
                if p != self.rank:
                    self.hub.transports[p].wake_sleeper()
            self.hub.cv.signal()
