"""Data frames on an established stream.

Every message part travels as one frame: a fixed 48-byte header followed by `length` payload bytes. The
decoder is sans-IO: the I/O shell feeds it bytes and asks for events. For large payloads the shell reads
straight into the destination buffer (zero copy); the decoder only tracks how much of the payload is left,
and hands out whatever payload bytes it already buffered.

What two ranks say about the connection itself (BYE, ABORT, probes) is a control message
(`protocol/control.py`), the same on every kind of link; on a TCP stream each is the payload of one
CONTROL frame. Why a group failed is an ABORT whose body is an `AbortInfo` (defined here, below): the
error's class and message, and the ranks it names as numbers, so a peer rebuilds the error from data
instead of parsing its text. ACK and RESYNC stay frame kinds of their own: they count bytes of one stream
for its failover (`transport/failover.py`), below what the peers say to each other.
"""
from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ProtocolError

MAGIC = 0x7442  # "Bt"
# magic, kind, space, sig (low 32 bits), tag, seq, sig (high 32 bits), offset, length, total
_HEADER = struct.Struct("<HBBIqIIQQQ")
FRAME_HEADER_SIZE = _HEADER.size  # 48

#: Defaults for what a peer may announce; anything larger is a protocol error, never an allocation.
DEFAULT_MAX_MESSAGE = 1 << 40
MAX_ABORT_PAYLOAD = 4096
MAX_CONTROL_PAYLOAD = 1 << 15  # a CONTROL frame's body: one control message (control.HEAD_SIZE + MAX_BODY)


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 4  # failover: `offset` = bytes of this stream the sender of the ACK has consumed
    RESYNC = 5  # failover: stream `tag` is lost; `offset` = bytes of it the sender of the RESYNC consumed
    CONTROL = 7  # payload = one control message (protocol/control.py: BYE, ABORT, PING, ...)


class Space(enum.IntEnum):
    """The spaces of the group made at set-up (group 0). Group `g` over the same links uses `2 * g` for its
    collectives and `2 * g + 1` for its point-to-point messages: a frame's space byte names its group."""

    COLL = 0  # collectives: tag = op sequence number, seq = message index within the op
    P2P = 1  # point to point: tag = user tag, seq = per (peer, tag) message counter


def is_p2p(space: int) -> bool:
    """Whether messages of `space` are point-to-point (else a collective op's)."""
    return bool(space & 1)


class _Discard:
    """What a sink gives for a frame of a group that is over or broken: the link drops its payload."""

    def __repr__(self) -> str:
        return "DISCARD"


DISCARD = _Discard()


class Frame(NamedTuple):
    """One decoded header. A tuple, not a frozen dataclass: one is built per message, and a frozen
    dataclass costs a small op twice as much to build."""

    kind: Kind
    space: int  # 2 * group + (1 for point to point): see Space
    sig: int  # 64-bit signature of the operation (protocol.signature): a mismatch check on every part
    tag: int
    seq: int
    offset: int  # byte offset of this part within the whole message
    length: int  # payload bytes in this frame
    total: int  # bytes of the whole message

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.space, self.tag, self.seq)


_KINDS = {k.value: k for k in Kind}


def encode_frame_header(
    kind: Kind, space: int, sig: int, tag: int, seq: int, offset: int, length: int, total: int
) -> bytes:
    return _HEADER.pack(MAGIC, kind, space, sig & 0xFFFFFFFF, tag, seq & 0xFFFFFFFF, (sig >> 32) & 0xFFFFFFFF, offset,
                        length, total)


def pack_frame_header(into: bytearray, kind: Kind, space: int, sig: int, tag: int, seq: int, offset: int, length: int,
                      total: int) -> None:
    """`encode_frame_header`, written into `into` (FRAME_HEADER_SIZE bytes): a buffer kept and reused."""
    _HEADER.pack_into(into, 0, MAGIC, kind, space, sig & 0xFFFFFFFF, tag, seq & 0xFFFFFFFF, (sig >> 32) & 0xFFFFFFFF,
                      offset, length, total)


def _parse(raw: bytes | memoryview, max_message: int) -> Frame:
    magic, kind, space, sig_lo, tag, seq, sig_hi, offset, length, total = _HEADER.unpack(raw)
    sig = (sig_hi << 32) | sig_lo
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x})")
    kind_e, space_e = _KINDS.get(kind), space  # (an enum call per frame costs as much again)
    if kind_e is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if total > max_message:
        raise ProtocolError(f"frame announces a {total}-byte message; the limit is {max_message}")
    if kind_e is Kind.ACK or kind_e is Kind.RESYNC:
        if length or total:
            raise ProtocolError(f"{kind_e.name} frame carries a payload")
        return Frame(kind_e, space_e, sig, tag, seq, offset, 0, 0)
    if offset + length > total:
        raise ProtocolError(f"frame part [{offset}, {offset + length}) lies outside its {total}-byte message")
    if kind_e is Kind.CONTROL and (total > MAX_CONTROL_PAYLOAD or length != total):
        raise ProtocolError(f"CONTROL frame of {length} of {total} bytes (one whole message of at most "
                            f"{MAX_CONTROL_PAYLOAD})")
    return Frame(kind_e, space_e, sig, tag, seq, offset, length, total)


class FrameDecoder:
    """Turns a byte stream into frames.

    Usage: `feed(data)`; `next_frame()` returns a Frame or None (needs more bytes). After a frame with a
    payload, the shell moves the payload: `take_buffered(n)` gives already-buffered payload bytes, and
    `consumed_direct(n)` records bytes it read from the socket straight into its own buffer.
    `payload_remaining` says how many payload bytes of the current frame are still to come.
    """

    header_size = FRAME_HEADER_SIZE  # bytes of stream a header takes (more with per-frame MACs: integrity.py)

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max_message = max_message
        self.payload_remaining = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def next_frame(self) -> Frame | None:
        if self.payload_remaining:
            raise ProtocolError("next_frame() called while the previous payload is unread")
        if self.buffered < FRAME_HEADER_SIZE:
            return None
        frame = _parse(memoryview(self._buf)[self._pos : self._pos + FRAME_HEADER_SIZE], self._max_message)
        self._pos += FRAME_HEADER_SIZE
        self.payload_remaining = frame.length
        return frame

    def take_buffered(self, n: int) -> bytes:
        """Up to `n` payload bytes of the current frame that are already buffered."""
        n = min(n, self.payload_remaining, self.buffered)
        out = bytes(memoryview(self._buf)[self._pos : self._pos + n])
        self._pos += n
        self.payload_remaining -= n
        self._compact()
        return out

    def take_buffered_into(self, dest: memoryview) -> int:
        """Copy buffered payload bytes into `dest`; returns how many."""
        n = min(len(dest), self.payload_remaining, self.buffered)
        if n:
            dest[:n] = memoryview(self._buf)[self._pos : self._pos + n]
            self._pos += n
            self.payload_remaining -= n
            self._compact()
        return n

    def consumed_direct(self, n: int) -> None:
        if n > self.payload_remaining or self.buffered:
            raise ProtocolError("direct payload read out of step with the decoder")
        self.payload_remaining -= n

    def _compact(self) -> None:
        if self._pos > (1 << 16) and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0


def encode_control(kind: Kind, offset: int, stream: int = 0) -> bytes:
    """An ACK or RESYNC frame (header only)."""
    return encode_frame_header(kind, Space.COLL, 0, stream, 0, offset, 0, 0)


def control_frame_header(nbytes: int) -> bytes:
    """The header of a CONTROL frame whose payload is one control message of `nbytes`."""
    return encode_frame_header(Kind.CONTROL, Space.COLL, 0, 0, 0, 0, nbytes, nbytes)


@dataclass(frozen=True)
class AbortInfo:
    """Why a rank broke its group, as its ABORT tells every peer: the error's class name and message, and the
    ranks it names as numbers (a peer that forwards the news keeps them: the rank finally blamed is the one
    that died or stopped, never the messenger). Encoded as UTF-8 JSON of at most MAX_ABORT_PAYLOAD bytes."""

    error: str  # the class name: "PeerLostError", "CollectiveTimeout", "MismatchError", ...
    reason: str  # its message
    rank: int = -1  # the rank that reports it (-1: not known)
    peer: int = -1  # the rank lost (PeerLostError) or the rank that failed first (a forwarded abort)
    ranks: tuple[int, ...] = ()  # the ranks a CollectiveTimeout blames
    group: int = 0  # the group that failed (its gid: the engine's groups share the links)

    @classmethod
    def of(cls, error: BaseException, rank: int = -1) -> "AbortInfo":
        """What `error`, raised on `rank`, tells the peers."""
        peer = getattr(error, "peer", -1)
        ranks = getattr(error, "ranks", ())
        return cls(type(error).__name__, str(error), rank, peer if isinstance(peer, int) else -1,
                   tuple(r for r in ranks if isinstance(r, int)) if isinstance(ranks, (list, tuple)) else ())


    def encode(self) -> bytes:
        """The ABORT body; a long reason is cut so that the whole body fits MAX_ABORT_PAYLOAD."""
        error, reason, ranks = self.error, self.reason, list(self.ranks)
        while True:
            body = json.dumps({"error": error, "reason": reason, "rank": self.rank, "peer": self.peer,
                               "ranks": ranks, "group": self.group}).encode()
            over = len(body) - MAX_ABORT_PAYLOAD
            if over <= 0:
                return body
            # Each pass keeps the share of the reason that fits, had every character the same size: at
            # least one character fewer (escaped characters take up to 6 bytes, hence the loop).
            if reason:
                reason = reason[: len(reason) * MAX_ABORT_PAYLOAD // len(body)]
            elif error:
                error = error[: max(0, len(error) - over)]
            else:
                ranks = ranks[: len(ranks) // 2]

    @classmethod
    def decode(cls, body: bytes | bytearray | memoryview) -> "AbortInfo":
        """The AbortInfo of an ABORT body; ProtocolError when it is not one."""
        try:
            d = json.loads(bytes(body).decode())
            info = cls(d["error"], d["reason"], d["rank"], d["peer"], tuple(d["ranks"]), d.get("group", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed ABORT body ({exc})") from None
        if not (isinstance(info.error, str) and isinstance(info.reason, str)
                and all(type(r) is int for r in (info.rank, info.peer, info.group, *info.ranks))):
            raise ProtocolError("malformed ABORT body (a field of the wrong type)")
        return info
