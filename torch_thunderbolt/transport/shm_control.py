"""The shm transport's control wire: one Unix socket per pair of ranks, carrying doorbell bytes (wake a
sleeping rank), BYE (an orderly close) and ABORT texts (why a group failed). EOF without BYE means the peer
process died, kill -9 included. A mixin of ShmTransport, which owns the peers, the lock and `_fail`.
"""
from __future__ import annotations

import errno
import socket
import struct
from typing import Any

from ..errors import ProtocolError
from . import shm_ring as ring
from .base import remote_error

BELL, BYE, ABORT = b"\x00", b"B", b"A"
LEN = struct.Struct("<I")  # length prefix of an ABORT text


class ControlWire:
    """Needs from its host class: `rank`, `broken`, `matcher`, `_list` (peers with sock, eof, bye, ctl,
    flag, rank, pid), `_read(pe)` and `_fail(pe, exc, wrap=...)`."""

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
