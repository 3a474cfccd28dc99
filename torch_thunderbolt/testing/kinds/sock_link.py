"""The transport file of the `sock` kind: links over one Unix stream socket per pair of ranks on a host.

A small kind of link written the way every kind is (a Link per peer and a LinkKind for what they share), to
show what the engine asks of one; tests run it through the conformance checks like the real kinds. It keeps
only what every kind must: frames of protocol/framing.py in the order posted, a collective message whose
receive is not posted yet *parked* (not read until it is: the socket's buffer holds it), and the control
protocol every kind speaks (protocol/control.py: its messages in CONTROL frames): the ABORT after the rest
of a frame in flight, BYE on an orderly close. No striping, failover, probes or fast paths.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
from collections import deque

from ...errors import ProtocolError, ThunderboltError, peer_shut_down
from ...protocol import control
from ...protocol.framing import AbortInfo, Frame, FrameDecoder, Kind, Space, control_frame_header, encode_frame_header
from ...transport.base import Link, LinkKind, Request, SocketFarewell, close_socket

log = logging.getLogger("torch_thunderbolt.sock")
_CONTROL = object()  # marks an inbound CONTROL frame's payload


def _park(frame: Frame) -> bool:
    """A collective message whose receive is not posted stays in the socket (flow control, no copy)."""
    return True


class _Out:
    """A frame being written: header and payload, bytes written, and the send it serves."""

    __slots__ = ("bufs", "sent", "size", "req")

    def __init__(self, hdr: bytes, payload: memoryview, req: Request | None) -> None:
        self.bufs, self.sent, self.size, self.req = [memoryview(hdr), payload], 0, len(hdr) + len(payload), req

    def rest(self) -> list[memoryview]:
        hl = len(self.bufs[0])
        return [self.bufs[0][self.sent:], self.bufs[1]] if self.sent < hl else [self.bufs[1][self.sent - hl:]]


class SockLink(Link):
    """A peer on this host, one non-blocking Unix stream socket away."""

    def __init__(self, kind: "SockLinks", peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.kind, self.peer, self.sock = kind, peer, sock
        self.address = f"unix socket to rank {peer}"
        self.decoder = FrameDecoder()
        self.ctl = control.ControlConnection()
        self.sendq: deque[_Out] = deque()
        self.inbound: list | None = None  # [destination, target, frame, bytes in]
        self.held: Frame | None = None  # a parked collective frame
        self.bye = self.eof = False
        self.staging = bytearray(1 << 16)

    # -- moving data ----------------------------------------------------------------------------------------
    def post_send(self, req: Request) -> None:
        if self.bye or self.eof:
            raise peer_shut_down(self.engine.rank, self.peer, f"to send it data ({req.describe()})",
                                 address=self.address)
        space, tag, seq = req.key
        hdr = encode_frame_header(Kind.DATA, space, req.sig, tag, seq, 0, req.nbytes, req.nbytes)
        self.sendq.append(_Out(hdr, req.buf, req))
        if len(self.sendq) == 1:
            self._flush()

    def pump(self) -> bool:
        moved = self._flush() if self.sendq else False
        if self.held is None and not self.eof and not self.bye:
            moved |= self._read()
        return moved

    def fds(self) -> list[tuple[int, int]]:
        if self.eof:
            return []
        ev = (select.POLLIN if self.held is None and not self.bye else 0) | (select.POLLOUT if self.sendq else 0)
        return [(self.sock.fileno(), ev)] if ev else []

    def posted_recv(self) -> None:
        if self.held is not None:
            self._read()

    # -- what it knows --------------------------------------------------------------------------------------
    def gone(self) -> bool:
        return self.bye or self.eof

    def parked(self) -> Frame | None:
        return self.held if self.held is not None and self.held.space == Space.COLL else None

    # -- the end --------------------------------------------------------------------------------------------
    def abort(self, err: BaseException, body: AbortInfo | None) -> SocketFarewell | None:
        rest = self.sendq[0].rest() if self.sendq and self.sendq[0].sent else []  # finish the frame in flight
        for out in self.sendq:
            if out.req is not None:
                out.req.error = err
        self.sendq.clear()
        if body is None or self.eof or self.ctl.ours is not None:
            return None
        return SocketFarewell([(self.sock, [*rest, memoryview(self._said(control.Abort(body)))])])

    def close(self, bye: bool) -> None:
        if bye and not self.sendq and not self.eof and self.ctl.ours is None:
            try:
                self.sock.send(self._said(control.Bye()))
            except OSError:
                pass
        self.sendq.clear()
        close_socket(self.sock)
        self.eof = True

    # -- inside ---------------------------------------------------------------------------------------------
    def _said(self, msg: control.Message) -> bytes:
        """A CONTROL frame carrying `msg`."""
        body = self.ctl.send(msg)
        return control_frame_header(len(body)) + body

    def _flush(self) -> bool:
        moved = False
        while self.sendq:
            out = self.sendq[0]
            try:
                k = self.sock.sendmsg(out.rest())
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as exc:
                self._lost(exc)
                return True
            moved = True
            out.sent += k
            if out.sent < out.size:
                continue
            self.sendq.popleft()
            self.kind.bytes_sent += len(out.bufs[1])
            if out.req is not None:
                out.req.done = True
                self.engine.signal()
        return moved

    def _read(self) -> bool:
        engine = self.engine
        moved = False
        try:
            while engine.broken is None:
                if self.inbound is not None:
                    if not self._payload():
                        return moved
                    moved = True
                    continue
                frame, self.held = self.held or self.decoder.next_frame(), None
                if frame is None:
                    k = self.sock.recv_into(self.staging)
                    if k == 0:
                        self.eof = True
                        self._lost(ConnectionResetError(errno.ECONNRESET, "connection closed by peer"))
                        return True
                    self.decoder.feed(memoryview(self.staging)[:k])
                    moved = True
                elif frame.kind is Kind.CONTROL:
                    self.inbound = [memoryview(bytearray(frame.length)), _CONTROL, frame, 0]
                elif frame.kind is Kind.DATA:
                    target = engine.matcher.match(self.peer, frame, park=_park)
                    if target is None:
                        self.held = frame
                        return moved
                    self.inbound = [target[0], target[1], frame, 0]
                else:
                    raise ProtocolError(f"rank {self.peer} sent a {frame.kind.name} frame on a sock link")
        except (BlockingIOError, InterruptedError):
            return moved
        except ThunderboltError as exc:  # a mismatch, or bytes that are not our protocol
            engine.fail(exc)
        except OSError as exc:
            self._lost(exc)
        return True

    def _payload(self) -> bool:
        """Move payload of the current frame into its destination; False when the socket has no more now."""
        dest, target, frame, got = self.inbound
        if got < len(dest) and self.decoder.buffered:
            got += self.decoder.take_buffered_into(dest[got:])
            self.inbound[3] = got
        if got < len(dest):
            k = self.sock.recv_into(dest[got:])  # BlockingIOError when empty
            if k == 0:
                raise ConnectionResetError(errno.ECONNRESET, "connection closed by peer")
            self.decoder.consumed_direct(k)
            got += k
            self.inbound[3] = got
            if got < len(dest):
                return True
        self.inbound = None
        if target is _CONTROL:
            msg = self.ctl.receive(bytes(dest))
            if isinstance(msg, control.Abort):
                self.engine.peer_aborted(self.peer, msg.info)
            elif isinstance(msg, control.Bye):
                self.bye = True
                self.engine.peer_left(self.peer, f"({self.address})")
            else:
                raise ProtocolError(f"rank {self.peer} sent {type(msg).__name__.upper()} on a sock link")
            return False
        self.kind.bytes_received += frame.length
        if self.engine.matcher.part_done(self.peer, frame.key, target, frame.length):
            self.engine.signal()
        return True

    def _lost(self, exc: BaseException) -> None:
        self.engine.fail(self.engine.lost(self.peer, f"({self.address})", exc, self.address))


class SockLinks(LinkKind):
    """The sock links of one engine: nothing shared but the counters."""

    name = "sock"

    def __init__(self, socks: dict[int, socket.socket]) -> None:
        self.log = log
        self.links = {p: SockLink(self, p, s) for p, s in socks.items()}
