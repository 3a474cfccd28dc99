"""How a TCP transport fails and ends: entering BROKEN (every pending and later request gets the error,
peers get an ABORT naming the root cause), a peer's ABORT, BYE or EOF, and the orderly shutdown (BYE on
every stream). Mixed into TcpTransport."""
from __future__ import annotations

import errno
import socket
import threading

from ..errors import BackendClosedError
from ..protocol.framing import Kind, Space, encode_abort, encode_frame_header
from .base import remote_error
from .tcp_conn import Stream


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
        if tell_peers:
            self._send_abort(err)
        self._enter_broken(err, [out.req for o in self._all for out in o.sendq if out.req is not None])
        for other in self._all:
            other.sendq.clear()
        self._close_sockets()
        self._cv.notify_all()

    def _send_abort(self, exc: BaseException) -> None:
        frame = encode_abort(exc)
        for c in self._all:
            if c.sendq or c.dead:  # mid-frame: an ABORT now would be garbage to the peer; closing says enough
                continue
            try:
                c.sock.send(frame)
            except OSError:
                pass

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

