"""The fake verbs provider: RDMA devices made of files (a `fabric.Fabric` directory), for tests and for
running whole jobs without the hardware. Never a measure of RDMA speed: its delivery is two memory copies
and Python on both ends.

How it plugs in: `FakeProvider.symbol(name)` hands the binding the address of a ctypes callback made with
the binding's own prototype, for every control-path function; the contexts it returns carry an ops table
whose poll_cq / req_notify_cq / post_send / post_recv are callbacks too. So `verbs.py` runs unchanged: it
calls addresses, reads the ops table and the structures, and gets errno, as with librdma.dylib.

Delivery: a SEND is checked against Apple's rules at the sender (the peer must be RTS, connected to this
QP, with a receive posted that no earlier send took), copied into the peer's ring, and copied out into the
posted receive's memory when the receiving process polls its completion queue. The sender claims posted
receives through a pair of counters in the peer's header (`posted` written only by the receiver, `claimed`
only by the connected sender), so a send never takes a receive posted after it was sent, as on the wire.

Apple's rules enforced (facts: ../shared/reference/rdma-tb5-facts.md and the sources cited there), and
what a breach gives:
- only UC queue pairs: RC (and UD) creation fails with EOPNOTSUPP;
- only SEND: another opcode fails the post with EOPNOTSUPP;
- path MTU 1024 only, GRH addressing (is_global) only, port 1 only: RTR fails with EINVAL;
- GID index: 0 is the link-local GID, 1 the IPv4-mapped one, present only while the device's interface
  has an IPv4 address (all zero otherwise); RTR with an sgid_index that is not a present IPv4-mapped GID
  fails with EINVAL;
- a receive covers 4 KiB x 2^k bytes (k <= max_frame_shift: 7 for macOS 26.3's 512 KiB, 0 for 26.2), else
  the post fails with EINVAL; a send and its receive must cover the same number of 4 KiB frames, else the
  receive completes with IBV_WC_LOC_LEN_ERR and gets no data (llama.cpp: "a short send would fail the
  peer's receive"; the status is our choice);
- receives only once the QP is RTS: an earlier post fails with EINVAL (llama.cpp: Apple's provider rejects
  it); sends only once RTS (EINVAL, as on every provider);
- a send to a peer that is not RTS, not connected to this QP, gone, or has no free receive posted is
  silently dropped: it completes successfully at the sender (UC). TN3205 describes credit-based flow
  control stalling the sender instead when no receive is posted: limits["no_receive"] = "stall" holds
  such a send (no completion) until a receive is posted;
- a PSN mismatch (our sq_psn against the peer's rq_psn) loses every message (UC drops out-of-sequence
  packets; simplified);
- about 10 QPs per device (then EBUSY), about 100 MRs per device (then ENOMEM), at most max_qp_wr (32)
  outstanding sends or receives per QP (then the post fails with ENOMEM, returned negated as Apple's
  provider does), MRs registered with LOCAL_WRITE|REMOTE_READ|REMOTE_WRITE (else EINVAL: Apple refuses
  LOCAL_WRITE alone; requiring all three is stricter than what is known);
- a completion queue that overflows returns -EOVERFLOW from every later poll.

Completion channels: `ibv_create_comp_channel` gives a FIFO's descriptor; a sender that fills a receive
of an armed CQ writes that CQ's id into it, as does a send completion on an armed CQ. Events may be
spurious (several per arm); a consumer polls after each, as verbs consumers do. limits["comp_channel"] =
False makes channel creation fail with EOPNOTSUPP, for code that must also work without (Apple's support
for channels is not known).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import select
import struct
import threading
import time
from collections import deque
from ctypes import POINTER, c_void_p, sizeof
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ...transport import verbs as v
from ...transport import ordering
from .fabric import (DESTROYED, H_ARMED, H_CHANNEL, H_CLAIMED, H_CQ, H_DEVICE, H_GID0, H_GID1, H_HEAD, H_MAGIC,
                     H_PID, H_POSTED, H_REMOTE_QPN, H_RING_BYTES, H_RQ_PSN, H_STATE, H_TAIL, HEADER_BYTES,
                     QP_MAGIC, RECORD, RECORD_BYTES, W_DROP_EVERY, W_DROP_NEXT, W_DROPPED, W_GENERATION,
                     W_HANG_MS, W_LEFT_OPEN, W_NEXT_QPN, W_PORT_UP, W_PRESENT, W_QP_DESTROYED, W_STALL,
                     W_WEDGE_ON_RECONNECT, W_WEDGED, WRAP, Fabric, pad8)

log = logging.getLogger(__name__)

# --- the provider's objects ---------------------------------------------------------------------------

@dataclass
class _Context:
    struct: v.ibv_context
    device: int
    generation: int


@dataclass
class _MR:
    struct: v.ibv_mr
    context: _Context
    pd: int
    addr: int
    length: int
    lkey: int
    marker: Path


@dataclass
class _Channel:
    struct: v.ibv_comp_channel
    context: _Context
    key: int
    path: Path
    read_fd: int
    keep_fd: int  # a writer of our own, so the FIFO never reads as hung up
    cqs: int = 0


@dataclass
class _CQ:
    struct: v.ibv_cq
    context: _Context
    id: int
    cqe: int
    channel: _Channel | None
    entries: deque = field(default_factory=deque)  # (wr_id, status, opcode, byte_len, qp_num, src_qp, qp, slots)
    armed: bool = False
    overrun: bool = False
    send_qps: list = field(default_factory=list)
    recv_qps: list = field(default_factory=list)


@dataclass
class _Send:
    wr_id: int
    sges: list[tuple[int, int, int]]
    length: int
    signaled: bool
    slots: int  # send-queue slots its completion frees (itself and the unsignaled sends before it)


class _Peer:
    """A mapping of the connected peer QP's file (the sender's side)."""

    def __init__(self, path: Path, device: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.device = device
        self.hdr = memoryview(self.map)[:HEADER_BYTES].cast("Q")
        self.ring_bytes = self.hdr[H_RING_BYTES]
        self._anchor = ctypes.c_char.from_buffer(self.map, HEADER_BYTES)
        self.base = ctypes.addressof(self._anchor)
        self.notify_fd = -1

    def close(self) -> None:
        if self.notify_fd >= 0:
            os.close(self.notify_fd)
        self.hdr.release()
        del self._anchor
        self.map.close()


class _QP:
    def __init__(self, struct_: v.ibv_qp, context: _Context, pd: int, send_cq: _CQ, recv_cq: _CQ,
                 cap: v.ibv_qp_cap, sig_all: bool, qpn: int, path: Path, ring_bytes: int) -> None:
        self.struct = struct_
        self.context = context
        self.pd = pd
        self.send_cq, self.recv_cq = send_cq, recv_cq
        self.max_send_wr, self.max_recv_wr = cap.max_send_wr, cap.max_recv_wr
        self.max_send_sge, self.max_recv_sge = cap.max_send_sge, cap.max_recv_sge
        self.sig_all = sig_all
        self.qpn = qpn
        self.path = path
        self.state = v.IBV_QPS_RESET
        self.remote_qpn = 0
        self.remote_gid = bytes(16)
        self.sgid = bytes(16)
        self.sq_psn = 0
        self.recvs: deque = deque()  # (wr_id, sges, total, ok)
        self.pending: deque[_Send] = deque()  # posted sends not yet on the wire (held) in order
        self.sq_used = 0  # send-queue slots taken (freed when their completion is polled)
        self.unsignaled = 0
        self.sent = 0  # messages this QP put on the wire (drop_every counts them)
        self.peer: _Peer | None = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + ring_bytes)
            self.map = mmap.mmap(fd, HEADER_BYTES + ring_bytes)
        finally:
            os.close(fd)
        self.hdr = memoryview(self.map)[:HEADER_BYTES].cast("Q")
        self.ring_bytes = ring_bytes
        self._anchor = ctypes.c_char.from_buffer(self.map, HEADER_BYTES)
        self.base = ctypes.addressof(self._anchor)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self.hdr.release()
        del self._anchor
        self.map.close()


# --- the provider -------------------------------------------------------------------------------------

class FakeProvider:
    """A verbs provider over a `Fabric` directory (see the module docstring)."""

    def __init__(self, fabric: str | os.PathLike[str]) -> None:
        self.fabric = Fabric(fabric)
        self.name = f"fake fabric {self.fabric.path}"
        self.limits = self.fabric.limits
        self.frame = int(self.limits["frame_bytes"])
        self.max_message = self.frame << int(self.limits["max_frame_shift"])
        self.stall_on_no_receive = self.limits["no_receive"] == "stall"
        self.failures: list[str] = []  # exceptions raised inside callbacks (a bug in the fake): tests check
        self._lock = threading.RLock()
        self._instance = int.from_bytes(os.urandom(4), "little")
        self._pid = os.getpid()
        self._counter = 0
        self._devices = [v.ibv_device(name=d.name.encode(), dev_name=d.ifname.encode(), node_type=1,
                                      transport_type=0) for d in self.fabric.devices]
        self._device_at = {ctypes.addressof(d): i for i, d in enumerate(self._devices)}
        self._lists: dict[int, Any] = {}
        self._contexts: dict[int, _Context] = {}
        self._pds: dict[int, tuple[v.ibv_pd, _Context]] = {}
        self._mrs: dict[int, _MR] = {}
        self._lkeys: dict[int, _MR] = {}
        self._channels: dict[int, _Channel] = {}
        self._cqs: dict[int, _CQ] = {}
        self._cq_ids: dict[int, _CQ] = {}
        self._qps: dict[int, _QP] = {}
        self._held: dict[int, Path] = {}  # address of a context, PD or CQ -> its marker (fabric.held_marker)
        self._thunks: dict[str, Any] = {}
        for name, proto in v.CONTROL_PROTOTYPES.items():
            fail = None if proto._restype_ in (None, c_void_p) else errno.EIO
            self._thunks[name] = proto(self._guard(name, getattr(self, "_" + name), fail,
                                                   locked=name != "ibv_get_cq_event"))
        data_fail = {"poll_cq": -errno.EIO, "req_notify_cq": errno.EIO, "post_send": -errno.EIO,
                     "post_recv": -errno.EIO}
        for name, proto in v.DATA_PROTOTYPES.items():
            self._thunks[name] = proto(self._guard(name, getattr(self, "_" + name), data_fail[name]))
        self._ops = {name: ctypes.cast(self._thunks[name], c_void_p).value for name in v.DATA_PROTOTYPES}

    def symbol(self, name: str) -> int | None:
        thunk = self._thunks.get(name) if name.startswith("ibv_") else None
        return ctypes.cast(thunk, c_void_p).value if thunk is not None else None

    def close(self) -> None:
        """Free whatever the binding left open (files of QPs, MR markers, channels, the markers of CQs, PDs
        and contexts), counting each in its device's `left_open`: the binding should have destroyed it."""
        with self._lock:
            left = [q.context.device for q in self._qps.values()] + [m.context.device for m in self._mrs.values()]
            left += [ch.context.device for ch in self._channels.values()]
            left += [q.context.device for q in self._cqs.values()] + [c.device for _, c in self._pds.values()]
            left += [c.device for c in self._contexts.values()]
            for q in list(self._qps.values()):
                self._destroy_qp_files(q)
            self._qps.clear()
            for m in self._mrs.values():
                with contextlib.suppress(OSError):
                    m.marker.unlink()
            self._mrs.clear()
            for ch in self._channels.values():
                self._close_channel(ch)
            self._channels.clear()
            for marker in self._held.values():
                with contextlib.suppress(OSError):
                    marker.unlink()
            self._held.clear()
            if left:
                with self.fabric.locked():
                    for device in left:
                        self.fabric.set_word(device, W_LEFT_OPEN, self.fabric.word(device, W_LEFT_OPEN) + 1)
            self.fabric.close()

    def _hold(self, address: int, device: int, what: str) -> None:
        """A marker for the object at `address` (`what`: pds, contexts or cqs), for `Fabric.held_by`."""
        marker = self.fabric.held_marker(device, what, self._pid, f"{self._instance}.{self._next()}")
        marker.parent.mkdir(exist_ok=True)  # a fabric made before markers had no such directory
        marker.touch()
        self._held[address] = marker

    def _release(self, address: int) -> None:
        marker = self._held.pop(address, None)
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.unlink()

    def _guard(self, name: str, fn: Callable[..., Any], fail: Any, locked: bool = True) -> Callable[..., Any]:
        """A callback must not raise (ctypes would print and return garbage to C): a bug in the fake becomes
        EIO plus a record in `failures` and the log."""
        def call(*args: Any) -> Any:
            try:
                if not locked:
                    return fn(*args)
                with self._lock:
                    return fn(*args)
            except Exception as exc:  # noqa: BLE001 - reported, see docstring
                log.exception("fake verbs: %s failed", name)
                self.failures.append(f"{name}: {exc!r}")
                ctypes.set_errno(errno.EIO)
                return fail
        return call

    def _next(self) -> int:
        self._counter += 1
        return self._counter

    # helpers ------------------------------------------------------------------------------------------

    def _alive(self, c: _Context) -> bool:
        return bool(self.fabric.word(c.device, W_PRESENT)) and self.fabric.word(c.device, W_GENERATION) == c.generation

    @staticmethod
    def _null(err: int) -> None:
        ctypes.set_errno(err)
        return None

    @staticmethod
    def _rc(err: int) -> int:
        ctypes.set_errno(err)
        return err

    def _context_of(self, ptr: int | None) -> _Context | None:
        return self._contexts.get(ptr or 0)

    # control path -------------------------------------------------------------------------------------

    def _ibv_get_device_list(self, num: Any) -> int | None:
        present = [ctypes.addressof(d) for i, d in enumerate(self._devices) if self.fabric.word(i, W_PRESENT)]
        array = (c_void_p * (len(present) + 1))(*present)
        address = ctypes.addressof(array)
        self._lists[address] = array
        if num:
            num[0] = len(present)
        return address

    def _ibv_free_device_list(self, array: int | None) -> None:
        self._lists.pop(array or 0, None)

    def _ibv_get_device_name(self, device: int | None) -> int | None:
        i = self._device_at.get(device or 0)
        if i is None:
            return self._null(errno.EINVAL)
        return ctypes.addressof(self._devices[i]) + v.ibv_device.name.offset

    def _ibv_open_device(self, device: int | None) -> int | None:
        i = self._device_at.get(device or 0)
        if i is None:
            return self._null(errno.EINVAL)
        if not self.fabric.word(i, W_PRESENT):
            return self._null(errno.ENODEV)
        s = v.ibv_context(device=ctypes.pointer(self._devices[i]), cmd_fd=-1, async_fd=-1, num_comp_vectors=1)
        for name, address in self._ops.items():
            setattr(s.ops, name, address)
        self._contexts[ctypes.addressof(s)] = _Context(s, i, self.fabric.word(i, W_GENERATION))
        self._hold(ctypes.addressof(s), i, "contexts")
        return ctypes.addressof(s)

    def _ibv_close_device(self, ctx: int | None) -> int:
        if self._contexts.pop(ctx or 0, None) is None:
            return self._rc(errno.EINVAL)
        self._release(ctx or 0)
        return 0

    def _ibv_query_device(self, ctx: int | None, attr: int | None) -> int:
        c = self._context_of(ctx)
        if c is None or not attr:
            return self._rc(errno.EINVAL)
        if not self._alive(c):
            return self._rc(errno.ENODEV)
        a = v.ibv_device_attr.from_address(attr)
        ctypes.memset(attr, 0, sizeof(v.ibv_device_attr))
        a.fw_ver = b"fake-verbs"
        lim = self.limits
        a.max_qp, a.max_qp_wr, a.max_sge, a.max_cq = lim["max_qp"], lim["max_qp_wr"], lim["max_sge"], 64
        a.max_cqe, a.max_mr, a.max_pd, a.phys_port_cnt = lim["max_cqe"], lim["max_mr"], 64, 1
        a.max_mr_size = 1 << 40
        return 0

    def _port_check(self, c: _Context | None, port: int) -> int:
        if c is None:
            return errno.EINVAL
        if not self._alive(c):
            return errno.ENODEV
        return 0 if port == 1 else errno.EINVAL

    def _hang(self, device: int) -> None:
        """A wedged port hangs the caller (ibv_devinfo hangs on a Mac); bounded here by hang_ms."""
        ms = self.fabric.word(device, W_HANG_MS)
        if ms > 0:
            time.sleep(ms / 1000)

    def _ibv_query_port(self, ctx: int | None, port: int, attr: int | None) -> int:
        c = self._context_of(ctx)
        err = self._port_check(c, port) or (0 if attr else errno.EINVAL)
        if err:
            return self._rc(err)
        assert c is not None
        if self.fabric.word(c.device, W_WEDGED):
            self._hang(c.device)
            return self._rc(errno.ETIMEDOUT)
        a = v.ibv_port_attr.from_address(attr)
        a.state = v.IBV_PORT_ACTIVE if self.fabric.word(c.device, W_PORT_UP) else v.IBV_PORT_DOWN
        a.max_mtu = a.active_mtu = v.IBV_MTU_1024
        a.gid_tbl_len, a.lid, a.link_layer = 2, 0, v.IBV_LINK_LAYER_ETHERNET
        a.max_msg_sz, a.pkey_tbl_len = self.max_message, 1
        return 0

    def _ibv_query_gid(self, ctx: int | None, port: int, index: int, gid: int | None) -> int:
        c = self._context_of(ctx)
        err = self._port_check(c, port) or (0 if gid and 0 <= index < 2 else errno.EINVAL)
        if err:
            return self._rc(err)
        assert c is not None
        ctypes.memmove(gid, self.fabric.gid(c.device, index), 16)
        return 0

    def _ibv_alloc_pd(self, ctx: int | None) -> int | None:
        c = self._context_of(ctx)
        if c is None:
            return self._null(errno.EINVAL)
        if not self._alive(c):
            return self._null(errno.ENODEV)
        s = v.ibv_pd(context=ctypes.pointer(c.struct), handle=self._next())
        self._pds[ctypes.addressof(s)] = (s, c)
        self._hold(ctypes.addressof(s), c.device, "pds")
        return ctypes.addressof(s)

    def _ibv_dealloc_pd(self, pd: int | None) -> int:
        if (pd or 0) not in self._pds:
            return self._rc(errno.EINVAL)
        if any(m.pd == pd for m in self._mrs.values()) or any(q.pd == pd for q in self._qps.values()):
            return self._rc(errno.EBUSY)
        del self._pds[pd]  # type: ignore[arg-type]
        self._release(pd or 0)
        return 0

    def _ibv_reg_mr(self, pd: int | None, addr: int | None, length: int, access: int) -> int | None:
        entry = self._pds.get(pd or 0)
        if entry is None or not addr or length <= 0:
            return self._null(errno.EINVAL)
        c = entry[1]
        if not self._alive(c):
            return self._null(errno.ENODEV)
        if access & v.DEFAULT_ACCESS != v.DEFAULT_ACCESS:
            return self._null(errno.EINVAL)
        lkey = self._next() | (self._instance & 0xFF00) << 8
        marker = self.fabric.path / self.fabric.devices[c.device].name / "mr" / f"{self._pid}.{self._instance}.{lkey}"
        with self.fabric.locked():
            if self.fabric.live_mrs(c.device) >= self.limits["max_mr"]:
                return self._null(errno.ENOMEM)
            marker.touch()
        s = v.ibv_mr(context=ctypes.pointer(c.struct), pd=ctypes.cast(pd, POINTER(v.ibv_pd)), addr=addr,
                     length=length, handle=lkey, lkey=lkey, rkey=0)  # rkey 0: no one-sided ops (facts)
        m = _MR(s, c, pd or 0, addr, length, lkey, marker)
        self._mrs[ctypes.addressof(s)] = m
        self._lkeys[lkey] = m
        return ctypes.addressof(s)

    def _ibv_dereg_mr(self, mr: int | None) -> int:
        m = self._mrs.pop(mr or 0, None)
        if m is None:
            return self._rc(errno.EINVAL)
        self._lkeys.pop(m.lkey, None)
        with contextlib.suppress(OSError):
            m.marker.unlink()
        return 0

    def _ibv_create_comp_channel(self, ctx: int | None) -> int | None:
        c = self._context_of(ctx)
        if c is None:
            return self._null(errno.EINVAL)
        if not self._alive(c):
            return self._null(errno.ENODEV)
        if not self.limits["comp_channel"]:
            return self._null(errno.EOPNOTSUPP)
        key = self._instance << 24 | self._next()
        path = self.fabric.path / "chan" / f"{self._pid}.{key}"
        os.mkfifo(path, 0o600)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        keep_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        s = v.ibv_comp_channel(context=ctypes.pointer(c.struct), fd=read_fd, refcnt=0)
        self._channels[ctypes.addressof(s)] = _Channel(s, c, key, path, read_fd, keep_fd)
        return ctypes.addressof(s)

    def _close_channel(self, ch: _Channel) -> None:
        for fd in (ch.read_fd, ch.keep_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            ch.path.unlink()

    def _ibv_destroy_comp_channel(self, channel: int | None) -> int:
        ch = self._channels.get(channel or 0)
        if ch is None:
            return self._rc(errno.EINVAL)
        if ch.cqs:
            return self._rc(errno.EBUSY)
        del self._channels[channel]  # type: ignore[arg-type]
        self._close_channel(ch)
        return 0

    def _ibv_create_cq(self, ctx: int | None, cqe: int, cq_context: int | None, channel: int | None,
                       vector: int) -> int | None:
        c = self._context_of(ctx)
        if c is None or not 1 <= cqe <= self.limits["max_cqe"] or (channel and channel not in self._channels):
            return self._null(errno.EINVAL)
        if not self._alive(c):
            return self._null(errno.ENODEV)
        ch = self._channels.get(channel or 0)
        cq_id = self._next()
        s = v.ibv_cq(context=ctypes.pointer(c.struct), cq_context=cq_context, handle=cq_id, cqe=cqe)
        if ch is not None:
            s.channel = ctypes.pointer(ch.struct)
            ch.cqs += 1
        q = _CQ(s, c, cq_id, cqe, ch)
        self._cqs[ctypes.addressof(s)] = q
        self._cq_ids[cq_id] = q
        self._hold(ctypes.addressof(s), c.device, "cqs")
        return ctypes.addressof(s)

    def _ibv_destroy_cq(self, cq: int | None) -> int:
        q = self._cqs.get(cq or 0)
        if q is None:
            return self._rc(errno.EINVAL)
        if q.send_qps or q.recv_qps:
            return self._rc(errno.EBUSY)
        del self._cqs[cq]  # type: ignore[arg-type]
        del self._cq_ids[q.id]
        if q.channel is not None:
            q.channel.cqs -= 1
        self._release(cq or 0)
        return 0

    def _ibv_get_cq_event(self, channel: int | None, cq_out: int | None, ctx_out: int | None) -> int:
        with self._lock:
            ch = self._channels.get(channel or 0)
        if ch is None or not cq_out or not ctx_out:
            return self._rc(errno.EINVAL)
        while True:  # blocks, as the verb does, without holding the provider's lock
            select.select([ch.read_fd], [], [])
            try:
                data = os.read(ch.read_fd, 4)
            except BlockingIOError:
                continue
            if len(data) < 4:
                continue
            with self._lock:
                q = self._cq_ids.get(int.from_bytes(data, "little"))
                if q is None or q.channel is not ch:
                    continue  # an event for a CQ destroyed since
                c_void_p.from_address(cq_out).value = ctypes.addressof(q.struct)
                c_void_p.from_address(ctx_out).value = q.struct.cq_context
                return 0

    def _ibv_ack_cq_events(self, cq: int | None, count: int) -> None:
        return None

    def _ibv_create_qp(self, pd: int | None, init: int | None) -> int | None:
        entry = self._pds.get(pd or 0)
        if entry is None or not init:
            return self._null(errno.EINVAL)
        c = entry[1]
        if not self._alive(c):
            return self._null(errno.ENODEV)
        a = v.ibv_qp_init_attr.from_address(init)
        if a.qp_type != v.IBV_QPT_UC or a.srq:
            return self._null(errno.EOPNOTSUPP)  # Apple: UC only; RC fails with EOPNOTSUPP
        send_cq = self._cqs.get(ctypes.cast(a.send_cq, c_void_p).value or 0)
        recv_cq = self._cqs.get(ctypes.cast(a.recv_cq, c_void_p).value or 0)
        cap, lim = a.cap, self.limits
        if (send_cq is None or recv_cq is None or not 1 <= cap.max_send_wr <= lim["max_qp_wr"]
                or not 1 <= cap.max_recv_wr <= lim["max_qp_wr"] or cap.max_send_sge > lim["max_sge"]
                or cap.max_recv_sge > lim["max_sge"]):
            return self._null(errno.EINVAL)
        cap.max_send_sge, cap.max_recv_sge = max(1, cap.max_send_sge), max(1, cap.max_recv_sge)
        cap.max_inline_data = 0
        with self.fabric.locked():
            if len(self.fabric.live_qps(c.device)) >= lim["max_qp"]:
                return self._null(errno.EBUSY)  # Apple: about 10 per device, then EBUSY
            qpn = self.fabric.word(c.device, W_NEXT_QPN)
            self.fabric.set_word(c.device, W_NEXT_QPN, qpn + 1)
            path = self.fabric.qp_path(c.device, qpn)
            ring = int(lim["ring_bytes"])
            s = v.ibv_qp(context=ctypes.pointer(c.struct), qp_context=a.qp_context,
                         pd=ctypes.cast(pd, POINTER(v.ibv_pd)), send_cq=a.send_cq, recv_cq=a.recv_cq,
                         handle=qpn, qp_num=qpn, state=v.IBV_QPS_RESET, qp_type=v.IBV_QPT_UC)
            q = _QP(s, c, pd or 0, send_cq, recv_cq, cap, bool(a.sq_sig_all), qpn, path, ring)
            h = q.hdr
            h[H_PID], h[H_STATE], h[H_RING_BYTES], h[H_DEVICE], h[H_CQ] = self._pid, v.IBV_QPS_RESET, ring, c.device, \
                recv_cq.id
            h[H_CHANNEL] = recv_cq.channel.key if recv_cq.channel is not None else 0
            h[H_MAGIC] = QP_MAGIC  # last: a QP file with the magic is complete
        self._qps[ctypes.addressof(s)] = q
        send_cq.send_qps.append(q)
        recv_cq.recv_qps.append(q)
        return ctypes.addressof(s)

    def _destroy_qp_files(self, q: _QP) -> None:
        q.hdr[H_STATE] = DESTROYED
        with contextlib.suppress(OSError):
            q.path.unlink()
        q.close()

    def _ibv_destroy_qp(self, qp: int | None) -> int:
        q = self._qps.pop(qp or 0, None)
        if q is None:
            return self._rc(errno.EINVAL)
        q.send_cq.send_qps.remove(q)
        q.recv_cq.recv_qps.remove(q)
        self._destroy_qp_files(q)
        self.fabric.set_word(q.context.device, W_QP_DESTROYED, 1)
        return 0

    def _ibv_modify_qp(self, qp: int | None, attr: int | None, mask: int) -> int:
        q = self._qps.get(qp or 0)
        if q is None or not attr or not mask & v.IBV_QP_STATE:
            return self._rc(errno.EINVAL)
        if not self._alive(q.context):
            return self._rc(errno.ENODEV)
        a = v.ibv_qp_attr.from_address(attr)
        target = a.qp_state
        err = self._transition(q, a, mask, target)
        if err:
            return self._rc(err)
        q.state = target
        q.struct.state = target
        q.hdr[H_STATE] = target
        return 0

    def _transition(self, q: _QP, a: v.ibv_qp_attr, mask: int, target: int) -> int:
        """Checks and effects of one ibv_modify_qp; an errno, or 0 once done (the state is set by the
        caller)."""
        fab, dev = self.fabric, q.context.device
        if target == v.IBV_QPS_RESET:
            self._flush(q, completions=False)
            q.remote_qpn, q.remote_gid = 0, bytes(16)
            q.hdr[H_REMOTE_QPN] = q.hdr[H_GID0] = q.hdr[H_GID1] = 0
            return 0
        if target == v.IBV_QPS_ERR:
            self._flush(q, completions=True)
            return 0
        if target == v.IBV_QPS_INIT and q.state == v.IBV_QPS_RESET:
            if mask & v.INIT_MASK != v.INIT_MASK or a.port_num != 1:
                return errno.EINVAL
            return 0
        if target == v.IBV_QPS_RTR and q.state == v.IBV_QPS_INIT:
            if fab.word(dev, W_WEDGED):
                self._hang(dev)
                return errno.ETIMEDOUT
            if fab.word(dev, W_WEDGE_ON_RECONNECT) and fab.word(dev, W_QP_DESTROYED):
                with fab.locked():
                    fab.set_word(dev, W_WEDGED, 1)
                self._hang(dev)
                return errno.ETIMEDOUT
            ah = a.ah_attr
            if (mask & v.RTR_MASK != v.RTR_MASK or a.path_mtu != v.IBV_MTU_1024 or not ah.is_global
                    or ah.port_num != 1 or ah.grh.sgid_index != 1):
                return errno.EINVAL
            sgid = fab.gid(dev, 1)
            if sgid == bytes(16):
                return errno.EINVAL  # no IPv4-mapped GID: the interface has no IPv4 address
            if not fab.word(dev, W_PORT_UP):
                return errno.ENETDOWN
            q.sgid, q.remote_qpn, q.remote_gid = sgid, a.dest_qp_num, bytes(ah.grh.dgid.raw)
            q.hdr[H_REMOTE_QPN], q.hdr[H_RQ_PSN] = a.dest_qp_num, a.rq_psn
            q.hdr[H_GID0], q.hdr[H_GID1] = struct.unpack("<QQ", q.remote_gid)
            return 0
        if target == v.IBV_QPS_RTS and q.state == v.IBV_QPS_RTR:
            if mask & v.RTS_MASK != v.RTS_MASK:
                return errno.EINVAL
            q.sq_psn = a.sq_psn
            return 0
        return errno.EINVAL

    def _flush(self, q: _QP, completions: bool) -> None:
        """Outstanding receives and held sends go away; with `completions` (to ERR) each completes with
        IBV_WC_WR_FLUSH_ERR, as on any provider. Later posts fail (the state is no longer RTS)."""
        q.hdr[H_POSTED] = q.hdr[H_CLAIMED]  # no receive left for a sender to claim
        q.hdr[H_TAIL] = q.hdr[H_HEAD]
        while completions and q.recvs:
            wr_id = q.recvs.popleft()[0]
            self._complete(q.recv_cq, (wr_id, v.IBV_WC_WR_FLUSH_ERR, v.IBV_WC_RECV, 0, q.qpn, 0, None, 0))
        q.recvs.clear()
        while completions and q.pending:
            s = q.pending.popleft()
            self._complete(q.send_cq, (s.wr_id, v.IBV_WC_WR_FLUSH_ERR, v.IBV_WC_SEND, 0, q.qpn, 0, q, s.slots))
        q.pending.clear()

    # data path ----------------------------------------------------------------------------------------

    def _complete(self, cq: _CQ, entry: tuple, notify: bool = True) -> None:
        cq.entries.append(entry)
        if len(cq.entries) > cq.cqe:
            cq.overrun = True
        if notify and cq.armed and cq.channel is not None:
            cq.armed = False
            with contextlib.suppress(BlockingIOError):
                os.write(cq.channel.keep_fd, cq.id.to_bytes(4, "little"))

    def _post_send(self, qp: int | None, wr: int | None, bad: int | None) -> int:
        q = self._qps.get(qp or 0)
        if q is None:
            return -errno.EINVAL
        err = 0
        if not self._alive(q.context):
            err = errno.ENODEV
        elif q.state != v.IBV_QPS_RTS:
            err = errno.EINVAL
        while wr and not err:
            w = v.ibv_send_wr.from_address(wr)
            if w.opcode != v.IBV_WR_SEND:
                err = errno.EOPNOTSUPP  # Apple: two-sided SEND/RECV only
            elif not 0 <= w.num_sge <= q.max_send_sge:
                err = errno.EINVAL
            elif q.sq_used >= q.max_send_wr:
                err = errno.ENOMEM
            else:
                sges = _sges(w.sg_list, w.num_sge)
                signaled = q.sig_all or bool(w.send_flags & v.IBV_SEND_SIGNALED)
                q.sq_used += 1
                slots = q.unsignaled + 1 if signaled else 0
                q.unsignaled = 0 if signaled else q.unsignaled + 1
                q.pending.append(_Send(w.wr_id, sges, sum(s[1] for s in sges), signaled, slots))
                wr = ctypes.cast(w.next, c_void_p).value
        if err and bad:
            c_void_p.from_address(bad).value = wr
        self._progress(q)
        return -err

    def _post_recv(self, qp: int | None, wr: int | None, bad: int | None) -> int:
        q = self._qps.get(qp or 0)
        if q is None:
            return -errno.EINVAL
        err = 0
        if not self._alive(q.context):
            err = errno.ENODEV
        elif q.state != v.IBV_QPS_RTS:
            err = errno.EINVAL  # Apple's provider takes receives only after RTS (llama.cpp)
        while wr and not err:
            w = v.ibv_recv_wr.from_address(wr)
            if not 0 < w.num_sge <= q.max_recv_sge:
                err = errno.EINVAL
                break
            if len(q.recvs) >= q.max_recv_wr:
                err = errno.ENOMEM
                break
            sges = _sges(w.sg_list, w.num_sge)
            total = sum(s[1] for s in sges)
            frames, rest = divmod(total, self.frame)
            if rest or frames < 1 or frames & (frames - 1) or total > self.max_message:
                err = errno.EINVAL  # receives of 4 KiB x 2^k only
                break
            q.recvs.append((w.wr_id, sges, total, self._owned(q, sges)))
            q.hdr[H_POSTED] += 1  # after the receive is queued: a sender may claim it from now on
            wr = ctypes.cast(w.next, c_void_p).value
        if err and bad:
            c_void_p.from_address(bad).value = wr
        return -err

    def _owned(self, q: _QP, sges: Sequence[tuple[int, int, int]]) -> bool:
        """Whether every entry lies inside a region of this QP's PD registered with its lkey."""
        for addr, length, lkey in sges:
            m = self._lkeys.get(lkey)
            if m is None or m.pd != q.pd or addr < m.addr or addr + length > m.addr + m.length:
                return False
        return True

    def _progress(self, q: _QP) -> None:
        """Put held sends on the wire, in order, until one must wait."""
        while q.pending:
            s = q.pending[0]
            status = self._transmit(q, s)
            if status is None:
                return
            q.pending.popleft()
            if s.signaled or status != v.IBV_WC_SUCCESS:
                self._complete(q.send_cq, (s.wr_id, status, v.IBV_WC_SEND, s.length, q.qpn, 0, q, s.slots))

    def _drop(self, device: int) -> int:
        with self.fabric.locked():
            self.fabric.set_word(device, W_DROPPED, self.fabric.word(device, W_DROPPED) + 1)
        return v.IBV_WC_SUCCESS  # UC: the sender never learns

    def _transmit(self, q: _QP, s: _Send) -> int | None:
        """One send onto the wire: a completion status (dropped messages complete successfully), or None
        when it must wait (a stall, a full ring, or no receive under no_receive="stall")."""
        if not self._owned(q, s.sges):
            return v.IBV_WC_LOC_PROT_ERR
        if s.length > self.max_message:
            return v.IBV_WC_LOC_LEN_ERR
        fab, me = self.fabric, q.context.device
        mine = fab.slot(me)
        if mine[W_STALL]:
            return None
        peer = self._peer(q)
        if peer is None:
            return self._drop(me)
        theirs = fab.slot(peer.device)
        if theirs[W_STALL]:
            return None
        h = peer.hdr
        if (not mine[W_PORT_UP] or not theirs[W_PRESENT] or not theirs[W_PORT_UP]
                or h[H_STATE] not in (v.IBV_QPS_RTR, v.IBV_QPS_RTS) or h[H_REMOTE_QPN] != q.qpn
                or struct.pack("<QQ", h[H_GID0], h[H_GID1]) != q.sgid or h[H_RQ_PSN] != q.sq_psn):
            return self._drop(me)
        q.sent += 1
        if mine[W_DROP_EVERY] and q.sent % mine[W_DROP_EVERY] == 0:
            return self._drop(me)
        if mine[W_DROP_NEXT]:
            with fab.locked():
                left = fab.word(me, W_DROP_NEXT)
                if left > 0:
                    fab.set_word(me, W_DROP_NEXT, left - 1)
            if left > 0:
                return self._drop(me)
        if h[H_POSTED] <= h[H_CLAIMED]:
            if self.stall_on_no_receive:
                q.sent -= 1  # not on the wire yet: counted again when it goes
                return None
            return self._drop(me)
        size = peer.ring_bytes
        head, tail = h[H_HEAD], h[H_TAIL]
        need = RECORD_BYTES + pad8(s.length)
        pos = head % size
        waste = size - pos if pos + need > size else 0
        if need + waste > size - (head - tail):
            q.sent -= 1
            return None  # the peer has not read what came before yet: wait, like the wire's credits
        if waste:
            if waste >= RECORD_BYTES:
                RECORD.pack_into(peer.map, HEADER_BYTES + pos, 0, q.qpn, WRAP)
            head += waste
            pos = 0
        RECORD.pack_into(peer.map, HEADER_BYTES + pos, s.length, q.qpn, 0)
        dest = peer.base + pos + RECORD_BYTES
        for addr, length, _lkey in s.sges:
            ctypes.memmove(dest, addr, length)
            dest += length
        h[H_CLAIMED] += 1
        ordering.release()  # the record before the head that publishes it
        h[H_HEAD] = head + need
        ordering.full()  # our head store before the load of the armed flag (the receiver: the reverse)
        if h[H_ARMED]:
            h[H_ARMED] = 0
            self._notify(peer)
        return v.IBV_WC_SUCCESS

    def _notify(self, peer: _Peer) -> None:
        h = peer.hdr
        if peer.notify_fd < 0 and h[H_CHANNEL]:
            path = self.fabric.path / "chan" / f"{h[H_PID]}.{h[H_CHANNEL]}"
            with contextlib.suppress(OSError):
                peer.notify_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        if peer.notify_fd >= 0:
            with contextlib.suppress(OSError):  # full (events pending anyway) or the reader is gone
                os.write(peer.notify_fd, int(h[H_CQ]).to_bytes(4, "little"))

    def _peer(self, q: _QP) -> _Peer | None:
        if q.peer is not None:
            return q.peer
        device = self.fabric.device_of_gid(q.remote_gid)
        if device is None:
            return None
        try:
            q.peer = _Peer(self.fabric.qp_path(device, q.remote_qpn), device)
        except OSError:
            return None
        return q.peer

    def _drain(self, q: _QP) -> None:
        """Move what the peer wrote into our ring into the posted receives, in order."""
        h = q.hdr
        if q.recv_cq.armed and not h[H_ARMED]:
            q.recv_cq.armed = False  # a sender raised the event of this arming already
        head, tail = h[H_HEAD], h[H_TAIL]
        if tail == head:
            return
        ordering.acquire()  # the head before the records it publishes
        size = q.ring_bytes
        while tail < head:
            pos = tail % size
            if size - pos < RECORD_BYTES:
                tail += size - pos
                continue
            length, src, flags = RECORD.unpack_from(q.map, HEADER_BYTES + pos)
            if flags & WRAP:
                tail += size - pos
                continue
            tail += RECORD_BYTES + pad8(length)
            if not q.recvs:  # cannot happen while senders claim receives; lost if it does
                continue
            wr_id, sges, total, ok = q.recvs.popleft()
            if max(1, -(-length // self.frame)) != total // self.frame:
                status, length = v.IBV_WC_LOC_LEN_ERR, 0  # Apple: a send and its receive cover as many frames
            elif not ok:
                status, length = v.IBV_WC_LOC_PROT_ERR, 0
            else:
                status, src_addr, left = v.IBV_WC_SUCCESS, q.base + pos + RECORD_BYTES, length
                for addr, room, _lkey in sges:
                    n = min(room, left)
                    ctypes.memmove(addr, src_addr, n)
                    src_addr += n
                    left -= n
            # no event: the sender raised it when the message arrived (if the queue was armed)
            self._complete(q.recv_cq, (wr_id, status, v.IBV_WC_RECV, length, q.qpn, src, None, 0), notify=False)
        ordering.release()  # our record loads before the tail store that lets the sender reuse the space
        h[H_TAIL] = tail

    def _poll_cq(self, cq: int | None, n: int, wc: int | None) -> int:
        c = self._cqs.get(cq or 0)
        if c is None or n < 0:
            return -errno.EINVAL
        if not self._alive(c.context):
            return -errno.ENODEV
        for q in c.send_qps:
            if q.pending:
                self._progress(q)
        for q in c.recv_qps:
            self._drain(q)
        if c.overrun:
            return -errno.EOVERFLOW
        k = min(n, len(c.entries))
        for i in range(k):
            wr_id, status, opcode, byte_len, qpn, src, owner, slots = c.entries.popleft()
            v.WC.pack_into((ctypes.c_char * v.WC_BYTES).from_address(wc + i * v.WC_BYTES), 0, wr_id, status,
                           opcode, 0, byte_len, 0, qpn, src)
            ctypes.memset(wc + i * v.WC_BYTES + v.WC.size, 0, v.WC_BYTES - v.WC.size)
            if owner is not None:
                owner.sq_used -= slots
        return k

    def _req_notify_cq(self, cq: int | None, solicited_only: int) -> int:
        c = self._cqs.get(cq or 0)
        if c is None:
            return errno.EINVAL
        if not self._alive(c.context):
            return errno.ENODEV
        c.armed = True
        for q in c.recv_qps:
            q.hdr[H_ARMED] = 1
        ordering.full()  # the armed flags before the caller's next poll reads the heads
        return 0


def _sges(sg_list: Any, count: int) -> list[tuple[int, int, int]]:
    if count <= 0:
        return []
    array = (v.ibv_sge * count).from_address(ctypes.cast(sg_list, c_void_p).value)
    return [(s.addr, s.length, s.lkey) for s in array]


__all__ = ["FakeProvider"]
