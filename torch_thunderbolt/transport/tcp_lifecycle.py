"""How a TCP transport fails and ends: entering BROKEN (every pending and later request gets the error,
peers get an ABORT naming the root cause), a peer's ABORT, BYE or EOF, and the orderly shutdown (BYE on
every stream). Mixed into TcpTransport."""
from __future__ import annotations

import errno
import select
import socket
import threading
import time

from ..errors import BackendClosedError
from ..protocol.framing import Kind, Space, encode_abort, encode_frame_header
from .base import remote_error
from .tcp_conn import Stream

# How long a failing rank spends getting its ABORT to the peers before it closes its sockets. Normally a few
# milliseconds (finish the frame in flight, write the ABORT, wait for each peer to close); only a peer that
# reads nothing (frozen, or itself stuck) uses it all.
ABORT_GRACE = 2.0
_SINK = 1 << 16  # bytes read (and dropped) per call while waiting for the peers to close


class StreamLifecycle:
    def _remote_abort(self, c: Stream, text: str) -> None:
        err = remote_error(self.rank, c.peer, text)
        self._fail(c, err, wrap=False)  # forward it: our FIN must not reach a peer before the reason

    def abort(self, error: BaseException) -> None:
        """Fail this transport with `error` and tell every peer why, so they fail fast and clearly too."""
        with self._cv:
            if self.broken is None and self._all:
                self._fail(self._all[0], error, wrap=False)

    def _peer_said_bye(self, c: Stream) -> None:
        if all(x.bye or x.dead for x in self.conns[c.peer]) and any(
                r.peer == c.peer and not r.is_send for r in self.matcher.pending()):
            self._fail(c, ConnectionAbortedError(errno.ECONNABORTED, "the peer shut down its process group "
                                                 "while this rank still expected data from it"))

    def _eof(self, c: Stream) -> bool:
        self._fail(c, ConnectionResetError(errno.ECONNRESET, "connection closed by peer"))
        return True

    def _fail(self, c: Stream, exc: BaseException, wrap: bool = True, tell_peers: bool = True) -> None:
        """Enter BROKEN: every pending and later request gets the error; peers learn the root cause."""
        if self.broken is not None:
            return
        err = self._lost(c.peer, f"at {c.addr} (stream {c.stream})", exc, c.addr) if wrap else exc
        self._enter_broken(err, [out.req for o in self._all for out in o.sendq if out.req is not None])
        self._cv.notify_all()
        if tell_peers:
            self._deliver_abort(err)
        for other in self._all:
            other.sendq.clear()
        self._close_sockets()
        self._cv.notify_all()

    def _deliver_abort(self, exc: BaseException) -> None:
        """Tell every peer the root cause, so none of them blames this rank for closing its connections.

        A stream in the middle of a frame gets the rest of that frame first (the peer would read an ABORT
        written now as payload). Then the ABORT, then FIN; the sockets are closed only once each peer closed
        its end too (it read the ABORT) or ABORT_GRACE passed, and whatever the peers send meanwhile is read
        and dropped: closing a socket with unread bytes makes the kernel send a reset and throw away what is
        still queued — the ABORT included — and the peer would then report "lost the connection" to us."""
        frame = memoryview(encode_abort(exc))
        todo: dict[int, tuple[Stream, list[memoryview]]] = {}
        for c in self._all:
            if c.dead:
                continue
            bufs: list[memoryview] = []
            if c.sendq and c.sendq[0].sent:
                out, hl = c.sendq[0], len(c.sendq[0].hdr)
                bufs = ([memoryview(out.hdr)[out.sent:], out.payload] if out.sent < hl
                        else [out.payload[out.sent - hl:]])
            c.sendq.clear()
            todo[c.fd] = (c, [b for b in bufs if len(b)] + [frame])
        sink = bytearray(_SINK)
        deadline = time.monotonic() + ABORT_GRACE
        while todo:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            poller = select.poll()
            for fd, (c, bufs) in todo.items():
                poller.register(fd, select.POLLIN | (select.POLLOUT if bufs else 0))
            for fd, ev in poller.poll(left * 1000.0):
                c, bufs = todo[fd]
                try:
                    if bufs and ev & select.POLLOUT:
                        _consume(bufs, c.sock.send(bufs[0]))
                        if not bufs:
                            c.sock.shutdown(socket.SHUT_WR)
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        while c.sock.recv_into(sink):
                            pass
                        del todo[fd]  # the peer closed its end: it has read all we sent
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    todo.pop(fd, None)  # gone (the dead rank, or a peer that reset): nothing more to do

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
                    if not c.sendq and not c.dead:
                        try:
                            c.sock.send(bye)
                        except OSError:
                            pass
                self._close_sockets()
                self.broken = BackendClosedError(f"rank {self.rank}: the process group was shut down")
            for s in (self._wake_r, self._wake_w):
                s.close()
            self._cv.notify_all()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(1.0)


def _consume(bufs: list[memoryview], k: int) -> None:
    """Drop the first `k` bytes of the buffer list `bufs` (after a partial write)."""
    while k and bufs:
        if k >= len(bufs[0]):
            k -= len(bufs.pop(0))
        else:
            bufs[0] = bufs[0][k:]
            k = 0
