"""What a send meets on macOS, on the darwin socket model (testing/darwin.py): EPIPE with the real cause kept
in SO_ERROR after the kernel dropped a connection, ENOBUFS while it is short of mbufs, EADDRNOTAVAIL when
the source address went away. Two TCP transports in one process over loopback, each socket one of the
model's; 127.0.0.1 and 127.0.0.2 stand for two cables."""
from __future__ import annotations

import errno
import socket
import time

import pytest

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.testing.darwin import Xnu
from torch_thunderbolt.testing.worlds import tcp_pair
from torch_thunderbolt.transport import tcp as tcp_module
from torch_thunderbolt.transport.engine import Transport
from torch_thunderbolt.transport.tcp import TcpLinks


def _pair(sources: "tuple[str, ...]" = ("127.0.0.1", "127.0.0.2")) -> "tuple[Transport, Transport, Xnu]":
    xnu = Xnu()
    return (*tcp_pair(sources, darwin=xnu), xnu)


def _tcp(t: Transport) -> TcpLinks:
    kind = t.link_kind("tcp")
    assert isinstance(kind, TcpLinks)
    return kind


def _send_and_receive(t0: Transport, t1: Transport, data: bytes, tag: int = 1) -> bytes:
    got = bytearray(len(data))
    recv = t1.irecv(0, (Space.COLL, tag, 0), memoryview(got))
    send = t0.isend(1, (Space.COLL, tag, 0), memoryview(data))
    deadline = time.monotonic() + 10
    t0.wait([send] if send is not None else [], deadline=deadline)
    t1.wait([recv], deadline=deadline)
    return bytes(got)


@pytest.mark.timeout(60)
def test_a_send_on_a_dropped_stream_fails_over_as_its_timeout_would() -> None:
    """Rank 0's kernel dropped stream 0 after its retransmissions timed out: its next send gets EPIPE, the
    ETIMEDOUT waits in SO_ERROR. The message goes over the other cable and the group stays whole."""
    t0, t1, _ = _pair()
    try:
        _tcp(t0).stream(1, 0).sock.drop(errno.ETIMEDOUT)
        data = bytes(range(256)) * 64
        assert _send_and_receive(t0, t1, data) == data
        assert t0.broken is None and t1.broken is None
        assert _tcp(t0).lost_streams == 1 and _tcp(t0).stream(1, 0).dead
        assert _send_and_receive(t0, t1, data[::-1], tag=2) == data[::-1]  # and it goes on
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_a_dropped_stream_whose_receive_is_parked_fails_over_too() -> None:
    """No read looks at the stream first (its frame is parked, so it is not read): the send alone must find
    the cause behind its EPIPE."""
    t0, t1, _ = _pair()
    try:
        c = _tcp(t0).stream(1, 0)
        c.bye = True  # (a stream not read any more: only SO_ERROR can tell what happened)
        c.sock.drop(errno.ETIMEDOUT)
        data = b"x" * 5000
        assert _send_and_receive(t0, t1, data) == data
        assert t0.broken is None and _tcp(t0).lost_streams == 1
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_with_one_cable_the_lost_peer_error_names_the_timeout_not_the_broken_pipe() -> None:
    t0, t1, _ = _pair(sources=("127.0.0.1",))
    try:
        c = _tcp(t0).stream(1, 0)
        c.bye = True
        c.sock.drop(errno.ETIMEDOUT)
        with pytest.raises(PeerLostError, match="rank 1") as info:
            t0.wait([t0.isend(1, (Space.COLL, 1, 0), memoryview(b"x" * 100))], deadline=time.monotonic() + 5)
        text = str(info.value) + repr(info.value.__cause__)
        assert "timed out" in text.lower() and "Broken pipe" not in text, text
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_enobufs_from_a_send_is_tried_again() -> None:
    t0, t1, _ = _pair(sources=("127.0.0.1",))
    try:
        _tcp(t0).stream(1, 0).sock.fail_sends(errno.ENOBUFS, errno.ENOBUFS, errno.ENOBUFS)
        data = bytes(range(256)) * 400
        assert _send_and_receive(t0, t1, data) == data
        assert t0.broken is None and not _tcp(t0).stream(1, 0).sock.send_faults
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_enobufs_that_lasts_fails_the_peer_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(tcp_module, "NOBUFS_SECONDS", 0.2)
    t0, t1, _ = _pair(sources=("127.0.0.1",))
    try:
        _tcp(t0).stream(1, 0).sock.fail_sends(*[errno.ENOBUFS] * 100_000)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1") as info:
            t0.wait([t0.isend(1, (Space.COLL, 1, 0), memoryview(b"x" * 100))], deadline=time.monotonic() + 5)
        assert time.monotonic() - start < 3
        assert "0.2 s" in str(info.value) + repr(info.value.__cause__)
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_a_source_address_gone_is_a_lost_cable() -> None:
    """EADDRNOTAVAIL (the interface of stream 0's source address went away) fails over like a timeout."""
    t0, t1, _ = _pair()
    try:
        _tcp(t0).stream(1, 0).sock.fail_sends(errno.EADDRNOTAVAIL)
        data = b"y" * 7000
        assert _send_and_receive(t0, t1, data) == data
        assert t0.broken is None and t1.broken is None and _tcp(t0).lost_streams == 1
    finally:
        t0.close()
        t1.close()


@pytest.mark.timeout(60)
def test_a_peer_that_stops_reading_is_found_by_the_deadline_on_macos() -> None:
    """macOS's TCP_RXT_CONNDROPTIME counts retransmissions only, and nothing sets PERSIST_TIMEOUT, so a
    stream stuck on the zero window of a peer that stopped reading is never dropped by the kernel (and a cut
    while the window is closed is not either): the wait's own deadline ends it, naming the peer. There is no
    window guard on darwin (it lifts Linux's TCP_USER_TIMEOUT, which does cover closed windows)."""
    from torch_thunderbolt.errors import CollectiveTimeout

    t0, t1, _ = _pair(sources=("127.0.0.1",))
    try:
        assert _tcp(t0).guard_every == 0 and not _tcp(t0).threads
        data = bytearray(32 << 20)  # far more than both socket buffers hold: the window closes
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            t0.wait([t0.isend(1, (Space.COLL, 1, 0), memoryview(data))], deadline=time.monotonic() + 2.0)
        assert 2.0 <= time.monotonic() - start < 5
        assert 1 in info.value.ranks or "rank 1" in str(info.value), str(info.value)
    finally:
        t0.close()
        t1.close()
