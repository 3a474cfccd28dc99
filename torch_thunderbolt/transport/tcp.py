"""TCP transport: several streams per peer, striped large messages, one progress engine per group.

Design: non-blocking sockets and a progress engine driven by whichever thread waits (MPI style), so a
receive is read by the very thread that needs it — no hand-off to a receiver thread on the latency path.
Posting a send writes inline when the socket has room; a collective frame whose receive is not posted yet
is *parked*: its stream is simply not read until the receive arrives, so TCP flow control holds the bytes
and nothing is copied twice. Any socket error or EOF puts the whole transport into the BROKEN state.
"""
from __future__ import annotations

import errno
import os
import time
import re
import logging
import select
import socket
from collections import deque

from ..errors import (BackendClosedError, CollectiveTimeout, MismatchError, PeerAbortedError, PeerLostError,
                      ProtocolError, ThunderboltError)
from ..protocol.framing import Frame, FrameDecoder, Kind, Space, encode_abort, encode_frame_header
from ..protocol.signature import describe_sig
from .base import ANY_SOURCE, DrivenTransport, Request
from .layout import split_aligned
from .matching import Matcher

log = logging.getLogger("torch_thunderbolt.tcp")
_STAGING = 1 << 16
_ABORT = object()  # marks an inbound ABORT payload
_REMOTE_ERRORS = {"MismatchError": MismatchError, "CollectiveTimeout": CollectiveTimeout,
                  "ProtocolError": ProtocolError, "PeerLostError": PeerLostError}


class _Conn:
    __slots__ = ("sock", "fd", "peer", "stream", "addr", "decoder", "sendq", "inbound", "parked", "bye", "staging")

    def __init__(self, sock: socket.socket, peer: int, stream: int, max_message: int) -> None:
        sock.setblocking(False)
        self.sock, self.fd, self.peer, self.stream = sock, sock.fileno(), peer, stream
        try:
            self.addr = "%s:%d" % sock.getpeername()[:2]
        except OSError:
            self.addr = "?"
        self.decoder = FrameDecoder(max_message)
        self.sendq: deque[list] = deque()  # [header, payload view, request, bytes sent]
        self.inbound: list | None = None  # [dest view, target, frame, bytes done]
        self.parked: Frame | None = None
        self.bye = False
        self.staging = bytearray(_STAGING)


class TcpTransport(DrivenTransport):
    def __init__(self, rank: int, world: int, conns: dict[int, list[socket.socket]], *,
                 stripe_bytes: int = 256 << 10, max_message: int = 1 << 40, spin_us: int = 0) -> None:
        super().__init__(rank, world)
        self.matcher = Matcher(rank)
        self.stripe_bytes = stripe_bytes
        self.conns: dict[int, list[_Conn]] = {
            p: [_Conn(s, p, i, max_message) for i, s in enumerate(socks)] for p, socks in conns.items()
        }
        self._all = [c for cs in self.conns.values() for c in cs]
        self._by_fd = {c.fd: c for c in self._all}
        self.spin_seconds = spin_us / 1e6
        self._no_spin_until = 0.0

    retired = 0  # every collective op up to this tag has finished on this rank

    def retire(self, tag: int) -> None:
        with self._cv:
            self.retired = max(self.retired, tag)
            for c in self._all:
                if c.parked is not None and c.parked.tag <= tag and self.broken is None:
                    self._fail(c, self._stray(c, c.parked), wrap=False)
            if self.broken is not None:
                raise self.broken

    def _stray(self, c: _Conn, frame: Frame) -> MismatchError:
        return MismatchError(
            f"rank {self.rank}: rank {c.peer} sent {describe_sig(frame.sig)} data for op #{frame.tag}, which this "
            f"rank finished without expecting data from rank {c.peer} (different collectives, roots or order)")

    def peer_address(self, peer: int) -> str:
        cs = self.conns.get(peer)
        return cs[0].addr if cs else "?"

    # -- posting ------------------------------------------------------------------------------------------
    def _post_send(self, req: Request) -> None:
        conns = self.conns[req.peer]
        space, tag, seq = req.key
        n = req.nbytes
        parts = split_aligned(n, len(conns)) if n >= self.stripe_bytes and len(conns) > 1 else [(0, n)]
        with self._cv:
            self._check_usable()
            req.pending = len(parts)
            for i, (off, ln) in enumerate(parts):
                hdr = encode_frame_header(Kind.DATA, Space(space), req.sig, tag, seq, off, ln, n)
                conn = conns[i]
                conn.sendq.append([hdr, req.buf[off : off + ln], req, 0])
                if len(conn.sendq) == 1:
                    self._flush(conn)
            if not req.done and self._polling:
                self._wake()

    def _post_recv(self, req: Request) -> None:
        with self._cv:
            self._check_usable()
            self.matcher.post(req)  # it may match a message that arrived before the peer said BYE
            if not req.done and req.peer != ANY_SOURCE and all(c.bye for c in self.conns[req.peer]):
                self.matcher.posted.pop((req.peer, req.key), None)
                raise PeerLostError(f"rank {self.rank}: rank {req.peer} has shut down its connections",
                                    rank=self.rank, peer=req.peer, address=self.peer_address(req.peer))
            peers = self.conns.values() if req.peer == ANY_SOURCE else [self.conns[req.peer]]
            for conns in peers:
                for c in conns:
                    if c.parked is not None:
                        self._read(c)
            if req.done:
                self._cv.notify_all()
            elif self._polling:
                self._wake()

    # -- the engine ---------------------------------------------------------------------------------------
    def _drive(self, timeout: float) -> None:
        with self._cv:
            if self._pump() or timeout <= 0 or self.broken is not None:
                return
        if self._spin(min(timeout, self.spin_seconds)):
            return
        with self._cv:
            poller = self._poll_set()
            self._polling = True
        try:
            poller.poll(timeout * 1000.0)
        finally:
            self._polling = False
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        with self._cv:
            self._pump()

    def _spin(self, seconds: float) -> bool:
        """Busy-poll briefly before sleeping: a cross-core wake-up costs more than a small message."""
        if seconds <= 0:
            return False
        now = time.perf_counter()
        if now < self._no_spin_until:
            return False
        end = now + seconds
        while now < end:
            with self._cv:
                if self._pump() or self.broken is not None:
                    return True
            os.sched_yield()  # let a rank sharing this core run
            after = time.perf_counter()
            if after - now > 200e-6:  # the core is contended: spinning only steals it, so stop a while
                self._no_spin_until = after + 0.5
                return False
            now = after
        return False

    def _poll_set(self) -> "select.poll":
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for c in self._all:
            ev = 0
            if c.parked is None and not c.bye:
                ev |= select.POLLIN
            if c.sendq:
                ev |= select.POLLOUT
            if ev:
                poller.register(c.fd, ev)
        return poller

    def _pump(self) -> bool:
        """Flush every send queue and read every readable stream; True if anything moved."""
        moved = False
        for c in self._all:
            if self.broken is not None:
                return True
            if c.sendq:
                moved |= self._flush(c)
            if c.parked is None and not c.bye:
                moved |= self._read(c)
        return moved

    def _flush(self, c: _Conn) -> bool:
        moved = False
        while c.sendq:
            item = c.sendq[0]
            hdr, payload, req, sent = item
            hl = len(hdr)
            bufs = [hdr[sent:], payload] if sent < hl else [payload[sent - hl :]]
            try:
                k = c.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as exc:
                if c.parked is None and not c.bye:
                    self._read(c)  # an ABORT waiting in the receive buffer names the real cause
                self._fail(c, exc)  # no-op if that read already failed the transport
                return True
            moved = True
            item[3] = sent = sent + k
            if sent < hl + len(payload):
                continue
            c.sendq.popleft()
            self.bytes_sent += len(payload)
            req.pending -= 1
            if req.pending == 0:
                req.done = True
                self._cv.notify_all()
        return moved

    def _read(self, c: _Conn) -> bool:
        moved = False
        try:
            while self.broken is None:
                if c.inbound is not None:
                    step = self._read_payload(c)
                    if step is None:
                        return moved
                    moved = True
                    continue
                frame = c.parked or c.decoder.next_frame()
                if frame is None:
                    k = c.sock.recv_into(c.staging)
                    if k == 0:
                        return self._eof(c) or True
                    c.decoder.feed(memoryview(c.staging)[:k])
                    moved = True
                    continue
                c.parked = None
                if frame.kind is Kind.ABORT:
                    c.inbound = [memoryview(bytearray(frame.length)), _ABORT, frame, 0]
                    continue
                if frame.kind is Kind.BYE:
                    c.bye = True
                    self._peer_said_bye(c)
                    return True
                target = self.matcher.match(c.peer, frame, allow_park=True)
                if target is None:
                    if frame.space == Space.COLL and frame.tag <= self.retired:
                        raise self._stray(c, frame)
                    c.parked = frame
                    return moved
                c.inbound = [target[0], target[1], frame, 0]
                moved = True
        except (BlockingIOError, InterruptedError):
            return moved
        except ThunderboltError as exc:  # mismatch or protocol violation: the stream is unusable now
            self._fail(c, exc, wrap=False)
        except OSError as exc:
            self._fail(c, exc)
        return True

    def _read_payload(self, c: _Conn) -> bool | None:
        """Move payload bytes of the current frame; None when the socket has nothing more right now."""
        dest, target, frame, got = c.inbound
        if got < len(dest) and c.decoder.buffered:
            got += c.decoder.take_buffered_into(dest[got:])
            c.inbound[3] = got  # saved now: the recv below may raise BlockingIOError
        if got < len(dest):
            k = c.sock.recv_into(dest[got:])  # raises BlockingIOError when empty
            if k == 0:
                self._eof(c)
                return None
            c.decoder.consumed_direct(k)
            got += k
        if got < len(dest):
            c.inbound[3] = got
            return True
        c.inbound = None
        if target is _ABORT:
            self._remote_abort(c, bytes(dest).decode(errors="replace"))
            return None
        self.bytes_received += frame.length
        if self.matcher.part_done(c.peer, frame.key, target, frame.length):
            self._cv.notify_all()
        return True

    def _remote_abort(self, c: _Conn, text: str) -> None:
        name, _, reason = text.partition(": ")
        cls = _REMOTE_ERRORS.get(name, PeerAbortedError)
        message = f"rank {self.rank}: rank {c.peer} aborted the group: {reason or name}"
        if cls is PeerLostError:  # name the rank that was actually lost, not the messenger
            lost = re.search(r"connection to rank (\d+)", reason)
            err: BaseException = PeerLostError(message, rank=self.rank, peer=int(lost.group(1)) if lost else c.peer)
        else:
            err = cls(message)
            if isinstance(err, PeerAbortedError):
                err.peer = c.peer
        self._fail(c, err, wrap=False)  # forward it: our FIN must not reach a peer before the reason

    def abort(self, error: BaseException) -> None:
        """Fail this transport with `error` and tell every peer why, so they fail fast and clearly too."""
        with self._cv:
            if self.broken is None and self._all:
                self._fail(self._all[0], error, wrap=False)

    def _peer_said_bye(self, c: _Conn) -> None:
        if all(x.bye for x in self.conns[c.peer]) and any(
                r.peer == c.peer and not r.is_send for r in self.matcher.pending()):
            self._fail(c, ConnectionAbortedError(errno.ECONNABORTED, "the peer shut down its process group "
                                                 "while this rank still expected data from it"))

    def _eof(self, c: _Conn) -> bool:
        self._fail(c, ConnectionResetError(errno.ECONNRESET, "connection closed by peer"))
        return True

    def _fail(self, c: _Conn, exc: BaseException, wrap: bool = True, tell_peers: bool = True) -> None:
        """Enter BROKEN: every pending and later request gets the error; peers learn the root cause."""
        if self.broken is not None:
            return
        if wrap:
            err: BaseException = PeerLostError(
                f"rank {self.rank}: lost the connection to rank {c.peer} at {c.addr} (stream {c.stream}): "
                f"{exc}", rank=self.rank, peer=c.peer, address=c.addr)
            err.__cause__ = exc
        else:
            err = exc
        if tell_peers:
            self._send_abort(err)
        log.error("%s", err)
        self.broken = err
        for r in self.matcher.pending():
            r.error = err
        for other in self._all:
            for item in other.sendq:
                item[2].error = err
            other.sendq.clear()
        self._close_sockets()
        self._cv.notify_all()

    def _send_abort(self, exc: BaseException) -> None:
        frame = encode_abort(exc)
        for c in self._all:
            if c.sendq:  # mid-frame: an ABORT now would be garbage to the peer; closing says enough
                continue
            try:
                c.sock.send(frame)
            except OSError:
                pass

    # -- shutdown -----------------------------------------------------------------------------------------
    def _close_sockets(self) -> None:
        for c in self._all:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.sock.close()

    def _shutdown(self) -> None:
        with self._cv:
            if self.broken is None:
                bye = encode_frame_header(Kind.BYE, Space.COLL, 0, 0, 0, 0, 0, 0)
                for c in self._all:
                    if not c.sendq:
                        try:
                            c.sock.send(bye)
                        except OSError:
                            pass
                self._close_sockets()
                self.broken = BackendClosedError(f"rank {self.rank}: the process group was shut down")
            for s in (self._wake_r, self._wake_w):
                s.close()
            self._cv.notify_all()

