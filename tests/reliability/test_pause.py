"""A pause is never a loss: a rank frozen (SIGSTOP) while a peer sends to it is named by that peer's
CollectiveTimeout at the group timeout, never reported lost (PeerLostError) when the link timeout runs out.

Linux applies the link timeout (TCP_USER_TIMEOUT) to a connection whose peer keeps its receive window closed
while its kernel answers the window probes, as a frozen rank's does; the TCP links lift it on a stream while
its kernel holds data the peer has no room for (transport/tcp.py, the window guard). The hard case is data
a send left in the kernel: the send is over for the program, and the stall comes after it. A cut cable, whose
sent data goes unacknowledged, is still found at the link timeout (tests/reliability/test_link_faults.py's
cable cuts, in the lab).
"""
from __future__ import annotations

import socket
import time

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import CollectiveTimeout
from torch_thunderbolt.platform import Platform, SendState
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.rendezvous import tcp as bootstrap
from torch_thunderbolt.testing.reliability.pause import OPS, PauseCase, held_size, run_pause_trial
from torch_thunderbolt.transport.tcp import silent, stalled, tcp_transport

LINUX = Platform.for_system("linux")
needs_tcp_info = pytest.mark.skipif(not hasattr(socket, "TCP_INFO") or not hasattr(socket, "TCP_USER_TIMEOUT"),
                                    reason="Linux only: TCP_INFO and TCP_USER_TIMEOUT")


@needs_tcp_info
@pytest.mark.timeout(60)
def test_data_left_in_the_kernel_for_a_frozen_peer_is_a_timeout_not_a_lost_peer() -> None:
    """The send to a peer that never reads completes (the kernel takes it all), then this rank waits for the
    peer's reply three link timeouts long: CollectiveTimeout, though the kernel holds the data all along with
    the peer's window closed. Once the peer reads again, the link timeout is back on the stream."""
    cfg = Config(link_timeout_ms=1000)
    with socket.create_server(("127.0.0.1", 0)) as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the frozen peer's window: small
        a = socket.create_connection(lst.getsockname())
        frozen, _ = lst.accept()
    bootstrap.tune_socket(a, cfg, LINUX)
    options = bootstrap.link_timeout_options(LINUX, cfg.link_timeout_ms)
    t = tcp_transport(0, 2, {1: [a]}, probe_after=60, plat=LINUX, link_timeout=options)
    try:
        n = 1 << 20  # far more than the peer's window, far less than this side's socket buffer
        t.wait([t.isend(1, (Space.COLL, 1, 0), memoryview(bytearray(n)))], deadline=time.monotonic() + 10)
        time.sleep(0.3)
        state = LINUX.send_state(a)
        assert state is not None and stalled(state) and state.unsent > 0, state  # the case asked about
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            t.wait([t.irecv(1, (Space.COLL, 2, 0), memoryview(bytearray(4)))], deadline=t0 + 3.0)
        assert info.value.ranks == [1], info.value
        assert time.monotonic() - t0 < 4.0
        assert stalled(LINUX.send_state(a))  # still held, still alive
        frozen.setblocking(False)
        got = 0
        end = time.monotonic() + 10
        while got < n and time.monotonic() < end:  # the peer wakes and reads everything
            try:
                got += len(frozen.recv(1 << 20))
            except BlockingIOError:
                time.sleep(0.01)
        while time.monotonic() < end and a.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) != 1000:
            time.sleep(0.02)
        assert got >= n and a.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1000
    finally:
        t.close()
        frozen.close()


def _state(window: int, in_flight: int, unsent: int, acked_ago: float = 0.0, probes: int = 0) -> SendState:
    return SendState(window, in_flight, unsent, segment=1000, acked_ago=acked_ago, probes=probes)


def test_a_stream_is_stalled_only_when_the_kernel_holds_data_the_peer_has_no_room_for() -> None:
    assert stalled(_state(0, 0, 10))  # window probes (persist)
    assert stalled(_state(0, 3, 0))  # a window shut over data in flight
    assert stalled(_state(500, 0, 10_000))  # too small for a segment
    assert not stalled(_state(0, 0, 0))  # nothing to send
    assert not stalled(_state(50_000, 2, 10_000))  # moving
    assert not stalled(_state(500, 2, 10_000))  # moving: acknowledgements will come
    assert not stalled(_state(500, 0, 400))  # it all fits: sent next


def test_a_stalled_peer_is_silent_only_when_two_probes_went_unanswered_for_the_link_timeout() -> None:
    assert not silent(_state(0, 0, 10, acked_ago=3.0, probes=1), 1.0)  # a frozen peer skipping one answer
    assert not silent(_state(0, 0, 10, acked_ago=0.9, probes=2), 1.0)  # too soon to tell
    assert silent(_state(0, 0, 10, acked_ago=1.3, probes=2), 1.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", OPS)
def test_a_rank_frozen_before_an_op_the_kernels_hold_is_named_at_the_group_timeout_never_lost(op: str,
                                                                                             tmp_path) -> None:
    """One trial per op, of a size the kernels hold whole (16 MB, 32 MB for all_reduce, with 4 MB socket
    buffers): the survivor's send is over while part of its data waits in its kernel with the frozen rank's
    window closed. Link timeout 1 s, group timeout 4 s."""
    case = PauseCase(OPS.index(op), op, size=held_size(op), victim=OPS.index(op) % 2, first=True)
    out = run_pause_trial(case, tmp_path, group_timeout=4.0, link_timeout_ms=1000)
    assert not out.lost and out.ok(), out.record()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_twenty_sigstop_trials_at_64_mb_give_no_lost_peer(tmp_path) -> None:
    """20 trials (all_reduce, broadcast and send/recv in turn, 64 MB, victim and moment varied), link timeout
    1 s, group timeout 10 s: every survivor times out at the group timeout naming the frozen rank."""
    outcomes = [run_pause_trial(PauseCase.nth(i), tmp_path / f"trial{i}", group_timeout=10.0, link_timeout_ms=1000)
                for i in range(20)]
    assert not [o.record() for o in outcomes if o.lost], "PeerLostError for a frozen rank"
    assert not [o.record() for o in outcomes if not o.ok()]
