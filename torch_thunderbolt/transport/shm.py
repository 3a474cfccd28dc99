"""Shared-memory transport for ranks on one host: slot rings in shared memory, a Unix socket per pair as
doorbell and liveness wire. Same Transport interface (and Matcher) as tcp.py.

Data path: a send is cut into slot-sized parts written into the ring to its receiver (copy 1); the
receiver copies each part straight into the posted buffer (copy 2). A collective part whose receive is not
posted yet is *parked*: the ring is not read past it until the receive arrives (the plan ordering rule
makes that deadlock-free, as on TCP). Early point-to-point messages are buffered by the Matcher.

Waiting: the thread that waits drives progress (as on TCP). It polls the rings, spins briefly yielding the
CPU (not at all when there are more ranks than cores), then sets its "sleeping" flag and blocks in poll()
on the doorbell sockets; a peer that publishes a slot to it, or frees a slot it waits for, rings the bell
when it sees the flag (a full fence on both sides orders flag and ring accesses). Each poll is capped
(2 ms, 20 ms once idle) so even a lost wake-up would cost at most that, never a hang. A yield that takes
long (other processes want the core) stops spinning for a while. The sockets carry only doorbell bytes,
BYE and ABORT texts; EOF without BYE means the peer process died (kill -9 included): PeerLostError.
"""
from __future__ import annotations

import logging
import os
import select
import socket
from collections import deque
from typing import Callable

from ..errors import BackendClosedError, MismatchError, PeerLostError, ProtocolError, ThunderboltError
from ..protocol.framing import Frame, Kind, Space
from ..protocol.signature import describe_sig
from . import shm_ring as ring
from .base import ANY_SOURCE, DrivenTransport, Request
from .matching import Matcher
from .shm_segment import Segment
from .shm_control import BELL, BYE, ControlWire
from .shm_window import ShmWindow, area_bytes
from .spin import SpinGuard

log = logging.getLogger("torch_thunderbolt.shm")
BLOCK_CAP = 0.002  # longest single poll while sleeping (bounds the cost of a lost wake-up)
QUIET_CAP = 0.02  # the same once a whole poll passed with nothing to do (an idle wait costs ~50 wake-ups/s)


def _never() -> bool:
    return False


def default_spin(local_ranks: int) -> float:
    """Seconds to spin before blocking: worth ~2 cross-core wake-ups, but none when ranks outnumber cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0.0 if local_ranks > cores else 100e-6


class _Peer:
    __slots__ = ("rank", "sock", "pid", "seg", "writer", "reader", "flag", "sendq", "parked", "ctl", "bye", "eof")

    def __init__(self, rank: int, sock: socket.socket, pid: int, seg: Segment, writer: ring.RingWriter,
                 reader: ring.RingReader, flag: memoryview) -> None:
        self.rank, self.sock, self.pid, self.seg = rank, sock, pid, seg
        self.writer, self.reader, self.flag = writer, reader, flag
        self.sendq: deque[list] = deque()  # [request, next offset]
        self.parked = False  # head slot waits for its receive to be posted
        self.ctl = bytearray()  # partial control message from the socket
        self.bye = False
        self.eof = False


class ShmTransport(ControlWire, DrivenTransport):
    _log = log
    def __init__(self, rank: int, world: int, own: Segment, peers: dict[int, tuple[socket.socket, int, Segment]],
                 *, slots: int, slot_bytes: int, spin: float | None = None, window_bytes: int = 0) -> None:
        super().__init__(rank, world)
        self.matcher = Matcher(rank)
        self.own = own
        self.slot_bytes = slot_bytes
        self._own_mv = memoryview(own.mm)
        self._my_flag = ring.flag_view(self._own_mv)
        self._my_board = ring.op_board(self._own_mv)
        self._boards = {p: ring.op_board(memoryview(seg.mm)) for p, (_, _, seg) in peers.items()}
        self.peers: dict[int, _Peer] = {}
        for p, (sock, pid, seg) in peers.items():
            sock.setblocking(False)
            pmv = memoryview(seg.mm)
            w_off = ring.ring_offset(p, rank, slots, slot_bytes)
            r_off = ring.ring_offset(rank, p, slots, slot_bytes)
            size = ring.ring_bytes(slots, slot_bytes)
            self.peers[p] = _Peer(p, sock, pid, seg, ring.RingWriter(pmv[w_off : w_off + size], slots, slot_bytes),
                                  ring.RingReader(self._own_mv[r_off : r_off + size], slots, slot_bytes),
                                  ring.flag_view(pmv))
        self._list = list(self.peers.values())
        self._by_fd = {pe.sock.fileno(): pe for pe in self._list}
        self.spin = default_spin(world) if spin is None else spin
        self._quiet = False  # the last blocking poll timed out with nothing to do
        self._spinner = SpinGuard()
        self._to_ring: set[_Peer] = set()
        self.window = self._make_window(slots, slot_bytes, window_bytes)

    def _make_window(self, slots: int, slot_bytes: int, nbytes: int) -> ShmWindow | None:
        """The shared window, when every rank of the group shares this host (a hybrid's host part has none)."""
        if nbytes <= 0 or len(self.peers) != self.world - 1:
            return None
        start = ring.rings_end(self.world, slots, slot_bytes)
        end = start + area_bytes(nbytes)
        areas = {p: memoryview(pe.seg.mm)[start:end] for p, pe in self.peers.items()}
        areas[self.rank] = self._own_mv[start:end]
        return ShmWindow(self, areas, nbytes)

    def parked_collective(self, peers: list[int]) -> tuple[int, int] | None:
        """(peer, op signature) of collective data from one of `peers` that waits for a receive nobody has
        posted (its ring is parked on it), or None."""
        with self._cv:
            for p in peers:
                pe = self.peers.get(p)
                if pe is not None and pe.parked and pe.reader.pending():
                    space, _, sig, *_ = pe.reader.peek()
                    if space == Space.COLL:
                        return p, sig
        return None

    def peer_address(self, peer: int) -> str:
        pe = self.peers.get(peer)
        return f"shm pid {pe.pid}" if pe else "?"

    # -- posting ------------------------------------------------------------------------------------------
    def _post_send(self, req: Request) -> None:
        pe = self.peers[req.peer]
        with self._cv:
            self._check_usable()
            if pe.bye or pe.eof:
                raise PeerLostError(f"rank {self.rank}: rank {req.peer} has shut down its process group",
                                    rank=self.rank, peer=req.peer, address=self.peer_address(req.peer))
            self._publish_op(req)
            pe.sendq.append([req, 0])
            self._quiet = False
            if len(pe.sendq) == 1:
                self._flush(pe)
                self._ring_bells()
            if not req.done and self._polling:
                self._wake()

    def _post_recv(self, req: Request) -> None:
        with self._cv:
            self._check_usable()
            self._publish_op(req)
            self.matcher.post(req)
            self._quiet = False
            peers = self._list if req.peer == ANY_SOURCE else [self.peers[req.peer]]
            for pe in peers:
                pe.parked = False
                self._read(pe)
            self._ring_bells()
            if not req.done and req.peer != ANY_SOURCE and self.peers[req.peer].bye:
                self.matcher.posted.pop((req.peer, req.key), None)
                raise PeerLostError(f"rank {self.rank}: rank {req.peer} has shut down its process group",
                                    rank=self.rank, peer=req.peer, address=self.peer_address(req.peer))
            if req.done:
                self._cv.notify_all()
            elif self._polling:
                self._wake()

    # -- the engine ---------------------------------------------------------------------------------------
    def _drive(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        done = until or _never
        with self._cv:
            if self._pump() or timeout <= 0 or self.broken is not None or done():
                self._quiet = False
                return
        # Spin only when traffic is flowing; a rank that already slept through a whole poll is waiting
        # for something slow (a late peer, the user's compute) and spinning would just burn CPU.
        if not self._quiet and self._spinner.spin(min(self.spin, timeout), lambda: self._spin_poll(done)):
            return
        with self._cv:
            self._my_flag[0] = 1
            ring.fence()  # the flag store must be visible before we look at the rings one last time
            if self._pump() or self.broken is not None or done():
                self._my_flag[0] = 0
                return
            poller = self._poll_set()
            self._polling = True
        try:
            events = poller.poll(min(timeout, QUIET_CAP if self._quiet else BLOCK_CAP) * 1000.0)
        finally:
            self._polling = False
            self._my_flag[0] = 0
        self._drain(self._wake_r)
        with self._cv:
            self._read_doorbells(events)
            self._quiet = not self._pump() and not events
            if self._quiet and self.window is not None:
                self._check_skipped_by_window()
            if self._quiet and self.broken is None:
                self._check_peer_ops()

    def _publish_op(self, req: Request) -> None:
        space, tag, _ = req.key
        if space == Space.COLL and req.sig and self._my_board[0] != tag:
            self._my_board[1] = req.sig
            ring.publish_fence()  # the signature is visible before the tag that says it is current
            self._my_board[0] = tag

    def _check_peer_ops(self) -> None:
        """Nothing moved for a whole poll: does a peer we wait for run this op with another signature?"""
        for req in self.matcher.pending():
            if req.is_send or req.key[0] != Space.COLL or req.peer == ANY_SOURCE or not req.sig:
                continue
            board = self._boards.get(req.peer)
            if board is None:
                continue
            tag = board[0]
            ring.publish_fence()
            sig = board[1]
            if tag == req.key[1] and board[0] == tag and sig and sig != req.sig:
                self._fail(self.peers[req.peer], MismatchError(
                    f"rank {self.rank}: mismatched operation with rank {req.peer} (op #{tag}): rank {req.peer} "
                    f"runs {describe_sig(sig)}, but rank {self.rank} waits for its part of "
                    f"{describe_sig(req.sig)} (different roots, collectives or order)"), wrap=False)
                return

    def _check_skipped_by_window(self) -> None:
        """A collective receive from a peer that has already begun a windowed op this rank has not reached
        can never complete: the peer skipped this op (its sends would be in the ring before it moved on).
        Without this, a ring op that only receives (a gather's root) facing a windowed op would time out."""
        for req in self.matcher.pending():
            if req.is_send or req.key[0] != Space.COLL or req.peer == ANY_SOURCE:
                continue
            pe = self.peers.get(req.peer)
            if pe is None or not self.window.started_beyond(req.peer):
                continue
            ring.publish_fence()  # the counter was read first: ring writes made before that post show now
            if not pe.reader.pending():
                self._fail(pe, MismatchError(
                    f"rank {self.rank}: mismatched operation with rank {req.peer}: rank {req.peer} has begun "
                    f"a shared-memory collective while rank {self.rank} waits for its data in "
                    f"{describe_sig(req.sig)} (op {req.key[1]})"), wrap=False)
                return

    def _spin_poll(self, done: Callable[[], bool]) -> bool:
        if done():
            return True
        if not self._ready():
            return False
        with self._cv:
            return self._pump() or self.broken is not None

    def _ready(self) -> bool:
        """Cheap lock-free look: is there anything the engine could move?"""
        for pe in self._list:
            if (pe.reader.pending() and not pe.parked) or (pe.sendq and pe.writer.free() > 0):
                return True
        return False

    def _poll_set(self) -> "select.poll":
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for pe in self._list:
            if not pe.eof:
                poller.register(pe.sock, select.POLLIN)
        return poller

    def _pump(self) -> bool:
        """Flush every send queue and read every ring; True if anything moved."""
        moved = False
        for pe in self._list:
            if self.broken is not None:
                return True
            if pe.sendq:
                moved |= self._flush(pe)
            if not pe.parked:
                moved |= self._read(pe)
        self._ring_bells()
        return moved

    def _flush(self, pe: _Peer) -> bool:
        w = pe.writer
        moved = False
        while pe.sendq and w.free() > 0:
            item = pe.sendq[0]
            req, off = item
            n = min(req.nbytes - off, self.slot_bytes)
            space, tag, seq = req.key
            w.put(space, Kind.DATA, req.sig, tag, seq, off, req.buf[off : off + n], req.nbytes)
            moved = True
            item[1] = off = off + n
            if off >= req.nbytes:
                pe.sendq.popleft()
                self.bytes_sent += req.nbytes
                req.done = True
                self._cv.notify_all()
        if moved:
            self._to_ring.add(pe)
        return moved

    def _read(self, pe: _Peer) -> bool:
        r = pe.reader
        moved = False
        try:
            while self.broken is None and r.pending():
                space, kind, sig, tag, seq, off, length, total = r.peek()
                if kind != Kind.DATA or off + length > total or length > self.slot_bytes:
                    raise ProtocolError(f"rank {pe.rank} wrote a corrupt slot into shared memory")
                frame = Frame(Kind.DATA, Space(space), sig, tag, seq, off, length, total)
                target = self.matcher.match(pe.rank, frame, allow_park=True)
                if target is None:
                    pe.parked = True
                    break
                dest, obj = target
                if length:
                    dest[:] = r.payload(length)
                r.pop()
                moved = True
                self.bytes_received += length
                if self.matcher.part_done(pe.rank, frame.key, obj, length):
                    self._cv.notify_all()
        except ThunderboltError as exc:  # mismatch or corrupt slot: this group can't continue
            self._fail(pe, exc, wrap=False)
            return True
        if moved:
            self._to_ring.add(pe)  # its sender may be waiting for ring space
        return moved

    def _ring_bells(self) -> None:
        if not self._to_ring:
            return
        ring.fence()  # our head/tail stores before the peer's flag load
        for pe in self._to_ring:
            if pe.flag[0] and not pe.eof:
                try:
                    pe.sock.send(BELL)
                except OSError:
                    pass  # full buffer: it has bells to read anyway; a dead peer shows up as EOF
        self._to_ring.clear()

    # -- shutdown -------------------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        with self._cv:
            if self.broken is None:
                self._send_all(BYE)
                self._close_sockets()
                self.broken = BackendClosedError(f"rank {self.rank}: the process group was shut down")
            for s in (self._wake_r, self._wake_w):
                s.close()
            self._release_memory()
            self._cv.notify_all()

    def _release_memory(self) -> None:
        self.own.unlink()
        if self.window is not None:
            self.window.release()
        for pe in self._list:
            pe.writer.release()
            pe.reader.release()
            for v in (pe.flag, pe.writer.mv, pe.reader.mv):
                v.release()
        self._my_flag.release()
        self._my_board.release()
        for board in self._boards.values():
            board.release()
        self._own_mv.release()
        for seg in [self.own] + [pe.seg for pe in self._list]:
            seg.close()


def connect_shm(store, rank: int, world: int, cfg, timeout: float) -> ShmTransport:
    """Build the shm transport of one group through the rendezvous store (see shm_connect)."""
    from .shm_connect import connect_shm as _connect

    return _connect(store, rank, world, cfg, timeout)
