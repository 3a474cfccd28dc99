"""Striping a large message over a peer's streams: the pieces (transport/tcp.py `stripe_pieces`) and who
carries them (`TcpLink._dispatch`: each piece to the next stream with room, so a slower cable carries less)."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from torch_thunderbolt.protocol.framing import FrameDecoder, Kind, Space
from torch_thunderbolt.transport.tcp import STRIPE_ALIGN, STRIPE_PIECE, split_aligned, stripe_pieces, tcp_transport


@pytest.mark.parametrize("nbytes", [0, 1, STRIPE_ALIGN * 3 + 5, STRIPE_PIECE - 1, STRIPE_PIECE * 5 + 12345,
                                    64 << 20])
@pytest.mark.parametrize("streams", [2, 3, 4])
def test_pieces_cover_the_message_in_order_and_are_small_enough_to_share(nbytes: int, streams: int) -> None:
    pieces = stripe_pieces(nbytes, streams)
    assert pieces[0][0] == 0 and sum(ln for _, ln in pieces) == nbytes
    assert all(a + la == b for (a, la), (b, _) in zip(pieces, pieces[1:]))
    if nbytes >= streams * STRIPE_ALIGN:
        assert len(pieces) >= streams
        assert all(off % STRIPE_ALIGN == 0 for off, _ in pieces)
        assert max(ln for _, ln in pieces[:-1]) <= STRIPE_PIECE
    if nbytes <= streams * STRIPE_PIECE:
        assert pieces == split_aligned(nbytes, streams)  # one piece per stream, as a fixed split


def _streams(n: int, small: set[int]) -> tuple[list[socket.socket], list[socket.socket]]:
    """n connected loopback TCP pairs (sender end, receiver end); those in `small` get small buffers, so
    their sockets fill up at once when nobody reads them."""
    lst = socket.create_server(("127.0.0.1", 0))
    out, inn = [], []
    for i in range(n):
        a = socket.socket()
        if i in small:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        a.connect(lst.getsockname())
        b, _ = lst.accept()
        if i in small:
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        b.setblocking(False)
        out.append(a)
        inn.append(b)
    lst.close()
    return out, inn


def _drain(sock: socket.socket, dec: FrameDecoder, frames: list, state: dict) -> int:
    """Read what `sock` has; complete frames go to `frames` as (offset, payload bytes)."""
    got = 0
    while True:
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return got
        got += len(data)
        dec.feed(data)
        while True:
            if state.get("frame") is None:
                f = dec.next_frame()
                if f is None:
                    break
                assert f.kind is Kind.DATA
                state["frame"], state["payload"] = f, bytearray()
            f = state["frame"]
            state["payload"] += dec.take_buffered(f.length - len(state["payload"]))
            if len(state["payload"]) < f.length:
                break
            frames.append((f.offset, bytes(state["payload"])))
            state["frame"] = None


@pytest.mark.timeout(60)
def test_a_stream_that_cannot_send_is_passed_over_and_the_message_arrives_whole() -> None:
    """Stream 1's receiver reads nothing until the end (a cable much slower than stream 0's): the pieces
    go to stream 0 once stream 1 is full, instead of half of the message waiting behind stream 1."""
    pieces = 8
    msg = torch.randint(0, 255, (pieces * STRIPE_PIECE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    out, inn = _streams(2, small={1})
    t = tcp_transport(0, 2, {1: out}, stripe_bytes=256 << 10)
    frames: list[list] = [[], []]
    decs, states = [FrameDecoder(), FrameDecoder()], [{}, {}]
    try:
        req = t.isend(1, (Space.COLL, 1, 0), memoryview(msg.numpy()))
        want = (pieces - 2) * STRIPE_PIECE  # everything but the two pieces stream 1 may hold
        carried = 0
        deadline = time.monotonic() + 5
        while carried < want and time.monotonic() < deadline:
            t.progress(0.01)
            carried += _drain(inn[0], decs[0], frames[0], states[0])
        assert carried >= want, f"stream 0 carried {carried} of {msg.numel()} bytes: the rest waited for stream 1"
        deadline = time.monotonic() + 30
        while not req.done and time.monotonic() < deadline:  # now stream 1's reader catches up
            t.progress(0.01)
            for i in (0, 1):
                _drain(inn[i], decs[i], frames[i], states[i])
        assert req.done and req.error is None
        for i in (0, 1):
            _drain(inn[i], decs[i], frames[i], states[i])
        got = bytearray(msg.numel())
        for i in (0, 1):
            offsets = [off for off, _ in frames[i]]
            assert offsets == sorted(offsets), "a stream carried the pieces out of order"
            for off, payload in frames[i]:
                got[off : off + len(payload)] = payload
        assert len(frames[0]) >= pieces - 2 and len(frames[1]) <= 2, [len(f) for f in frames]
        assert sum(len(p) for fr in frames for _, p in fr) == msg.numel()
        assert bytes(got) == msg.numpy().tobytes()
    finally:
        t.close()
        for s in inn:
            s.close()


@pytest.mark.timeout(60)
def test_equal_streams_share_the_pieces_and_later_messages_keep_their_order() -> None:
    """Both receivers read: the pieces alternate, and a small message posted while pieces wait goes behind
    them on its stream, never ahead of an earlier message."""
    msg = torch.arange(6 * STRIPE_PIECE // 4, dtype=torch.int32)
    small = torch.arange(100, dtype=torch.int32)
    out, inn = _streams(2, small=set())
    t = tcp_transport(0, 2, {1: out}, stripe_bytes=256 << 10)
    frames: list[list] = [[], []]
    decs, states = [FrameDecoder(), FrameDecoder()], [{}, {}]
    try:
        big = t.isend(1, (Space.COLL, 1, 0), memoryview(msg.numpy()).cast("B"))
        tail = t.isend(1, (Space.COLL, 2, 0), memoryview(small.numpy()).cast("B"))
        deadline = time.monotonic() + 30
        while not (big.done and tail.done) and time.monotonic() < deadline:
            t.progress(0.01)
            for i in (0, 1):
                _drain(inn[i], decs[i], frames[i], states[i])
        assert big.done and tail.done
        for i in (0, 1):
            _drain(inn[i], decs[i], frames[i], states[i])
        assert frames[0] and frames[1], "one stream carried everything"
        last = [fr[-1] for fr in frames if len(fr[-1][1]) == small.numel() * 4 and fr[-1][0] == 0]
        assert len(last) == 1, "the small message must come last on its stream"
        big_bytes = sum(len(p) for fr in frames for _, p in fr) - small.numel() * 4
        assert big_bytes == msg.numel() * 4
    finally:
        t.close()
        for s in inn:
            s.close()
