"""Failover bookkeeping without sockets: what a stream log keeps, copies and resends."""
import errno

import pytest

from torch_thunderbolt.errors import ProtocolError
from torch_thunderbolt.protocol.framing import FRAME_HEADER_SIZE as H
from torch_thunderbolt.protocol.framing import FrameDecoder, Kind, encode_control
from torch_thunderbolt.transport.failover import Fields, StreamLog, is_link_failure


def _fields(offset: int, length: int, total: int = 1000, tag: int = 7) -> Fields:
    return Fields(0, 0, tag, 0, offset, length, total)


def test_control_frames_round_trip_and_must_not_carry_a_payload():
    dec = FrameDecoder()
    dec.feed(encode_control(Kind.RESYNC, 123456789, stream=3) + encode_control(Kind.ACK, 42))
    resync, ack = dec.next_frame(), dec.next_frame()
    assert (resync.kind, resync.tag, resync.offset) == (Kind.RESYNC, 3, 123456789)
    assert (ack.kind, ack.offset) == (Kind.ACK, 42)
    raw = bytearray(encode_control(Kind.ACK, 1))
    raw[-8:] = (5).to_bytes(8, "little")  # a `total` on a control frame
    dec = FrameDecoder()
    dec.feed(bytes(raw))
    with pytest.raises(ProtocolError, match="ACK frame carries a payload"):
        dec.next_frame()


def test_an_unfinished_frame_is_resent_from_the_callers_buffer_after_what_the_peer_consumed():
    log = StreamLog()
    buf = memoryview(bytearray(range(100)))
    owner = object()
    log.started(_fields(200, 100), H, buf, owner)
    parts = log.replay(H + 30)  # the peer read the header and 30 payload bytes
    assert len(parts) == 1 and parts[0].owner is owner
    assert parts[0].fields == _fields(230, 70) and bytes(parts[0].payload) == bytes(range(30, 100))


def test_a_completed_frame_keeps_only_a_copy_of_its_unacknowledged_tail():
    log = StreamLog()
    data = bytearray(range(100))
    e = log.started(_fields(0, 100), H, memoryview(data), object())
    log.ack(H + 60)
    log.completed(e)
    data[:] = bytes(100)  # the caller reuses its buffer once the send completed
    assert isinstance(e.payload, bytes) and len(e.payload) == 40
    (part,) = log.replay(H + 75)
    assert part.owner is None and part.fields == _fields(75, 25) and bytes(part.payload) == bytes(range(75, 100))


def test_acknowledged_frames_are_dropped_and_control_bytes_are_counted():
    log = StreamLog()
    a = log.started(_fields(0, 10), H, memoryview(bytes(10)), object())
    log.completed(a)
    log.control(H)  # an ACK we sent on this stream sits between the two frames
    b = log.started(_fields(10, 10), H, memoryview(bytes(10)), object())
    assert b.start == 2 * H + 10
    log.ack(2 * H + 10)
    assert list(log.entries) == [b]
    assert [p.fields for p in log.replay(2 * H + 10)] == [_fields(10, 10)]


@pytest.mark.parametrize("offset", [-1, 10_000])
def test_resync_or_ack_outside_what_was_sent_is_a_protocol_error(offset):
    log = StreamLog()
    log.started(_fields(0, 100), H, memoryview(bytes(100)), object())
    log.ack(20)
    with pytest.raises(ProtocolError):
        log.replay(offset if offset >= 0 else 10)  # below the acknowledged offset, or beyond the sent bytes
    with pytest.raises(ProtocolError, match="beyond"):
        log.ack(10_000)


def test_only_link_errors_count_as_a_lost_cable():
    assert is_link_failure(TimeoutError(errno.ETIMEDOUT, "timed out"))
    assert is_link_failure(OSError(errno.EHOSTUNREACH, "no route"))
    assert not is_link_failure(ConnectionResetError(errno.ECONNRESET, "reset"))  # the peer process died
    assert not is_link_failure(BrokenPipeError(errno.EPIPE, "pipe"))
    assert not is_link_failure(ValueError("x"))


def test_link_timeout_socket_options_per_platform():
    import socket

    from torch_thunderbolt.rendezvous.tcp import DARWIN_TCP_RXT_CONNDROPTIME, link_timeout_options

    (linux,) = link_timeout_options("linux", 3000)
    assert linux[0] == socket.IPPROTO_TCP and linux[1] == getattr(socket, "TCP_USER_TIMEOUT", 18) and linux[2] == 3000
    assert link_timeout_options("darwin", 2500) == [(socket.IPPROTO_TCP, DARWIN_TCP_RXT_CONNDROPTIME, 3)]
    assert link_timeout_options("win32", 3000) == []


def test_link_timeout_config():
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.errors import ConfigError

    assert Config.from_env({}).link_timeout_ms == 3000
    assert Config.from_env({"THUNDERBOLT_LINK_TIMEOUT_MS": "1500"}).link_timeout_ms == 1500
    with pytest.raises(ConfigError, match="THUNDERBOLT_LINK_TIMEOUT_MS"):
        Config.from_env({"THUNDERBOLT_LINK_TIMEOUT_MS": "10"})
