"""Groups over one engine, in one process with a kind of link whose sends wait in a queue (as RDMA's wait for
credits): when the link to a peer fails, a send still queued to it fails with its group's PeerLostError
naming the peer in that group's ranks, never with the link's bare OS error."""
from __future__ import annotations

from typing import Any

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.transport.base import Key, Link, LinkKind, Request
from torch_thunderbolt.transport.engine import Transport


class QueueLink(Link):
    """A link that sends nothing: every send waits in its queue until the link is aborted."""

    address = "queue"

    def __init__(self) -> None:
        self.queued: list[Request] = []
        self.closed = False

    def send(self, key: Key, sig: int, buf: memoryview) -> Request:
        req = Request(self.peer, key, sig, buf, is_send=True)
        self.queued.append(req)
        return req

    def pump(self, woken: bool = False) -> bool:
        return False

    def say(self, msg: Any) -> None:
        pass

    def abort(self, err: BaseException, body: Any, group: int) -> None:
        for req in [r for r in self.queued if group < 0 or r.key[0] >> 1 == group]:
            req.error = err
            self.queued.remove(req)

    def close(self, bye: bool) -> None:
        self.closed = True


class QueueKind(LinkKind):
    name = "queue"

    def __init__(self, peers: list[int]) -> None:
        self.links = {p: QueueLink() for p in peers}


def test_a_send_queued_to_a_lost_peer_fails_with_its_groups_peer_lost_error() -> None:
    world = Transport(0, 3, [QueueKind([1, 2])])
    # (a split's group, as an agreement makes it: engine ranks 0 and 2, its ranks 0 and 1)
    sub = world.engine.add_group(world.engine.agreement.add(1, (0, 2), (1, 1)))
    buf = memoryview(bytearray(8))
    sends = {"world": world.isend(2, (world.coll, 1, 0), buf), "sub": sub.isend(1, (sub.coll, 1, 0), buf)}
    other = world.isend(1, (world.coll, 1, 0), buf)
    world.engine.failed(2, ConnectionResetError(104, "Connection reset by peer"), "(stream 0)")
    for name, req in sends.items():
        assert isinstance(req.error, PeerLostError), (name, repr(req.error))
    assert sends["world"].error.peer == 2 and sends["sub"].error.peer == 1
    assert "Connection reset by peer" in str(sends["sub"].error)
    assert isinstance(other.error, PeerLostError) and other.error.peer == 2  # (its group broke: named the same)
    world.close()
    sub.close()
