"""Losing one stream of a pair whose streams use two different address pairs (two cables): the transfer
completes on the other stream with every byte right. Two TCP transports in one process over loopback
(127.0.0.1 and 127.0.0.2 stand for the two cables); the cut is injected as the ETIMEDOUT a dead cable
gives, on one side only, at a random moment. On the darwin socket model (testing/darwin.py) the cut is the
kernel's drop, met through the socket as macOS answers: EPIPE on a send with the ETIMEDOUT in SO_ERROR,
the ETIMEDOUT on a receive."""
from __future__ import annotations

import errno
import random
import socket
import threading
import time

import pytest
import torch

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.testing.darwin import Xnu, XnuSocket
from torch_thunderbolt.transport.engine import Transport
from torch_thunderbolt.testing.worlds import tcp_pair
from torch_thunderbolt.transport.tcp import TcpLinks


def _pair(sources=("127.0.0.1", "127.0.0.2"), stripe=64 << 10, sealed: bool = False,
          darwin: bool = False) -> tuple[Transport, Transport]:
    """`sealed`: every frame carries a MAC (THUNDERBOLT_INTEGRITY=mac), so a resend must be sealed anew on
    the surviving stream and a payload cut short never counts. `darwin`: every socket one of the darwin
    model's."""
    return tcp_pair(sources, stripe_bytes=stripe, sealed=sealed, darwin=Xnu() if darwin else None)


def _tcp(t: Transport) -> TcpLinks:
    kind = t.link_kind("tcp")
    assert isinstance(kind, TcpLinks)
    return kind


def _cut(t: Transport, stream: int) -> None:
    with t._cv:
        link = _tcp(t).links[1 - t.rank]
        c = link.streams[stream]
        if isinstance(c.sock, XnuSocket):
            c.sock.drop(errno.ETIMEDOUT)  # met by the next send (EPIPE) or receive on it
        else:
            link.conn_error(c, TimeoutError(errno.ETIMEDOUT, "Connection timed out (injected cable cut)"))


def _exchange(t: Transport, msgs: list[torch.Tensor], results: dict, lazy: bool, seed: int) -> None:
    rng = random.Random(seed)
    try:
        peer = 1 - t.rank
        got = [torch.empty_like(m) for m in msgs]
        sends = [t.isend(peer, (Space.COLL, i + 1, t.rank), memoryview(m.numpy()).cast("B"))
                 for i, m in enumerate(msgs)]
        recvs = []
        for i, g in enumerate(got):
            if lazy:  # receives posted late: the peer's frames sit parked meanwhile
                time.sleep(rng.random() * 0.02)
            recvs.append(t.irecv(peer, (Space.COLL, i + 1, peer), memoryview(g.numpy()).cast("B")))
        t.wait(sends + recvs, deadline=time.monotonic() + 30)
        results[t.rank] = got
    except BaseException as exc:  # noqa: BLE001
        results[t.rank] = exc


def _cut_mid_frame(victim: Transport, fraction: float, total: int) -> dict:
    """Cut stream 0 from inside the victim's own reader, at a payload being read, once `fraction` of the
    bytes arrived: a cut that is sure to catch data in flight."""
    link = _tcp(victim).links[1 - victim.rank]
    original, state = link._read_payload, {"cut": False}

    def reading(c):
        # A payload whose header was read is in flight on stream 0 (all of it, or what is left of it).
        if (not state["cut"] and c.stream == 0 and c.inbound is not None
                and victim.bytes_received >= fraction * total):
            state["cut"] = True
            if isinstance(c.sock, XnuSocket):
                c.sock.drop(errno.ETIMEDOUT)
                return original(c)  # the receive meets the drop
            link.conn_error(c, TimeoutError(errno.ETIMEDOUT, "Connection timed out (injected cable cut)"))
            return None
        return original(c)

    link._read_payload = reading
    return state


def _run(t0, t1, sizes, cut_at: float | None, lazy: bool, seed: int, cut_rank: int = 0):
    g = torch.Generator().manual_seed(seed)
    msgs = {r: [torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32) for n in sizes]
            for r in (0, 1)}
    victim = (t0, t1)[cut_rank]
    state = _cut_mid_frame(victim, cut_at, sum(4 * n for n in sizes)) if cut_at is not None else None
    results: dict = {}
    threads = [threading.Thread(target=_exchange, args=(t, msgs[t.rank], results, lazy, seed + t.rank))
               for t in (t0, t1)]
    for th in threads:
        th.start()
    if cut_at is None:
        _cut(victim, 0)
    for th in threads:
        th.join(40)
    assert not any(th.is_alive() for th in threads), "a rank hung after the cut"
    assert state is None or state["cut"], "the cut was never made"
    return msgs, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("system", ["linux", "darwin"])
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("seed", range(6))
def test_transfers_survive_losing_one_of_two_cables(seed, sealed, system):
    rng = random.Random(seed)
    t0, t1 = _pair(sealed=sealed, darwin=system == "darwin")
    try:
        sizes = [rng.choice([1, 1000, 50_000, 1 << 20, 3 << 20]) for _ in range(24)]
        msgs, results = _run(t0, t1, sizes, cut_at=0.1 + 0.4 * rng.random(), lazy=seed % 2 == 1, seed=seed,
                             cut_rank=seed % 2)
        for r in (0, 1):
            assert not isinstance(results[r], BaseException), results[r]
            for sent, got in zip(msgs[1 - r], results[r]):
                assert torch.equal(sent, got)
        assert t0.broken is None and t1.broken is None
        assert _tcp((t0, t1)[seed % 2 == 0]).resent_bytes > 0  # the peer of the cut side resent what was in flight
        # and the survivors keep working afterwards
        msgs, results = _run(t0, t1, [1 << 20] * 4, cut_at=None, lazy=False, seed=seed + 100, cut_rank=seed % 2)
        assert all(torch.equal(s, g) for r in (0, 1) for s, g in zip(msgs[1 - r], results[r]))
        assert _tcp(t0).lost_streams == 1 and _tcp(t1).lost_streams == 1  # the other side learnt it from the RESYNC
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_one_cable_has_no_failover_a_cut_is_a_peer_lost_error():
    t0, t1 = _pair(sources=("127.0.0.1", "127.0.0.1"))
    try:
        assert _tcp(t0).stream(1, 0).log is None
        _cut(t0, 0)
        with pytest.raises(PeerLostError, match="rank 1"):
            t0.wait([t0.irecv(1, (Space.COLL, 1, 1), memoryview(bytearray(4)))], deadline=time.monotonic() + 5)
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_a_closed_stream_is_still_a_lost_peer_even_with_two_cables():
    """EOF or reset means the peer process is gone, not a cable: no failover, a clear PeerLostError."""
    t0, t1 = _pair()
    try:
        _tcp(t1).stream(0, 0).sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(PeerLostError, match="rank 1"):
            t0.wait([t0.irecv(1, (Space.COLL, 1, 1), memoryview(bytearray(4)))], deadline=time.monotonic() + 5)
        assert _tcp(t0).lost_streams == 0
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_a_rank_waiting_to_receive_pings_its_peer_and_the_peer_ignores_the_pings():
    """A waiting receiver has nothing unacknowledged, so a dead link would never time out for it: after
    `probe_after` seconds without traffic it sends PING frames, which a live peer reads and ignores."""
    from torch_thunderbolt.errors import CollectiveTimeout

    t0, t1 = _pair(sources=("127.0.0.1", "127.0.0.1"))
    _tcp(t0).probe_after = 0.2
    try:
        late = bytearray(8)
        with pytest.raises(CollectiveTimeout):
            t0.wait([t0.irecv(1, (Space.COLL, 1, 1), memoryview(late))], deadline=time.monotonic() + 1.0)
        assert t0.probes_sent >= 2
        got = bytearray(4)
        req = t1.irecv(0, (Space.COLL, 2, 0), memoryview(got))
        t0.wait([t0.isend(1, (Space.COLL, 2, 0), memoryview(b"abcd"))], deadline=time.monotonic() + 5)
        t1.wait([req], deadline=time.monotonic() + 5)  # the pings ahead of the data were skipped
        assert bytes(got) == b"abcd" and t1.broken is None
    finally:
        t0.close()
        t1.close()
