"""Continuing on the remaining cables when one of several cables between two ranks is lost.

TCP cannot say which written bytes the peer's program actually consumed, so when a cable dies the data in
flight on its streams is in limbo. With failover on (two ranks joined by streams over two or more cables),
every stream keeps a `StreamLog` of the DATA frames it carried that the receiver has not acknowledged:

- The receiver counts the bytes it consumed from each stream (headers and payload, even a partly read
  payload) and every `ACK_EVERY` bytes sends an ACK frame back on that stream; the sender drops log
  entries up to it.
- A frame still being written points at the caller's buffer (the request is not complete, so the buffer
  is valid). When its last byte is written the request completes and the caller may reuse the buffer, so
  the unacknowledged tail of the payload is copied then — at most the bytes in flight, not the message.
- On a link error (timeout, unreachable: never EOF or reset, which mean the peer process is gone) each
  side stops using the stream and sends RESYNC(stream, bytes consumed) over a surviving stream. The side
  that receives it resends, on the surviving streams, exactly the bytes the other side has not consumed,
  as frames of the same messages (frames carry their offset, so a message may arrive in any split).

Pure bookkeeping here; tcp.py does the I/O.
"""
from __future__ import annotations

import errno
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from ..errors import ProtocolError

ACK_EVERY = 2 << 20
# Errors a cut or unplugged cable produces; EOF, ECONNRESET and EPIPE mean the peer closed or died (an EPIPE
# behind which the socket keeps one of these is read as that one: tcp.socket_error). EADDRNOTAVAIL: the
# source address went away with its interface (XNU's tcp_output, tcp_output.c:3389-3394).
LINK_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                         errno.EHOSTDOWN, errno.EADDRNOTAVAIL})
# Errors of a send that a later send may not meet: XNU's sosend fails with ENOBUFS while the system is short
# of mbufs (uipc_socket.c:2455-2458).
TRANSIENT_SEND_ERRNOS = frozenset({errno.ENOBUFS})


def is_link_failure(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in LINK_ERRNOS


class Fields(NamedTuple):
    """What a DATA frame header says, minus the stream it travels on (a tuple: one is built per message
    part, and a frozen dataclass costs a small send a microsecond to build)."""

    space: int
    sig: int
    tag: int
    seq: int
    offset: int
    length: int
    total: int

    def tail(self, skip: int) -> "Fields":
        return Fields(self.space, self.sig, self.tag, self.seq, self.offset + skip, self.length - skip, self.total)


@dataclass
class Entry:
    fields: Fields
    start: int  # stream offset of the frame's first header byte
    header: int  # header bytes
    payload: Any  # memoryview of the caller's buffer while `owner` is set, else a copy of the tail
    copy_from: int = 0  # payload index where `payload` begins once copied
    owner: Optional[Any] = None  # the send item still being written (its request is not complete)

    @property
    def end(self) -> int:
        return self.start + self.header + self.fields.length


@dataclass(frozen=True)
class Resend:
    """A part to send again: its fields, its payload bytes and the unfinished item it replaces (if any)."""

    fields: Fields
    payload: Any
    owner: Optional[Any]


class StreamLog:
    """Sender side of one stream: stream offsets of what was written, what the peer acknowledged."""

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()
        self.tx_off = 0
        self.acked = 0

    def control(self, nbytes: int) -> None:
        """A frame that is never resent (ACK, RESYNC) took `nbytes` of the stream."""
        self.tx_off += nbytes

    def started(self, fields: Fields, header: int, payload: Any, owner: Any) -> Entry:
        """A DATA frame is about to be written (all of it, contiguously)."""
        entry = Entry(fields, self.tx_off, header, payload, 0, owner)
        self.tx_off = entry.end
        self.entries.append(entry)
        return entry

    def completed(self, entry: Entry) -> None:
        """The frame's last byte was written: keep a copy of whatever the peer may not have consumed."""
        entry.owner = None
        first = entry.start + entry.header
        skip = max(0, self.acked - first)
        if entry.end <= self.acked:
            self.ack(self.acked)  # acknowledged already: drop it (and stop holding the caller's buffer)
            return
        entry.payload = bytes(entry.payload[skip:])
        entry.copy_from = skip

    def ack(self, offset: int) -> None:
        if offset > self.tx_off:
            raise ProtocolError(f"ACK of stream offset {offset} beyond the {self.tx_off} bytes sent")
        self.acked = max(self.acked, offset)
        while self.entries and self.entries[0].end <= self.acked and self.entries[0].owner is None:
            self.entries.popleft()

    def replay(self, consumed: int) -> list[Resend]:
        """The parts to resend after the peer said it consumed `consumed` bytes of this stream."""
        if not self.acked <= consumed <= self.tx_off:
            raise ProtocolError(f"RESYNC at stream offset {consumed}, outside [{self.acked}, {self.tx_off}]")
        out = []
        for e in self.entries:
            if e.end <= consumed:
                continue
            skip = max(0, consumed - (e.start + e.header))
            data = e.payload[skip - e.copy_from:] if e.owner is None else e.payload[skip:]
            out.append(Resend(e.fields.tail(skip), data, e.owner))
        self.entries.clear()
        return out


class RxCount:
    """Receiver side of one stream: bytes consumed, and when to acknowledge them."""

    __slots__ = ("consumed", "acked")

    def __init__(self) -> None:
        self.consumed = 0
        self.acked = 0

    def ack_due(self) -> bool:
        return self.consumed - self.acked >= ACK_EVERY
