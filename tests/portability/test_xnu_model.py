"""The darwin socket model (torch_thunderbolt.testing.darwin) answers as XNU does, and the TCP set-up copes
with those answers: every stream tuned after connect and accept, clamped buffers reported."""
from __future__ import annotations

import errno
import logging
import socket

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.rendezvous import tcp as bootstrap
from torch_thunderbolt.testing import darwin
from torch_thunderbolt.testing.darwin import (DARWIN, TCP_KEEPALIVE, TCP_KEEPCNT, TCP_KEEPINTVL, TCP_NODELAY,
                                              TCP_RXT_CONNDROPTIME, Xnu, drop_after, linux_drop_after)
from torch_thunderbolt.testing.worlds import tcp_world
from torch_thunderbolt.transport.tcp import TcpLinks


def _pair(xnu: Xnu) -> "tuple[darwin.XnuSocket, darwin.XnuSocket, darwin.XnuSocket]":
    lst = xnu.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    a = xnu.socket(socket.AF_INET, socket.SOCK_STREAM)
    a.connect(lst.getsockname())
    b, _ = lst.accept()
    return lst, a, b


def test_an_accepted_socket_keeps_none_of_the_listeners_per_connection_timeouts() -> None:
    xnu = Xnu()
    lst = xnu.socket(socket.AF_INET, socket.SOCK_STREAM)
    for option, value in ((TCP_RXT_CONNDROPTIME, 3), (TCP_KEEPALIVE, 5), (TCP_KEEPINTVL, 2), (TCP_KEEPCNT, 4),
                          (TCP_NODELAY, 1)):
        lst.setsockopt(socket.IPPROTO_TCP, option, value)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    with lst, socket.create_connection(lst.getsockname()):
        b, _ = lst.accept()
        with b:
            assert isinstance(b, darwin.XnuSocket)
            assert b.getsockopt(socket.IPPROTO_TCP, TCP_RXT_CONNDROPTIME) == 0  # off
            assert b.getsockopt(socket.IPPROTO_TCP, TCP_KEEPALIVE) == 7200  # 2 h
            assert [b.option(o) for o in (TCP_KEEPINTVL, TCP_KEEPCNT, TCP_NODELAY)] == [2, 4, 1]  # inherited


def test_the_model_has_macos_option_names_and_refuses_linux_ones() -> None:
    mod = Xnu().module
    for name in ("TCP_KEEPIDLE", "TCP_USER_TIMEOUT", "TCP_CONGESTION", "TCP_INFO"):
        assert not hasattr(mod, name), name
    assert (mod.TCP_KEEPALIVE, mod.TCP_KEEPINTVL, mod.TCP_KEEPCNT) == (0x10, 0x101, 0x102)
    with mod.socket(mod.AF_INET, mod.SOCK_STREAM) as s:
        with pytest.raises(OSError) as info:
            s.setsockopt(mod.IPPROTO_TCP, 18, 3000)  # Linux's TCP_USER_TIMEOUT
        assert info.value.errno == errno.ENOPROTOOPT


@pytest.mark.parametrize("clamp", [True, False], ids=["14.4+", "14.3"])
def test_socket_buffers_over_the_limit_are_clamped_or_refused(clamp: bool) -> None:
    xnu = Xnu(maxsockbuf=8 << 20, clamp=clamp)
    with xnu.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 1 << 20  # not doubled as on Linux
        if clamp:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == xnu.sockbuf_max == (8 << 20) * 8 // 9
        else:
            with pytest.raises(OSError) as info:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
            assert info.value.errno == errno.ENOBUFS


def test_after_a_drop_sends_fail_with_epipe_and_the_cause_waits_in_so_error() -> None:
    xnu = Xnu()
    lst, a, b = _pair(xnu)
    with lst, a, b:
        a.drop(errno.ETIMEDOUT)
        for _ in range(3):
            with pytest.raises(BrokenPipeError):
                a.send(b"x")
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ETIMEDOUT
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # read once, then cleared
        b.drop(errno.EADDRNOTAVAIL)
        with pytest.raises(OSError) as info:
            b.recv(10)  # a receive takes the pending error too ...
        assert info.value.errno == errno.EADDRNOTAVAIL
        assert b.recv(10) == b""  # ... and then sees the end of the stream


def test_queued_send_faults_fail_one_send_each() -> None:
    xnu = Xnu()
    lst, a, b = _pair(xnu)
    with lst, a, b:
        a.fail_sends(errno.ENOBUFS)
        with pytest.raises(OSError) as info:
            a.sendmsg([b"abc"])
        assert info.value.errno == errno.ENOBUFS
        assert a.sendmsg([b"abc"]) == 3 and b.recv(3) == b"abc"


def test_the_drop_timer_starts_at_the_first_retransmission_and_is_checked_at_backed_off_ones() -> None:
    # 100 ms base: timeouts of 0.3, 0.4, 0.6, 1.0, 1.8 s fire at 0.3 (the timer starts), 0.7, 1.3, 2.3 and
    # 4.1 s, the first firing 3 s or more after 0.3 s.
    assert drop_after(3, 0.1) == pytest.approx(4.1)
    assert drop_after(1, 0.1) == pytest.approx(1.3)
    # The figures docs/platforms.md and RELIABILITY.md give for a 3 s setting.
    times = [drop_after(3, base / 1000) for base in range(100, 501, 5)]
    assert 3.4 <= min(times) < 3.45 and 7.2 < max(times) <= 7.3
    assert all(t >= 3 for t in times)
    assert drop_after(0, 0.1) > 50  # without the option only the retransmission limit ends it
    assert linux_drop_after(3) == 3


@pytest.mark.timeout(60)
def test_every_stream_is_tuned_after_connect_and_after_accept(monkeypatch) -> None:
    """3 ranks over loopback on the model: each rank connects to the lower ranks and accepts the higher
    ones, and every stream of every rank carries the link timeout, the keepalive times and TCP_NODELAY
    (XNU would give the accepted ones the defaults: a cut cable found only after minutes)."""
    xnu = Xnu()
    xnu.install(monkeypatch)
    cfg = Config(streams=2, link_timeout_ms=3000)
    with tcp_world(3, cfg) as transports:
        seen = 0
        for t in transports:
            kind = t.link_kind("tcp")
            assert isinstance(kind, TcpLinks) and kind.plat.name == "darwin"
            for link in kind.links.values():
                for c in link.streams:
                    assert isinstance(c.sock, darwin.XnuSocket)
                    got = {o: c.sock.option(o) for o in (TCP_RXT_CONNDROPTIME, TCP_KEEPALIVE, TCP_KEEPINTVL,
                                                         TCP_KEEPCNT, TCP_NODELAY)}
                    assert got == {TCP_RXT_CONNDROPTIME: 3, TCP_KEEPALIVE: 5, TCP_KEEPINTVL: 2, TCP_KEEPCNT: 4,
                                   TCP_NODELAY: 1}, f"rank {t.rank}, stream {c.stream} to rank {c.peer}"
                    seen += 1
        assert seen == 3 * 2 * 2  # 3 ranks x 2 peers x 2 streams


def test_a_silently_clamped_socket_buffer_is_reported_once_with_both_sizes(caplog) -> None:
    xnu = Xnu(maxsockbuf=8 << 20, clamp=True)
    tuner = bootstrap.SocketTuner(Config(socket_buffer=16 << 20), DARWIN, rank=1)
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt.bootstrap"):
        for _ in range(3):
            with xnu.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                tuner.tune(s)
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == xnu.sockbuf_max
    warnings = [r.getMessage() for r in caplog.records if "SOCKET_BUFFER" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "rank 1" in warnings[0] and str(16 << 20) in warnings[0] and str(xnu.sockbuf_max) in warnings[0]


def test_a_buffer_granted_as_asked_is_not_reported(caplog) -> None:
    xnu = Xnu(maxsockbuf=8 << 20, clamp=True)
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt.bootstrap"):
        with xnu.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            bootstrap.SocketTuner(Config(socket_buffer=4 << 20), DARWIN).tune(s)
    assert not [r for r in caplog.records if "SOCKET_BUFFER" in r.getMessage()]


@pytest.mark.timeout(90)
def test_a_cut_cable_is_found_on_both_ranks_within_the_macos_drop_time(monkeypatch) -> None:
    """2 ranks on the model, the cable cut while both wait to receive: each sends PINGs into the cut, its
    kernel drops the stream `drop_after` the first (TCP_RXT_CONNDROPTIME from 3 s: 4.1 s), and the next PING
    meets EPIPE with the ETIMEDOUT behind it. Both ranks raise PeerLostError long before the 20 s deadline.
    (A stream that kept only what it inherited has no drop time: its rank would wait for the deadline.)"""
    import threading
    import time

    from torch_thunderbolt.errors import PeerLostError
    from torch_thunderbolt.protocol.framing import Space

    xnu = Xnu()
    xnu.install(monkeypatch)
    with tcp_world(2, Config(streams=1, link_timeout_ms=3000)) as transports:
        assert xnu.cut() == 2
        cut = time.monotonic()
        outcome: dict = {}

        def wait(t) -> None:
            try:
                t.wait([t.irecv(1 - t.rank, (Space.COLL, 1, 1 - t.rank), memoryview(bytearray(8)))],
                       deadline=time.monotonic() + 20)
                outcome[t.rank] = None
            except BaseException as exc:  # noqa: BLE001 - what the test looks at
                outcome[t.rank] = (exc, time.monotonic() - cut)

        threads = [threading.Thread(target=wait, args=(t,)) for t in transports]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    for r in (0, 1):
        exc, after = outcome[r]
        assert isinstance(exc, PeerLostError), (r, exc)
        assert "timed out" in str(exc).lower() or "ETIMEDOUT" in str(exc), (r, str(exc))
        assert drop_after(3) <= after < drop_after(3) + 4, (r, after)
