"""The shm transport's control wire: one Unix socket per pair of ranks, carrying doorbell bytes (wake a
sleeping rank), BYE (an orderly close) and ABORT texts (why a group failed). EOF without BYE means the peer
process died, kill -9 included. Entering BROKEN lives here too, since it sends the ABORT. A mixin of
ShmTransport, which owns the peers and the lock.
"""
from __future__ import annotations

import errno
import socket
import struct
from typing import Any

from ..errors import ProtocolError
from ..protocol.framing import abort_body
from . import shm_ring as ring
from .base import remote_error

BELL, BYE, ABORT = b"\x00", b"B", b"A"
LEN = struct.Struct("<I")  # length prefix of an ABORT text


class ControlWire:
    """Needs from its host class: `rank`, `broken`, `matcher`, `_cv`, `_list` (peers with sock, eof, bye,
    ctl, flag, rank, pid, sendq), `peer_address(rank)` and `_read(pe)`."""

    def wake_sleepers(self) -> None:
        """After a window post: ring the bell of every peer asleep in poll() (it may wait for that post)."""
        ring.fence()  # our counter store before their flag loads (they fence between flag store and check)
        for pe in self._list:
            if pe.flag[0] and not pe.eof:
                try:
                    pe.sock.send(BELL)
                except OSError:
                    pass  # full buffer: bells are pending anyway; a closed socket: the group is failing

    def _read_doorbells(self, events: list) -> None:
        """After poll(): read the control bytes (bells, BYE, ABORT) of every peer socket that woke us."""
        for fd, _ in events:
            pe = self._by_fd.get(fd)
            if pe is not None:
                self._read_control(pe)

    def _drain(self, sock: socket.socket) -> None:
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass

    def _read_control(self, pe: Any) -> None:
        while not pe.eof and self.broken is None:
            try:
                data = pe.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if pe.bye:
                    # The peer left in order. A Unix socket closed with our doorbells still unread in it
                    # reports ECONNRESET after the BYE instead of EOF: that is its close, not a loss.
                    pe.eof = True
                else:
                    self._fail(pe, exc)
                return
            if not data:
                pe.eof = True
                if not pe.bye:
                    self._fail(pe, ConnectionResetError(errno.ECONNRESET, f"process {pe.pid} is gone"))
                return
            if pe.ctl or data.strip(BELL):  # plain doorbells need no parsing
                pe.ctl += data
                self._parse_control(pe)

    def _parse_control(self, pe: Any) -> None:
        buf = pe.ctl
        i = 0
        while i < len(buf):
            c = buf[i : i + 1]
            if c == BELL:
                i += 1
            elif c == BYE:
                i += 1
                pe.bye = True
                self._peer_said_bye(pe)
            elif c == ABORT:
                if len(buf) < i + 5:
                    break
                (n,) = LEN.unpack_from(buf, i + 1)
                if len(buf) < i + 5 + n:
                    break
                self._remote_abort(pe, bytes(buf[i + 5 : i + 5 + n]).decode(errors="replace"))
                i += 5 + n
            else:
                self._fail(pe, ProtocolError(f"rank {pe.rank} sent an unknown control byte {c!r}"), wrap=False)
                return
        del buf[:i]

    def _peer_said_bye(self, pe: Any) -> None:
        self._read(pe)  # what it sent before leaving is in the ring already
        if any(r.peer == pe.rank and not r.is_send for r in self.matcher.pending()):
            self._fail(pe, ConnectionAbortedError(errno.ECONNABORTED, "the peer shut down its process group "
                                                  "while this rank still expected data from it"))

    def _remote_abort(self, pe: Any, text: str) -> None:
        err = remote_error(self.rank, pe.rank, text)
        # Forward it: a peer must not see our socket close (and blame us) before it hears the reason.
        self._fail(pe, err, wrap=False)

    def _send_all(self, msg: bytes) -> None:
        for pe in self._list:
            if pe.eof:
                continue
            try:
                pe.sock.setblocking(True)
                pe.sock.settimeout(0.5)
                pe.sock.sendall(msg)
            except OSError:
                pass

    def _close_sockets(self) -> None:
        for pe in self._list:
            try:
                pe.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            pe.sock.close()
            pe.eof = True

    # -- failure -------------------------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Fail this transport with `error` and tell every peer why, so they fail fast and clearly too."""
        with self._cv:
            if self.broken is None and self._list:
                self._fail(self._list[0], error, wrap=False)
            elif self.broken is None:
                super().abort(error)

    def _fail(self, pe: Any, exc: BaseException, wrap: bool = True, tell_peers: bool = True) -> None:
        """Enter BROKEN: every pending and later request gets the error; peers learn the root cause."""
        if self.broken is not None:
            return
        err = exc
        if wrap:
            err = self._lost(pe.rank, f"(shared memory, pid {pe.pid})", exc, self.peer_address(pe.rank))
        if tell_peers:
            body = abort_body(err)
            self._send_all(ABORT + LEN.pack(len(body)) + body)
        self._enter_broken(err, [item[0] for other in self._list for item in other.sendq])
        for other in self._list:
            other.sendq.clear()
        self._close_sockets()
        self._cv.notify_all()
