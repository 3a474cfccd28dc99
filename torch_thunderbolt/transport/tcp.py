"""TCP links: several streams per peer, large messages striped over them, failover between cables.

Non-blocking sockets driven by the engine (engine.py): a receive is read by the very thread that needs it,
with no hand-off to a receiver thread on the latency path. Posting a send writes inline when the socket has
room. A collective frame whose receive is not posted yet is *parked*: its stream is simply not read until
the receive arrives, so TCP flow control holds the bytes and nothing is copied twice.

Any socket error or EOF breaks the whole group, except a link error on one of a peer's streams while
others over another cable live: then the stream is dropped and its unconsumed bytes are sent again on the
others (bookkeeping in failover.py). With failover on, a keeper thread acknowledges and answers RESYNCs
while no thread waits. What the peers say about the connection (BYE, ABORT, probes) is a control message
(protocol/control.py) in a CONTROL frame, one ControlConnection per stream. A rank that only waits to
receive sends PING probes after a quiet spell; each names the op it waits for, so a peer that ran that op
differently (another root or collective) detects the mismatch (the engine's MismatchDetector decides), and
its ANSWER says whom it waits on itself (a timeout then blames the end of the chain).
The link timeout (THUNDERBOLT_LINK_TIMEOUT_MS) finds a cut cable: the kernel ends a stream whose sent data
stays unacknowledged that long. Linux also ends one whose peer answers but keeps its window closed (a rank
frozen or busy elsewhere), so there a thread of the TCP links' own, the window guard, lifts the timeout on
each stream whose kernel holds data the peer has no room for, as the kernel reports it (TcpLinks._guard).
With THUNDERBOLT_INTEGRITY=mac a peer's link is a SealedTcpLink: every frame carries MACs
(protocol/integrity.py), sealed when its first byte is about to be written and checked before it is acted on.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any, Sequence

from ..errors import ProtocolError, ThunderboltError
from ..platform import SOCKET_IO_CAP, Platform, SendState, current
from ..protocol import control
from ..protocol.framing import (DISCARD, FRAME_HEADER_SIZE, AbortInfo, Frame, FrameDecoder, Kind, control_frame_header, encode_control, encode_frame_header, pack_frame_header)
from ..protocol.integrity import SEALED_HEADER_SIZE, Opener, SealedFrameDecoder, Sealer
from .base import NOT_YET, REFUSED, TAKEN, Key, Link, LinkKind, Request, close_socket
from .engine import Transport
from .failover import TRANSIENT_SEND_ERRNOS, Fields, RxCount, StreamLog, is_link_failure

log = logging.getLogger("torch_thunderbolt.tcp")
_STAGING = 1 << 16
# The window guard looks at the streams this often, or GUARD_LOOKS times per link timeout when that is
# shorter. Linux ends a stalled connection no sooner than the link timeout plus one retransmission timeout
# (200 ms at least) after the stall began: the guard has several looks in that time, even on a busy machine.
GUARD_EVERY = 0.25
GUARD_LOOKS = 5
CONTROL_PAYLOAD = object()  # marks an inbound CONTROL frame's payload (one control message)


STRIPE_ALIGN = 4096  # striped parts start on page boundaries where the message allows it
# A striped message goes in pieces of at most this much, each to the next stream with room (see
# TcpLink._dispatch): a cable slower than its neighbours then carries a smaller share, and a piece is
# large enough that a frame header per piece costs nothing measurable.
STRIPE_PIECE = 4 << 20
STREAM_DEPTH = 1  # frames queued on a stream (the one being written included) before it gets no more pieces
# A send that fails with ENOBUFS (XNU short of mbufs: sosend, uipc_socket.c:2455-2458) is tried again, a
# millisecond apart (the socket stays writable, so poll would not wait), for this long before it counts.
NOBUFS_SECONDS = 2.0
NOBUFS_PAUSE = 0.001


def split_aligned(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """How a large message is cut into `parts` (offset, length) pieces covering [0, nbytes), one per stream;
    boundaries on STRIPE_ALIGN bytes when possible."""
    if parts <= 1 or nbytes < parts * STRIPE_ALIGN:
        return [(0, nbytes)]
    per = (nbytes // parts) // STRIPE_ALIGN * STRIPE_ALIGN
    out = [(i * per, per) for i in range(parts - 1)]
    out.append(((parts - 1) * per, nbytes - (parts - 1) * per))
    return out


def stripe_pieces(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """How a striped message is cut: one piece per stream, or pieces of at most STRIPE_PIECE bytes when that
    gives more (aligned as split_aligned aligns them)."""
    return split_aligned(nbytes, max(streams, -(-nbytes // STRIPE_PIECE)))


class Outgoing:
    """One frame queued on a stream: header, payload view, the request it serves (None for control
    frames and resends of completed parts), bytes written, and its failover log entry."""

    __slots__ = ("hdr", "payload", "req", "sent", "fields", "entry", "front")

    def __init__(self, hdr: bytes, payload: memoryview, req: Request | None, fields: Fields | None = None) -> None:
        self.hdr, self.payload, self.req, self.sent, self.fields, self.entry = hdr, payload, req, 0, fields, None
        self.front = False  # queued ahead of data (see `enqueue`)


def _control_frame(hdr: bytes) -> Outgoing:
    """An ACK or RESYNC (a header, no payload)."""
    return Outgoing(hdr, memoryview(b""), None)


def _said(c: "Stream", msg: control.Message) -> Outgoing:
    """Control message `msg` as a CONTROL frame on stream `c` (its ControlConnection checks it may be said)."""
    body = c.ctl.send(msg)
    return Outgoing(control_frame_header(len(body)), memoryview(body), None)


class Stream:
    """One socket to a peer and what is in flight on it."""

    __slots__ = ("sock", "fd", "peer", "stream", "addr", "local", "decoder", "sendq", "inbound", "parked", "bye",
                 "staging", "dead", "log", "rx", "written", "looked", "holds", "lifted", "emptied", "sealer", "opener",
                 "ctl", "nobufs")

    def __init__(self, sock: socket.socket, peer: int, stream: int, max_message: int) -> None:
        sock.setblocking(False)
        self.sock, self.fd, self.peer, self.stream = sock, sock.fileno(), peer, stream
        try:
            self.addr = "%s:%d" % sock.getpeername()[:2]
            self.local = sock.getsockname()[0]  # one local address per cable
        except OSError:
            self.addr = self.local = "?"
        self.decoder = FrameDecoder(max_message)
        self.ctl = control.ControlConnection()  # what this end and the peer said on this stream
        self.sendq: deque[Outgoing] = deque()
        self.inbound: list | None = None  # [dest view, target, frame, bytes done]
        self.parked: Frame | None = None
        self.bye = False
        self.dead = False  # lost its cable; the peer's other streams carry on
        self.staging = bytearray(_STAGING)
        self.log: StreamLog | None = None  # set when failover is on for this peer
        self.rx: RxCount | None = None
        # What the window guard (TcpLinks._guard, its own thread) looks at and decides; this thread only counts.
        self.written = 0  # bytes written to the socket
        self.looked = 0  # `written` when the guard last asked the kernel about the socket
        self.holds = False  # the kernel held data for the peer then (sent or not)
        self.lifted = False  # the link timeout is lifted: the kernel holds data the peer has no room for
        # This pass's last read was a short one into `staging`: every frame it brought is handled and the
        # socket was empty then, so one more read would most likely only raise (over a microsecond in
        # Python: a small message pays it once per pump). What arrives later, poll() reports.
        self.emptied = False
        # THUNDERBOLT_INTEGRITY=mac (SealedTcpLink): frames sealed as written, checked as read.
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.nobufs = 0.0  # when sends began failing with ENOBUFS (0: they do not)

    @property
    def where(self) -> str:
        return f"at {self.addr} (stream {self.stream})"


_NOTHING = memoryview(b"")


class TcpLink(Link):
    """A peer reached over TCP: its streams (one or more per cable), striping and failover between them."""

    def __init__(self, kind: "TcpLinks", peer: int, socks: list[socket.socket], max_message: int) -> None:
        self.kind = kind
        self.peer = peer
        self.streams = [Stream(s, peer, i, max_message) for i, s in enumerate(socks)]
        # Streams over two or more cables (address pairs; the set looks the same from both ends) fail over.
        self.failover = len({(c.local, c.addr.rpartition(":")[0]) for c in self.streams}) > 1
        if self.failover:
            for c in self.streams:
                c.log, c.rx = StreamLog(), RxCount()
        # A parked frame stops its stream, and a RESYNC behind it could wait for data that only the RESYNC
        # brings back: with failover (or after a lost stream), early frames are buffered instead.
        self.no_park = self.failover
        # Pieces of messages not yet on a stream, in the order the messages were posted: [request, its
        # pieces, the next one to hand out]. While any wait here, later messages wait behind them, so every
        # stream carries its frames in message order (what lets a receiver park a frame without deadlock).
        self.unsent: deque[list] = deque()
        self._turn = 0  # the stream the next piece is offered to first
        self.address = self.streams[0].addr if self.streams else "?"
        self._posts = 0  # the sink's receive count when the parked frames were last matched
        self._leaves: dict[int, set[int]] = {}  # per group the peer left: the streams that said so yet
        # A small message's header, written and compared in place (`send`, `take`): no bytes made per message.
        self._hdr = bytearray(FRAME_HEADER_SIZE)
        self._expect = bytearray(FRAME_HEADER_SIZE)
        self._head = bytearray(FRAME_HEADER_SIZE)
        self._head_mv = memoryview(self._head)
        self._got = -1  # bytes `take` has read of the message it looks for (header first); -1: none under way
        self._take_dest = memoryview(b"")

    def fds(self) -> "list[tuple[int, int]]":
        out = []
        for c in self.streams:
            if c.dead:  # a stream that lost its cable: never read again
                continue
            ev = (select.POLLIN if c.parked is None and not c.bye else 0) | (select.POLLOUT if c.sendq else 0)
            if ev:
                out.append((c.fd, ev))
        return out

    # -- posting ------------------------------------------------------------------------------------------
    def send(self, key: Key, sig: int, buf: memoryview) -> Request | None:
        n = len(buf)
        conns = [c for c in self.streams if not c.dead] if self.failover else self.streams
        if n >= self.kind.stripe_bytes and len(conns) > 1:
            pieces = stripe_pieces(n, len(conns))
        elif not self.unsent:  # the common case: one frame on the first stream, written at once
            c = conns[0]
            k = 0 if c.sendq or c.log is not None else self._write_whole(c, key, sig, buf)
            if k == FRAME_HEADER_SIZE + n:
                self.kind.bytes_sent += n
                return None
            req = Request(self.peer, key, sig, buf, is_send=True)
            req.pending = 1
            self._put(c, req, 0, n, sent=k)
            return req
        else:
            pieces = [(0, n)]
        req = Request(self.peer, key, sig, buf, is_send=True)
        req.pending = len(pieces)
        self.unsent.append([req, pieces, 0])
        self._dispatch()
        return req

    def _write_whole(self, c: Stream, key: Key, sig: int, buf: memoryview) -> int:
        """Write message `key` as one frame on the idle stream `c` (no failover log to keep) with one
        sendmsg, its header packed into the link's own buffer: what most small messages need, and a small
        send paid for a queued frame's steps as much as for the system call. Returns the bytes written,
        header included: 0 when the socket takes nothing or fails (then `_put` queues the frame, and its
        writer handles both, as for any frame); the caller queues the rest of a partial write."""
        n = len(buf)
        if FRAME_HEADER_SIZE + n > SOCKET_IO_CAP:
            return 0
        hdr = self._hdr
        pack_frame_header(hdr, Kind.DATA, key[0], sig, key[1], key[2], 0, n, n)
        try:
            k = c.sock.sendmsg([hdr, buf])
        except OSError:  # BlockingIOError and InterruptedError included
            return 0
        c.written += k
        return k

    def _part_written(self, req: Request, n: int) -> None:
        """The last byte of one of `req`'s frames (n payload bytes) is on its stream."""
        self.kind.bytes_sent += n
        req.pending -= 1
        if req.pending == 0:
            self.sink.completed(self.peer, req.key, req, req.nbytes)

    def _put(self, c: Stream, req: Request, off: int, ln: int, sent: int = 0) -> None:
        """Queue the frame of `req`'s bytes [off, off + ln) on `c`, of which `sent` bytes (header first)
        were already written (by `_write_whole`)."""
        space, tag, seq = req.key
        fields = Fields(space, req.sig, tag, seq, off, ln, req.nbytes)
        out = Outgoing(_header(fields), req.buf[off : off + ln], req, fields)
        out.sent = sent
        self.enqueue(c, out)

    def _dispatch(self) -> None:
        """Hand out unsent pieces in order, each to the next live stream (round robin) with fewer than
        STREAM_DEPTH frames queued. A stream whose socket is full keeps its frames, so it is passed over:
        cables of unequal speed each carry what they can, where a fixed split would wait for the slowest."""
        unsent, streams = self.unsent, self.streams
        while unsent:
            for step in range(len(streams)):
                c = streams[(self._turn + step) % len(streams)]
                if not c.dead and len(c.sendq) < STREAM_DEPTH:
                    break
            else:
                return  # every stream is busy: the next pump that drains one calls again
            self._turn = (c.stream + 1) % len(streams)
            entry = unsent[0]
            req, pieces, i = entry
            if i + 1 == len(pieces):
                unsent.popleft()
            else:
                entry[2] = i + 1
            self._put(c, req, *pieces[i])

    def take(self, key: Key, sig: int, dest: memoryview) -> int:
        """The peer's message `key` read off its first stream with no decoder, Request or matching: the
        first read puts the header into the link's own buffer and the payload straight into `dest` (one
        recvmsg_into), and the header is compared, as bytes, with the one the expected message has. It is
        only ever read up to that message's last byte, so any other frame (another message first, a PING,
        an ABORT) is found by that comparison and everything read is given back to the stream's decoder
        (`_give_back`), to be read the general way. Refused with failover (the byte log counts what is
        consumed) or after a lost stream, while anything else is under way on the peer's streams, and for a
        message of the striping size or more: the peer stripes it over its streams where it has several
        (the header would not match, and every byte read would be copied again), and a large one outlasts
        the spin anyway. (A small message on another stream, which a sender striping a large one at the
        same time may use, is found by the general path after the spin.)"""
        got = self._got
        n = len(dest)
        if got < 0:
            if self.no_park or n >= min(self.kind.stripe_bytes, SOCKET_IO_CAP - FRAME_HEADER_SIZE):
                return REFUSED  # (SOCKET_IO_CAP: THUNDERBOLT_STRIPE may be set above what one recvmsg takes)
            for c in self.streams:
                if c.inbound is not None or c.parked is not None or c.decoder.buffered or c.bye or c.dead:
                    return REFUSED
            pack_frame_header(self._expect, Kind.DATA, key[0], sig, key[1], key[2], 0, n, n)
            got = 0
            self._take_dest = dest
        elif dest is not self._take_dest:  # (a look for another message: what was read goes back first)
            self._give_back()
            return REFUSED
        c = self.streams[0]
        try:
            if got < FRAME_HEADER_SIZE:
                k = c.sock.recvmsg_into([self._head_mv[got:], dest])[0]
            else:
                k = c.sock.recv_into(dest[got - FRAME_HEADER_SIZE:])
        except (BlockingIOError, InterruptedError):
            self._got = got
            return NOT_YET
        except OSError as exc:
            self._got = got
            self._give_back()
            self.conn_error(c, exc)
            return REFUSED
        if k == 0:
            self._got = got
            self._give_back()
            self._eof(c)
            return REFUSED
        self._got = got + k
        if got < FRAME_HEADER_SIZE <= got + k and self._head != self._expect:
            self._give_back()  # another frame came first
            return REFUSED
        if got + k == FRAME_HEADER_SIZE + n:
            self._got = -1
            self._take_dest = _NOTHING
            kind = self.kind
            kind.bytes_received += n
            kind.quick_messages += 1
            return TAKEN
        return NOT_YET

    def _give_back(self) -> None:
        """What `take` read of a message it did not finish goes back to the first stream's decoder, so that
        the general path reads the stream as if `take` had never looked at it."""
        got = self._got
        if got > 0:
            h = min(got, FRAME_HEADER_SIZE)
            c = self.streams[0]
            c.decoder.feed(bytes(self._head[:h]) + bytes(self._take_dest[: got - h]))
            c.emptied = False
        self._got = -1
        self._take_dest = _NOTHING

    def enqueue(self, c: Stream, out: Outgoing, front: bool = False) -> None:
        """Queue a frame (with `front`: ahead of queued data, right after the frame being written and the frames
        queued ahead before it: control messages keep the order they were said in, which the agreement on new
        groups relies on) and try to write."""
        out.front = front
        if front and c.sendq:
            head = c.sendq[0]
            at = 1 if head.sent else 0
            while at < len(c.sendq) and c.sendq[at].front:
                at += 1
            if at == 0 and c.sealer is not None and len(head.hdr) != FRAME_HEADER_SIZE:
                head.hdr = c.sealer.unseal(head.hdr)  # sealed but not written: `out` takes its number
            c.sendq.insert(at, out)
        else:
            c.sendq.append(out)
        if c.sendq[0] is out:
            self._flush(c)

    def pump(self, woken: bool = False) -> bool:
        if self._got >= 0:
            self._give_back()
        sink = self.sink
        moved = False
        posted = sink.posts != self._posts  # a receive was posted: a parked frame may have one now
        self._posts = sink.posts
        for c in self.streams:
            if sink.broken is not None:
                return True
            if c.dead:
                continue
            if c.sendq:
                moved |= self._flush(c)
            if (c.parked is None or posted) and not c.bye:
                moved |= self._read(c)
        if self.unsent and sink.broken is None:
            self._dispatch()
        return moved

    def held(self) -> Frame | None:
        first = None  # (a loop, not a list: every collective op asks every link once)
        for c in self.streams:
            f = c.parked
            if f is not None and (first is None or f.tag < first.tag):
                first = f
        return first

    def say(self, msg: control.Message) -> None:
        live = [c for c in self.streams if not c.dead and c.ctl.ours is None]
        # A LEAVE goes behind the group's data on every stream (the peer acts on it once every stream said it);
        # anything else jumps the queue on the first stream.
        for c in live if isinstance(msg, control.Leave) else live[:1]:
            self.enqueue(c, _said(c, msg), front=not isinstance(msg, control.Leave))

    # -- writing --------------------------------------------------------------------------------------------
    def _flush(self, c: Stream) -> bool:
        moved = False
        while c.sendq and not c.dead:
            out = c.sendq[0]
            if c.sealer is not None and not out.sent and len(out.hdr) == FRAME_HEADER_SIZE:
                out.hdr = c.sealer.seal(out.hdr, out.payload)  # numbered in the order frames hit the wire
            hl = len(out.hdr)
            # At most SOCKET_IO_CAP bytes per call: macOS fails a sendmsg over INT_MAX with EINVAL.
            bufs = ([out.hdr[out.sent:], out.payload[: SOCKET_IO_CAP - hl]] if out.sent < hl
                    else [out.payload[out.sent - hl : out.sent - hl + SOCKET_IO_CAP]])
            try:
                k = c.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as exc:
                if exc.errno in TRANSIENT_SEND_ERRNOS:
                    if self._send_again(c):
                        return moved
                    exc = OSError(exc.errno, f"{exc.strerror}, on every send for {NOBUFS_SECONDS:g} s")
                if c.parked is None and not c.bye:
                    self._read(c)  # an ABORT waiting in the receive buffer names the real cause
                self.conn_error(c, exc)  # no-op if that read already failed the transport or the stream
                return True
            if c.nobufs:
                c.nobufs = 0.0
            moved = True
            c.written += k
            if out.sent == 0 and k and c.log is not None:  # its first byte is on this stream now
                if out.fields is None:
                    c.log.control(hl + len(out.payload))
                else:
                    out.entry = c.log.started(out.fields, hl, out.payload, out)
            out.sent += k
            if out.sent < hl + len(out.payload):
                continue
            c.sendq.popleft()
            if out.entry is not None:
                c.log.completed(out.entry)
            if out.req is not None:
                self._part_written(out.req, len(out.payload))
            elif out.fields is not None:  # a resent part (a control message is no payload)
                self.kind.bytes_sent += len(out.payload)
        return moved

    # -- reading --------------------------------------------------------------------------------------------
    def _read(self, c: Stream) -> bool:
        moved = False
        c.emptied = False
        sink = self.sink
        try:
            while sink.broken is None:
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
                        c.rx.consumed += c.decoder.header_size
                if frame is None:
                    if c.emptied:
                        return moved
                    k = c.sock.recv_into(c.staging)
                    if k == 0:
                        self._eof(c)
                        return True
                    c.decoder.feed(memoryview(c.staging)[:k])
                    c.emptied = k < len(c.staging)
                    moved = True
                    continue
                c.parked = None
                if frame.kind is Kind.CONTROL:
                    c.inbound = [memoryview(bytearray(frame.length)), CONTROL_PAYLOAD, frame, 0]
                    continue
                if frame.kind is Kind.ACK or frame.kind is Kind.RESYNC:
                    self._control(c, frame)
                    continue
                target = sink.delivered(c.peer, frame, -1 if self.no_park else self.kind.early_bytes)
                if target is None:
                    c.parked = frame
                    return moved
                if target is DISCARD:  # a group that is over: read its payload, and drop it
                    c.inbound = [None, DISCARD, frame, 0]
                else:
                    c.inbound = [target[0], target[1], frame, 0]
                moved = True
        except (BlockingIOError, InterruptedError):
            return moved
        except ThunderboltError as exc:  # mismatch or protocol violation: the stream is unusable now
            sink.failed(c.peer, exc)
        except OSError as exc:
            self.conn_error(c, exc)
        finally:
            if c.rx is not None and c.rx.ack_due() and not c.dead and sink.broken is None:
                c.rx.acked = self._checked(c)
                self.enqueue(c, _control_frame(encode_control(Kind.ACK, c.rx.acked)), front=True)
        return True

    def _read_payload(self, c: Stream) -> bool | None:
        """Move payload bytes of the current frame; None when the socket has nothing more right now."""
        dest, target, frame, got = c.inbound
        if target is DISCARD:
            return self._skip(c)
        if got < len(dest) and c.decoder.buffered:
            k = c.decoder.take_buffered_into(dest[got:])
            got += k
            c.inbound[3] = got  # saved now: the recv below may raise BlockingIOError
            if c.rx is not None:
                c.rx.consumed += k
        if got < len(dest):
            # Read again even right after a short read: a bulk payload keeps arriving while Python loops.
            c.emptied = False
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
        if c.opener is not None:
            c.opener.check(dest)  # before the bytes count as received
        if target is CONTROL_PAYLOAD:
            return self._heard(c, c.ctl.receive(bytes(dest)))
        self.kind.bytes_received += frame.length
        self.sink.completed(c.peer, frame.key, target, frame.length)
        return True

    def _skip(self, c: Stream) -> bool | None:
        """Read and drop the payload of the current frame (its group is over here), a staging buffer's worth at
        a time: what a frame announces is never allocated. (Its MAC is not checked: nothing of it is used, and
        the next header's is.)"""
        frame, got = c.inbound[2], c.inbound[3]
        scratch = memoryview(c.staging)
        while got < frame.length:
            want = min(frame.length - got, len(scratch))
            if c.decoder.buffered:
                k = c.decoder.take_buffered_into(scratch[:want])
            else:
                k = c.sock.recv_into(scratch[:want])  # BlockingIOError when empty (inbound keeps `got`)
                if k == 0:
                    self._eof(c)
                    return None
                c.decoder.consumed_direct(k)
            got += k
            c.inbound[3] = got
            if c.rx is not None:
                c.rx.consumed += k
        c.inbound = None
        return True

    def _heard(self, c: Stream, msg: control.Message) -> "bool | None":
        """What the peer said on stream `c`: True to read on, None to stop reading the stream (after its
        BYE). BYE and LEAVE reach the sink once the peer said them on every stream: what it sent before them,
        on any stream, is in by then."""
        if isinstance(msg, control.Bye):
            c.bye = True
            if all(x.bye or x.dead for x in self.streams):
                self.sink.said(self.peer, msg)
            return None
        if isinstance(msg, control.Leave):
            said = self._leaves.setdefault(msg.epoch, set())
            said.add(c.stream)
            if all(x.stream in said or x.dead for x in self.streams):
                del self._leaves[msg.epoch]
                self.sink.said(self.peer, msg)
            return True
        self.sink.said(c.peer, msg)
        return None if isinstance(msg, control.Abort) else True

    def _eof(self, c: Stream) -> None:
        self._fail(c, ConnectionResetError(errno.ECONNRESET, "connection closed by peer"))

    def _fail(self, c: Stream, exc: BaseException) -> None:
        self.sink.failed(c.peer, exc, c.where, c.addr)

    def _send_again(self, c: Stream) -> bool:
        """Whether a send on `c` that failed with ENOBUFS is tried again (after a pause): for NOBUFS_SECONDS
        after the first such failure in a row."""
        now = time.monotonic()
        if not c.nobufs:
            c.nobufs = now
        if now - c.nobufs >= NOBUFS_SECONDS:
            return False
        time.sleep(NOBUFS_PAUSE)
        return True

    # -- failover -------------------------------------------------------------------------------------------
    def conn_error(self, c: Stream, exc: BaseException) -> None:
        """A socket error on stream `c` (every failed call on a stream's socket ends here): a cable's failure
        with others left fails over, anything else fails. A stream already given up (failed over) is left
        alone."""
        if c.dead:
            return
        exc = socket_error(c.sock, exc)
        if c.log is not None and is_link_failure(exc) and self.sink.broken is None:
            self._kill_stream(c, exc)  # fails the transport itself when no other stream is left
        else:
            self._fail(c, exc)

    def _survivors(self, c: Stream) -> list[Stream]:
        """The peer's other live streams, those on other cables first."""
        live = [x for x in self.streams if x is not c and not x.dead]
        return sorted(live, key=lambda x: x.local == c.local)

    def _kill_stream(self, c: Stream, exc: BaseException) -> None:
        """Stop using stream `c`; tell the peer how much of it we consumed (it resends the rest)."""
        if c.dead:
            return
        survivors = self._survivors(c)
        if not survivors:
            self._fail(c, exc)
            return
        c.dead = True
        self.kind.lost_streams += 1
        self.no_park = True
        log.warning("rank %d: lost stream %d to rank %d (%s -> %s): %s; continuing on %s", self.sink.rank,
                    c.stream, c.peer, c.local, c.addr, exc,
                    ", ".join(f"stream {x.stream} ({x.local})" for x in survivors))
        if c.opener is not None:  # a payload not yet checked does not count: the peer sends its frame again
            c.rx.consumed = self._checked(c)
        elif c.inbound is not None:  # payload bytes already in place count: the resend starts after them
            dest, target, frame, got = c.inbound
            if target is not CONTROL_PAYLOAD and target is not DISCARD and got:
                self.sink.completed(c.peer, frame.key, target, got)
        c.inbound, c.parked = None, None
        unstarted = [o for o in c.sendq if o.entry is None and o.fields is not None]
        if c.sealer is not None:
            for o in unstarted:
                if len(o.hdr) != FRAME_HEADER_SIZE:
                    o.hdr = c.sealer.unseal(o.hdr)
        c.sendq.clear()  # started frames are in the log and go again when the peer's RESYNC says from where
        self.enqueue(survivors[0], _control_frame(encode_control(Kind.RESYNC, c.rx.consumed, c.stream)), front=True)
        for i, out in enumerate(unstarted):
            self.enqueue(survivors[i % len(survivors)], out)
        for x in survivors:  # frames parked there may wait for data that will now come after them
            if x.parked is not None:
                self._read(x)

    @staticmethod
    def _checked(c: Stream) -> int:
        """Bytes of stream `c` consumed that count (what an ACK or RESYNC may say): all of them, or with
        per-frame MACs only up to the start of a frame whose payload is still coming (not checked yet)."""
        if c.opener is None or c.inbound is None:
            return c.rx.consumed
        return c.rx.consumed - SEALED_HEADER_SIZE - c.inbound[3]

    def _control(self, c: Stream, frame: Frame) -> None:
        if c.log is None:
            raise ProtocolError(f"rank {c.peer} sent {frame.kind.name} on a stream without failover")
        if frame.kind is Kind.ACK:
            c.log.ack(frame.offset)
            return
        if not 0 <= frame.tag < len(self.streams) or self.streams[frame.tag] is c:
            raise ProtocolError(f"rank {c.peer} sent RESYNC for stream {frame.tag} on stream {c.stream}")
        lost = self.streams[frame.tag]
        self._kill_stream(lost, ConnectionAbortedError(errno.ECONNABORTED, f"rank {c.peer} lost this stream"))
        survivors = self._survivors(lost)
        parts = lost.log.replay(frame.offset)
        for i, part in enumerate(parts):  # ahead of queued data, in order (front frames keep theirs)
            owner = part.owner
            out = Outgoing(_header(part.fields), memoryview(part.payload), owner.req if owner else None,
                           part.fields)
            self.kind.resent_bytes += len(out.payload)
            self.enqueue(survivors[i % len(survivors)], out, front=True)

    # -- ending ---------------------------------------------------------------------------------------------
    def abort(self, err: BaseException, body: AbortInfo | None, group: int) -> None:
        """Group `group`'s sends not yet on their way get `err` and are dropped (every group's, for -1), except
        a frame half-written on a stream: the peer would read what comes next as the rest of its payload. The
        ABORT goes after it, in a CONTROL frame."""
        for c in self.streams:
            keep: deque[Outgoing] = deque()
            for i, out in enumerate(c.sendq):
                g = (out.req.key[0] if out.req is not None else out.fields.space if out.fields is not None
                     else -2) >> 1
                if (i == 0 and out.sent) or (group >= 0 and g != group) or g < -1:
                    keep.append(out)  # (in flight, another group's, or control)
                    continue
                if out.req is not None:
                    out.req.error = err
                if i == 0 and c.sealer is not None and len(out.hdr) != FRAME_HEADER_SIZE:
                    c.sealer.unseal(out.hdr)  # sealed, never written: the next frame takes its number
            c.sendq = keep
        kept: deque[list] = deque()
        for entry in self.unsent:
            if group < 0 or entry[0].key[0] >> 1 == group:
                entry[0].error = err
            else:
                kept.append(entry)
        self.unsent = kept
        if body is not None:
            self.say(control.Abort(body))

    def close(self, bye: bool) -> None:
        if bye:
            for c in self.streams:
                if not c.sendq and not c.dead and c.ctl.ours is None:
                    msg = c.ctl.send(control.Bye())
                    hdr = control_frame_header(len(msg))
                    try:
                        c.sock.send((hdr if c.sealer is None else c.sealer.seal(hdr, msg)) + msg)
                    except OSError:
                        pass
        self.unsent.clear()
        for c in self.streams:
            c.sendq.clear()
            close_socket(c.sock)


class SealedTcpLink(TcpLink):
    """A TcpLink whose frames carry MACs (THUNDERBOLT_INTEGRITY=mac, protocol/integrity.py). `keys`: per
    stream, (key of what this rank sends, key of what it receives). Every frame is sealed by the writer
    (`_flush`, so frames are numbered in the order they hit the wire) and checked by the reader; the small-
    message shortcuts, which write and read frames without either, are off (TcpLink keeps them free of any
    check for this mode)."""

    def __init__(self, kind: "TcpLinks", peer: int, socks: list[socket.socket], max_message: int,
                 keys: "list[tuple[bytes, bytes]]", rank: int) -> None:
        super().__init__(kind, peer, socks, max_message)
        for c, (send, recv) in zip(self.streams, keys):
            c.sealer = Sealer(send)
            c.opener = Opener(recv, f"rank {rank}: a frame from rank {peer} on stream {c.stream} ({c.addr})")
            c.decoder = SealedFrameDecoder(c.opener, max_message)

    def take(self, key: Key, sig: int, dest: memoryview) -> int:
        return REFUSED

    def _write_whole(self, c: Stream, key: Key, sig: int, buf: memoryview) -> int:
        return 0  # queue it: _flush seals it


class TcpLinks(LinkKind):
    """The TCP links of one engine and what they share: probe timing, failover counters and the keeper
    thread."""

    name = "tcp"

    def __init__(self, conns: dict[int, list[socket.socket]], *, stripe_bytes: int = 256 << 10,
                 early_bytes: int = 64 << 10, max_message: int = 1 << 40, spin_us: int = 0, probe_after: float = 1.5,
                 plat: Platform | None = None, link_timeout: Sequence[tuple[int, int, int]] = (),
                 seal: "tuple[int, dict[int, list[tuple[bytes, bytes]]]] | None" = None) -> None:
        """`seal`: (this rank, per peer and stream the keys of integrity.stream_keys) to carry a MAC on every
        frame to those peers (THUNDERBOLT_INTEGRITY=mac); None: plain frames."""
        self.log = log
        # Where the link timeout also ends a connection whose peer keeps its window closed while answering
        # our window probes (Platform.timeout_on_closed_window: Linux), a rank frozen or busy elsewhere would
        # be reported lost. The window guard, a thread of this kind's, lifts it on each stream whose kernel
        # holds data the peer has no room for, and puts it back once there is room (`_guard`).
        self.plat = plat or current()
        self.link_timeout = list(link_timeout)
        self.guard_every = 0.0  # seconds between the window guard's looks; 0: no guard
        self.link_seconds = 0.0  # the link timeout, where the guard runs
        if self.plat.timeout_on_closed_window and self.link_timeout and self.plat.link_timeout is not None:
            self.link_seconds = min(value for _, _, value in self.link_timeout) * self.plat.link_timeout[2] / 1000
            self.guard_every = min(GUARD_EVERY, self.link_seconds / GUARD_LOOKS)
        self._stop = threading.Event()  # set when the engine closes: the window guard ends
        self.stripe_bytes = stripe_bytes
        self.early_bytes = early_bytes  # early collective frames up to this size are read ahead, not parked
        self.links: dict[int, TcpLink] = {
            p: TcpLink(self, p, socks, max_message) if seal is None or p not in seal[1]
            else SealedTcpLink(self, p, socks, max_message, seal[1][p], seal[0]) for p, socks in conns.items()}
        self.spin = spin_us / 1e6
        self.lost_streams = 0
        self.resent_bytes = 0  # payload sent again after a lost stream
        self.quick_messages = 0  # messages read by a StreamReceive (Transport.exchange), not the decoder
        # A rank that only waits to receive has no unacknowledged data, so the kernel's link timeout never
        # fires for it; after this long without traffic the engine sends a PING to the peers it waits on.
        self.probe_after = probe_after
        self.threads: list[threading.Thread] = []  # the failover keeper and the window guard, if any

    def attach(self, engine: Transport) -> None:
        super().attach(engine)
        if any(link.failover for link in self.links.values()):
            keeper = threading.Thread(target=self._keep_going, name=f"tb-failover-r{engine.rank}", daemon=True)
            self.threads.append(keeper)
            keeper.start()
        if self.guard_every:
            guard = threading.Thread(target=self._guard, name=f"tb-window-r{engine.rank}", daemon=True)
            self.threads.append(guard)
            guard.start()

    def release(self) -> None:
        self._stop.set()

    def _guard(self) -> None:
        """The window guard: every `guard_every` seconds, ask the kernel (TCP_INFO) about each live stream
        written to since its last look, or whose kernel held data for the peer then (no other can hold any),
        and lift the link timeout on it while it is `stalled`, put it back when it is not, or when the peer
        went `silent` (a cable cut while the window was closed: the kernel then ends the connection at its
        next probe). The decision reads only the kernel's own state, never a send that happens to find no
        room: data a send left in the kernel may stall there long after the send returned (the peer froze
        before reading it)."""
        while not self._stop.wait(self.guard_every):
            for link in list(self.links.values()):
                for c in link.streams:
                    if c.dead or not (c.lifted or c.holds or c.written != c.looked):
                        continue
                    c.looked = c.written  # (read first: a write after it is looked at next time)
                    state = self.plat.send_state(c.sock)
                    if state is None:  # closed meanwhile, or a kernel that does not tell
                        continue
                    c.holds = bool(state.in_flight or state.unsent)
                    if not stalled(state):
                        if c.lifted:
                            self.set_link_timeout(c, False, "there is room again")
                    elif silent(state, self.link_seconds):
                        if c.lifted:
                            self.set_link_timeout(c, False, "the peer answers nothing: the link is gone")
                    elif not c.lifted:
                        self.set_link_timeout(c, True, "the peer has no room for what the kernel holds")

    def set_link_timeout(self, c: Stream, lifted: bool, why: str) -> None:
        """Lift the link timeout on `c` (0: the kernel's own limits), or put it back."""
        for level, option, value in self.link_timeout:
            try:
                c.sock.setsockopt(level, option, 0 if lifted else value)
            except OSError:  # a socket that just failed: its error reaches the engine through the next call
                return
        c.lifted = lifted
        log.debug("rank %d: %s the link timeout on the stream to rank %d %s (%s)", self.engine.rank,
                  "lifted" if lifted else "restored", c.peer, c.where, why)

    def stream(self, peer: int, i: int) -> Stream:
        return self.links[peer].streams[i]

    def _keep_going(self) -> None:
        """With failover on, acknowledge and answer RESYNCs even while no thread waits on this transport:
        a peer may be waiting for data that only our answer brings back."""
        while self.engine.broken is None:  # (a kind's own thread: it drives the engine through its calls)
            time.sleep(0.05)
            self.engine.pump_if_idle()


def stalled(state: SendState) -> bool:
    """Whether a stream's kernel holds data its peer has no room for: the peer's window is closed over data
    sent or waiting, or, with nothing in flight, too small for the next segment. The kernel then probes the
    window, and Linux ends the connection after the link timeout even while the peer answers (a frozen
    rank's kernel does). Otherwise data moves, or there is none, and the link timeout only ends a connection
    whose sent data goes unacknowledged: a cut cable."""
    if state.window == 0:
        return bool(state.in_flight or state.unsent)
    return not state.in_flight and state.unsent > 0 and state.window < min(state.unsent, state.segment)


def silent(state: SendState, link_timeout: float) -> bool:
    """Whether the peer of a stalled stream stopped answering: two window probes in a row unanswered, and
    nothing acknowledged for the link timeout. A live peer's kernel answers them (a frozen rank's too; it
    skips at most one while they come faster than its limit of two such answers a second), so only a cut
    cable or a dead host leaves them unanswered. (A window shut over data in flight is retransmitted into,
    not probed: a cut then is found by the group timeout.)"""
    return state.probes >= 2 and state.acked_ago > link_timeout


def socket_error(sock: socket.socket, exc: BaseException) -> BaseException:
    """What a failed call on a stream's socket means. EPIPE from a send is looked behind: after XNU drops a
    connection (a retransmission timeout, a soft error such as a source address gone) every send fails with
    EPIPE while the cause waits in SO_ERROR (uipc_socket.c:2032-2047), and that cause (ETIMEDOUT,
    EADDRNOTAVAIL, EHOSTUNREACH) decides between failover and a lost peer. Linux's send returns the cause
    itself, and leaves SO_ERROR empty after an EPIPE from a peer that closed."""
    if not isinstance(exc, OSError) or exc.errno != errno.EPIPE:
        return exc
    try:
        cause = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        return exc
    if not cause:
        return exc
    return OSError(cause, f"{os.strerror(cause)} (a send failed with EPIPE: the system dropped the connection "
                          f"with this error)")


def _header(f: Fields) -> bytes:
    return encode_frame_header(Kind.DATA, f.space, f.sig, f.tag, f.seq, f.offset, f.length, f.total)


def tcp_transport(rank: int, world: int, conns: dict[int, list[socket.socket]], **options: Any) -> Transport:
    """A transport over already connected, authenticated sockets (`conns[peer]`: that peer's streams);
    `options` as TcpLinks takes them."""
    return Transport(rank, world, [TcpLinks(conns, **options)])
