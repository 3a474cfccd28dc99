"""The control protocol (protocol/control.py) without any I/O: the codec and the state machine."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.errors import ProtocolError
from torch_thunderbolt.protocol import control as c
from torch_thunderbolt.protocol.framing import AbortInfo

u64 = st.integers(0, (1 << 64) - 1)
counters = st.lists(u64, max_size=c.MAX_COUNTERS).map(tuple)
ops = st.builds(c.Op, space=st.integers(0, 255), tag=st.integers(-1, (1 << 63) - 1), sig=u64,
                waits_on=st.integers(-1, 1 << 20), counters=counters)
infos = st.builds(AbortInfo, error=st.text(max_size=40), reason=st.text(max_size=200), rank=st.integers(-1, 99),
                  peer=st.integers(-1, 99), ranks=st.lists(st.integers(0, 99), max_size=5).map(tuple),
                  group=st.integers(0, 127))
rank_sets = st.sets(st.integers(0, 1 << 20), min_size=1, max_size=50).map(lambda s: tuple(sorted(s)))
messages = st.one_of(
    st.builds(c.Bye, sent=counters), st.builds(c.Abort, info=infos), st.builds(c.Ping, op=ops),
    st.builds(c.Answer, op=ops), st.builds(c.Leave, epoch=u64, sent=counters),
    st.builds(c.Propose, nonce=st.integers(1, (1 << 64) - 1), ranks=rank_sets, used=st.integers(0, (1 << 128) - 1)),
    rank_sets.flatmap(lambda r: st.builds(c.Commit, nonce=st.integers(1, (1 << 64) - 1), ranks=st.just(r),
                                          view=st.tuples(*[st.integers(1, (1 << 64) - 1)] * len(r)),
                                          gid=st.integers(0, c.MAX_GID))),
    st.builds(c.Done, nonce=st.integers(1, (1 << 64) - 1), view=st.lists(st.integers(1, (1 << 64) - 1), max_size=20).map(tuple)))


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_survives_a_round_trip(msg: c.Message) -> None:
    data = c.encode(msg)
    assert c.decode(data) == msg
    assert c.parse(b"junk" + data, 4) == (msg, 4 + len(data))


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_a_truncated_message_is_incomplete_or_refused_never_misread(msg: c.Message, data: st.DataObject) -> None:
    raw = c.encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert c.parse(raw[:cut]) is None  # incomplete on a stream: wait for more
    with pytest.raises(ProtocolError):
        c.decode(raw[:cut])  # a whole frame's body that is cut short
    with pytest.raises(ProtocolError):
        c.decode(raw + b"\0")  # and one with bytes left over


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_is_refused_with_protocol_error_only(junk: bytes) -> None:
    try:
        c.parse(junk)
    except ProtocolError:
        pass
    conn = c.ControlConnection()
    conn.receive_data(junk)
    try:
        while conn.next_event() is not None:
            pass
    except ProtocolError:
        assert conn.state is c.State.ERROR


@pytest.mark.parametrize("raw, what", [
    (b"\x00" * 8, "magic 0x0000"),
    (bytes([0xB7, 0x43, 1, 1, 0, 0, 0, 0]), "version 1"),
    (bytes([0xB7, 0x43, 2, 99, 0, 0, 0, 0]), "unknown control message type 99"),
    (bytes([0xB7, 0x43, 2, 1]) + (1 << 30).to_bytes(4, "little"), "limit"),
    (bytes([0xB7, 0x43, 2, 1, 3, 0, 0, 0]) + b"\x05ab", "BYE of 3 bytes"),
    (c.encode(c.Propose(1, (0, 1)))[:-8] + (1).to_bytes(4, "little") + (1).to_bytes(4, "little"), "increasing"),
    (c.encode(c.Commit(1, (0, 1), (1, 1), 2))[:-8] + (0).to_bytes(8, "little"), "view"),
    (c.encode(c.Done(1))[:-10] + (0).to_bytes(8, "little") + b"\0\0", "nonce 0"),
])
def test_refusals_say_what_is_wrong(raw: bytes, what: str) -> None:
    with pytest.raises(ProtocolError, match=what):
        c.decode(raw)


def test_encoding_refuses_what_it_cannot_carry() -> None:
    for bad in (c.Bye(tuple(range(c.MAX_COUNTERS + 1))), c.Ping(c.Op(sig=1 << 64)), c.Propose(1, (2, 1)),
                c.Propose(1, ()), c.Propose(0, (1,)), c.Propose(1, (1,), 1 << 128), c.Commit(1, (0, 1), (1,), 0),
                c.Commit(1, (0,), (1,), c.MAX_GID + 1), c.Done(0), c.Done(1, (0,))):
        with pytest.raises(ProtocolError):
            c.encode(bad)


def test_the_wire_head_is_fixed() -> None:
    """Head: magic (first byte never 0, the shm wake-up byte), version, type, body length."""
    assert c.encode(c.Leave(7)) == bytes([0xB7, 0x43, 2, 5, 9, 0, 0, 0]) + (7).to_bytes(8, "little") + b"\0"


# -- the state machine ---------------------------------------------------------------------------------------
def pair() -> tuple[c.ControlConnection, c.ControlConnection]:
    return c.ControlConnection(), c.ControlConnection()


def test_bye_both_ways_closes() -> None:
    a, b = pair()
    b.receive(a.send(c.Bye((3, 4))))
    assert a.state is c.State.CLOSING and b.state is c.State.PEER_CLOSING
    a.receive(b.send(c.Bye()))
    assert a.state is b.state is c.State.CLOSED


@pytest.mark.parametrize("after", [c.Ping(c.Op()), c.Leave(1), c.Propose(1, (0,)), c.Done(1),
                                   c.Bye(),
                                   c.Abort(AbortInfo("X", "y"))])
def test_nothing_after_ones_own_bye(after: c.Message) -> None:
    a, _ = pair()
    a.send(c.Bye())
    with pytest.raises(ProtocolError, match="after its BYE"):
        a.send(after)
    assert a.state is c.State.ERROR
    with pytest.raises(ProtocolError, match="failed earlier"):
        a.send(c.Ping(c.Op()))


def test_a_message_after_the_peers_bye_is_an_error() -> None:
    a, b = pair()
    b.receive(a.send(c.Bye()))
    b.receive_data(c.encode(c.Ping(c.Op(tag=3))))
    with pytest.raises(ProtocolError, match="PING after its BYE"):
        b.next_event()
    assert b.state is c.State.ERROR


def test_an_answer_needs_a_ping() -> None:
    a, b = pair()
    with pytest.raises(ProtocolError, match="ANSWER to no PING"):
        a.receive(b.send(c.Answer(c.Op())))
    a, b = pair()
    b.receive(a.send(c.Ping(c.Op(tag=5, sig=9))))
    assert a.receive(b.send(c.Answer(c.Op(tag=5, sig=9, waits_on=2)))) == c.Answer(c.Op(0, 5, 9, 2))
    assert a.state is c.State.OPEN


def test_aborts_are_per_group_may_cross_and_leave_the_wire_open() -> None:
    """An ABORT ends its group, not the wire: other groups over it go on. A group id is reused once the group is
    over everywhere, so a second ABORT of an id is the next group's (the engine's ledger decides what it means)."""
    a, b = pair()
    to_b = a.send(c.Abort(AbortInfo("MismatchError", "x", 0, group=2)))
    to_a = b.send(c.Abort(AbortInfo("CollectiveTimeout", "y", 1, group=2)))
    assert b.receive(to_b).info.error == "MismatchError" and a.receive(to_a).info.rank == 1
    assert a.state is b.state is c.State.OPEN
    b.receive(a.send(c.Ping(c.Op(4, 1, 9))))  # group 2's space is 4: group 0 talks on
    b.receive(a.send(c.Abort(AbortInfo("X", "", group=0))))
    b.receive(a.send(c.Abort(AbortInfo("X", "", group=2))))
    assert a.state is b.state is c.State.OPEN


def test_leave_is_per_group() -> None:
    a, b = pair()
    b.receive(a.send(c.Leave(3)))
    b.receive(a.send(c.Leave(4)))
    b.receive(a.send(c.Ping(c.Op())))  # the wire and its other groups go on
    b.receive(a.send(c.Leave(3)))  # (a later group of the same id)
    assert b.state is c.State.OPEN
    a2, b2 = pair()
    b2.receive(a2.send(c.Leave(3)))
    b2.receive(a2.send(c.Bye()))
    assert b2.state is c.State.PEER_CLOSING


def test_proposals_only_grow_on_a_wire() -> None:
    a, b = pair()
    b.receive(a.send(c.Propose(4, (0, 2))))
    b.receive(a.send(c.Commit(4, (0, 2), (4, 1), 1)))
    b.receive(a.send(c.Done(4, (4, 1))))
    b.receive(a.send(c.Propose(5, (0,))))
    with pytest.raises(ProtocolError, match="call 5 after call 5"):
        b.receive(c.encode(c.Propose(5, (0,))))


def test_a_stream_split_anywhere_gives_the_same_messages_and_drops_wake_bytes() -> None:
    msgs = [c.Ping(c.Op(0, 7, 99, -1, (1, 2, 3))), c.Abort(AbortInfo("PeerLostError", "gone", 0, 2))]
    a = c.ControlConnection()
    raw = b"\0\0" + a.send(msgs[0]) + b"\0" + a.send(msgs[1])
    for step in (1, 3, 8, len(raw)):
        b = c.ControlConnection(wake=0)
        got = []
        for i in range(0, len(raw), step):
            b.receive_data(raw[i : i + step])
            while (m := b.next_event()) is not None:
                got.append(m)
        assert got == msgs and b.state is c.State.OPEN


def test_a_wake_byte_inside_no_message_and_none_without_wake() -> None:
    b = c.ControlConnection()
    b.receive_data(b"\0")
    with pytest.raises(ProtocolError, match="first byte 0x00"):
        b.next_event()
    with pytest.raises(ValueError):
        c.ControlConnection(wake=0xB7)
