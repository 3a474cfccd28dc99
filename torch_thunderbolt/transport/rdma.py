"""RDMA links over Thunderbolt 5: two unreliable-connected (UC) queue pairs per peer for the data, and one
TCP connection per peer for what must not be lost (liveness, BYE, ABORT, probes).

Apple's provider (facts and sources: ../shared/reference/rdma-tb5-facts.md; the binding: verbs.py) gives
two-sided SEND/RECV on UC queue pairs only, in frames of 4 KiB; a receive covers 4 KiB x 2^k bytes and a
send must cover as many 4 KiB frames as the receive it lands in; a send with no receive posted, or lost on
the wire, vanishes without a word to either side. So:

- **Lanes.** Each peer gets a *message lane* (a queue pair whose receives are `msg_size` bytes, 8 KiB where
  the provider takes 2-frame receives, else 4 KiB) for small messages and credit updates, and where the
  device has queue pairs to spare a *bulk lane* (receives of `bulk_size`, 64 KiB) for the pieces of large
  messages. Every receive of a lane has the lane's size, so a send may land in any of them: a send that
  covers fewer frames is padded (its length field says what counts) to more than the size less 4 KiB.
- **Frames.** Every send is one frame: a 64-byte header (below) and up to size - 64 payload bytes, copied
  into a registered send slot (registering user tensors would save the sender one copy, but the receiver
  copies anyway, each registration is a kernel call and a region of the ~100 a device has: not worth it).
  A message goes as one frame on the message lane when it fits, else as bulk frames, its last piece on
  the message lane when that is small. The receiving side matches frames by (key, offset) like TCP
  parts, so the lanes need not agree on order.
- **Credits.** No send ever goes without a receive posted for it: each frame carries how many receives
  this side has posted on each lane so far (cumulative, so a later frame repairs a lost one), and a side
  sends data only while the peer has more than one receive free (the last is kept for a credit update).
  A side that runs out says so (STARVING); the peer then answers every receive it frees at once.
- **Checks.** Every frame carries its lane's sequence number; a gap (UC dropped a frame) fails the group
  at once with PeerLostError on every rank: no retransmission (see docs/architecture.md, "RDMA"). A frame
  whose length fields disagree with what arrived is a ProtocolError. A lost *last* frame leaves no gap:
  a rank that waits probes its peers over the TCP connection (PING, with every lane's counters); a peer
  that says it sent frames that do not arrive within THUNDERBOLT_LINK_TIMEOUT_MS has lost them (or its
  port stalls): PeerLostError, with the port's state. Probes also find a peer that runs another op.
- **Waiting.** The engine spins on the completion queues (`RdmaLinks.ready` says "pump"), then sleeps in
  poll(): on the completion channel's descriptor where the set-up saw it signalled, else with a bounded
  backoff (Apple's provider may never signal channels). Each sleep is capped either way.
- **Failing mid-job.** Any verbs error, a lost frame or a stall fails the group: every rank gets a named
  error, sent over the TCP connections (which still work when the RDMA path does not). The error says the
  peer is reachable over TCP (that connection is a TCP path): THUNDERBOLT_TRANSPORT=tcp would use it. No
  failover to TCP mid-job: frames in flight on a UC queue pair may be lost unseen, and resending them
  would need a copy of every frame until the peer confirmed it.

Frame header (64 bytes, little-endian): type, flags, space, pad, payload length (u32), lane sequence number
(u32), receives posted on the message and the bulk lane (u32 each, cumulative mod 2^32), pad, then the
message's signature, tag, seq, this part's offset and the message's total length (u64 each).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import select
import socket
import struct
import time
from collections import deque
from ctypes import c_void_p
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ProtocolError, RdmaError, ThunderboltError, peer_shut_down
from ..platform import Platform, current, macos_version
from ..protocol import control
from ..protocol.framing import DISCARD, AbortInfo, Frame, Kind
from . import verbs as v
from .verbs import WC, WC_BYTES
from .base import NOT_YET, REFUSED, TAKEN, Key, Link, LinkKind, Request, close_control, drop_group, write_some

log = logging.getLogger("torch_thunderbolt.rdma")

HDR = struct.Struct("<BBBxIIIIxxxxQqQQQ")
_U32 = struct.Struct("<I")
# Offsets in verbs' structures (rdma-core's layout, pinned by tests/rdma/test_verbs_layout.py): an ibv_sge's
# length, an ibv_send_wr's send_flags, and their sizes (arrays of them are patched in place).
SGE_BYTES, SGE_LENGTH = ctypes.sizeof(v.ibv_sge), v.ibv_sge.length.offset
SEND_WR_BYTES, SEND_FLAGS = ctypes.sizeof(v.ibv_send_wr), v.ibv_send_wr.send_flags.offset
HEADER = HDR.size  # 64
assert HEADER == 64
T_DATA, T_CREDIT, T_HELLO = 1, 2, 3
F_STARVING = 1
M32 = 0xFFFFFFFF
_TYPES = frozenset((T_DATA, T_CREDIT, T_HELLO))
_NO_DEST = memoryview(b"")

FRAME = 4096  # a Thunderbolt frame
MSG_SIZE = 8192  # message lane receives: 2 frames (1 where the provider takes only 4 KiB receives)
BULK_SIZE = 64 << 10  # bulk lane receives: 75 Gbit/s measured at 64 KiB on one queue pair (hellas-ai PR #27)
MIN_BULK = 16 << 10  # below this a bulk lane saves too little to spend a queue pair on
MSG_DEPTH, MSG_SLOTS = 16, 16  # receives posted / send slots of the message lane (~32 outstanding is safe)
BULK_DEPTH, BULK_SLOTS = 8, 8
RESERVE = 1  # receives of the peer data never takes: kept for a credit update
SIGNAL_EVERY = 4  # one signalled send in this many frees them all (fewer completions to poll)
MAX_MESSAGE = 1 << 40
QP_BUDGET = 10  # queue pairs per device on Apple's provider (mlx #3162, PR #4209)

BLOCK_CAP = 0.002  # longest sleep while traffic flows and no completion channel works
QUIET_CAP = 0.02  # the same once a whole sleep passed with nothing to do
CHANNEL_CAP = 0.05  # with a working completion channel: a lost event costs at most this
BACKOFF_FIRST = 0.0002  # first sleep of the bounded backoff (poll() rounds up to a millisecond)

# The control connection carries control messages (protocol/control.py): a BYE's `sent` is the frames sent
# on the message and the bulk lane; a probe's counters are frames sent, received and receives posted, each
# message lane then bulk lane (RdmaLink.counters).
BYE_COUNTS, PROBE_COUNTERS = 2, 6


def frame_limit(port_max_msg: int, plat: Platform | None = None, os_version: "tuple[int, ...] | None" = None) -> int:
    """The largest receive (4 KiB x 2^k) to use with a device whose port reports `port_max_msg`: macOS before
    26.3 takes 4 KiB receives only (JACCL's check), later ones up to 512 KiB."""
    plat = plat or current()
    limit = FRAME << 7
    if port_max_msg >= FRAME:
        limit = min(limit, 1 << (port_max_msg.bit_length() - 1))
    if plat.name == "darwin":
        version = macos_version() if os_version is None else os_version
        if version is not None and version < (26, 3):
            limit = FRAME
    return max(limit, FRAME)


def lane_sizes(limit_a: int, limit_b: int) -> tuple[int, int]:
    """(message lane size, bulk lane size or 0) two ends with these frame limits agree on."""
    limit = min(limit_a, limit_b)
    bulk = min(BULK_SIZE, limit)
    return min(MSG_SIZE, limit), (bulk if bulk >= MIN_BULK else 0)


# --- devices ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceState:
    """What a device can do here, as probed for `doctor`, `offer` and the set-up."""

    name: str
    port: str = ""  # PORT_ACTIVE, DOWN, ... ("" when it could not be asked)
    gid_index: int = -1  # of the IPv4-mapped GID
    ipv4: str = ""  # that GID's address
    frame_limit: int = FRAME
    max_qp: int = QP_BUDGET
    problem: str = ""  # why it cannot be used ("" = it can), with the fix

    @property
    def usable(self) -> bool:
        return not self.problem


def probe_device(verbs: v.Verbs, name: str, plat: Platform | None = None) -> DeviceState:
    """Open `name` and check what a link needs, end to end short of a peer: port active, an IPv4-mapped
    GID, a protection domain. Never raises: a problem is in the result, with what to do about it."""
    try:
        dev = verbs.open(name)
    except RdmaError as exc:
        return DeviceState(name, problem=str(exc))
    try:
        port = dev.query_port(1)
        if not port.active:
            return DeviceState(name, port=port.state_name, problem=(
                f"port 1 of {name} is {port.state_name}: plug in the Thunderbolt 5 cable to the other Mac (and "
                f"check `ibv_devinfo`: PORT_ACTIVE)"))
        found = dev.ipv4_gid_index(1)
        if found is None:
            return DeviceState(name, port=port.state_name, problem=(
                f"{name} has no IPv4-mapped GID: give its interface ({name.removeprefix('rdma_')}) an IPv4 "
                f"address (the GID appears with it)"))
        index, gid = found
        max_qp = QP_BUDGET
        if verbs.has("ibv_query_device"):
            max_qp = min(max_qp, dev.query_device().max_qp or max_qp)
        dev.alloc_pd()  # closed with the device
        return DeviceState(name, port=port.state_name, gid_index=index, ipv4=v.gid_ipv4(gid) or "",
                           frame_limit=frame_limit(port.max_msg_sz, plat), max_qp=max_qp)
    except RdmaError as exc:
        return DeviceState(name, problem=str(exc))
    finally:
        with contextlib.suppress(RdmaError):
            dev.close()


def probe_devices(verbs: v.Verbs, plat: Platform | None = None) -> list[DeviceState]:
    """Every device the provider lists, probed (see probe_device)."""
    return [probe_device(verbs, name, plat) for name in verbs.devices()]


# --- one peer's queue pairs and memory ---------------------------------------------------------------------

class Lane:
    """One queue pair of a link, its send slots and receive slots (in the link's registered buffer), and the
    counters of its credits and sequence numbers (absolute; frames carry them mod 2^32).

    Every slot has its work request made once (`verbs.ibv_send_wr` / `ibv_recv_wr` with its scatter/gather
    entry pointing at the slot): a post patches at most a send's length and flags, then calls the provider
    through the context's ops table as verbs.h's inline ibv_post_send does. A small op posts one send and one
    receive, and building them per post was a good part of its Python (QueuePair.post_send does that)."""

    __slots__ = ("qp", "index", "size", "payload", "min_send", "depth", "nslots", "send_base", "recv_base",
                 "send_code", "recv_code", "head", "tail", "sig_head", "sent", "rx", "posted", "peer_posted",
                 "backlog", "name", "_swrs", "_ssges", "_rwrs", "_rsges", "send_args", "recv_args", "send_lens",
                 "send_flags", "post_send_fn", "post_recv_fn", "qp_arg", "_bad", "bad_arg", "device")

    def __init__(self, qp: v.QueuePair, index: int, size: int, depth: int, nslots: int, send_base: int,
                 recv_base: int, addr: int = 0, lkey: int = 0) -> None:
        self.qp, self.index, self.size = qp, index, size
        self.name = ("message", "bulk")[index]
        self.payload = size - HEADER
        # A send covers as many 4 KiB frames as the receive it lands in: more than size - 4 KiB bytes.
        self.min_send = size - FRAME + 1 if size > FRAME else 1
        self.depth, self.nslots = depth, nslots
        self.send_base, self.recv_base = send_base, recv_base
        self.send_code, self.recv_code = (index * 2) << 16, (index * 2 + 1) << 16
        self.head = self.tail = 0  # send slots handed out / freed (absolute)
        self.sig_head = 0  # slots up to here are freed by a signalled send posted already
        self.sent = 0  # frames posted
        self.rx = 0  # frames received
        self.posted = 0  # receives posted
        self.peer_posted = 0  # receives the peer said it posted for us
        self.backlog: deque[tuple[int, Frame]] = deque()  # frames held until their receive is posted
        self.device = qp.device.name
        # The work requests, one per slot (addr: the registered buffer's address, lkey: its key).
        self._ssges = (v.ibv_sge * nslots)()
        self._swrs = (v.ibv_send_wr * nslots)()
        self._rsges = (v.ibv_sge * depth)()
        self._rwrs = (v.ibv_recv_wr * depth)()
        for slot in range(nslots):
            sge = self._ssges[slot]
            sge.addr, sge.length, sge.lkey = addr + send_base + slot * size, 0, lkey
            wr = self._swrs[slot]
            wr.wr_id, wr.sg_list, wr.num_sge = self.send_code | slot, ctypes.pointer(sge), 1
            wr.opcode, wr.send_flags = v.IBV_WR_SEND, 0
        for slot in range(depth):
            sge = self._rsges[slot]
            sge.addr, sge.length, sge.lkey = addr + recv_base + slot * size, size, lkey
            rwr = self._rwrs[slot]
            rwr.wr_id, rwr.sg_list, rwr.num_sge = self.recv_code | slot, ctypes.pointer(sge), 1
        self.send_args = [c_void_p(ctypes.addressof(wr)) for wr in self._swrs]
        self.recv_args = [c_void_p(ctypes.addressof(wr)) for wr in self._rwrs]
        self.send_lens = [0] * nslots  # what each slot's work request says now
        self.send_flags = [0] * nslots
        # As the inline ibv_post_send/ibv_post_recv do (and QueuePair): qp->context->ops.post_send / post_recv.
        ops = v.ibv_qp.from_address(qp.qp).context.contents.ops
        self.post_send_fn, self.post_recv_fn = v.POST_SEND(ops.post_send), v.POST_RECV(ops.post_recv)
        self.qp_arg = c_void_p(qp.qp)
        self._bad = c_void_p()
        self.bad_arg = c_void_p(ctypes.addressof(self._bad))

    def credits(self) -> int:
        return self.peer_posted - self.sent

    def free_slots(self) -> int:
        return self.nslots - (self.head - self.tail)

    def post_send(self, slot: int, length: int, signal: bool) -> None:
        """Post send slot `slot` with `length` bytes (its frame written already)."""
        if self.send_lens[slot] != length:
            _U32.pack_into(self._ssges, slot * SGE_BYTES + SGE_LENGTH, length)
            self.send_lens[slot] = length
        flags = v.IBV_SEND_SIGNALED if signal else 0
        if self.send_flags[slot] != flags:
            _U32.pack_into(self._swrs, slot * SEND_WR_BYTES + SEND_FLAGS, flags)
            self.send_flags[slot] = flags
        rc = self.post_send_fn(self.qp_arg, self.send_args[slot], self.bad_arg)
        if rc:
            raise v._fail("ibv_post_send", self.device, rc, f"queue pair {self.qp.qp_num}, {length} bytes")

    def post_recv(self, slot: int) -> None:
        """Post receive slot `slot` (again)."""
        rc = self.post_recv_fn(self.qp_arg, self.recv_args[slot], self.bad_arg)
        if rc:
            raise v._fail("ibv_post_recv", self.device, rc, f"queue pair {self.qp.qp_num}, {self.size} bytes")
        self.posted += 1


class RdmaEnd:
    """One peer's verbs resources on this rank: a registered buffer, a completion queue (and channel where
    the provider has them), the queue pairs. Built by the set-up in three steps (create, `connect` once the
    peer's numbers are known, `hello`), then handed to an RdmaLink."""

    def __init__(self, device: v.Device, pd: v.ProtectionDomain, gid_index: int, gid: bytes, msg_size: int,
                 bulk_size: int, channel: bool = True, max_wr: int = 32) -> None:
        self.device, self.pd, self.gid_index, self.gid = device, pd, gid_index, gid
        self.psn = int.from_bytes(os.urandom(3), "little")
        self.peer_gid = bytes(16)
        self.channel_works = False  # the set-up saw the channel signal the peer's hello
        self.told = (0, 0)  # the posted counts our last frame carried
        msg_depth, msg_slots = min(MSG_DEPTH, max_wr), min(MSG_SLOTS, max_wr)
        bulk_depth, bulk_slots = min(BULK_DEPTH, max_wr), min(BULK_SLOTS, max_wr)
        sizes = [(msg_size, msg_depth, msg_slots)] + ([(bulk_size, bulk_depth, bulk_slots)] if bulk_size else [])
        total = sum(size * (depth + slots) for size, depth, slots in sizes)
        self.buffer = mmap.mmap(-1, total)
        self.mem = memoryview(self.buffer)
        self.channel: v.CompletionChannel | None = None
        self.lanes: list[Lane] = []
        made: list[Any] = []
        try:
            self.mr = pd.reg_buffer(self.buffer)
            made.append(self.mr)
            if channel:
                try:
                    self.channel = device.create_comp_channel()
                    made.append(self.channel)
                except RdmaError as exc:  # Apple's provider may have none: poll with backoff instead
                    log.debug("no completion channel on %s: %s", device.name, exc)
            entries = sum(depth + slots for _, depth, slots in sizes) + 4
            self.cq = device.create_cq(entries, self.channel, max_poll=16)
            made.append(self.cq)
            at = 0
            for i, (size, depth, slots) in enumerate(sizes):
                try:
                    qp = pd.create_qp(self.cq, self.cq, max_send_wr=slots, max_recv_wr=depth)
                except RdmaError as exc:
                    if i == 0 or exc.errno != errno.EBUSY:
                        raise
                    log.debug("%s: no queue pair left for a bulk lane: large messages go in %d-byte frames",
                              device.name, sizes[0][0])
                    break
                made.append(qp)
                qp.to_init()
                self.lanes.append(Lane(qp, i, size, depth, slots, at, at + size * slots, self.mr.addr,
                                       self.mr.lkey))
                at += size * (depth + slots)
        except BaseException:
            for obj in reversed(made):  # queue pairs, then the queue, the channel, the region
                with contextlib.suppress(RdmaError):
                    obj.close()
            self.release()
            raise

    def info(self) -> dict[str, Any]:
        """What the peer needs to connect to this end (published through the store)."""
        return {"gid": self.gid.hex(), "psn": self.psn, "qpns": [lane.qp.qp_num for lane in self.lanes],
                "sizes": [lane.size for lane in self.lanes], "depths": [lane.depth for lane in self.lanes]}

    def connect(self, peer: dict[str, Any]) -> None:
        """RTR towards the peer's queue pairs, RTS, then every receive posted (Apple's provider takes receives
        only once RTS). The peer's lanes must match ours (the set-up agreed on sizes and bulk)."""
        # A side that found no queue pair for a bulk lane has the message lane only: so do we then (our bulk
        # queue pair stays unused until the device closes).
        self.lanes = self.lanes[:len(peer["qpns"])]
        if list(peer["sizes"])[:len(self.lanes)] != [lane.size for lane in self.lanes]:
            raise ProtocolError(f"the peer's queue pairs {peer['qpns']} of {peer['sizes']} bytes do not match "
                                f"ours ({[lane.size for lane in self.lanes]})")
        gid = self.peer_gid = bytes.fromhex(peer["gid"])
        for lane, qpn, depth in zip(self.lanes, peer["qpns"], peer["depths"]):  # (the peer may have more)
            lane.qp.to_rtr(int(qpn), gid, int(peer["psn"]), self.gid_index)
            lane.qp.to_rts(self.psn)
            lane.peer_posted = int(depth)
        for lane in self.lanes:
            for slot in range(lane.depth):
                self.post_recv(lane, slot)

    def post_recv(self, lane: Lane, slot: int) -> None:
        lane.post_recv(slot)

    def send_hello(self) -> None:
        """Frame 0 of every lane: proves the path end to end (both ends are RTS with receives posted: the
        set-up's barrier), and raises the peer's first channel event."""
        pm, pb = self.lanes[0].posted, self.lanes[1].posted if len(self.lanes) > 1 else 0
        for lane in self.lanes:
            slot = lane.head % lane.nslots
            at = lane.send_base + slot * lane.size
            HDR.pack_into(self.mem, at, T_HELLO, 0, 0, 0, lane.sent & M32, pm & M32, pb & M32, 0, 0, 0, 0, 0)
            lane.post_send(slot, max(HEADER, lane.min_send), True)
            lane.head += 1
            lane.sig_head = lane.head
            lane.sent += 1
        self.told = (pm, pb)

    def take_hello(self) -> bool:
        """Poll once during the set-up: True once the peer's hello arrived on every lane. Nothing else can
        arrive before the set-up's last barrier (the peer sends data only after it)."""
        for wr_id, status, _op, byte_len, _qpn in self.cq.completions():
            code, slot = wr_id >> 16, wr_id & 0xFFFF
            lane = self.lanes[code >> 1]
            if status:
                raise RdmaError(f"the set-up's hello {'receive' if code & 1 else 'send'} on {self.device.name} "
                                f"completed with {v.wc_status_name(status)}", call="poll_cq",
                                device=self.device.name, errno=errno.EIO)
            if not code & 1:
                lane.tail = lane.head
                continue
            at = lane.recv_base + slot * lane.size
            typ, _f, _s, _n, qseq, pm, pb = HDR.unpack_from(self.mem, at)[:7]
            if typ != T_HELLO or qseq != 0 or lane.rx or byte_len < HEADER:
                raise ProtocolError(f"the peer's first frame on the {lane.name} lane is not its hello "
                                    f"(type {typ}, number {qseq})")
            lane.rx = 1
            self.lanes[0].peer_posted = max(self.lanes[0].peer_posted, pm)
            if len(self.lanes) > 1:
                self.lanes[1].peer_posted = max(self.lanes[1].peer_posted, pb)
            self.post_recv(lane, slot)
        return all(lane.rx for lane in self.lanes)

    def arm(self) -> None:
        """Ask for a channel event at the next completion (then poll once more: one may be in already)."""
        self.cq.req_notify()

    def channel_events(self) -> int:
        """Take and acknowledge the events waiting on the channel (its fd is non-blocking to poll first)."""
        if self.channel is None:
            return 0
        n = 0
        fd = self.channel.fd
        while select.select([fd], [], [], 0)[0]:
            self.channel.get_event()
            n += 1
        if n:
            self.cq.ack(n)
        return n

    def release(self) -> None:
        """Free the buffer once the device closed what hangs off it (queue pairs before regions)."""
        self.mem.release()
        self.buffer.close()


# --- the link ----------------------------------------------------------------------------------------------

def _is_whole(frame: Frame, key: Key, sig: int, nbytes: int) -> bool:
    """`frame` is the whole message `key` of `nbytes` bytes, with a signature `sig` accepts."""
    return (frame.offset == 0 and frame.length == frame.total == nbytes and frame.tag == key[1]
            and frame.seq == key[2] and frame.space == key[0] and (frame.sig == sig or not sig or not frame.sig))


class RdmaLink(Link):
    """A peer over RDMA: its lanes (queue pairs), the completion queue, the TCP control connection."""

    def __init__(self, kind: "RdmaLinks", peer: int, end: RdmaEnd, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.kind, self.peer, self.end, self.sock = kind, peer, end, sock
        self.lanes = end.lanes
        self.msg = end.lanes[0]
        self.bulk = end.lanes[1] if len(end.lanes) > 1 else None
        self.by_code = [lane for lane in end.lanes for _ in (0, 1)]  # wr_id >> 16 -> lane
        self.cq = end.cq
        # As the inline ibv_poll_cq does (and CompletionQueue.poll): cq->context->ops.poll_cq, into the
        # queue's array of completions; called here directly, one Python call less per look.
        cq = end.cq
        self._poll_cq = v.POLL_CQ(v.ibv_cq.from_address(cq.cq).context.contents.ops.poll_cq)
        self._cq_arg, self._wc_arg = c_void_p(cq.cq), c_void_p(ctypes.addressof(cq.wc))
        self._wc, self._max_poll = cq.wc, cq.max_poll
        self.mem = end.mem
        self.base, self.lkey = end.mr.addr, end.mr.lkey
        self.channel_fd = end.channel.fd if (end.channel is not None and end.channel_works) else -1
        self.told_m, self.told_b = end.told  # the posted counts our last frame carried (message, bulk lane)
        self.half_m = self.msg.depth // 2  # receives posted since then that are worth a frame of their own
        self.half_b = self.bulk.depth // 2 if self.bulk is not None else 0
        self.sendq: deque[list] = deque()  # [request, bytes handed out]
        self.starving = False  # our next data waits for credits
        self.asked = False  # and we told the peer (once per famine)
        self.peer_starving = False  # the peer's last frame said it waits for our credits
        self.expect: "Expected | None" = None
        self._quick = Expected()  # what `take` looks for (restarted per message)
        self._posts = 0  # the sink's receive count when the held-back frames were last offered
        self.out = bytearray()  # control bytes not written yet (the socket was full)
        self.leaves: deque[control.Leave] = deque()  # LEAVEs whose frames are not all in yet
        self.ctl = control.ControlConnection()  # what this end and the peer said on the control connection
        self.eof = False
        self.bye: tuple[int, int] | None = None  # the peer's BYE: frames it sent on each lane
        self.left = False
        self.claim: tuple[int, int, float] | None = None  # frames the peer said it sent, when we heard it
        self.last_probe = 0.0
        ipv4 = v.gid_ipv4(end.peer_gid)
        self.address = f"{end.device.name} -> {ipv4 or v.gid_text(end.peer_gid)} (queue pair {self.msg.qp.qp_num})"

    # -- posting --------------------------------------------------------------------------------------------
    def send(self, key: Key, sig: int, buf: memoryview) -> "Request | None":
        """A message that fits one frame of the message lane goes at once when the lane has a free slot and
        credit: no Request (what a small collective's message does; `_frame_out`, written out for this
        case). Anything else is queued and goes frame by frame as slots and credits allow (`_flush`)."""
        if self.eof or self.bye is not None:
            raise peer_shut_down(self.sink.rank, self.peer, f"to send it data "
                                 f"({Request(self.peer, key, sig, buf, True).describe()})", address=self.address)
        lane = self.msg
        n = len(buf)
        head = lane.head
        if (self.sendq or n > lane.payload or head - lane.tail >= lane.nslots
                or lane.peer_posted - lane.sent <= RESERVE):
            req = Request(self.peer, key, sig, buf, is_send=True)
            self.sendq.append([req, 0])
            if len(self.sendq) == 1:
                self._guarded(self._flush)
            return req
        slot = head % lane.nslots
        at = lane.send_base + slot * lane.size
        bulk = self.bulk
        pm, pb = lane.posted, bulk.posted if bulk is not None else 0
        mem = self.mem
        HDR.pack_into(mem, at, T_DATA, F_STARVING if self.starving else 0, key[0], n, lane.sent & M32, pm & M32,
                      pb & M32, sig, key[1], key[2], 0, n)
        if n:
            mem[at + HEADER : at + HEADER + n] = buf
        length = HEADER + n
        try:
            lane.post_send(slot, length if length >= lane.min_send else lane.min_send,
                           head % SIGNAL_EVERY == SIGNAL_EVERY - 1)
        except RdmaError as exc:
            self._failed(exc)
            raise self.sink.broken from None
        lane.head = head + 1
        if head % SIGNAL_EVERY == SIGNAL_EVERY - 1:
            lane.sig_head = head + 1
        lane.sent += 1
        self.told_m, self.told_b = pm, pb
        self.kind.bytes_sent += n
        return None

    def _frame_out(self, lane: Lane, typ: int, space: int, sig: int, tag: int, seq: int, offset: int,
                   length: int, total: int, payload: "memoryview | None", signal: bool = False) -> None:
        """Write one frame into the lane's next send slot and post it (the caller checked slot and credit).
        One send in SIGNAL_EVERY is signalled (its completion frees the slots before it too), or `signal`."""
        head = lane.head
        slot = head % lane.nslots
        at = lane.send_base + slot * lane.size
        msg, bulk = self.msg, self.bulk
        pm, pb = msg.posted, bulk.posted if bulk is not None else 0
        HDR.pack_into(self.mem, at, typ, F_STARVING if self.starving else 0, space, length, lane.sent & M32,
                      pm & M32, pb & M32, sig, tag, seq, offset, total)
        if length:
            self.mem[at + HEADER : at + HEADER + length] = payload
        n = HEADER + length
        signal = signal or head % SIGNAL_EVERY == SIGNAL_EVERY - 1
        lane.post_send(slot, n if n >= lane.min_send else lane.min_send, signal)
        lane.head = head + 1
        if signal:
            lane.sig_head = head + 1
        lane.sent += 1
        self.told_m, self.told_b = pm, pb

    def _flush(self) -> bool:
        """Put queued messages on the lanes while slots and credits last."""
        moved = False
        msg, bulk = self.msg, self.bulk
        while self.sendq:
            item = self.sendq[0]
            req, off = item
            rest = req.nbytes - off
            if rest <= msg.payload:
                lane, piece = msg, rest
            elif bulk is not None:
                lane, piece = bulk, min(rest, bulk.payload)
            else:
                lane, piece = msg, msg.payload
            if lane.head - lane.tail >= lane.nslots:
                break  # no free send slot: the completions of earlier frames free some
            if lane.peer_posted - lane.sent <= RESERVE:
                self._starve()
                break
            self.starving = False
            space, tag, seq = req.key
            self._frame_out(lane, T_DATA, space, req.sig, tag, seq, off, piece, req.nbytes,
                            req.buf[off : off + piece])
            moved = True
            item[1] = off = off + piece
            if off >= req.nbytes:
                self.sendq.popleft()
                self.kind.bytes_sent += req.nbytes
                self.sink.completed(self.peer, req.key, req, req.nbytes)
        if not self.sendq:
            self.starving = False
        return moved

    def _starve(self) -> None:
        """Our data waits for credits: tell the peer once (a credit update with STARVING, on the reserve)."""
        self.starving = True
        if not self.asked and self._can_credit():
            self.asked = True
            self._credit()

    def _can_credit(self) -> bool:
        msg = self.msg
        return msg.head - msg.tail < msg.nslots and msg.peer_posted - msg.sent > 0

    def _credit(self, lane: "Lane | None" = None, signal: bool = False) -> None:
        """A frame with no data: our posted counts (and STARVING) for the peer."""
        self._frame_out(lane or self.msg, T_CREDIT, 0, 0, 0, 0, 0, 0, 0, None, signal)
        self.kind.credit_frames += 1

    def _maybe_credit(self) -> None:
        """Tell the peer about receives posted since our last frame when it is worth a frame of its own: half
        a lane's worth, or any while the peer starves."""
        owed = self.msg.posted - self.told_m
        due = owed >= self.half_m
        bulk = self.bulk
        if bulk is not None:
            owed_bulk = bulk.posted - self.told_b
            due = due or owed_bulk >= self.half_b
            owed += owed_bulk
        if (due or (self.peer_starving and owed > 0)) and self._can_credit():
            self._credit()

    # -- receiving ------------------------------------------------------------------------------------------
    def pump(self, woken: bool = False) -> bool:
        sink = self.sink
        try:
            if woken:
                if self.channel_fd >= 0:
                    self.end.channel_events()
                if not self.eof:
                    self.read_control()
            if self._posts != sink.posts:  # a receive was posted: frames held back may have one now
                self._posts = sink.posts
                if self.msg.backlog or (self.bulk is not None and self.bulk.backlog):
                    self._resume()
            moved = self._poll()
            if self.sendq and sink.broken is None:
                moved |= self._flush()
            if sink.broken is None:
                bulk = self.bulk
                # (_maybe_credit's test, cheapest first: every look of a spinning rank comes here)
                if (self.peer_starving or self.msg.posted - self.told_m >= self.half_m
                        or (bulk is not None and bulk.posted - self.told_b >= self.half_b)):
                    self._maybe_credit()
                if self.leaves:
                    self._check_leaves()
                if self.bye is not None and not self.left:
                    self._check_bye()
        except RdmaError as exc:
            self._failed(exc)
            return True
        except ThunderboltError as exc:
            sink.failed(self.peer, exc)
            return True
        except OSError as exc:  # a frame that never came (`_lost`)
            sink.failed(self.peer, exc, self.where, self.address)
            return True
        return moved

    def _guarded(self, fn: Any) -> Any:
        try:
            return fn()
        except RdmaError as exc:
            self._failed(exc)
        except ThunderboltError as exc:
            self.sink.failed(self.peer, exc)
        except OSError as exc:
            self.sink.failed(self.peer, exc, self.where, self.address)
        return None

    def _poll(self) -> bool:
        """Take every completion waiting: free send slots, check and deliver arrived frames."""
        sink, wc, by_code = self.sink, self._wc, self.by_code
        moved = False
        while True:
            n = self._poll_cq(self._cq_arg, self._max_poll, self._wc_arg)
            if n <= 0:
                if n < 0:
                    raise v._fail("poll_cq", self.end.device.name, n)
                return moved
            moved = True
            for i in range(n):
                wr_id, status, _op, _vendor, byte_len, _imm, _qpn, _src = WC.unpack_from(wc, i * WC_BYTES)
                code = wr_id >> 16
                lane = by_code[code]
                if status:
                    self._bad_completion(lane, code & 1, status)
                    return True
                if code & 1:
                    self._arrived(lane, wr_id & 0xFFFF, byte_len)
                    if sink.broken is not None:
                        return True
                else:
                    lane.tail += ((wr_id & 0xFFFF) - lane.tail) % lane.nslots + 1
            if n < self._max_poll:
                return moved

    def _arrived(self, lane: Lane, slot: int, byte_len: int) -> None:
        at = lane.recv_base + slot * lane.size
        (typ, flags, space, length, qseq, pm, pb, sig, tag, seq, offset,
         total) = HDR.unpack_from(self.mem, at)
        if qseq != lane.rx & M32:
            raise self._lost(lane, qseq)
        if (byte_len < HEADER + length or byte_len > lane.size or typ not in _TYPES
                or offset + length > total or total > MAX_MESSAGE):
            raise ProtocolError(f"rank {self.sink.rank}: rank {self.peer} sent a malformed frame on the RDMA "
                                f"{lane.name} lane ({byte_len} bytes arrived, type {typ}, length {length}, "
                                f"offset {offset} of {total})")
        lane.rx += 1
        msg, bulk = self.msg, self.bulk
        d = (pm - msg.peer_posted) & M32
        if d < 1 << 31:  # (a frame of the other lane may carry an older count)
            msg.peer_posted += d
        if bulk is not None:
            d = (pb - bulk.peer_posted) & M32
            if d < 1 << 31:
                bulk.peer_posted += d
        self.peer_starving = flags & F_STARVING != 0
        if self.asked and msg.peer_posted - msg.sent > RESERVE and (
                bulk is None or bulk.peer_posted - bulk.sent > RESERVE):
            self.asked = False  # fed again: the next famine is told again
        if typ != T_DATA:
            lane.post_recv(slot)
            return
        expect = self.expect
        if (expect is not None and lane is msg and length == total and not lane.backlog and not expect.done
                and offset == 0 and length == len(expect.dest) and tag == expect.tag and seq == expect.seq
                and space == expect.space and (sig == expect.sig or not sig or not expect.sig)):
            if length:
                expect.dest[:] = self.mem[at + HEADER : at + HEADER + length]
            expect.done, expect.dest = True, _NO_DEST  # (the link keeps its quick receive: not the user's buffer)
            lane.post_recv(slot)
            kind = self.kind
            kind.bytes_received += length
            kind.quick_messages += 1
            return
        frame = Frame(Kind.DATA, space, sig, tag, seq, offset, length, total)
        if lane.backlog or not self._deliver(lane, slot, frame):
            lane.backlog.append((slot, frame))

    def _deliver(self, lane: Lane, slot: int, frame: Frame) -> bool:
        """Hand one frame to the sink; False when it is parked (its receive not posted yet: it stays in its
        receive slot, whose credit comes back once the receive is posted, so a peer that runs ahead is held
        by flow control)."""
        sink = self.sink
        target = sink.delivered(self.peer, frame, 0)
        if target is None:
            return False
        if target is DISCARD:  # a group that is over: the slot is posted again, its frame dropped
            lane.post_recv(slot)
            return True
        dest, obj = target
        length = frame.length
        if length:
            at = lane.recv_base + slot * lane.size + HEADER
            dest[:] = self.mem[at : at + length]
        lane.post_recv(slot)
        self.kind.bytes_received += length
        sink.completed(self.peer, frame.key, obj, length)
        return True

    def _resume(self) -> None:
        """Deliver the frames held back for a receive that was not posted, while receives take them."""
        for lane in self.lanes:
            while lane.backlog and self.sink.broken is None:
                slot, frame = lane.backlog[0]
                if not self._deliver(lane, slot, frame):
                    break
                lane.backlog.popleft()
        self._maybe_credit()

    def take(self, key: Key, sig: int, dest: memoryview) -> int:
        """The peer's message `key` taken straight from its receive slot: the link's completion handling
        (`_arrived`) copies a frame whose header is exactly the one expected (`Expected`) into `dest` instead
        of matching it, while this look pumps; anything else that arrives meanwhile is handled the general
        way. Only for a message that fits one frame of the message lane, and only when nothing is held there
        but, first in line, that very message (a peer a step ahead sent it before this rank got here)."""
        msg = self.msg
        if len(dest) > msg.payload or self.eof or self.bye is not None:
            return REFUSED
        q = self._quick.start(key, sig, dest)
        if msg.backlog:  # held back before this look: it is the message, or the general path takes over
            self._guarded_take_parked(q)
            return TAKEN if q.done else REFUSED
        self.expect = q  # only while this look pumps: a frame arriving at any other time is matched
        try:
            self.pump()
        finally:
            self.expect = None
        if q.done:
            return TAKEN
        return REFUSED if self.sink.broken is not None else NOT_YET

    def _guarded_take_parked(self, q: "Expected") -> None:
        try:
            self._take_parked(q)
        except RdmaError as exc:
            self._failed(exc)

    def _take_parked(self, q: "Expected") -> None:
        """The message `take` looks for from the head of the message lane's backlog (if it is that), as
        `_deliver` would give it to a posted receive: copied out, its receive slot posted again."""
        msg = self.msg
        slot, frame = msg.backlog[0]
        if not _is_whole(frame, (q.space, q.tag, q.seq), q.sig, len(q.dest)):
            return
        msg.backlog.popleft()
        if frame.length:
            at = msg.recv_base + slot * msg.size + HEADER
            q.dest[:] = self.mem[at : at + frame.length]
        q.done, q.dest = True, _NO_DEST
        self.kind.bytes_received += frame.length
        self.kind.quick_messages += 1
        msg.post_recv(slot)

    # -- what the link knows about the peer ---------------------------------------------------------------
    def held(self) -> Frame | None:
        if not self.msg.backlog and (self.bulk is None or not self.bulk.backlog):
            return None  # (every op's retire asks)
        held = [lane.backlog[0][1] for lane in self.lanes if lane.backlog]
        return min(held, key=lambda f: (f.space & 1, f.tag))

    def counters(self) -> tuple[int, ...]:
        """Frames sent, received and receives posted, message lane then bulk lane (for probes)."""
        b = self.bulk
        return (self.msg.sent, b.sent if b else 0, self.msg.rx, b.rx if b else 0, self.msg.posted,
                b.posted if b else 0)

    # -- failures -----------------------------------------------------------------------------------------
    @property
    def where(self) -> str:
        return f"over RDMA ({self.address})"

    def _tcp_hint(self) -> str:
        return (f"; rank {self.peer} is reachable over TCP (this link's control connection uses it): "
                f"THUNDERBOLT_TRANSPORT=tcp would run the job there. The group fails rather than switch "
                f"mid-job, since frames in flight on an unreliable queue pair may be lost unseen")

    def _port_state(self) -> str:
        """The state of this end's port, for an error message (never raises)."""
        try:
            return f"port 1 of {self.end.device.name} is {self.end.device.query_port(1).state_name}"
        except RdmaError as exc:
            return f"port 1 of {self.end.device.name} cannot be queried ({exc})"

    def _lost(self, lane: Lane, got: int) -> OSError:
        expected = lane.rx & M32
        missing = (got - expected) & M32
        return ConnectionAbortedError(errno.ECONNABORTED, (
            f"frame {expected} of the {lane.name} lane was lost ({missing} frame(s) missing, frame {got} arrived "
            f"next): Thunderbolt RDMA queue pairs are unreliable (UC) and drop frames silently; "
            f"{self._port_state()}{self._tcp_hint()}"))

    def stalled(self, sent: tuple[int, int], waited: float) -> None:
        """Frames the peer said it sent have not arrived for `waited` seconds: the path loses or stalls them."""
        got = (self.msg.rx, self.bulk.rx if self.bulk else 0)
        exc = ConnectionAbortedError(errno.ETIMEDOUT, (
            f"rank {self.peer} sent {sent[0]} + {sent[1]} frames (message + bulk lane), {got[0]} + {got[1]} arrived "
            f"in {waited:.1f}s: frames were lost or the port stalls; {self._port_state()}{self._tcp_hint()}"))
        self.sink.failed(self.peer, exc, self.where, self.address)

    def _failed(self, exc: RdmaError) -> None:
        """A verbs call failed: the RDMA path to the peer is gone (device, port, driver)."""
        cause = OSError(exc.errno or errno.EIO, f"{exc}{self._tcp_hint()}")
        cause.__cause__ = exc
        self.sink.failed(self.peer, cause, self.where, self.address)

    def _bad_completion(self, lane: Lane, receive: int, status: int) -> None:
        name = v.wc_status_name(status)
        what = "receive" if receive else "send"
        if status == v.IBV_WC_LOC_LEN_ERR and receive:
            self.sink.failed(self.peer, ProtocolError(
                f"rank {self.sink.rank}: a frame from rank {self.peer} did not cover as many 4 KiB frames as "
                f"the {lane.name} lane's receives ({lane.size} bytes): the two ranks run different versions"))
            return
        self._failed(RdmaError(f"a {what} on the {lane.name} lane completed with {name} on {self.end.device.name}",
                               call="poll_cq", device=self.end.device.name, errno=errno.EIO))

    # -- the control connection -----------------------------------------------------------------------------
    def fds(self) -> "list[tuple[int, int]]":
        out = [] if self.eof else [(self.sock.fileno(), select.POLLIN | (select.POLLOUT if self.out else 0))]
        if self.channel_fd >= 0:
            out.append((self.channel_fd, select.POLLIN))
        return out

    def read_control(self) -> None:
        """Read what the peer sent on the control connection (BYE, ABORT, probes); EOF without BYE means its
        process died."""
        sink = self.sink
        if self.out:
            self._write_control()
        while not self.eof and sink.broken is None:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if self.bye is not None:
                    self.eof = True
                else:
                    sink.failed(self.peer, exc, self._ctl_where, self.address)
                return
            if not data:
                self.eof = True
                if self.bye is None:
                    sink.failed(self.peer, ConnectionResetError(
                        errno.ECONNRESET, "its process is gone (the control connection closed without BYE)"),
                        self._ctl_where, self.address)
                return
            self._parse_control(data)

    @property
    def _ctl_where(self) -> str:
        try:
            return "(RDMA control connection at %s:%d)" % self.sock.getpeername()[:2]
        except OSError:
            return "(RDMA control connection)"

    def _parse_control(self, data: bytes) -> None:
        sink = self.sink
        try:
            self.ctl.receive_data(data)
            while sink.broken is None and (msg := self.ctl.next_event()) is not None:
                if isinstance(msg, control.Bye) and len(msg.sent) == BYE_COUNTS:
                    self.bye = (msg.sent[0], msg.sent[1])
                    self._poll()  # what it sent before leaving has most likely arrived
                    self._check_bye()  # (the sink hears BYE once every frame it counts is in)
                elif isinstance(msg, control.Leave) and len(msg.sent) == BYE_COUNTS:
                    self.leaves.append(msg)
                    self._poll()  # what it sent before leaving has most likely arrived
                    self._check_leaves()  # (the sink hears it once every frame it counts is in)
                elif isinstance(msg, (control.Ping, control.Answer)) and len(msg.op.counters) == PROBE_COUNTERS:
                    self.kind.on_probe(self, msg.op)
                    sink.said(self.peer, msg)
                elif isinstance(msg, (control.Abort, control.Propose, control.Commit, control.Done)):
                    sink.said(self.peer, msg)
                else:
                    raise ProtocolError(f"sent {msg}, which no RDMA link of this version takes (the ranks run "
                                        f"different versions)")
        except RdmaError as exc:
            self._failed(exc)
        except ProtocolError as exc:
            sink.failed(self.peer, ProtocolError(f"rank {sink.rank}: rank {self.peer} {self._ctl_where}: {exc}"))
        except ThunderboltError as exc:
            sink.failed(self.peer, exc)

    def _check_leaves(self) -> None:
        """The peer left groups after the frames each LEAVE counts: those whose frames are all in are told."""
        b = self.bulk
        while self.leaves and self.msg.rx >= self.leaves[0].sent[0] and (b is None or b.rx >= self.leaves[0].sent[1]):
            self.sink.said(self.peer, self.leaves.popleft())

    def _check_bye(self) -> None:
        """The peer said BYE after `bye` frames: once they are all in, it has left in order."""
        assert self.bye is not None
        b = self.bulk
        if self.msg.rx >= self.bye[0] and (b is None or b.rx >= self.bye[1]):
            self.left = True
            self.sink.said(self.peer, control.Bye(self.bye))

    def say(self, msg: control.Message) -> None:
        """A control message on the control connection; an op announcement (PING, ANSWER) carries this link's
        counters (frames sent, received and receives posted per lane), which repair the peer's credits and
        tell it what to expect."""
        if self.eof or self.ctl.ours is not None:
            return  # this end said BYE or ABORT: nothing more
        if isinstance(msg, control.Leave):
            msg = control.Leave(msg.epoch, (self.msg.sent, self.bulk.sent if self.bulk else 0))
        if isinstance(msg, (control.Ping, control.Answer)):
            op = msg.op
            op = control.Op(op.space, op.tag, op.sig, op.waits_on, self.counters())
            msg = control.Ping(op) if isinstance(msg, control.Ping) else control.Answer(op)
            if isinstance(msg, control.Ping):
                self.last_probe = time.monotonic()
                self.kind.probes_sent += 1
        self.out += self.ctl.send(msg)
        self._write_control()

    def _write_control(self) -> None:
        write_some(self.sock, self.out)

    # -- the end --------------------------------------------------------------------------------------------
    def abort(self, err: BaseException, body: AbortInfo | None, group: int) -> None:
        """Group `group`'s queued sends get `err` and are dropped (every group's, for -1): frames already on
        the lanes stay, each whole in itself. The ABORT goes on the control connection (the RDMA path may be
        what broke)."""
        self.sendq = drop_group(self.sendq, err, group)
        if body is not None:
            self.say(control.Abort(body))

    def close(self, bye: bool) -> None:
        self.sendq.clear()
        self._quick.dest = _NO_DEST  # (one the engine gave up on: a view of a buffer the engine may free next)
        msg = None
        if bye and not self.eof and self.ctl.ours is None:
            self.read_control()  # a peer that left already reads nothing more: no frame to see off
            if self.bye is None and not self.eof:
                with contextlib.suppress(RdmaError):
                    self._drain_sends(time.monotonic() + 0.5)
            if self.ctl.ours is None:  # (what it read may have been an ABORT: this end said ABORT then)
                msg = bytes(self.out) + self.ctl.send(control.Bye((self.msg.sent, self.bulk.sent if self.bulk else 0)))
        close_control(self.sock, msg)
        self.eof = True

    def _drain_sends(self, deadline: float) -> None:
        """Wait (bounded) until every frame posted has left: a queue pair destroyed with sends in it drops
        them. Unsignalled sends complete with a later signalled one: a signalled credit frame is that one."""
        for lane in self.lanes:
            if lane.sig_head < lane.head and lane.free_slots() and lane.credits() > 0:
                self._credit(lane, signal=True)
        while any(lane.tail < lane.sig_head for lane in self.lanes) and time.monotonic() < deadline:
            if not self._poll():
                time.sleep(0.0005)


class Expected:
    """The one message `RdmaLink.take` looks for (made once per link, restarted per message): the header
    fields a frame must have to be copied straight into `dest`."""

    __slots__ = ("space", "tag", "seq", "sig", "dest", "done")

    def __init__(self) -> None:
        self.space = self.tag = self.seq = self.sig = 0
        self.dest = _NO_DEST
        self.done = False

    def start(self, key: Key, sig: int, dest: memoryview) -> "Expected":
        self.space, self.tag, self.seq = key
        self.sig, self.dest, self.done = sig, dest, False
        return self


class RdmaLinks(LinkKind):
    """The RDMA links of one engine and what they share: the provider, the open devices, probe timing and the
    ops this rank posted (to answer PINGs)."""

    name = "rdma"

    def __init__(self, verbs: v.Verbs, devices: Sequence[v.Device], ends: "dict[int, RdmaEnd]",
                 socks: "dict[int, socket.socket]", *, spin_us: int = 0, link_timeout: float = 3.0) -> None:
        self.log = log
        self.verbs = verbs
        self.devices = list(devices)
        self.ends = dict(ends)
        self.links: dict[int, RdmaLink] = {p: RdmaLink(self, p, e, socks[p]) for p, e in ends.items()}
        self._list = list(self.links.values())
        self.spin = spin_us / 1e6
        self.grace = link_timeout  # frames a peer sent that have not arrived this long are lost
        self.probe_after = max(0.2, link_timeout / 3)
        self._backoff = BACKOFF_FIRST
        self._traffic = 0.0
        self.quick_messages = 0
        self.credit_frames = 0
        self.probes_sent = 0

    # -- engine hooks -------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Polling a completion queue is the look (no system call): always worth a pump while spinning."""
        return True

    def before_sleep(self, quiet: bool) -> float:
        engine = self.engine
        if engine.last_traffic != self._traffic:
            self._traffic = engine.last_traffic
            self._backoff = BACKOFF_FIRST
        cap = CHANNEL_CAP
        for link in self._list:
            if link.channel_fd >= 0:
                try:
                    link.end.arm()
                except RdmaError as exc:
                    link._failed(exc)
            else:
                cap = min(cap, self._backoff)
        if cap < CHANNEL_CAP:
            self._backoff = min(self._backoff * 2, QUIET_CAP if quiet else BLOCK_CAP)
        return cap

    def idle(self, slept: bool) -> None:
        """Read the control connections when a sleep passed (a spinning rank does not poll them), look for
        frames a peer sent that never came, and PING a peer this rank has data queued for after a quiet spell
        (its counters in the answer repair the credits the data waits for). PINGs naming the op a rank waits
        for come from the engine (`Transport._probe`), through `RdmaLink.say`."""
        now = time.monotonic()
        engine = self.engine
        for link in self._list:
            if engine.broken is not None:
                return
            if slept and not link.eof:
                link.read_control()
            claim = link.claim
            if claim is not None and engine.broken is None:
                b = link.bulk
                if link.msg.rx >= claim[0] and (b is None or b.rx >= claim[1]):
                    link.claim = None
                elif now - claim[2] > self.grace:
                    link.stalled((claim[0], claim[1]), now - claim[2])
                    return
        if now - engine.last_traffic < self.probe_after:
            return
        for link in self._list:
            if link.sendq and not link.eof and now - link.last_probe >= self.probe_after:
                link.say(control.Ping(control.Op()))

    def on_probe(self, link: RdmaLink, op: control.Op) -> None:
        """A peer's PING or its answer to ours: its counters repair our credits and tell what it sent us (what
        the op announcement itself says goes on to the engine's MismatchDetector)."""
        sent_m, sent_b, _rx_m, _rx_b, posted_m, posted_b = op.counters
        msg, bulk = link.msg, link.bulk
        msg.peer_posted = max(msg.peer_posted, posted_m)
        if bulk is not None:
            bulk.peer_posted = max(bulk.peer_posted, posted_b)
        if link.sendq:
            link._flush()
        now = time.monotonic()
        if msg.rx < sent_m or (bulk is not None and bulk.rx < sent_b):
            old = link.claim
            if old is None or (msg.rx >= old[0] and (bulk is None or bulk.rx >= old[1])):
                link.claim = (sent_m, sent_b, now)  # (an unmet older claim keeps its time)
        else:
            link.claim = None

    def release(self) -> None:
        """Close the devices (queue pairs first, then regions, queues, channels, domains), then the buffers."""
        for dev in self.devices:
            try:
                dev.close()
            except RdmaError as exc:  # a device that disappeared: nothing left to free
                log.debug("closing %s: %s", dev.name, exc)
        for end in self.ends.values():
            end.release()
        with contextlib.suppress(RdmaError):
            self.verbs.close()


__all__ = ["DeviceState", "HEADER", "RdmaEnd", "RdmaLink", "RdmaLinks", "Expected", "frame_limit", "lane_sizes",
           "probe_device", "probe_devices"]
