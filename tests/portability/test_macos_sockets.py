"""macOS socket behaviour, run on Linux: sockets of the darwin model (testing/darwin.py) and fakes that fail
the way XNU does.

XNU fails a single send/recv over INT_MAX bytes with EINVAL (Linux moves part of it), refuses socket
buffers above its limit with ENOBUFS up to macOS 14.3 (Linux caps them), and on macOS 15+ answers
connections to directly attached peers with EHOSTUNREACH/EPERM when the app lacks the Local Network
permission.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import pytest
import torch

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, PeerLostError
from torch_thunderbolt.platform import INT_MAX, LOCAL_NETWORK_SETTING, SOCKET_IO_CAP, Platform
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.rendezvous import tcp as bootstrap
from torch_thunderbolt.rendezvous.setup import SetUp
from torch_thunderbolt.testing.darwin import Xnu
from torch_thunderbolt.transport.engine import Transport
from torch_thunderbolt.transport.tcp import tcp_transport

DARWIN = Platform.for_system("darwin")
LINUX = Platform.for_system("linux")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_message_over_int_max_bytes_moves_in_calls_macos_accepts() -> None:
    """One 2 GiB + message over one stream: every sendmsg/recv_into stays within the 1 GiB cap. Without the
    cap, the first sendmsg would ask for the whole message, and the fake (like XNU) fails that with EINVAL."""
    n = INT_MAX + 1 + 4099
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    xnu = Xnu()
    fa, fb = xnu.wrap(a), xnu.wrap(b)
    t0, t1 = tcp_transport(0, 2, {1: [fa]}), tcp_transport(1, 2, {0: [fb]})
    src = torch.empty(n, dtype=torch.uint8)  # untouched pages stay unallocated; the marks below are checked
    marks = [0, 1, SOCKET_IO_CAP - 1, SOCKET_IO_CAP, INT_MAX, INT_MAX + 1, n - 1]
    for i, pos in enumerate(marks):
        src[pos] = 11 + i
    dst = torch.zeros(n, dtype=torch.uint8)
    errors: list[BaseException] = []

    def side(t: Transport, send: bool) -> None:
        try:
            key = (Space.COLL, 1, 0)
            req = (t.isend(1, key, memoryview(src.numpy()).cast("B")) if send
                   else t.irecv(0, key, memoryview(dst.numpy()).cast("B")))
            t.wait([req], deadline=time.monotonic() + 100)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(t0, True)), threading.Thread(target=side, args=(t1, False))]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(110)
    finally:
        t0.close()
        t1.close()
    assert not errors, errors
    assert 0 < fa.largest <= SOCKET_IO_CAP and 0 < fb.largest <= SOCKET_IO_CAP
    assert [int(dst[p]) for p in marks] == [11 + i for i in range(len(marks))]


class BufferLimitedSocket:
    """SO_SNDBUF/SO_RCVBUF above `limit` fail with ENOBUFS, as on macOS up to 14.3; records what was set."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.set: dict[int, int] = {}

    def setsockopt(self, level: int, option: int, value) -> None:
        if level == socket.SOL_SOCKET and option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            if value > self.limit:
                raise OSError(errno.ENOBUFS, "No buffer space available")
            self.set[option] = value

    def getsockopt(self, level: int, option: int) -> int:
        return self.set[option]


def test_socket_buffers_above_the_macos_limit_are_retried_smaller_with_one_warning(caplog) -> None:
    cfg = Config(socket_buffer=16 << 20)
    tuner = bootstrap.SocketTuner(cfg, DARWIN, rank=2)
    socks = [BufferLimitedSocket(limit=7 << 20) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt.bootstrap"):
        for s in socks:
            tuner.tune(s)
    for s in socks:
        assert s.set == {socket.SO_SNDBUF: 4 << 20, socket.SO_RCVBUF: 4 << 20}
    warnings = [r.getMessage() for r in caplog.records if "SOCKET_BUFFER" in r.getMessage()]
    assert len(warnings) == 1 and "rank 2" in warnings[0] and str(4 << 20) in warnings[0]


def test_a_socket_buffer_within_the_limit_is_set_as_asked_without_warning(caplog) -> None:
    s = BufferLimitedSocket(limit=7 << 20)
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt.bootstrap"):
        bootstrap.tune_socket(s, Config(socket_buffer=4 << 20), DARWIN)
    assert s.set == {socket.SO_SNDBUF: 4 << 20, socket.SO_RCVBUF: 4 << 20}
    assert not [r for r in caplog.records if "SOCKET_BUFFER" in r.getMessage()]


def test_the_effective_socket_buffer_is_what_the_linux_kernel_reports() -> None:
    """Linux caps silently at net.core.rmem_max and reports double: the effective size undoes both."""
    with open("/proc/sys/net/core/rmem_max") as fh:
        rmem_max = int(fh.read())
    for asked in (64 << 10, 64 << 20):
        assert bootstrap.effective_socket_buffer(Config(socket_buffer=asked), LINUX) == min(asked, rmem_max)


def test_thunderbolt_cc_warns_once_on_macos_that_it_does_nothing(caplog) -> None:
    tuner = bootstrap.SocketTuner(Config(congestion_control="cubic"), DARWIN, rank=1)
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt.bootstrap"):
        for _ in range(3):
            with socket.socket() as s:
                tuner.tune(s)
    warnings = [r.getMessage() for r in caplog.records if "THUNDERBOLT_CC" in r.getMessage()]
    assert len(warnings) == 1 and "does nothing on darwin" in warnings[0]


class DeniedSocket(BufferLimitedSocket):
    """connect() fails the way macOS 15+ fails it without the Local Network permission."""

    def __init__(self, err: int, calls: list) -> None:
        super().__init__(limit=1 << 30)
        self.err, self.calls = err, calls

    def settimeout(self, t) -> None:
        pass

    def bind(self, addr) -> None:
        pass

    def connect(self, target) -> None:
        self.calls.append(target)
        raise OSError(self.err, errno.errorcode[self.err])

    def close(self) -> None:
        pass


@pytest.mark.parametrize("err", [errno.EPERM, errno.EHOSTUNREACH])
def test_a_peer_denied_by_local_network_privacy_fails_within_seconds_naming_the_setting(err) -> None:
    calls: list = []
    cfg = Config()
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        bootstrap._connect(3, 1, 0, ("169.254.10.2", 29500), "", b"k" * 32, "g", cfg, time.monotonic() + 120,
                           bootstrap.SocketTuner(cfg, DARWIN, rank=3), lambda: DeniedSocket(err, calls))
    assert time.monotonic() - start < 5
    assert len(calls) == bootstrap.LOCAL_NETWORK_TRIES
    text = str(info.value)
    assert LOCAL_NETWORK_SETTING in text and "rank 3" in text and "rank 1" in text and "169.254.10.2:29500" in text


def test_on_linux_the_same_errors_are_retried_until_the_deadline() -> None:
    calls: list = []
    cfg = Config()
    with pytest.raises(PeerLostError):
        bootstrap._connect(0, 1, 0, ("10.0.0.2", 29500), "", b"k" * 32, "g", cfg, time.monotonic() + 0.6,
                           bootstrap.SocketTuner(cfg, LINUX), lambda: DeniedSocket(errno.EHOSTUNREACH, calls))
    assert len(calls) > bootstrap.LOCAL_NETWORK_TRIES


def test_the_open_file_soft_limit_is_raised_when_a_job_needs_more_sockets() -> None:
    import resource

    limits = {"now": (256, 10240)}  # macOS's default soft limit
    calls: list = []

    def setrlimit(which, value):
        calls.append(value)
        limits["now"] = value

    got = bootstrap.ensure_open_files(31 * 8 * 2 + bootstrap.OPEN_FILES_MARGIN, 0,
                                      lambda which: limits["now"], setrlimit)
    assert got == 31 * 8 * 2 + bootstrap.OPEN_FILES_MARGIN and calls == [(got, 10240)]
    # Enough already: untouched. Above the hard limit: up to the hard limit.
    assert bootstrap.ensure_open_files(100, 0, lambda which: (1024, 4096), setrlimit) == 1024 and len(calls) == 1
    assert bootstrap.ensure_open_files(9000, 0, lambda which: (256, 4096), setrlimit) == 4096
    assert calls[-1] == (4096, 4096)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)  # the real one is untouched by the fakes


def test_connect_tcp_asks_for_enough_open_files(monkeypatch) -> None:
    """A 33-rank job with 4 streams needs 32 * 4 * 2 sockets plus the margin; the set-up asks for them
    before opening any."""
    asked: list = []

    def stop(needed, rank=None, *a):
        asked.append(needed)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bootstrap, "ensure_open_files", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        bootstrap.connect_tcp_links(SetUp(object(), 0, 33, Config(streams=4), 5.0, tuple(range(1, 33)),
                                          tuple(range(33)), None, None))
    assert asked == [32 * 4 * 2 + bootstrap.OPEN_FILES_MARGIN]


def _late_receive(guard: bool) -> tuple[list[BaseException], bool]:
    """A 64 MB send to a receiver that posts its receive three link timeouts late (its stream parks the
    frame, so flow control closes the window): the sender's errors, and whether the data arrived whole."""
    cfg = Config(link_timeout_ms=1000)
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    for s in (a, b):
        bootstrap.tune_socket(s, cfg, LINUX)
    # As the set-up builds them (rendezvous.tcp), or without the link timeout to lift (guard off).
    options = {"plat": LINUX, "link_timeout": bootstrap.link_timeout_options(LINUX, cfg.link_timeout_ms) if guard
               else ()}
    t0 = tcp_transport(0, 2, {1: [a]}, probe_after=60, **options)
    t1 = tcp_transport(1, 2, {0: [b]}, probe_after=60, **options)
    n = 64 << 20  # far more than both socket buffers hold
    src, dst = torch.arange(n, dtype=torch.int64).to(torch.uint8), torch.zeros(n, dtype=torch.uint8)
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            t0.wait([t0.isend(1, (Space.COLL, 1, 0), memoryview(src.numpy()).cast("B"))],
                    deadline=time.monotonic() + 30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=sender)
    th.start()
    try:
        time.sleep(3.0)  # the receiving rank is busy elsewhere, three link timeouts long
        try:
            t1.wait([t1.irecv(0, (Space.COLL, 1, 0), memoryview(dst.numpy()).cast("B"))],
                    deadline=time.monotonic() + 30)
        except BaseException as exc:  # noqa: BLE001 - the sender's error is the one asked about
            errors.append(exc)
        th.join(30)
    finally:
        t0.close()
        t1.close()
    return errors, torch.equal(src, dst)


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="the peer's window is read from TCP_INFO (Linux)")
@pytest.mark.timeout(60)
def test_a_receive_posted_after_the_link_timeout_still_gets_a_large_parked_message() -> None:
    """Linux applies TCP_USER_TIMEOUT to zero-window probes too: a sender whose peer keeps its window closed
    longer than the link timeout would lose a healthy connection. The TCP links lift the timeout while
    they see the window closed, and put it back when data moves."""
    errors, whole = _late_receive(guard=True)
    assert not errors, errors
    assert whole


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="the peer's window is read from TCP_INFO (Linux)")
@pytest.mark.timeout(60)
def test_without_lifting_the_link_timeout_the_kernel_ends_that_connection() -> None:
    """What the guard is for, shown on this kernel: the same late receive with the timeout left in place."""
    errors, _ = _late_receive(guard=False)
    assert errors and any("timed out" in str(e).lower() or "lost the connection" in str(e) for e in errors), errors


def test_the_closed_window_guard_is_linux_only_and_the_kernel_is_asked_only_there() -> None:
    assert LINUX.timeout_on_closed_window and not DARWIN.timeout_on_closed_window
    with socket.create_server(("127.0.0.1", 0)) as lst, socket.create_connection(lst.getsockname()) as a:
        b, _ = lst.accept()
        with b:
            assert DARWIN.send_state(a) is None  # macOS mode never asks the kernel
            if hasattr(socket, "TCP_INFO"):
                state = LINUX.send_state(a)  # a fresh connection: the peer's window is open, nothing held
                assert state is not None and state.window > 0 and not state.in_flight and not state.unsent
                assert state.segment > 0


def test_on_linux_enobufs_from_a_socket_buffer_is_not_papered_over() -> None:
    """Linux caps oversized buffers itself: an ENOBUFS there is something else, and is raised."""
    with pytest.raises(OSError) as info:
        bootstrap.SocketTuner(Config(socket_buffer=16 << 20), LINUX).tune(BufferLimitedSocket(limit=7 << 20))
    assert info.value.errno == errno.ENOBUFS
