"""The sans-IO wire protocol: frames and handshake, bytes in, events out."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.errors import (CollectiveTimeout, HandshakeError, MismatchError, PeerAbortedError,
                                      PeerLostError, ProtocolError)
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.protocol.framing import (FRAME_HEADER_SIZE, MAX_ABORT_PAYLOAD, AbortInfo, FrameDecoder, Kind,
                                                Space, encode_frame_header)
from torch_thunderbolt.protocol import control
from torch_thunderbolt.transport.base import remote_error


def frame(payload: bytes, tag: int = 5, seq: int = 1, offset: int = 0, total: int | None = None) -> bytes:
    total = len(payload) if total is None else total
    return encode_frame_header(Kind.DATA, Space.COLL, 0x01020304, tag, seq, offset, len(payload), total) + payload


def drain(dec: FrameDecoder) -> list[tuple]:
    out = []
    while (f := dec.next_frame()) is not None:
        out.append((f, dec.take_buffered(f.length)))
    return out


def test_header_round_trip_and_size() -> None:
    assert FRAME_HEADER_SIZE == 48
    dec = FrameDecoder()
    dec.feed(frame(b"hello", tag=-3, seq=9))
    (f, payload), = drain(dec)
    assert (f.kind, f.space, f.sig, f.tag, f.seq, f.length, f.total, payload) == (
        Kind.DATA, Space.COLL, 0x01020304, -3, 9, 5, 5, b"hello")


@given(st.lists(st.binary(max_size=300), max_size=8), st.integers(1, 97))
@settings(max_examples=200, deadline=None)
def test_any_split_of_the_stream_gives_the_same_frames(payloads: list[bytes], cut: int) -> None:
    wire = b"".join(frame(p, seq=i) for i, p in enumerate(payloads))
    dec = FrameDecoder()
    got = []
    for i in range(0, len(wire), cut):
        dec.feed(wire[i : i + cut])
        while True:
            if dec.payload_remaining:
                got[-1][1] += dec.take_buffered(dec.payload_remaining)
                if dec.payload_remaining:
                    break
            f = dec.next_frame()
            if f is None:
                break
            got.append([f.seq, dec.take_buffered(f.length)])
    assert [(s, bytes(p)) for s, p in got] == list(enumerate(payloads))


def test_direct_payload_reads_are_tracked() -> None:
    dec = FrameDecoder()
    dec.feed(frame(b"x" * 100)[:FRAME_HEADER_SIZE + 10])
    f = dec.next_frame()
    assert f.length == 100 and dec.take_buffered(100) == b"x" * 10
    dec.consumed_direct(90)  # the shell read the rest straight into its buffer
    assert dec.payload_remaining == 0 and dec.next_frame() is None


@pytest.mark.parametrize("bad, what", [
    (b"\x00" * FRAME_HEADER_SIZE, "magic"),
    (encode_frame_header(Kind.DATA, Space.COLL, 0, 0, 0, 10, 10, 15), "outside"),
    (encode_frame_header(Kind.DATA, Space.COLL, 0, 0, 0, 0, 0, 1 << 50), "limit"),
    (encode_frame_header(Kind.CONTROL, Space.COLL, 0, 0, 0, 0, 3, 9), "CONTROL frame of 3 of 9"),
    (encode_frame_header(Kind.CONTROL, Space.COLL, 0, 0, 0, 0, 1 << 20, 1 << 20), "CONTROL"),
    (encode_frame_header(Kind.ACK, Space.COLL, 0, 0, 0, 0, 1, 1), "ACK frame carries a payload"),
])
def test_bad_headers_are_protocol_errors(bad: bytes, what: str) -> None:
    dec = FrameDecoder(max_message=1 << 40)
    dec.feed(bad)
    with pytest.raises(ProtocolError, match=what):
        dec.next_frame()


@given(st.binary(min_size=0, max_size=400))
@settings(max_examples=500, deadline=None)
def test_fuzz_only_protocol_errors_escape(data: bytes) -> None:
    dec = FrameDecoder(max_message=1 << 20)
    try:
        dec.feed(data)
        drain(dec)
    except ProtocolError:
        pass


def test_abort_frame_carries_the_reason() -> None:
    dec = FrameDecoder()
    dec.feed(control.framed(control.Abort(AbortInfo.of(ValueError("boom"), rank=2))))
    (f, payload), = drain(dec)
    assert f.kind is Kind.CONTROL
    assert control.decode(payload) == control.Abort(AbortInfo("ValueError", "boom", 2, -1, ()))


def test_abort_info_carries_the_ranks_as_data() -> None:
    lost = AbortInfo.decode(AbortInfo.of(PeerLostError("rank 1: gone", rank=1, peer=3), 1).encode())
    assert (lost.error, lost.rank, lost.peer) == ("PeerLostError", 1, 3)
    late = AbortInfo.decode(AbortInfo.of(CollectiveTimeout("Timed out", ranks=[2, 4]), 0).encode())
    assert (late.error, late.ranks) == ("CollectiveTimeout", (2, 4))


def test_the_receiver_names_the_ranks_the_abort_names_not_those_in_its_text() -> None:
    """The ranks come from the ABORT's fields: a message that mentions other ranks does not mislead."""
    lost = remote_error(0, 1, AbortInfo("PeerLostError", "rank 1: lost the connection to rank 5 (it was 3)", 1, 3))
    assert isinstance(lost, PeerLostError) and lost.peer == 3 and lost.rank == 0
    late = remote_error(0, 1, AbortInfo("CollectiveTimeout", "ranks that did not arrive: [7]", 1, -1, (2,)))
    assert isinstance(late, CollectiveTimeout) and late.ranks == [2]
    assert remote_error(0, 1, AbortInfo("CollectiveTimeout", "Timed out", 1)).ranks == [1]  # no blame: the sender
    assert isinstance(remote_error(0, 1, AbortInfo("MismatchError", "x", 1)), MismatchError)
    other = remote_error(0, 1, AbortInfo("ValueError", "boom", 1))
    assert isinstance(other, PeerAbortedError) and other.peer == 1 and "ValueError: boom" in str(other)
    forwarded = remote_error(0, 1, AbortInfo("PeerAbortedError", "rank 1: rank 2 aborted the group: x", 1, 2))
    assert isinstance(forwarded, PeerAbortedError) and forwarded.peer == 2  # who failed first, not the messenger


def test_a_long_abort_reason_is_cut_to_fit() -> None:
    body = AbortInfo.of(MismatchError("\u00e9\n" * 5000), 0).encode()
    assert len(body) <= MAX_ABORT_PAYLOAD
    info = AbortInfo.decode(body)
    assert info.error == "MismatchError" and info.reason and set(info.reason) <= {"\u00e9", "\n"}


@pytest.mark.parametrize("body", [b"", b"ValueError: boom", b"[]", b'{"error": "X"}',
                                  b'{"error": 1, "reason": "", "rank": 0, "peer": 0, "ranks": []}',
                                  b'{"error": "X", "reason": "", "rank": 0, "peer": 0, "ranks": ["1"]}', b"\xff"])
def test_a_malformed_abort_body_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        AbortInfo.decode(body)


def _pair(secret_s: bytes = b"s" * 32, secret_c: bytes = b"s" * 32, group_s: str = "g", group_c: str = "g",
          accept=lambda r, s: True, client_rank: int = 3, server_rank: int = 1, stream: int = 0):
    server = hs.ServerHandshake(secret_s, server_rank, group_s, accept, streams=2)
    client = hs.ClientHandshake(secret_c, client_rank, server_rank, stream, group_c)
    return server, client


def test_handshake_accepts_the_right_peer() -> None:
    server, client = _pair()
    hello = client.receive_challenge(server.challenge())
    res = server.receive(hello[:10])
    assert res is None  # needs the rest
    res = server.receive(hello[10:])
    assert (res.peer_rank, res.stream) == (3, 0)
    client.receive_reply(server.reply)  # mutual: the server proved the secret too


@pytest.mark.parametrize("case, match", [
    ({"secret_c": b"x" * 32}, "secret"),
    ({"group_c": "other"}, "group"),
    ({"accept": lambda r, s: False}, "not expected"),
    ({"stream": 5}, "out of range"),
])
def test_handshake_refusals(case: dict, match: str) -> None:
    server, client = _pair(**case)
    try:
        hello = client.receive_challenge(server.challenge())
    except HandshakeError as exc:  # the client already sees the listener belongs to another group
        assert match in str(exc)
        return
    with pytest.raises(HandshakeError, match=match):
        server.receive(hello)
    with pytest.raises(HandshakeError, match="refused"):
        client.receive_reply(server.reply)


def test_handshake_rejects_garbage_and_wrong_version() -> None:
    server, _ = _pair()
    with pytest.raises(HandshakeError, match="not a torch-thunderbolt"):
        server.receive(b"GET / HTTP/1.1\r\n" + b"x" * (hs.HELLO_SIZE - 16))
    server, client = _pair()
    hello = bytearray(client.receive_challenge(server.challenge()))
    hello[6:8] = (99).to_bytes(2, "little")
    with pytest.raises(HandshakeError, match="version 99"):
        server.receive(bytes(hello))


def test_client_detects_wrong_rank_at_address() -> None:
    server = hs.ServerHandshake(b"s" * 32, 2, "g", lambda r, s: True, 1)
    client = hs.ClientHandshake(b"s" * 32, 3, 1, 0, "g")
    with pytest.raises(HandshakeError, match="expected rank 1"):
        client.receive_challenge(server.challenge())


def test_handshake_binds_the_addresses_each_end_used() -> None:
    """A relay forwards a genuine HELLO over a connection of its own: the addresses the client dialled and
    dialled from are not those of the connection the server accepted, so the server refuses it (and says
    why, so the client can); a direct connection is accepted, and both ends derive the same stream key."""
    key = b"s" * 32
    server = hs.ServerHandshake(key, 0, "g", lambda r, s: True, 1, local=("10.0.0.1", 5000),
                                peer=("10.0.0.2", 40001))
    relayed = hs.ClientHandshake(key, 1, 0, 0, "g", dialled=("10.0.0.9", 6000), local=("10.0.0.2", 40002))
    with pytest.raises(HandshakeError, match="relayed: rank 1 dialled 10.0.0.9:6000 from 10.0.0.2:40002, but "
                                             "the connection reached this rank at 10.0.0.1:5000 from "
                                             "10.0.0.2:40001") as info:
        server.receive(relayed.receive_challenge(server.challenge()))
    assert info.value.why == "relay"
    with pytest.raises(HandshakeError, match="refused") as info:
        relayed.receive_reply(server.reply)
    assert info.value.why == "relay"

    server = hs.ServerHandshake(key, 0, "g", lambda r, s: True, 1, local=("10.0.0.1", 5000),
                                peer=("10.0.0.2", 40001))
    direct = hs.ClientHandshake(key, 1, 0, 0, "g", dialled=("10.0.0.1", 5000), local=("10.0.0.2", 40001))
    res = server.receive(direct.receive_challenge(server.challenge()))
    direct.receive_reply(server.reply)
    assert res.session == direct.session and len(res.session) == 32 and res.session != key


def test_a_bad_mac_is_told_apart_from_other_refusals() -> None:
    server, client = _pair(secret_c=b"x" * 32)
    with pytest.raises(HandshakeError) as info:
        server.receive(client.receive_challenge(server.challenge()))
    assert info.value.why == "mac" and server.claimed_rank == 3
    with pytest.raises(HandshakeError) as info:
        client.receive_reply(server.reply)
    assert info.value.why == "mac"
    server, client = _pair(accept=lambda r, s: False)
    with pytest.raises(HandshakeError) as info:
        server.receive(client.receive_challenge(server.challenge()))
    assert info.value.why == ""
