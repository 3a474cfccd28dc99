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
ABORT, why a group failed; PING and ANSWER, the op a waiting rank waits for) and doorbell bytes; EOF
without BYE means the peer process died, kill -9 included. A doorbell is a bare 0 byte between messages,
not a control message: it says nothing but "look at the rings", is written from the hot path (one send of
one byte, which a full socket may drop: the sleeper has bells to read anyway), and any number of them may
be read as one; no control message starts with 0, so the ControlConnection (`wake=0`) drops them. A bell is
never written in the middle of a control message: while one is still to be written, the bell waits behind
it.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections import deque

from ..errors import ProtocolError, ThunderboltError, peer_shut_down
from ..platform import Platform, spin_cores
from ..protocol import control
from ..protocol.framing import DISCARD, AbortInfo, Frame, Kind
from . import ordering
from . import shm_ring as ring
from .base import NOT_YET, REFUSED, TAKEN, Key, Link, LinkKind, Request, close_control, drop_group, write_some
from .engine import Transport
from .shm_segment import Segment
from .shm_window import ShmWindowMemory, area_bytes

log = logging.getLogger("torch_thunderbolt.shm")
BLOCK_CAP = 0.002  # longest single poll while sleeping (bounds the cost of a lost wake-up)
QUIET_CAP = 0.02  # the same once a whole poll passed with nothing to do (an idle wait costs ~50 wake-ups/s)
BELL = b"\x00"  # a doorbell: a wake-up byte between control messages (see the module docstring)


PROBE_AFTER = 1.5  # seconds without traffic before a waiting rank PINGs the peers it waits on


def default_spin(local_ranks: int, plat: Platform | None = None) -> float:
    """Seconds to spin before blocking: worth ~2 cross-core wake-ups, but none when ranks outnumber cores
    (those of the affinity mask where there is one; macOS's performance cores: `spin_cores`)."""
    cores = spin_cores(plat)
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
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
        self.parked = False  # the head slot waits for its receive to be posted
        self._posts = 0  # the sink's receive count when the parked slot was last matched
        self.ctl = control.ControlConnection(wake=BELL[0])  # what this end and the peer said on the socket
        self.out = bytearray()  # control bytes not written yet (the socket was full)
        self.bye = False
        self.eof = False
        self.address = f"shm pid {pid}"

    def fds(self) -> "list[tuple[int, int]]":
        return [] if self.eof else [(self.sock.fileno(), select.POLLIN | (select.POLLOUT if self.out else 0))]

    def send(self, key: Key, sig: int, buf: memoryview) -> Request | None:
        if self.bye or self.eof:
            raise peer_shut_down(self.sink.rank, self.peer, f"to send it data ({Request(self.peer, key, sig, buf, True).describe()})",
                                 address=self.address)
        n = len(buf)
        w = self.writer
        if not self.sendq and n <= self.kind.slot_bytes and w.free() > 0:  # one slot, written now
            space, tag, seq = key
            w.put(space, Kind.DATA, sig, tag, seq, 0, buf, n)
            self.kind.bytes_sent += n
            self.kind.to_ring.add(self)
            return None
        req = Request(self.peer, key, sig, buf, is_send=True)
        self.sendq.append([req, 0])
        if len(self.sendq) == 1:
            self._flush()
        return req

    def pump(self, woken: bool = False) -> bool:
        if woken:
            self._read_control()
        if self.out:
            self._write_control()
        moved = self._flush() if self.sendq else False
        sink = self.sink
        if not self.parked or sink.posts != self._posts:
            self._posts = sink.posts
            moved |= self._read()
        return moved

    def ready(self) -> bool:
        """Lock-free: is there anything to read or room for what we want to write?"""
        return bool((not self.parked and self.reader.pending()) or (self.sendq and self.writer.free() > 0))

    def take(self, key: Key, sig: int, dest: memoryview) -> int:
        """The peer's message `key` straight from the head slot of its ring, when it is that whole message in
        one slot (a small op's); anything else in the head slot is left for the general path."""
        r = self.reader
        if self.parked or not r.pending():
            return REFUSED if self.parked else NOT_YET
        space, kind, fsig, tag, seq, off, length, total = r.peek()
        n = len(dest)
        if (space, tag, seq) != key or length != n or total != n or off or kind != Kind.DATA or (
                fsig != sig and sig and fsig):
            return REFUSED
        if n:
            dest[:] = r.payload(n)
        r.pop()
        self.kind.bytes_received += n
        self.kind.to_ring.add(self)  # its sender may be waiting for ring space
        return TAKEN

    def held(self) -> Frame | None:
        if self.reader.pending():
            space, kind, sig, tag, seq, off, length, total = self.reader.peek()
            return Frame(Kind.DATA, space, sig, tag, seq, off, length, total)
        return None

    # -- the rings ------------------------------------------------------------------------------------------
    def _flush(self) -> bool:
        w = self.writer
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
                self.sink.completed(self.peer, req.key, req, req.nbytes)
        if moved:
            self.kind.to_ring.add(self)
        return moved

    def _read(self) -> bool:
        r = self.reader
        sink = self.sink
        slot = self.kind.slot_bytes
        moved = False
        self.parked = False
        try:
            while sink.broken is None and r.pending():
                space, kind, sig, tag, seq, off, length, total = r.peek()
                if kind != Kind.DATA or off + length > total or length > slot:
                    raise ProtocolError(f"rank {self.peer} wrote a corrupt slot into shared memory")
                frame = Frame(Kind.DATA, space, sig, tag, seq, off, length, total)
                target = sink.delivered(self.peer, frame, 0)  # (early data stays in the ring: nothing is copied)
                if target is None:
                    self.parked = True
                    break
                moved = True
                if target is DISCARD:  # a group that is over: the slot is dropped
                    r.pop()
                    continue
                dest, obj = target
                if length:
                    dest[:] = r.payload(length)
                r.pop()
                self.kind.bytes_received += length
                sink.completed(self.peer, frame.key, obj, length)
        except ThunderboltError as exc:  # mismatch or corrupt slot: this group can't continue
            sink.failed(self.peer, exc)
            return True
        if moved:
            self.kind.to_ring.add(self)  # its sender may be waiting for ring space
        return moved

    # -- the control wire -----------------------------------------------------------------------------------
    def _read_control(self) -> None:
        """Read the control bytes (bells, BYE, ABORT, probes) that woke us."""
        sink = self.sink
        while not self.eof and sink.broken is None:
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
                    while sink.broken is None and (msg := self.ctl.next_event()) is not None:
                        self._heard(msg)
                except ProtocolError as exc:
                    sink.failed(self.peer, ProtocolError(f"rank {sink.rank}: rank {self.peer} {self._where}: {exc}"))
                    return

    def _heard(self, msg: control.Message) -> None:
        if isinstance(msg, control.Bye):
            self.bye = True
        if isinstance(msg, (control.Bye, control.Leave)):
            self._read()  # what it sent before leaving is in the ring already: it is delivered first
        self.sink.said(self.peer, msg)

    def say(self, msg: control.Message) -> None:
        if self.eof or self.ctl.ours is not None:
            return
        self.out += self.ctl.send(msg)
        self._write_control()

    def _write_control(self) -> None:
        write_some(self.sock, self.out)

    @property
    def _where(self) -> str:
        return f"(shared memory, pid {self.pid})"

    def _fail(self, exc: BaseException) -> None:
        self.sink.failed(self.peer, exc, self._where, self.address)

    def ring_bell(self) -> None:
        if self.out:
            return  # a control message is half-written: a bell now would land inside it (it wakes the peer anyway)
        try:
            self.sock.send(BELL)
        except OSError:
            pass  # full buffer: it has bells to read anyway; a dead peer shows up as EOF

    def abort(self, err: BaseException, body: AbortInfo | None, group: int) -> None:
        """Group `group`'s queued sends get `err` and are dropped (every group's, for -1): slots already
        published stay for the peer to read or drop, each whole in itself. The ABORT goes on the control
        wire (the rings may be full, and a peer reads them only for data it expects)."""
        self.sendq = drop_group(self.sendq, err, group)
        if body is not None:
            self.say(control.Abort(body))

    def close(self, bye: bool) -> None:
        self.sendq.clear()
        rest, self.out = bytes(self.out), bytearray()
        close_control(self.sock, rest + self.ctl.send(control.Bye()) if bye and not self.eof and self.ctl.ours is None
                      else None)
        self.eof = True


class ShmLinks(LinkKind):
    """The shared-memory links of one engine and what they share: this rank's segment (its inbound rings and
    sleeping flag), the peers' segments, and the window memory of this host's ranks."""

    name = "shm"
    probe_after = PROBE_AFTER

    def __init__(self, rank: int, world: int, own: Segment, peers: dict[int, tuple[socket.socket, int, Segment]],
                 *, slots: int, slot_bytes: int, spin: float | None = None, window_bytes: int = 0) -> None:
        self.log = log
        self.rank, self.world = rank, world
        self.own = own
        self.slots, self.slot_bytes, self.window_bytes = slots, slot_bytes, window_bytes
        self._own_mv = memoryview(own.mm)
        self._my_flag = ring.flag_view(self._own_mv)
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

    # -- engine hooks ---------------------------------------------------------------------------------------
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

    def wake_sleepers(self) -> None:
        """After a window post: ring the bell of every peer asleep in poll() (it may wait for that post)."""
        ordering.full()  # our counter store before the loads of their flags (they fence the reverse)
        for link in self._list:
            if link.flag[0] and not link.eof:
                link.ring_bell()

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
        self._own_mv.release()
        for seg in [self.own] + [link.seg for link in self._list]:
            seg.close()
