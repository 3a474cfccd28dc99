"""The TCP transport's per-stream state: one `Stream` per socket, `Outgoing` per queued frame."""
from __future__ import annotations

import socket
from collections import deque

from ..protocol.framing import Frame, FrameDecoder
from .base import Request
from .failover import Fields, RxCount, StreamLog

_STAGING = 1 << 16
ABORT_PAYLOAD = object()  # marks an inbound ABORT payload


class Outgoing:
    """One frame queued on a stream: header, payload view, the request it serves (None for control
    frames and resends of completed parts), bytes written, and its failover log entry."""

    __slots__ = ("hdr", "payload", "req", "sent", "fields", "entry")

    def __init__(self, hdr: bytes, payload: memoryview, req: Request | None, fields: Fields | None = None) -> None:
        self.hdr, self.payload, self.req, self.sent, self.fields, self.entry = hdr, payload, req, 0, fields, None


class Stream:
    __slots__ = ("sock", "fd", "peer", "stream", "addr", "local", "decoder", "sendq", "inbound", "parked", "bye",
                 "staging", "dead", "log", "rx")

    def __init__(self, sock: socket.socket, peer: int, stream: int, max_message: int) -> None:
        sock.setblocking(False)
        self.sock, self.fd, self.peer, self.stream = sock, sock.fileno(), peer, stream
        try:
            self.addr = "%s:%d" % sock.getpeername()[:2]
            self.local = sock.getsockname()[0]  # one local address per cable
        except OSError:
            self.addr = self.local = "?"
        self.decoder = FrameDecoder(max_message)
        self.sendq: deque[Outgoing] = deque()
        self.inbound: list | None = None  # [dest view, target, frame, bytes done]
        self.parked: Frame | None = None
        self.bye = False
        self.dead = False  # lost its cable; the peer's other streams carry on
        self.staging = bytearray(_STAGING)
        self.log: StreamLog | None = None  # set when failover is on for this peer
        self.rx: RxCount | None = None
