"""Shared-memory links for ranks on one host: slot rings in shared memory, a Unix socket per pair as
doorbell and liveness wire.

Data path: a send is cut into slot-sized parts written into the ring to its receiver (copy 1); the
receiver copies each part straight into the posted buffer (copy 2). A collective part whose receive is not
posted yet is *parked*: the ring is not read past it until the receive arrives (the plan ordering rule
makes that deadlock-free, as on TCP). Early point-to-point messages are buffered by the Matcher.

Waiting (engine.py): the waiting thread looks at the rings without a system call while it spins (not at
all when there are more ranks than cores), then raises its "sleeping" flag and sleeps in poll() on the
doorbell sockets; a peer that publishes a slot to it, or frees a slot it waits for, rings the bell when it
sees the flag (a full fence on both sides orders flag and ring accesses). Each sleep is capped (2 ms, 20 ms
once idle) so even a lost wake-up would cost at most that, never a hang.

The control wire (the Unix socket) carries control messages (protocol/control.py: BYE, the orderly close;
ABORT, why a group failed) and doorbell bytes; EOF without BYE means the peer process died, kill -9
included. A doorbell is a bare 0 byte between messages, not a control message: it says nothing but "look
at the rings", is written from the hot path (one send of one byte, which a full socket may drop: the
sleeper has bells to read anyway), and any number of them may be read as one; no control message starts
with 0, so the ControlConnection (`wake=0`) drops them. Each rank also publishes the collective op it is in
(tag and signature) on an op board in its segment header; a peer that slept through a whole poll hands
what it reads there to the engine's MismatchDetector, which finds a mismatch instead of a timeout.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections import deque

from ..errors import ProtocolError, ThunderboltError, peer_shut_down
from ..protocol import control
from ..protocol.framing import AbortInfo, Frame, Kind, Space
from . import ordering
from . import shm_ring as ring
from .base import Key, Link, LinkKind, Request, SocketFarewell, close_control
from .engine import Transport
from .shm_segment import Segment
from .shm_window import ShmWindowMemory, area_bytes

log = logging.getLogger("torch_thunderbolt.shm")
BLOCK_CAP = 0.002  # longest single poll while sleeping (bounds the cost of a lost wake-up)
QUIET_CAP = 0.02  # the same once a whole poll passed with nothing to do (an idle wait costs ~50 wake-ups/s)
BELL = b"\x00"  # a doorbell: a wake-up byte between control messages (see the module docstring)


def _always(frame: Frame) -> bool:
    """A ring's early collective data stays in the ring until its receive is posted (nothing is copied)."""
    return True


def default_spin(local_ranks: int) -> float:
    """Seconds to spin before blocking: worth ~2 cross-core wake-ups, but none when ranks outnumber cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0.0 if local_ranks > cores else 100e-6


class ShmLink(Link):
    """A peer on this host: the ring we write into (in its segment), the ring we read (in ours), its
    sleeping flag and the control socket."""

    def __init__(self, kind: "ShmLinks", peer: int, sock: socket.socket, pid: int, seg: Segment,
                 writer: ring.RingWriter, reader: ring.RingReader, flag: memoryview) -> None:
        sock.setblocking(False)
        self.kind, self.peer, self.sock, self.pid, self.seg = kind, peer, sock, pid, seg
        self.writer, self.reader, self.flag = writer, reader, flag
        self.sendq: deque[list] = deque()  # [request, next offset]
        self.held = False  # the head slot waits for its receive to be posted (parked)
        self.ctl = control.ControlConnection(wake=BELL[0])  # what this end and the peer said on the socket
        self.bye = False
        self.eof = False
        self.address = f"shm pid {pid}"

    def fds(self) -> "list[tuple[int, int]]":
        return [] if self.eof else [(self.sock.fileno(), select.POLLIN)]

    def post_send(self, req: Request) -> None:
        if self.bye or self.eof:
            raise peer_shut_down(self.engine.rank, self.peer, f"to send it data ({req.describe()})",
                                 address=self.address)
        self.sendq.append([req, 0])
        if len(self.sendq) == 1:
            self._flush()

    def posted_recv(self) -> None:
        self.held = False
        self._read()

    def pump(self) -> bool:
        moved = self._flush() if self.sendq else False
        if not self.held:
            moved |= self._read()
        return moved

    def ready(self) -> bool:
        """Lock-free: is there anything to read or room for what we want to write?"""
        return bool((not self.held and self.reader.pending()) or (self.sendq and self.writer.free() > 0))

    def gone(self) -> bool:
        return self.bye or self.eof

    def parked(self) -> Frame | None:
        if self.held and self.reader.pending():
            space, kind, sig, tag, seq, off, length, total = self.reader.peek()
            if space == Space.COLL:
                return Frame(Kind.DATA, Space.COLL, sig, tag, seq, off, length, total)
        return None

    def has_unread(self) -> bool:
        return bool(self.reader.pending())

    # -- the rings ------------------------------------------------------------------------------------------
    def _flush(self) -> bool:
        w = self.writer
        engine = self.engine
        slot = self.kind.slot_bytes
        moved = False
        while self.sendq and w.free() > 0:
            item = self.sendq[0]
            req, off = item
            n = min(req.nbytes - off, slot)
            space, tag, seq = req.key
            w.put(space, Kind.DATA, req.sig, tag, seq, off, req.buf[off : off + n], req.nbytes)
            moved = True
            item[1] = off = off + n
            if off >= req.nbytes:
                self.sendq.popleft()
                self.kind.bytes_sent += req.nbytes
                req.done = True
                engine.signal()
        if moved:
            self.kind.to_ring.add(self)
        return moved

    def _read(self) -> bool:
        r = self.reader
        engine = self.engine
        slot = self.kind.slot_bytes
        moved = False
        try:
            while engine.broken is None and r.pending():
                space, kind, sig, tag, seq, off, length, total = r.peek()
                if kind != Kind.DATA or off + length > total or length > slot:
                    raise ProtocolError(f"rank {self.peer} wrote a corrupt slot into shared memory")
                frame = Frame(Kind.DATA, Space(space), sig, tag, seq, off, length, total)
                target = engine.matcher.match(self.peer, frame, park=_always)
                if target is None:
                    self.held = True
                    break
                dest, obj = target
                if length:
                    dest[:] = r.payload(length)
                r.pop()
                moved = True
                self.kind.bytes_received += length
                if engine.matcher.part_done(self.peer, frame.key, obj, length):
                    engine.signal()
        except ThunderboltError as exc:  # mismatch or corrupt slot: this group can't continue
            engine.fail(exc)
            return True
        if moved:
            self.kind.to_ring.add(self)  # its sender may be waiting for ring space
        return moved

    # -- the control wire -----------------------------------------------------------------------------------
    def on_event(self, fd: int) -> None:
        """Read the control bytes (bells, BYE, ABORT) that woke us."""
        engine = self.engine
        while not self.eof and engine.broken is None:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if self.bye:
                    # The peer left in order. A Unix socket closed with our doorbells still unread in it
                    # reports ECONNRESET after the BYE instead of EOF: that is its close, not a loss.
                    self.eof = True
                else:
                    self._fail(exc)
                return
            if not data:
                self.eof = True
                if not self.bye:
                    self._fail(ConnectionResetError(errno.ECONNRESET, f"process {self.pid} is gone"))
                return
            if self.ctl.buffered or data.strip(BELL):  # plain doorbells need no parsing
                try:
                    self.ctl.receive_data(data)
                    while engine.broken is None and (msg := self.ctl.next_event()) is not None:
                        self._heard(msg)
                except ProtocolError as exc:
                    engine.fail(ProtocolError(f"rank {engine.rank}: rank {self.peer} {self._where}: {exc}"))
                    return

    def _heard(self, msg: control.Message) -> None:
        engine = self.engine
        if isinstance(msg, control.Bye):
            self.bye = True
            self._read()  # what it sent before leaving is in the ring already
            engine.peer_left(self.peer, self._where)
        elif isinstance(msg, control.Abort):
            engine.peer_aborted(self.peer, msg.info)
        else:  # probes and membership go over the op board and the window here, not this wire
            raise ProtocolError(f"sent {type(msg).__name__.upper()}, which no shared-memory link of this "
                                f"version acts on (the ranks run different versions)")

    @property
    def _where(self) -> str:
        return f"(shared memory, pid {self.pid})"

    def _fail(self, exc: BaseException) -> None:
        self.engine.fail(self.engine.lost(self.peer, self._where, exc, self.address))

    def ring_bell(self) -> None:
        try:
            self.sock.send(BELL)
        except OSError:
            pass  # full buffer: it has bells to read anyway; a dead peer shows up as EOF

    def abort(self, err: BaseException, body: AbortInfo | None) -> SocketFarewell | None:
        """The ABORT goes on the control wire (the rings may be full, and a peer reads them only for data it
        expects); slots already published stay valid for the peer to read or drop."""
        for req, _ in self.sendq:
            req.error = err
        self.sendq.clear()
        if body is None or self.eof or self.ctl.ours is not None:
            return None
        return SocketFarewell([(self.sock, [memoryview(self.ctl.send(control.Abort(body)))])])

    def close(self, bye: bool) -> None:
        self.sendq.clear()
        close_control(self.sock, self.ctl.send(control.Bye()) if bye and not self.eof and self.ctl.ours is None
                      else None)
        self.eof = True


class ShmLinks(LinkKind):
    """The shared-memory links of one engine and what they share: this rank's segment (its inbound rings,
    sleeping flag and op board), the peers' segments, and the window memory of this host's ranks."""

    name = "shm"

    def __init__(self, rank: int, world: int, own: Segment, peers: dict[int, tuple[socket.socket, int, Segment]],
                 *, slots: int, slot_bytes: int, spin: float | None = None, window_bytes: int = 0) -> None:
        self.log = log
        self.rank, self.world = rank, world
        self.own = own
        self.slots, self.slot_bytes, self.window_bytes = slots, slot_bytes, window_bytes
        self._own_mv = memoryview(own.mm)
        self._my_flag = ring.flag_view(self._own_mv)
        self._my_board = ring.op_board(self._own_mv)
        self._boards = {p: ring.op_board(memoryview(seg.mm)) for p, (_, _, seg) in peers.items()}
        self.links: dict[int, ShmLink] = {}
        size = ring.ring_bytes(slots, slot_bytes)
        for p, (sock, pid, seg) in peers.items():
            pmv = memoryview(seg.mm)
            w_off = ring.ring_offset(p, rank, slots, slot_bytes)
            r_off = ring.ring_offset(rank, p, slots, slot_bytes)
            self.links[p] = ShmLink(self, p, sock, pid, seg,
                                    ring.RingWriter(pmv[w_off : w_off + size], slots, slot_bytes),
                                    ring.RingReader(self._own_mv[r_off : r_off + size], slots, slot_bytes),
                                    ring.flag_view(pmv))
        self._list = list(self.links.values())
        # Spin by how many ranks share this host (all of a one-host group, or a multi-host job's share).
        self.spin = default_spin(len(peers) + 1) if spin is None else spin
        self.to_ring: set[ShmLink] = set()  # peers to ring once this round of posting or pumping is over
        self.window: ShmWindowMemory | None = None

    def attach(self, engine: Transport) -> None:
        super().attach(engine)
        # The window memory of this host's ranks of the group (all of them, or a multi-host job's share).
        if self.window_bytes > 0 and self.links:
            start = ring.rings_end(self.world, self.slots, self.slot_bytes)
            end = start + area_bytes(self.window_bytes)
            areas = {p: memoryview(link.seg.mm)[start:end] for p, link in self.links.items()}
            areas[self.rank] = self._own_mv[start:end]
            members = sorted(areas)
            self.window = ShmWindowMemory(members, members.index(self.rank), areas, self.window_bytes,
                                          self.wake_sleepers)
            engine.window_memory = self.window

    # -- engine hooks ---------------------------------------------------------------------------------------
    def note_post(self, key: Key, sig: int) -> None:
        """Publish the collective op this rank is in on its op board, as a seqlock: tag 0 (op tags start at
        1) while the sig changes, then the tag, so a reader never pairs one op's tag with another's sig."""
        space, tag, _ = key
        board = self._my_board
        if space == Space.COLL and sig and board[0] != tag:
            board[0] = 0
            ordering.release()  # the 0 before the new sig
            board[1] = sig
            ordering.release()  # the sig before the tag that says it is current
            board[0] = tag

    def after_pump(self) -> None:
        if not self.to_ring:
            return
        ordering.full()  # our head/tail stores before the load of the peer's flag (the sleeper: the reverse)
        for link in self.to_ring:
            if link.flag[0] and not link.eof:
                link.ring_bell()
        self.to_ring.clear()

    def ready(self) -> bool:
        for link in self._list:
            if link.ready():
                return True
        return False

    def before_sleep(self, quiet: bool) -> float:
        self._my_flag[0] = 1
        ordering.full()  # the flag store before the engine's last look at the rings and counters
        return QUIET_CAP if quiet else BLOCK_CAP

    def after_sleep(self) -> None:
        self._my_flag[0] = 0

    def idle(self, slept: bool) -> None:
        if slept:
            self._check_peer_ops()

    def wake_sleepers(self) -> None:
        """After a window post: ring the bell of every peer asleep in poll() (it may wait for that post)."""
        ordering.full()  # our counter store before the loads of their flags (they fence the reverse)
        for link in self._list:
            if link.flag[0] and not link.eof:
                link.ring_bell()

    # -- mismatch checks while quiet ------------------------------------------------------------------------
    def _check_peer_ops(self) -> None:
        """Nothing moved for a whole poll: tell the engine's MismatchDetector what op each peer we wait
        for says it is in (a torn read, the tag changing under us, says nothing)."""
        engine = self.engine
        for peer in sorted({r.peer for r in engine.matcher.collective_waits() if r.sig}):
            board = self._boards.get(peer)
            if board is None:
                continue
            tag = board[0]
            ordering.acquire()  # the tag before the sig (see note_post)
            sig = board[1]
            ordering.acquire()  # the sig before the tag's second load
            if tag and board[0] == tag:
                try:
                    engine.ops.peer_runs(peer, tag, sig)
                except ThunderboltError as exc:
                    engine.fail(exc)
                    return

    # -- the end --------------------------------------------------------------------------------------------
    def release(self) -> None:
        self.own.unlink()
        if self.window is not None:
            self.window.release()
        for link in self._list:
            link.writer.release()
            link.reader.release()
            for v in (link.flag, link.writer.mv, link.reader.mv):
                v.release()
        self._my_flag.release()
        self._my_board.release()
        for board in self._boards.values():
            board.release()
        self._own_mv.release()
        for seg in [self.own] + [link.seg for link in self._list]:
            seg.close()
