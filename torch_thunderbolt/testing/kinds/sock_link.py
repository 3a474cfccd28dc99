"""The transport file of the `sock` kind: links over one Unix stream socket per pair of ranks on a host.

A small kind of link written the way every kind is (a Link per peer and a LinkKind for what they share), to
show what the engine asks of one; tests run it through the conformance checks like the real kinds. It keeps
only what every kind must: frames of protocol/framing.py in the order posted, a collective message whose
receive is not posted yet *parked* (not read until it is: the socket's buffer holds it), and the control
protocol every kind speaks (protocol/control.py: its messages in CONTROL frames, after the rest of a frame
in flight): ABORT, BYE on an orderly close, and whatever the engine says through `say`. No striping,
failover or shortcut for whole messages.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
from collections import deque

from ...errors import ProtocolError, ThunderboltError, peer_shut_down
from ...protocol import control
from ...protocol.framing import DISCARD, AbortInfo, Frame, FrameDecoder, Kind, control_frame_header, encode_frame_header
from ...transport.base import Link, LinkKind, Request, close_socket

log = logging.getLogger("torch_thunderbolt.sock")
_CONTROL = object()  # marks an inbound CONTROL frame's payload


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
        self.held_frame: Frame | None = None  # a parked collective frame
        self._posts = 0  # the sink's receive count when the held frame was last matched
        self.bye = self.eof = False
        self.staging = bytearray(1 << 16)

    # -- moving data ----------------------------------------------------------------------------------------
    def send(self, key: tuple[int, int, int], sig: int, buf: memoryview) -> Request:
        req = Request(self.peer, key, sig, buf, is_send=True)
        if self.bye or self.eof:
            raise peer_shut_down(self.sink.rank, self.peer, f"to send it data ({req.describe()})",
                                 address=self.address)
        space, tag, seq = key
        hdr = encode_frame_header(Kind.DATA, space, sig, tag, seq, 0, req.nbytes, req.nbytes)
        self.sendq.append(_Out(hdr, buf, req))
        if len(self.sendq) == 1:
            self._flush()
        return req

    def pump(self, woken: bool = False) -> bool:
        moved = self._flush() if self.sendq else False
        posted = self.sink.posts != self._posts  # a receive was posted: the held frame may have one now
        self._posts = self.sink.posts
        if (self.held_frame is None or posted) and not self.eof and not self.bye:
            moved |= self._read()
        return moved

    def fds(self) -> list[tuple[int, int]]:
        if self.eof:
            return []
        ev = (select.POLLIN if self.held_frame is None and not self.bye else 0) | (select.POLLOUT if self.sendq else 0)
        return [(self.sock.fileno(), ev)] if ev else []

    def say(self, msg: control.Message) -> None:
        if self.eof or self.ctl.ours is not None:
            return
        body = self._said(msg)
        out = _Out(body, memoryview(b""), None)
        if self.sendq and self.sendq[0].sent:  # after the frame in flight
            self.sendq.insert(1, out)
        else:
            self.sendq.appendleft(out)
        self._flush()

    # -- what it knows --------------------------------------------------------------------------------------
    def held(self) -> Frame | None:
        return self.held_frame

    # -- the end --------------------------------------------------------------------------------------------
    def abort(self, err: BaseException, body: AbortInfo | None, group: int) -> None:
        """Group `group`'s frames not begun get `err` and are dropped (every group's, for -1); a frame in
        flight is finished first (the peer would read what follows as its payload), then the ABORT."""
        keep: deque[_Out] = deque()
        for i, out in enumerate(self.sendq):
            if out.req is None or (i == 0 and out.sent) or (group >= 0 and out.req.key[0] >> 1 != group):
                keep.append(out)
            else:
                out.req.error = err
        self.sendq = keep
        if body is not None:
            self.say(control.Abort(body))

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
                self.sink.completed(self.peer, out.req.key, out.req, out.req.nbytes)
        return moved

    def _read(self) -> bool:
        sink = self.sink
        moved = False
        try:
            while sink.broken is None:
                if self.inbound is not None:
                    if not self._payload():
                        return moved
                    moved = True
                    continue
                frame, self.held_frame = self.held_frame or self.decoder.next_frame(), None
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
                    target = sink.delivered(self.peer, frame, 0)  # (held in the socket: flow control, no copy)
                    if target is None:
                        self.held_frame = frame
                        return moved
                    if target is DISCARD:  # a group that is over: read and drop
                        self.inbound = [memoryview(bytearray(frame.length)), DISCARD, frame, 0]
                    else:
                        self.inbound = [target[0], target[1], frame, 0]
                else:
                    raise ProtocolError(f"rank {self.peer} sent a {frame.kind.name} frame on a sock link")
        except (BlockingIOError, InterruptedError):
            return moved
        except ThunderboltError as exc:  # a mismatch, or bytes that are not our protocol
            sink.failed(self.peer, exc)
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
            if isinstance(msg, control.Bye):
                self.bye = True
            self.sink.said(self.peer, msg)
            return not isinstance(msg, (control.Abort, control.Bye))
        if target is not DISCARD:
            self.kind.bytes_received += frame.length
            self.sink.completed(self.peer, frame.key, target, frame.length)
        return True

    def _lost(self, exc: BaseException) -> None:
        self.sink.failed(self.peer, exc, f"({self.address})", self.address)


class SockLinks(LinkKind):
    """The sock links of one engine: nothing shared but the counters."""

    name = "sock"

    def __init__(self, socks: dict[int, socket.socket]) -> None:
        self.log = log
        self.links = {p: SockLink(self, p, s) for p, s in socks.items()}
