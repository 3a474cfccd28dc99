"""TCP transport: several streams per peer, striped large messages, one progress engine per group.

Design: non-blocking sockets and a progress engine driven by whichever thread waits (MPI style), so a
receive is read by the very thread that needs it — no hand-off to a receiver thread on the latency path.
Posting a send writes inline when the socket has room; a collective frame whose receive is not posted yet
is *parked*: its stream is simply not read until the receive arrives, so TCP flow control holds the bytes
and nothing is copied twice. Any socket error or EOF puts the whole transport into the BROKEN state —
except a link error on one of a peer's streams while others over another cable live: then the stream is
dropped and its unconsumed bytes are sent again on the others (tcp_failover.py, failover.py).
"""
from __future__ import annotations

import time
import logging
import select
import socket
from typing import Callable

from ..errors import MismatchError, PeerLostError, ThunderboltError
from ..platform import SOCKET_IO_CAP
from ..protocol.framing import FRAME_HEADER_SIZE, Frame, Kind, Space, encode_control, encode_frame_header
from ..protocol.signature import describe_sig
from .base import ANY_SOURCE, DrivenTransport, Request
from .failover import Fields
from .tcp_conn import ABORT_PAYLOAD, Stream, Outgoing
from .tcp_failover import StreamFailover
from .tcp_lifecycle import StreamLifecycle
from .layout import split_aligned
from .matching import Matcher
from .spin import SpinGuard

log = logging.getLogger("torch_thunderbolt.tcp")


class TcpTransport(StreamLifecycle, StreamFailover, DrivenTransport):
    _log = log
    def __init__(self, rank: int, world: int, conns: dict[int, list[socket.socket]], *,
                 stripe_bytes: int = 256 << 10, max_message: int = 1 << 40, spin_us: int = 0,
                 probe_after: float = 1.5) -> None:
        super().__init__(rank, world)
        self.matcher = Matcher(rank)
        self.stripe_bytes = stripe_bytes
        self.conns: dict[int, list[Stream]] = {
            p: [Stream(s, p, i, max_message) for i, s in enumerate(socks)] for p, socks in conns.items()
        }
        self._all = [c for cs in self.conns.values() for c in cs]
        self._by_fd = {c.fd: c for c in self._all}
        self.spin_seconds = spin_us / 1e6
        self._spinner = SpinGuard()
        self._init_failover(probe_after)

    retired = 0  # every collective op up to this tag has finished on this rank

    def retire(self, tag: int) -> None:
        with self._cv:
            self.retired = max(self.retired, tag)
            for c in self._all:
                if c.parked is not None and c.parked.tag <= tag and self.broken is None:
                    self._fail(c, self._stray(c, c.parked), wrap=False)
            if self.broken is not None:
                raise self.broken

    def _stray(self, c: Stream, frame: Frame) -> MismatchError:
        return MismatchError(
            f"rank {self.rank}: rank {c.peer} sent {describe_sig(frame.sig)} data for op #{frame.tag}, which this "
            f"rank finished without expecting data from rank {c.peer} (different collectives, roots or order)")

    def peer_address(self, peer: int) -> str:
        cs = self.conns.get(peer)
        return cs[0].addr if cs else "?"

    # -- posting ------------------------------------------------------------------------------------------
    def _post_send(self, req: Request) -> None:
        space, tag, seq = req.key
        n = req.nbytes
        with self._cv:
            self._check_usable()
            self._note_op(req.key, req.sig)
            conns = [c for c in self.conns[req.peer] if not c.dead]
            parts = split_aligned(n, len(conns)) if n >= self.stripe_bytes and len(conns) > 1 else [(0, n)]
            req.pending = len(parts)
            for i, (off, ln) in enumerate(parts):
                fields = Fields(space, req.sig, tag, seq, off, ln, n)
                self._enqueue(conns[i], Outgoing(self._header(fields), req.buf[off : off + ln], req, fields))
            if not req.done and self._polling:
                self._wake()

    @staticmethod
    def _header(f: Fields) -> bytes:
        return encode_frame_header(Kind.DATA, Space(f.space), f.sig, f.tag, f.seq, f.offset, f.length, f.total)

    def _enqueue(self, conn: Stream, out: Outgoing, front: bool = False) -> None:
        """Queue a frame (with `front`: right after the frame being written, if any) and try to write."""
        if front and conn.sendq:
            conn.sendq.insert(1 if conn.sendq[0].sent else 0, out)
        else:
            conn.sendq.append(out)
        if conn.sendq[0] is out:
            self._flush(conn)

    def _post_recv(self, req: Request) -> None:
        with self._cv:
            self._check_usable()
            self._note_op(req.key, req.sig)
            self.matcher.post(req)  # it may match a message that arrived before the peer said BYE
            if not req.done and req.peer != ANY_SOURCE and all(c.bye or c.dead for c in self.conns[req.peer]):
                self.matcher.posted.pop((req.peer, req.key), None)
                raise PeerLostError(f"rank {self.rank}: rank {req.peer} has shut down its connections",
                                    rank=self.rank, peer=req.peer, address=self.peer_address(req.peer))
            peers = self.conns.values() if req.peer == ANY_SOURCE else [self.conns[req.peer]]
            for conns in peers:
                for c in conns:
                    if c.parked is not None and not c.dead:
                        self._read(c)
            if req.done:
                self._cv.notify_all()
            elif self._polling:
                self._wake()

    # -- the engine ---------------------------------------------------------------------------------------
    def _drive(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        with self._cv:
            moved = self._pump()
            if moved:
                self._last_traffic = time.monotonic()
            if moved or timeout <= 0 or self.broken is not None:
                return
            self._probe_if_quiet()
            ready = self._poll_set() if self.spin_seconds > 0 else None
        if ready is not None and self._spin(min(timeout, self.spin_seconds), ready):
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
            if self._pump():
                self._last_traffic = time.monotonic()

    def _spin(self, seconds: float, ready: "select.poll") -> bool:
        """Busy-poll briefly before sleeping: a cross-core wake-up costs more than a small message. Each look
        is one poll(0) over the streams, and the streams are read only once it reports news: an empty
        read raises BlockingIOError per stream, which costs more than the poll."""
        return self._spinner.spin(seconds, lambda: bool(ready.poll(0)) and self._pump_locked())

    def _pump_locked(self) -> bool:
        with self._cv:
            return self._pump() or self.broken is not None

    def _poll_set(self) -> "select.poll":
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for c in self._all:
            if c.dead:
                continue
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
            if c.dead:
                continue
            if c.sendq:
                moved |= self._flush(c)
            if c.parked is None and not c.bye:
                moved |= self._read(c)
        return moved

    def _flush(self, c: Stream) -> bool:
        moved = False
        while c.sendq and not c.dead:
            out = c.sendq[0]
            hl = len(out.hdr)
            # At most SOCKET_IO_CAP bytes per call: macOS fails a sendmsg over INT_MAX with EINVAL.
            bufs = ([out.hdr[out.sent:], out.payload[: SOCKET_IO_CAP - hl]] if out.sent < hl
                    else [out.payload[out.sent - hl : out.sent - hl + SOCKET_IO_CAP]])
            try:
                k = c.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as exc:
                if c.parked is None and not c.bye:
                    self._read(c)  # an ABORT waiting in the receive buffer names the real cause
                self._conn_error(c, exc)  # no-op if that read already failed the transport
                return True
            moved = True
            if out.sent == 0 and k and c.log is not None:  # its first byte is on this stream now
                if out.fields is None:
                    c.log.control(hl)
                else:
                    out.entry = c.log.started(out.fields, hl, out.payload, out)
            out.sent += k
            if out.sent < hl + len(out.payload):
                continue
            c.sendq.popleft()
            if out.entry is not None:
                c.log.completed(out.entry)
            self.bytes_sent += len(out.payload)
            req = out.req
            if req is not None:
                req.pending -= 1
                if req.pending == 0:
                    req.done = True
                    self._cv.notify_all()
        return moved

    def _read(self, c: Stream) -> bool:
        moved = False
        try:
            while self.broken is None:
                if c.inbound is not None:
                    step = self._read_payload(c)
                    if step is None:
                        return moved
                    moved = True
                    continue
                frame = c.parked
                if frame is None:
                    frame = c.decoder.next_frame()
                    if frame is not None and c.rx is not None:
                        c.rx.consumed += FRAME_HEADER_SIZE
                if frame is None:
                    k = c.sock.recv_into(c.staging)
                    if k == 0:
                        return self._eof(c) or True
                    c.decoder.feed(memoryview(c.staging)[:k])
                    moved = True
                    continue
                c.parked = None
                if frame.kind is Kind.PING:
                    self._check_probe(c, frame)
                    continue
                if frame.kind is Kind.ACK or frame.kind is Kind.RESYNC:
                    self._control(c, frame)
                    continue
                if frame.kind is Kind.ABORT:
                    c.inbound = [memoryview(bytearray(frame.length)), ABORT_PAYLOAD, frame, 0]
                    continue
                if frame.kind is Kind.BYE:
                    c.bye = True
                    self._peer_said_bye(c)
                    return True
                if frame.space == Space.COLL and frame.tag <= self.retired:
                    raise self._stray(c, frame)  # its op is over here: no receive can be waiting for it
                target = self.matcher.match(c.peer, frame, allow_park=c.peer not in self.no_park)
                if target is None:
                    c.parked = frame
                    return moved
                c.inbound = [target[0], target[1], frame, 0]
                moved = True
        except (BlockingIOError, InterruptedError):
            return moved
        except ThunderboltError as exc:  # mismatch or protocol violation: the stream is unusable now
            self._fail(c, exc, wrap=False)
        except OSError as exc:
            self._conn_error(c, exc)
        finally:
            if c.rx is not None and c.rx.ack_due() and not c.dead and self.broken is None:
                c.rx.acked = c.rx.consumed
                self._enqueue(c, Outgoing(encode_control(Kind.ACK, c.rx.consumed), memoryview(b""), None), front=True)
        return True

    def _read_payload(self, c: Stream) -> bool | None:
        """Move payload bytes of the current frame; None when the socket has nothing more right now."""
        dest, target, frame, got = c.inbound
        if got < len(dest) and c.decoder.buffered:
            k = c.decoder.take_buffered_into(dest[got:])
            got += k
            c.inbound[3] = got  # saved now: the recv below may raise BlockingIOError
            if c.rx is not None:
                c.rx.consumed += k
        if got < len(dest):
            k = c.sock.recv_into(dest[got : got + SOCKET_IO_CAP])  # BlockingIOError when empty; cap: see _flush
            if k == 0:
                self._eof(c)
                return None
            c.decoder.consumed_direct(k)
            got += k
            if c.rx is not None:
                c.rx.consumed += k
        if got < len(dest):
            c.inbound[3] = got
            return True
        c.inbound = None
        if target is ABORT_PAYLOAD:
            self._remote_abort(c, bytes(dest).decode(errors="replace"))
            return None
        self.bytes_received += frame.length
        if self.matcher.part_done(c.peer, frame.key, target, frame.length):
            self._cv.notify_all()
        return True
