"""Small collective messages over TCP: `Transport.exchange` and the link's `take` (transport/tcp.py), which
reads an op's messages straight off the stream and gives everything else back to the general path exactly
as it arrived; and the read-ahead of a small message of a later op, which keeps the
stream readable (a peer's probes and ABORT behind it) within a budget, and is still a mismatch if its op
ends without taking it.

Rank 0 is a real TCP transport; "rank 1" is the raw other end of its stream, so each test writes the bytes
it wants, split where it wants, and in the order it wants.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest
import torch

from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import MismatchError, PeerAbortedError, PeerLostError
from torch_thunderbolt.protocol import control
from torch_thunderbolt.protocol.framing import (FRAME_HEADER_SIZE, AbortInfo, FrameDecoder, Kind, Space,
                                               encode_frame_header)
from torch_thunderbolt.transport.engine import Transport
from torch_thunderbolt.transport.base import NOT_YET, REFUSED, TAKEN
from torch_thunderbolt.transport.matching import EARLY_BUDGET
from torch_thunderbolt.transport.tcp import tcp_transport
from torch_thunderbolt.testing.worlds import on_threads, tcp_world

pytestmark = pytest.mark.timeout(60)

SIG = 0x1234_5678_9ABC_DEF0
TAG = 7


@pytest.fixture
def pair() -> Iterator[tuple[Transport, socket.socket]]:
    """Rank 0's transport (one stream to rank 1, 200 µs spin) and rank 1's raw end of that stream."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        peer = socket.create_connection(ls.getsockname())
        mine, _ = ls.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = tcp_transport(0, 2, {1: [mine]}, spin_us=200)
    try:
        yield t, peer
    finally:
        t.close()
        peer.close()


def frame(payload: bytes, key: tuple[int, int, int] = (Space.COLL, TAG, 0), sig: int = SIG,
          kind: Kind = Kind.DATA) -> bytes:
    space, tag, seq = key
    return encode_frame_header(kind, space, sig, tag, seq, 0, len(payload), len(payload)) + payload


def quick(t: Transport) -> int:
    return t.kinds[0].quick_messages


def later(seconds: float, fn) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def settle() -> None:
    time.sleep(0.02)  # loopback delivers at once; this is only so that the bytes are surely there


def test_a_whole_message_is_read_without_the_decoder(pair) -> None:
    t, peer = pair
    payload = bytes(range(256)) * 16
    peer.sendall(frame(payload))
    settle()
    dest = bytearray(len(payload))
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)
    assert dest == payload
    assert quick(t) == 1
    assert t.kinds[0].bytes_received == len(payload)


def test_a_message_in_pieces_is_read_piece_by_piece(pair) -> None:
    t, peer = pair
    payload = bytes(range(200))
    data = frame(payload)
    link = t.kinds[0].links[1]
    dest = memoryview(bytearray(len(payload)))
    key = (Space.COLL, TAG, 0)
    # Cut inside the header, at its end, and inside the payload.
    pieces = [data[:20], data[20:FRAME_HEADER_SIZE], data[FRAME_HEADER_SIZE:FRAME_HEADER_SIZE + 100],
              data[FRAME_HEADER_SIZE + 100:]]
    with t._lock:
        assert link.take(key, SIG, dest) == NOT_YET  # nothing yet
        for i, piece in enumerate(pieces):
            peer.sendall(piece)
            settle()
            assert link.take(key, SIG, dest) == (TAKEN if i == len(pieces) - 1 else NOT_YET), i
    assert dest == payload


def test_another_frame_first_is_handed_back_and_both_arrive(pair) -> None:
    """A point-to-point message written before the collective one: the take finds its header,
    gives back every byte it read, and the general path delivers both, each to its own receive."""
    t, peer = pair
    p2p, coll = b"p2p-bytes" * 30, bytes(range(250)) * 4
    peer.sendall(frame(p2p, key=(Space.P2P, 5, 0), sig=0) + frame(coll))
    settle()
    dest, box = bytearray(len(coll)), bytearray(len(p2p))
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)
    assert dest == coll
    assert quick(t) == 0, "the collective message came second: the general path must have read it"
    t.wait([t.irecv_p2p(1, 5, memoryview(box))], time.monotonic() + 5)
    assert box == p2p


@pytest.mark.parametrize("first", [20, FRAME_HEADER_SIZE + 300])
def test_a_message_that_stops_part_way_is_finished_by_the_general_path(pair, first: int) -> None:
    """The spin ends with part of the header (or part of the payload) read: those bytes go back to the
    stream's decoder, which reads the rest when it comes."""
    t, peer = pair
    payload = bytes(range(256)) * 4
    data = frame(payload)
    peer.sendall(data[:first])
    th = later(0.05, lambda: peer.sendall(data[first:]))
    dest = bytearray(len(payload))
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)
    th.join()
    assert dest == payload
    assert quick(t) == 0


def test_a_message_that_comes_after_the_spin_is_received(pair) -> None:
    t, peer = pair
    payload = b"late" * 100
    th = later(0.05, lambda: peer.sendall(frame(payload)))
    dest = bytearray(len(payload))
    t0 = time.monotonic()
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, t0 + 5)
    th.join()
    assert dest == payload and time.monotonic() - t0 >= 0.04


def test_another_ops_message_is_still_a_mismatch(pair) -> None:
    """The same op number with another signature (a peer in another collective): the header differs, the
    general path reads it and names the mismatch, as it would without the take."""
    t, peer = pair
    payload = bytes(400)
    peer.sendall(frame(payload, sig=SIG ^ 0xFF))
    dest = bytearray(len(payload))
    with pytest.raises(MismatchError, match="mismatched operation with rank 1"):
        t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)


def test_a_message_of_another_size_is_a_mismatch(pair) -> None:
    t, peer = pair
    peer.sendall(frame(bytes(300)))
    dest = bytearray(400)
    with pytest.raises(MismatchError, match="300 bytes"):
        t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)


def test_a_peer_that_closes_is_lost(pair) -> None:
    t, peer = pair
    peer.sendall(frame(bytes(100))[:30])
    peer.close()
    dest = bytearray(100)
    with pytest.raises(PeerLostError) as info:
        t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)
    assert info.value.peer == 1


def test_two_messages_from_one_peer_go_the_general_way(pair) -> None:
    """Two readers of one stream would take each other's bytes: one op's two messages from the same peer
    are received the general way."""
    t, peer = pair
    a, b = b"a" * 300, b"b" * 500
    peer.sendall(frame(a, key=(Space.COLL, TAG, 0)) + frame(b, key=(Space.COLL, TAG, 1)))
    da, db = bytearray(len(a)), bytearray(len(b))
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(da)), (1, (Space.COLL, TAG, 1), memoryview(db))], SIG,
               time.monotonic() + 5)
    assert (da, db) == (a, b) and quick(t) == 0


def test_a_message_of_the_striping_size_goes_the_general_way(pair) -> None:
    """A peer with several streams stripes it (pieces whose headers the take would not match, each
    byte read then copied again), and it would outlast the spin: the general path receives it."""
    t, peer = pair
    n = t.kinds[0].stripe_bytes
    payload = bytes(range(256)) * (n // 256)
    assert t.kinds[0].links[1].take((Space.COLL, TAG, 0), SIG, memoryview(bytearray(n))) == REFUSED
    sender = threading.Thread(target=lambda: peer.sendall(frame(payload)), daemon=True)
    sender.start()
    dest = bytearray(n)
    t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, time.monotonic() + 5)
    sender.join(5)
    assert dest == payload and quick(t) == 0


def test_the_sends_are_ordinary_frames(pair) -> None:
    """What `exchange` writes is what isend writes: one frame per message, in order."""
    t, peer = pair
    x, y = bytes(range(100)), bytes(range(50))
    t.exchange([(1, (Space.COLL, TAG, 0), memoryview(x)), (1, (Space.COLL, TAG, 1), memoryview(y))], [], SIG,
               time.monotonic() + 5)
    expected = frame(x) + frame(y, key=(Space.COLL, TAG, 1))
    got = b""
    peer.settimeout(5)
    while len(got) < len(expected):
        got += peer.recv(4096)
    assert got == expected
    dec = FrameDecoder()
    dec.feed(got)
    f = dec.next_frame()
    assert (f.kind, f.key, f.sig, f.total) == (Kind.DATA, (Space.COLL, TAG, 0), SIG, 100)


@pytest.mark.parametrize("world", [2, 3])
def test_small_collectives_over_tcp_take_the_quick_receive_and_give_exact_results(world: int) -> None:
    """Over real TCP between threads: small all_reduce (direct), broadcast and all_gather give the reference
    bits on every rank, and their messages are read by the take (most of them: a message that
    arrives after the spin goes the general way)."""
    n, ops = 1000, 30
    with tcp_world(world, Config(streams=2)) as ts:
        def body(r: int):
            comm = Communicator(ts[r], Config(), timeout=20)
            out = []
            for i in range(ops):
                x = torch.randn(n, generator=torch.Generator().manual_seed(100 * i + r))
                comm.all_reduce(x)
                b = torch.full((n,), float(r))
                comm.broadcast(b, root=i % world)
                g = torch.empty(world * n)
                comm.all_gather(g, torch.full((n,), float(r * 10 + i)))
                out.append((x, b, g))
            return out

        run = on_threads(world, body, 50)
        assert not run.errors and not run.hung, (run.errors, run.hung)
        for i in range(ops):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * i + r)) for r in range(world)]
            ref = xs[0].clone()
            for r in range(1, world):
                ref += xs[r]
            for r in range(world):
                x, b, g = run.results[r][i]
                assert torch.equal(x, ref), (i, r)
                assert torch.equal(b, torch.full((n,), float(i % world))), (i, r)
                assert torch.equal(g, torch.cat([torch.full((n,), float(q * 10 + i)) for q in range(world)])), (i, r)
        assert sum(t.kinds[0].quick_messages for t in ts) > 0


def test_an_abort_behind_a_later_ops_small_message_is_read_at_once(pair) -> None:
    """The peer is one op ahead: its next op's small message, then its ABORT. The message is read ahead
    and kept, so the ABORT is read too and this rank fails with the peer's reason at once, not at its own
    deadline (a parked message would hold everything behind it on the stream)."""
    t, peer = pair
    peer.sendall(frame(bytes(400), key=(Space.COLL, TAG + 1, 0)) + control.framed(control.Abort(AbortInfo.of(RuntimeError("it went wrong")))))
    peer.close()  # as a failing rank does after its ABORT (this rank's own ABORT then finds it gone at once)
    dest = bytearray(100)
    t0 = time.monotonic()
    with pytest.raises(PeerAbortedError, match="it went wrong"):
        t.exchange([], [(1, (Space.COLL, TAG, 0), memoryview(dest))], SIG, t0 + 5)
    assert time.monotonic() - t0 < 1


def test_a_message_read_ahead_is_received_in_its_op(pair) -> None:
    t, peer = pair
    now, later = bytes(range(100)), bytes(range(200))
    peer.sendall(frame(now) + frame(later, key=(Space.COLL, TAG + 1, 0)))
    settle()
    a, b = bytearray(len(now)), bytearray(len(later))
    # The general path reads both (a receive posted the ordinary way), the second one ahead of its op.
    t.wait([t.irecv(1, (Space.COLL, TAG, 0), memoryview(a), SIG)], time.monotonic() + 5)
    t.progress(0.05)
    t.retire(TAG)
    assert (1, (Space.COLL, TAG + 1, 0)) in t.matcher.unexpected
    t.exchange([], [(1, (Space.COLL, TAG + 1, 0), memoryview(b))], SIG, time.monotonic() + 5)
    t.retire(TAG + 1)
    assert (a, b) == (now, later) and not t.matcher.unexpected


def test_a_message_read_ahead_that_its_op_never_takes_is_a_mismatch(pair) -> None:
    """The peer sent data for an op in which this rank expects nothing from it (another collective or
    root): when that op ends here, the kept message is named, as a parked one is."""
    t, peer = pair
    peer.sendall(frame(bytes(300), key=(Space.COLL, TAG, 0)))
    settle()
    t.progress(0.05)
    assert (1, (Space.COLL, TAG, 0)) in t.matcher.unexpected
    with pytest.raises(MismatchError, match=f"rank 1 sent .* data for op #{TAG}, which this rank finished"):
        t.retire(TAG)


def test_read_ahead_stops_at_its_budget_and_the_rest_parks(pair) -> None:
    """A peer running many small ops ahead (a root broadcasting in a loop): a few of its messages are kept,
    then the stream parks, so TCP flow control holds the sender back; every message still arrives whole
    and in its op."""
    t, peer = pair
    n = t.kinds[0].early_bytes
    payloads = [bytes([i]) * n for i in range(EARLY_BUDGET + 2)]
    sender = threading.Thread(target=lambda: peer.sendall(b"".join(
        frame(p, key=(Space.COLL, TAG + i, 0)) for i, p in enumerate(payloads))), daemon=True)
    sender.start()
    time.sleep(0.1)
    t.progress(0.05)
    link = t.kinds[0].links[1]
    assert len(t.matcher.unexpected) == EARLY_BUDGET
    assert link.streams[0].parked is not None and link.streams[0].parked.tag == TAG + EARLY_BUDGET
    for i, p in enumerate(payloads):
        dest = bytearray(n)
        t.exchange([], [(1, (Space.COLL, TAG + i, 0), memoryview(dest))], SIG, time.monotonic() + 5)
        t.retire(TAG + i)
        assert dest == p, i
    sender.join(5)


def test_a_rank_one_op_ahead_learns_whom_the_rank_behind_waits_on() -> None:
    """Rank 2 sends its part of op 1 to rank 0 only, then freezes. Rank 0 finishes op 1 and sends its part
    of op 2 to rank 1, which is still in op 1, waiting on rank 2. Rank 0's timeout (the shorter one here)
    must blame rank 2 alone: rank 1 answers its probe with the rank it waits on. A parked op-2 message
    held rank 0's probe behind it, unread, and rank 0 blamed ranks 1 and 2."""
    from torch_thunderbolt.algorithms.plan import tensor_bytes
    from torch_thunderbolt.errors import CollectiveTimeout

    n = 256
    with tcp_world(3, Config(streams=1, link_timeout_ms=1500)) as ts:
        def body(r: int):
            comm = Communicator(ts[r], Config(), timeout=(3.0, 8.0, 8.0)[r])
            x = torch.ones(n)
            if r == 2:  # its part of op 1 to rank 0 only, then nothing
                sig = comm._sig("all_reduce", x, 0, n, "sum", None)
                ts[2].exchange([(0, (Space.COLL, 1, 0), tensor_bytes(x))], [], sig, time.monotonic() + 5)
                time.sleep(4)
                return None
            try:
                for _ in range(2):
                    comm.all_reduce(x)
            except CollectiveTimeout as exc:
                return exc
            return None

        run = on_threads(3, body, 30)
    err = run.results[0]
    assert isinstance(err, CollectiveTimeout), (run.results, run.errors)
    assert err.ranks == [2], str(err)
    assert "rank 1 is itself waiting on rank 2" in str(err), str(err)
