"""Hostile or broken peers beyond tests/core/test_hostile.py: a duplicate rank, a rank from an unexpected
address, idle connections that never speak, and absurd length fields from an authenticated peer. Each is
refused (or rejected) and logged; the legitimate streams are unaffected; no memory from an unchecked length."""
from __future__ import annotations

import logging
import socket
import time
import tracemalloc

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import HandshakeError, MismatchError, ProtocolError
from torch_thunderbolt.protocol.framing import (
    FrameDecoder,
    Kind,
    Space,
    encode_frame_header,
)
from torch_thunderbolt.rendezvous import tcp as bs
from torch_thunderbolt.testing.worlds import tcp_world

pytestmark = pytest.mark.timeout(60)
SECRET, GROUP = b"k" * 32, "hostile-test"


class _Rank0:
    """Rank 0's acceptor of a 3-rank group (1 stream per peer) on 127.0.0.1, peers allowed from `allowed`."""

    def __init__(self, allowed: set[str]) -> None:
        self.cfg = Config(streams=1)
        self.listener = bs._listen("127.0.0.1", self.cfg)
        self.ep = self.listener.getsockname()
        self.acceptor = bs._Acceptor([self.listener], 0, 3, 1, SECRET, GROUP, lambda p: allowed, self.cfg,
                                     time.monotonic() + 30)
        self.acceptor.start()

    def connect(self, rank: int, source: str = "") -> socket.socket:
        return bs._connect(rank, 0, 0, self.ep, source, SECRET, GROUP, self.cfg, time.monotonic() + 10)

    def close(self) -> None:
        self.acceptor.stop()
        self.listener.close()
        for s in self.acceptor.conns.values():
            if s is not None:
                s.close()


@pytest.fixture
def refusals(caplog):
    caplog.set_level(logging.WARNING, logger="torch_thunderbolt.bootstrap")
    return lambda: [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


def test_a_duplicate_rank_is_refused_and_the_first_stream_survives(refusals) -> None:
    r0 = _Rank0({"127.0.0.1"})
    try:
        first = r0.connect(1)
        with pytest.raises(HandshakeError, match="not expected"):
            r0.connect(1)  # same rank, same stream, right secret
        last = r0.connect(2)
        assert r0.acceptor.done.wait(5)
        assert any("duplicate" in m for m in refusals()), refusals()
        accepted = r0.acceptor.conns[(1, 0)]
        first.sendall(b"still here")
        assert accepted.recv(64) == b"still here"  # the original rank-1 stream is the one kept
        first.close()
        last.close()
    finally:
        r0.close()


def test_a_rank_from_an_unexpected_address_is_refused(refusals) -> None:
    r0 = _Rank0({"127.0.0.2"})  # rank 1 published 127.0.0.2 as its address
    try:
        with pytest.raises(HandshakeError):
            r0.connect(1, source="127.0.0.1")
        assert any("unexpected address 127.0.0.1" in m for m in refusals()), refusals()
        ok = r0.connect(1, source="127.0.0.2")  # the real one still gets in
        end = time.monotonic() + 5
        while r0.acceptor.conns.get((1, 0)) is None and time.monotonic() < end:
            time.sleep(0.01)  # the acceptor records the stream just after sending ACCEPT
        assert r0.acceptor.conns.get((1, 0)) is not None
        ok.close()
    finally:
        r0.close()


def test_idle_connections_do_not_delay_the_real_peers() -> None:
    r0 = _Rank0({"127.0.0.1"})
    idle = [socket.create_connection(r0.ep) for _ in range(20)]  # connect, then never speak
    try:
        t0 = time.monotonic()
        socks = [r0.connect(1), r0.connect(2)]
        assert r0.acceptor.done.wait(5) and time.monotonic() - t0 < 5
        for s in socks:
            s.close()
    finally:
        for s in idle:
            s.close()
        r0.close()


def _drive(t, rounds: int = 20) -> None:
    """Run t's progress engine (an unrelated posted receive keeps test() polling the sockets)."""
    other = t.irecv(1, (Space.COLL, 999, 0), memoryview(bytearray(8)))
    for _ in range(rounds):
        t.test([other])
        time.sleep(0.01)


def _allocated_while(fn) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("total, kind, space", [(1 << 62, Kind.DATA, Space.COLL), (1 << 20, Kind.CONTROL, Space.COLL),
                                                ((1 << 64) - 1, Kind.DATA, Space.P2P)])
def test_absurd_lengths_are_protocol_errors_without_allocation(total, kind, space) -> None:
    dec = FrameDecoder(max_message=1 << 40)
    raw = bytearray(encode_frame_header(Kind.DATA, space, 0, 1, 0, 0, 0, 0))
    raw[1] = int(kind)
    raw[40:48] = total.to_bytes(8, "little")

    def feed() -> None:
        dec.feed(raw)
        with pytest.raises(ProtocolError):
            dec.next_frame()

    assert _allocated_while(feed) < 1 << 16


def test_a_huge_collective_header_is_parked_not_allocated_and_mismatches_at_post() -> None:
    with tcp_world(2) as (t0, t1):
        hdr = encode_frame_header(Kind.DATA, Space.COLL, 0, 7, 0, 0, 1 << 39, 1 << 39)
        t1.link_kind("tcp").stream(0, 0).sock.sendall(hdr + b"x" * 1000)  # announces 512 GiB, sends 1000 bytes
        assert _allocated_while(lambda: _drive(t0)) < 1 << 20
        with pytest.raises(MismatchError):
            req = t0.irecv(1, (Space.COLL, 7, 0), memoryview(bytearray(100)))
            t0.wait([req], time.monotonic() + 5)


class _Recorded:
    """Stands in for matching.Unexpected: records the size asked for instead of allocating it."""

    sizes: list[int] = []

    def __init__(self, total: int, sig: int, order: int) -> None:
        type(self).sizes.append(total)
        self.buf, self.total, self.received, self.sig, self.claimed_by, self.order = b"", total, 0, sig, None, order


def test_unsolicited_p2p_headers_cannot_make_a_rank_allocate_gigabytes(monkeypatch) -> None:
    from torch_thunderbolt.protocol.framing import Frame
    from torch_thunderbolt.transport import matching

    monkeypatch.setattr(matching, "Unexpected", _Recorded)
    monkeypatch.setattr(_Recorded, "sizes", [])
    m = matching.Matcher(0)
    with pytest.raises(ProtocolError):
        for seq in range(8):  # 8 headers announcing 2 GiB each: 16 GiB if all were accepted
            m.match(1, Frame(Kind.DATA, Space.P2P, 0, 5, seq, 0, 0, 2 << 30))
    assert sum(_Recorded.sizes) <= 1 << 30, f"{sum(_Recorded.sizes) >> 30} GiB requested"
