"""The control protocol every kind of link speaks to its peer, whatever wire carries it (sans-IO).

Data moves over each kind's own path (TCP frames, shared-memory rings, RDMA queue pairs); what two ranks
say *about* the connection goes as control messages, the same messages with the same encoding on every
kind: TCP carries each as the body of one CONTROL frame (`framing.Kind.CONTROL`), shared memory writes
them on its Unix socket, RDMA on its TCP control connection.

Messages:

- `Bye(sent)`: no more data comes from this end (the orderly close). `sent`: per-lane counts of data
  frames sent, for a kind whose data path may lose its last frames unseen (RDMA: the peer counts them in
  before it calls the sender gone); empty elsewhere.
- `Abort(info)`: this end failed a group, and why (`framing.AbortInfo`: the error's class, message, the
  ranks it names, as data, and the group: several groups may run over one wire, and one failing ends
  neither the wire nor the others).
- `Ping(op)` / `Answer(op)`: an op announcement (`Op`): the collective op this rank is in or waits for
  (space, tag, signature), whom it waits on there, and the kind's own counters (RDMA's per-lane frames
  sent, received and receives posted). A Ping asks; an Answer replies to a Ping this end sent.
- `Leave(epoch, sent)`: this end closed group `epoch` (its id) in order: a wait for its data there is over,
  once what it sent before is in (`sent`: per-lane counts, as BYE's, where the data path may deliver later).
- `Propose(nonce, ranks, used)`, `Commit(nonce, ranks, view, gid)`, `Done(nonce, view)`: the agreement on a
  new group's members and id (split, shrink, new_group) over the live links, no store needed. `nonce`
  names one call of this end (it only grows); `used` is the set of group ids this end cannot take now (a
  bitmask); a Commit says which proposal of every member (`view`: their nonces, in `ranks` order) this
  end decided on, and the id that follows from them; a Done says the call `nonce` is over, and the view of
  the group it made (empty: it made none). The state machine is `protocol/agreement.py`.

Encoding: an 8-byte head (magic, version, type, body length) and the body. The magic's first byte is
never 0, so a kind may put a bare 0 byte between messages as a wake-up (shared memory's doorbell), and
`ControlConnection(wake=0)` drops those. Anything that is not a message of this version (another magic or
version, an unknown type, a body of the wrong size or over MAX_BODY, fields out of range) is a
`ProtocolError`, never an allocation of what a peer announces.

`ControlConnection` is one end's state machine for one wire (h11's idea: bytes and events in, bytes out,
no I/O): what each end may still say depends on what was said before (nothing after BYE, one ABORT and one
an Answer only to a Ping, a Propose's nonce only upwards on one wire). An illegal event, sent or received,
puts it in ERROR for good, and the only exception any of its methods raises is ProtocolError. What a group's
messages may say across wires (a TCP link has several, and group ids are reused once a group is over
everywhere) is the engine's and the agreement's business (`protocol/agreement.py`), not one wire's.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Union

from ..errors import ProtocolError
from .framing import MAX_ABORT_PAYLOAD, MAX_CONTROL_PAYLOAD, AbortInfo, control_frame_header

MAGIC = 0x43B7  # little-endian on the wire: 0xB7 first (never the 0 of a wake-up byte), then 0x43 ("C")
VERSION = 2
_HEAD = struct.Struct("<HBBI")  # magic, version, type, body length
HEAD_SIZE = _HEAD.size  # 8
MAX_COUNTERS = 16
MAX_RANKS = 1 << 11  # a PROPOSE or COMMIT names fewer ranks than this
MAX_GID = 127  # a frame's space byte holds 2 * gid + 1
# The largest body of any message: an ABORT's AbortInfo, or a COMMIT naming MAX_RANKS ranks and their nonces.
MAX_BODY = max(MAX_ABORT_PAYLOAD, 12 + 12 * MAX_RANKS)
_U64 = (1 << 64) - 1


class Type(enum.IntEnum):
    BYE = 1
    ABORT = 2
    PING = 3
    ANSWER = 4
    LEAVE = 5
    PROPOSE = 6
    COMMIT = 7
    DONE = 8


@dataclass(frozen=True)
class Op:
    """What a rank announces about the op it is in: `tag`/`sig` of the collective op it waits for (tag -1,
    sig 0: none), `waits_on` the rank it waits on there (-1: none said), `counters` the kind's own."""

    space: int = 0
    tag: int = -1
    sig: int = 0
    waits_on: int = -1
    counters: tuple[int, ...] = ()


@dataclass(frozen=True)
class Bye:
    sent: tuple[int, ...] = ()


@dataclass(frozen=True)
class Abort:
    info: AbortInfo


@dataclass(frozen=True)
class Ping:
    op: Op


@dataclass(frozen=True)
class Answer:
    op: Op


@dataclass(frozen=True)
class Leave:
    epoch: int = 0
    sent: tuple[int, ...] = ()  # as Bye's: data frames sent per lane, where they may arrive after this


@dataclass(frozen=True)
class Propose:
    nonce: int  # this end's call (only grows)
    ranks: tuple[int, ...]  # the new group's members, engine ranks, increasing
    used: int = 0  # bit g set: group id g cannot be taken on this end now


@dataclass(frozen=True)
class Commit:
    nonce: int  # the call of this end that decided
    ranks: tuple[int, ...]
    view: tuple[int, ...]  # the nonce of each member's proposal decided on, in `ranks` order
    gid: int  # the id those proposals give


@dataclass(frozen=True)
class Done:
    nonce: int  # this end's call that is over
    view: tuple[int, ...] = ()  # the view of the group it made; empty: it made none


Message = Union[Bye, Abort, Ping, Answer, Leave, Propose, Commit, Done]

_OP = struct.Struct("<BqQqB")  # space, tag, sig, waits_on, counter count; then the counters (u64 each)
_COUNT = struct.Struct("<B")
_EPOCH = struct.Struct("<Q")
_PROPOSE = struct.Struct("<QQQH")  # nonce, used (low, high 64 bits), rank count
_COMMIT = struct.Struct("<QHH")  # nonce, gid, rank count; then the ranks (u32), then the view (u64)
_DONE = struct.Struct("<QH")  # nonce, view length; then the view (u64)
_USED = (1 << (MAX_GID + 1)) - 1
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")


def _u64s(values: tuple[int, ...], what: str) -> bytes:
    if len(values) > MAX_COUNTERS:
        raise ProtocolError(f"{what}: {len(values)} counters (at most {MAX_COUNTERS})")
    if any(not 0 <= v <= _U64 for v in values):
        raise ProtocolError(f"{what}: a counter out of range")
    return b"".join(_Q.pack(v) for v in values)


def _encode_op(op: Op) -> bytes:
    if not 0 <= op.space < 256 or not 0 <= op.sig <= _U64 or op.tag < -1 << 63 or op.tag >= 1 << 63 \
            or op.waits_on < -1 or op.waits_on >= 1 << 63:
        raise ProtocolError(f"an op announcement out of range: {op}")
    return _OP.pack(op.space, op.tag, op.sig, op.waits_on, len(op.counters)) + _u64s(op.counters, "an op")


def _body(msg: Message) -> tuple[Type, bytes]:
    if isinstance(msg, Bye):
        counts = _u64s(msg.sent, "BYE")
        return Type.BYE, _COUNT.pack(len(msg.sent)) + counts
    if isinstance(msg, Abort):
        return Type.ABORT, msg.info.encode()
    if isinstance(msg, Ping):
        return Type.PING, _encode_op(msg.op)
    if isinstance(msg, Answer):
        return Type.ANSWER, _encode_op(msg.op)
    if isinstance(msg, Leave):
        if not 0 <= msg.epoch <= _U64:
            raise ProtocolError(f"LEAVE epoch {msg.epoch} out of range")
        return Type.LEAVE, _EPOCH.pack(msg.epoch) + _COUNT.pack(len(msg.sent)) + _u64s(msg.sent, "LEAVE")
    if isinstance(msg, Propose):
        _check_ranks(msg.ranks, "PROPOSE")
        _check_nonce(msg.nonce, "PROPOSE")
        if not 0 <= msg.used <= _USED:
            raise ProtocolError(f"PROPOSE: used ids {msg.used:#x} out of range")
        return Type.PROPOSE, _PROPOSE.pack(msg.nonce, msg.used & _U64, msg.used >> 64, len(msg.ranks)) + b"".join(
            _I.pack(r) for r in msg.ranks)
    if isinstance(msg, Commit):
        _check_ranks(msg.ranks, "COMMIT")
        _check_nonce(msg.nonce, "COMMIT")
        if len(msg.view) != len(msg.ranks) or any(type(v) is not int or not 0 < v <= _U64 for v in msg.view):
            raise ProtocolError(f"COMMIT: a view of {len(msg.view)} nonces for {len(msg.ranks)} ranks")
        if not 0 <= msg.gid <= MAX_GID:
            raise ProtocolError(f"COMMIT: group id {msg.gid} out of range")
        return Type.COMMIT, _COMMIT.pack(msg.nonce, msg.gid, len(msg.ranks)) + b"".join(
            _I.pack(r) for r in msg.ranks) + b"".join(_Q.pack(v) for v in msg.view)
    if isinstance(msg, Done):
        _check_nonce(msg.nonce, "DONE")
        if len(msg.view) >= MAX_RANKS or any(type(v) is not int or not 0 < v <= _U64 for v in msg.view):
            raise ProtocolError(f"DONE: a view of {len(msg.view)} nonces out of range")
        return Type.DONE, _DONE.pack(msg.nonce, len(msg.view)) + b"".join(_Q.pack(v) for v in msg.view)
    raise ProtocolError(f"not a control message: {msg!r}")


def _check_ranks(ranks: tuple[int, ...], name: str) -> None:
    if not 0 < len(ranks) < MAX_RANKS:
        raise ProtocolError(f"{name} names {len(ranks)} ranks (1 to {MAX_RANKS - 1})")
    if any(type(r) is not int or not 0 <= r < 1 << 32 for r in ranks) or list(ranks) != sorted(set(ranks)):
        raise ProtocolError(f"{name} ranks must be distinct ranks in increasing order")


def _check_nonce(nonce: int, name: str) -> None:
    if type(nonce) is not int or not 0 < nonce <= _U64:
        raise ProtocolError(f"{name}: nonce {nonce} out of range")


def encode(msg: Message) -> bytes:
    """One message, head and body."""
    typ, body = _body(msg)
    return _HEAD.pack(MAGIC, VERSION, typ, len(body)) + body


def framed(msg: Message) -> bytes:
    """`msg` as a TCP stream carries it: one CONTROL frame (`framing.Kind.CONTROL`) whose payload is it."""
    data = encode(msg)
    return control_frame_header(len(data)) + data


def _decode_op(body: bytes, name: str) -> Op:
    if len(body) < _OP.size:
        raise ProtocolError(f"{name} of {len(body)} bytes (at least {_OP.size})")
    space, tag, sig, waits_on, n = _OP.unpack_from(body)
    if len(body) != _OP.size + 8 * n or n > MAX_COUNTERS:
        raise ProtocolError(f"{name} of {len(body)} bytes does not hold the {n} counters it announces")
    if waits_on < -1:
        raise ProtocolError(f"{name} names rank {waits_on}")
    counters = struct.unpack_from(f"<{n}Q", body, _OP.size)
    return Op(space, tag, sig, waits_on, tuple(counters))


def _decode_body(typ: int, body: bytes) -> Message:
    if typ == Type.BYE:
        if not body or len(body) != 1 + 8 * body[0] or body[0] > MAX_COUNTERS:
            raise ProtocolError(f"BYE of {len(body)} bytes")
        return Bye(tuple(struct.unpack_from(f"<{body[0]}Q", body, 1)))
    if typ == Type.ABORT:
        return Abort(AbortInfo.decode(body))
    if typ == Type.PING:
        return Ping(_decode_op(body, "PING"))
    if typ == Type.ANSWER:
        return Answer(_decode_op(body, "ANSWER"))
    if typ == Type.LEAVE:
        n = body[_EPOCH.size] if len(body) > _EPOCH.size else -1
        if n < 0 or n > MAX_COUNTERS or len(body) != _EPOCH.size + 1 + 8 * n:
            raise ProtocolError(f"LEAVE of {len(body)} bytes")
        return Leave(_EPOCH.unpack_from(body)[0], tuple(struct.unpack_from(f"<{n}Q", body, _EPOCH.size + 1)))
    if typ == Type.PROPOSE:
        if len(body) < _PROPOSE.size:
            raise ProtocolError(f"PROPOSE of {len(body)} bytes")
        nonce, lo, hi, n = _PROPOSE.unpack_from(body)
        if len(body) != _PROPOSE.size + 4 * n:
            raise ProtocolError(f"PROPOSE of {len(body)} bytes does not hold the {n} ranks it announces")
        msg: Message = Propose(nonce, tuple(struct.unpack_from(f"<{n}I", body, _PROPOSE.size)), lo | hi << 64)
        _body(msg)  # the same checks as sending it
        return msg
    if typ == Type.COMMIT:
        if len(body) < _COMMIT.size:
            raise ProtocolError(f"COMMIT of {len(body)} bytes")
        nonce, gid, n = _COMMIT.unpack_from(body)
        if len(body) != _COMMIT.size + 12 * n:
            raise ProtocolError(f"COMMIT of {len(body)} bytes does not hold the {n} ranks it announces")
        ranks = tuple(struct.unpack_from(f"<{n}I", body, _COMMIT.size))
        msg = Commit(nonce, ranks, tuple(struct.unpack_from(f"<{n}Q", body, _COMMIT.size + 4 * n)), gid)
        _body(msg)
        return msg
    if typ == Type.DONE:
        if len(body) < _DONE.size:
            raise ProtocolError(f"DONE of {len(body)} bytes")
        nonce, n = _DONE.unpack_from(body)
        if len(body) != _DONE.size + 8 * n:
            raise ProtocolError(f"DONE of {len(body)} bytes does not hold the view of {n} it announces")
        msg = Done(nonce, tuple(struct.unpack_from(f"<{n}Q", body, _DONE.size)))
        _body(msg)
        return msg
    raise ProtocolError(f"unknown control message type {typ}")


def parse(buf: "bytes | bytearray | memoryview", pos: int = 0) -> "tuple[Message, int] | None":
    """The message starting at `buf[pos]` and where it ends, or None while it is incomplete."""
    if len(buf) - pos < HEAD_SIZE:
        if len(buf) > pos and buf[pos] != MAGIC & 0xFF:  # garbage is refused at its first byte
            raise ProtocolError(f"not a control message (first byte 0x{buf[pos]:02x})")
        return None
    magic, version, typ, n = _HEAD.unpack_from(buf, pos)
    if magic != MAGIC:
        raise ProtocolError(f"bad control message magic 0x{magic:04x} (expected 0x{MAGIC:04x})")
    if version != VERSION:
        raise ProtocolError(f"control protocol version {version} (this rank speaks {VERSION}): the ranks run "
                            f"different versions of torch-thunderbolt")
    if n > MAX_BODY:
        raise ProtocolError(f"control message of {n} bytes (limit {MAX_BODY})")
    if typ not in Type._value2member_map_:
        raise ProtocolError(f"unknown control message type {typ}")
    end = pos + HEAD_SIZE + n
    if len(buf) < end:
        return None
    return _decode_body(typ, bytes(buf[pos + HEAD_SIZE : end])), end


def decode(data: "bytes | bytearray | memoryview") -> Message:
    """Exactly one whole message (a TCP CONTROL frame's body)."""
    got = parse(data)
    if got is None or got[1] != len(data):
        raise ProtocolError(f"a control frame of {len(data)} bytes is not one whole control message")
    return got[0]


class State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # this end said BYE; the peer has not
    PEER_CLOSING = "peer closing"  # the peer said BYE; this end has not
    CLOSED = "closed"  # BYE both ways
    ERROR = "error"  # an illegal event: final


class ControlConnection:
    """One end of one control wire. `send(msg)` checks that this end may say `msg` now and gives its bytes;
    `receive(msg_or_body)` takes one message the wire delivered whole (bytes or a decoded message);
    `receive_data(bytes)` then `next_event()` take a byte stream. `wake`: a byte value dropped between
    messages (a wake-up, not a message). Only ProtocolError escapes, and after it the state is ERROR."""

    def __init__(self, wake: "int | None" = None) -> None:
        if wake is not None and wake == MAGIC & 0xFF:
            raise ValueError("a wake-up byte cannot be the first byte of a message")
        self.wake = wake
        self.ours: "Type | None" = None  # BYE once this end said it (the wire ends)
        self.theirs: "Type | None" = None
        self.pings_sent = 0
        self.nonces = [0, 0]  # the last call proposed on this wire by this end, by the peer
        self._error: "ProtocolError | None" = None
        self._buf = bytearray()

    @property
    def state(self) -> State:
        if self._error is not None:
            return State.ERROR
        if self.ours is Type.BYE:
            return State.CLOSED if self.theirs is Type.BYE else State.CLOSING
        return State.PEER_CLOSING if self.theirs is Type.BYE else State.OPEN

    def _fail(self, text: str) -> ProtocolError:
        self._error = ProtocolError(text)
        return self._error

    def _check(self, msg: Message, mine: bool) -> None:
        """Raise (into ERROR) if `msg` may not be said now by this end (`mine`) or the peer."""
        if self._error is not None:
            raise ProtocolError(f"the control connection failed earlier: {self._error}")
        who = "this rank" if mine else "the peer"
        end = 0 if mine else 1
        said = self.ours if mine else self.theirs
        name = type(msg).__name__.upper()
        if said is not None:
            raise self._fail(f"{who} sent {name} after its {said.name}")
        if isinstance(msg, Answer) and not mine and not self.pings_sent:
            raise self._fail("the peer sent an ANSWER to no PING")
        if isinstance(msg, Propose) and msg.nonce <= self.nonces[end]:
            raise self._fail(f"{who} proposed call {msg.nonce} after call {self.nonces[end]}")

    def _apply(self, msg: Message, mine: bool) -> None:
        end = 0 if mine else 1
        if isinstance(msg, Bye):
            if mine:
                self.ours = Type.BYE
            else:
                self.theirs = Type.BYE
        elif isinstance(msg, Propose):
            self.nonces[end] = msg.nonce
        elif isinstance(msg, Ping) and mine:
            self.pings_sent += 1

    def send(self, msg: Message) -> bytes:
        """The bytes of `msg`, which this end may say now (else ProtocolError, and ERROR)."""
        self._check(msg, mine=True)
        try:
            data = encode(msg)
        except ProtocolError as exc:
            raise self._fail(str(exc)) from None
        self._apply(msg, mine=True)
        return data

    def receive(self, msg: "Message | bytes | bytearray | memoryview") -> Message:
        """One message the wire delivered whole (its bytes, or decoded); it must be legal now."""
        if self._error is not None:
            raise ProtocolError(f"the control connection failed earlier: {self._error}")
        if isinstance(msg, (bytes, bytearray, memoryview)):
            try:
                msg = decode(msg)
            except ProtocolError as exc:
                raise self._fail(str(exc)) from None
        self._check(msg, mine=False)
        self._apply(msg, mine=False)
        return msg

    def receive_data(self, data: "bytes | bytearray | memoryview") -> None:
        """Bytes of the stream, in order; `next_event` gives the messages they complete."""
        if self._error is not None:
            raise ProtocolError(f"the control connection failed earlier: {self._error}")
        self._buf += data

    def next_event(self) -> "Message | None":
        """The next whole message received (checked as `receive` checks it), or None until more bytes come."""
        buf = self._buf
        i = 0
        if self.wake is not None:
            while i < len(buf) and buf[i] == self.wake:
                i += 1
        try:
            got = parse(buf, i)
        except ProtocolError as exc:
            raise self._fail(str(exc)) from None
        if got is None:
            del buf[:i]
            return None
        msg, end = got
        del buf[:end]
        return self.receive(msg)

    @property
    def buffered(self) -> int:
        """Bytes received that are not a whole message yet (wake-up bytes included)."""
        return len(self._buf)


assert HEAD_SIZE + MAX_BODY <= MAX_CONTROL_PAYLOAD  # a TCP CONTROL frame holds any message
