"""A model of macOS's socket layer, run on Linux: sockets that behave as XNU's do where that matters to the
TCP links, so CI runs the macOS code paths and meets macOS's answers without a Mac.

`Xnu` is one emulated kernel; `Xnu().socket` is its socket class (a real Linux socket underneath, so data
really moves over loopback), `Xnu().module` a stand-in for Python's `socket` module as it is on macOS (its
option names and numbers, none of Linux's), and `Xnu().install(monkeypatch)` puts both and
`Platform.for_system("darwin")` under the TCP set-up (rendezvous/tcp.py). `XNU_MODEL=1` in a rank process's
environment does the same for a whole process (`install_from_env`, called by the conformance ranks).

What it does, each with the XNU source it follows (xnu-11417 unless said otherwise):

- TCP options are kept per socket and never reach the Linux kernel. An accepted socket takes from its
  listener TCP_NODELAY, TCP_NOPUSH, TCP_NOOPT, TCP_KEEPINTVL, TCP_KEEPCNT and TCP_NOTSENT_LOWAT, and starts
  with the defaults of the rest: TCP_KEEPALIVE (idle, 2 h), TCP_RXT_CONNDROPTIME (off) and PERSIST_TIMEOUT
  (off) are per connection (tcp_input.c:2883-2898, the listener's tcpcb copied into the new one). Linux
  copies TCP_USER_TIMEOUT and the keepalive times on accept, which hides a set-up that tunes the listener
  only. Socket-level options (SO_KEEPALIVE, the buffer sizes) are inherited on both (sonewconn).
  An option XNU does not have (TCP_USER_TIMEOUT, TCP_KEEPIDLE, TCP_CONGESTION, TCP_INFO) fails with
  ENOPROTOOPT (tcp_usrreq.c, tcp_ctloutput's default case).
- SO_SNDBUF/SO_RCVBUF above `sockbuf_max` (kern.ipc.maxsockbuf × 2048 / 2304, sb_max_adj) are clamped to it
  silently from macOS 14.4 on (uipc_socket2.c:803-815), refused with ENOBUFS before (xnu-10002
  uipc_socket2.c:817): `clamp`. getsockopt reports what was granted, not doubled as on Linux.
- After the kernel drops a connection (`drop`: a retransmission timeout, or a soft error such as
  EADDRNOTAVAIL or EHOSTUNREACH kept in t_softerror, tcp_timer.c tcp_drop(tp, t_softerror ?: ETIMEDOUT)),
  every send fails with EPIPE while the cause stays pending in so_error (sosendcheck, uipc_socket.c:2032-2047);
  getsockopt(SO_ERROR) returns it once and clears it, and so does the next receive (soreceive,
  uipc_socket.c:3535-3542), after which a receive returns 0 (end of stream). Linux's send returns the
  cause itself.
- A send may fail with ENOBUFS when the kernel is short of mbufs, and try again later succeeds
  (sosend, uipc_socket.c:2455-2458); one whose source address went away fails with EADDRNOTAVAIL
  (tcp_output.c:3389-3394): `fail_sends` queues either for the next sends.
- One send or receive of more than INT_MAX bytes fails with EINVAL (uipc_syscalls.c:2219; Linux moves
  part of it).
- `Xnu.cut` cuts the cable under connected sockets: from then on what they send goes nowhere (what was
  sent before still arrives), and the kernel drops each as XNU would: `drop_after` the first segment sent
  into the cut (TCP_RXT_CONNDROPTIME), or, with nothing sent, once keepalive gave up (idle time + count ×
  interval, tcp_timer.c TCPT_KEEP), met at the socket's next call (XNU's timers run by themselves; the
  links call often enough, their PING probes included, for the time to be right within a probe interval).
- `drop_after` is when TCP_RXT_CONNDROPTIME really drops a connection whose peer stopped answering: the
  timer starts at the first retransmission timeout, not at the first unanswered segment, and is looked at
  only when a backed-off retransmission timeout fires (tcp_timer.c, TCPT_REXMT), so a 3 s setting drops
  4.1 s after the first unanswered segment with the 100 ms base timeout of a quiet directly attached link,
  3.4-7.3 s for base timeouts of 0.1-0.5 s (modelled, `drop_after`; not measured on a Mac).
  `linux_drop_after` is Linux's TCP_USER_TIMEOUT for comparison: it clamps the retransmission timer to the
  timeout (tcp_clamp_rto_to_user_timeout), so the drop comes at the setting.

Not emulated: a connection dropped with data still in its receive buffer delivers that data before the
error on XNU (here the error comes first); a dropped socket does not wake poll (XNU reports it readable);
a send into a cut cable always takes everything (XNU's fills the send buffer, then blocks); zero-window
probing (XNU's persist timer has no timeout unless PERSIST_TIMEOUT is
set, so a cut while the peer's window is closed is found by the group timeout); 8 KB AF_UNIX buffers,
16 KiB pages, `/dev/fd`, the scheduler, Metal.
"""
from __future__ import annotations

import errno
import os
import socket as _socket
import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch_thunderbolt.platform import DARWIN_TCP_RXT_CONNDROPTIME, INT_MAX, Platform

DARWIN = Platform.for_system("darwin")

# XNU's netinet/tcp.h: the TCP options the model knows (any other fails with ENOPROTOOPT).
TCP_NODELAY = 0x01
TCP_MAXSEG = 0x02
TCP_NOPUSH = 0x04
TCP_NOOPT = 0x08
TCP_KEEPALIVE = 0x10  # idle seconds before the first keepalive probe (Linux: TCP_KEEPIDLE)
TCP_CONNECTIONTIMEOUT = 0x20
PERSIST_TIMEOUT = 0x40  # seconds of unanswered zero-window probes before a drop (0: never)
TCP_RXT_CONNDROPTIME = DARWIN_TCP_RXT_CONNDROPTIME  # 0x80: seconds of retransmissions before a drop
TCP_RXT_FINDROP = 0x100
TCP_KEEPINTVL = 0x101
TCP_KEEPCNT = 0x102
TCP_NOTSENT_LOWAT = 0x201

# An accepted socket starts with these defaults (tcp_timer.h: TCPTV_KEEP_IDLE 2 h, TCPTV_KEEPINTVL 75 s,
# TCPTV_KEEPCNT 8; the drop timers off) ...
TCP_DEFAULTS = {TCP_NODELAY: 0, TCP_MAXSEG: 1460, TCP_NOPUSH: 0, TCP_NOOPT: 0, TCP_KEEPALIVE: 7200,
                TCP_CONNECTIONTIMEOUT: 0, PERSIST_TIMEOUT: 0, TCP_RXT_CONNDROPTIME: 0, TCP_RXT_FINDROP: 0,
                TCP_KEEPINTVL: 75, TCP_KEEPCNT: 8, TCP_NOTSENT_LOWAT: 0}
# ... and takes these from its listener (tcp_input.c:2883-2898: t_flags & (TF_NOPUSH|TF_NOOPT|TF_NODELAY),
# TF_RXTFINDROP, t_keepinit, t_keepcnt, t_keepintvl, t_notsent_lowat; not t_keepidle, t_rxt_conndroptime,
# t_persist_timeout).
TCP_INHERITED = frozenset({TCP_NODELAY, TCP_NOPUSH, TCP_NOOPT, TCP_RXT_FINDROP, TCP_CONNECTIONTIMEOUT,
                           TCP_KEEPINTVL, TCP_KEEPCNT, TCP_NOTSENT_LOWAT})
SOCKBUF_DEFAULT = 128 << 10  # net.inet.tcp.sendspace / recvspace

# Names Python's socket module has on Linux that macOS lacks or numbers otherwise (socketmodule.c defines a
# name only where the system header does): code that looks them up with hasattr must find macOS's answer.
LINUX_NAMES = ("TCP_USER_TIMEOUT", "TCP_KEEPIDLE", "TCP_CONGESTION", "TCP_INFO", "TCP_QUICKACK", "TCP_CORK",
              "TCP_SYNCNT", "TCP_LINGER2", "TCP_DEFER_ACCEPT", "TCP_WINDOW_CLAMP", "SO_BINDTODEVICE",
              "SO_PRIORITY", "SO_MARK", "MSG_NOSIGNAL", "MSG_MORE", "MSG_CONFIRM", "SO_PASSCRED",
              "SO_PEERCRED", "TCP_NOTSENT_LOWAT", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_FASTOPEN")
DARWIN_NAMES = {"TCP_KEEPALIVE": TCP_KEEPALIVE, "TCP_KEEPINTVL": TCP_KEEPINTVL, "TCP_KEEPCNT": TCP_KEEPCNT,
                "TCP_NOTSENT_LOWAT": TCP_NOTSENT_LOWAT, "TCP_MAXSEG": TCP_MAXSEG, "TCP_NODELAY": TCP_NODELAY}

# tcp_timer.c / tcp_timer.h, for `drop_after`.
TCP_BACKOFF = (1, 2, 4, 8, 16, 32, 64, 64, 64, 64, 64, 64, 64)  # tcp_backoff[], one per retransmission
TCP_MAXRXTSHIFT = 12
REXMT_SLOP = 0.2  # TCPTV_REXMTSLOP, added to every retransmission timeout of an established connection
REXMT_MAX = 64.0  # TCPTV_REXMTMAX
REXMT_MIN_LOCAL = 0.1  # tcp_TCPTV_MIN: the smallest timeout towards a directly attached peer (TF_LOCAL)


def drop_after(conndroptime: float, rexmt: float = REXMT_MIN_LOCAL) -> float:
    """Seconds from the first unanswered segment to XNU's drop of the connection with TCP_RXT_CONNDROPTIME
    = `conndroptime` (0: only the retransmission limit, TCP_MAXRXTSHIFT), when its retransmission timeout
    is `rexmt` before backoff (TCP_REXMTVAL: at least 0.1 s to a peer on the same subnet, about srtt + 4
    rttvar above that). The n-th timeout is `rexmt` × tcp_backoff[n] plus the 200 ms slop, at most 64 s;
    the drop timer starts when the first one fires (t_rxtstart, at t_rxtshift 1) and is compared with the
    setting each time a later one fires, so the drop comes at the first firing at least `conndroptime` after
    the first (tcp_timer.c, case TCPT_REXMT)."""
    now = 0.0
    start = None
    for shift in range(TCP_MAXRXTSHIFT + 1):
        now += min(REXMT_MAX, rexmt * TCP_BACKOFF[shift] + REXMT_SLOP)  # this timeout fires
        if shift + 1 > TCP_MAXRXTSHIFT or (conndroptime > 0 and start is not None and now - start >= conndroptime):
            return now
        if start is None:
            start = now
    return now


def linux_drop_after(user_timeout: float) -> float:
    """Seconds from the first unanswered segment to Linux's drop with TCP_USER_TIMEOUT = `user_timeout`: the
    retransmission timer is clamped to what is left of the timeout, so the drop comes at the setting (give or
    take a jiffy)."""
    return user_timeout


@dataclass
class Xnu:
    """One emulated macOS kernel's socket layer (see the module): its limits, and every socket it made."""

    maxsockbuf: int = 8 << 20  # kern.ipc.maxsockbuf (8 MiB by default)
    clamp: bool = True  # macOS 14.4 and later clamp an over-large SO_SNDBUF/SO_RCVBUF; earlier: ENOBUFS
    sockets: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.socket = type("XnuSocket", (XnuSocket,), {"xnu": self})
        self.module = _module(self)

    @property
    def sockbuf_max(self) -> int:
        """sb_max_adj: the largest socket buffer granted (uipc_socket2.c: sb_max × MCLBYTES / (MSIZE + MCLBYTES))."""
        return self.maxsockbuf * 2048 // (256 + 2048)

    def wrap(self, sock: _socket.socket) -> "XnuSocket":
        """`sock` (a real socket, which this takes over) as one of this kernel's sockets."""
        timeout = sock.gettimeout()  # (kept by the Python object, not the descriptor)
        out = self.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())
        out.settimeout(timeout)
        return out

    def streams(self) -> "list[XnuSocket]":
        """The connected stream sockets made so far (accepted or connected), not closed."""
        out = []
        for s in self.sockets:
            if s.fileno() < 0:
                continue
            try:
                s.getpeername()
            except OSError:
                continue
            out.append(s)
        return out

    def cut(self, between: "tuple[str, str] | None" = None) -> int:
        """Cut the cable `between` (its two addresses, either order; None: every cable) under this kernel's
        connected sockets, now; how many sockets it cut."""
        now, n = time.monotonic(), 0
        for s in self.streams():
            if between is None or {s.getsockname()[0], s.getpeername()[0]} == set(between):
                s.cut_at = now
                n += 1
        return n

    def install(self, monkeypatch: Any) -> None:
        """Run the TCP set-up (rendezvous/tcp.py) on this kernel: its socket module and the darwin
        Platform, undone when the test ends (`monkeypatch`: pytest's fixture)."""
        from torch_thunderbolt.rendezvous import tcp as rendezvous_tcp

        monkeypatch.setattr(rendezvous_tcp, "socket", self.module)
        monkeypatch.setattr(rendezvous_tcp, "current", lambda: DARWIN)


class XnuSocket(_socket.socket):
    """A socket of an `Xnu` kernel (`Xnu().socket`): a real socket whose calls answer as XNU's do."""

    xnu: Xnu

    def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: "int | None" = None) -> None:
        super().__init__(family, type, proto, fileno)
        self.tcp: dict[int, int] = {}  # TCP options set on this socket (the rest: TCP_DEFAULTS)
        self.buffers: dict[int, int] = {}  # SO_SNDBUF / SO_RCVBUF as granted
        self.so_error = 0  # the error a drop left pending
        self.dropped = False  # the kernel dropped the connection: SS_CANTSENDMORE | SS_CANTRCVMORE
        self.send_faults: deque[int] = deque()  # errnos the next sends fail with
        self.largest = 0  # the most bytes one send or receive asked for
        self.cut_at: float | None = None  # when the cable under it was cut (`Xnu.cut`)
        self.unanswered: float | None = None  # when the first segment went into the cut
        self.xnu.sockets.append(self)

    # -- options --------------------------------------------------------------------------------------------
    def setsockopt(self, level: int, option: int, value: Any, *rest: Any) -> None:  # type: ignore[override]
        if level == _socket.SOL_SOCKET and option in (_socket.SO_SNDBUF, _socket.SO_RCVBUF):
            if value > self.xnu.sockbuf_max:
                if not self.xnu.clamp:
                    raise OSError(errno.ENOBUFS, "No buffer space available")
                value = self.xnu.sockbuf_max
            self.buffers[option] = value
            super().setsockopt(level, option, value)
            return
        if level == _socket.IPPROTO_TCP:
            if option not in TCP_DEFAULTS:
                raise OSError(errno.ENOPROTOOPT, "Protocol not available")
            value = int.from_bytes(value[:4], "little") if isinstance(value, (bytes, bytearray)) else int(value)
            if value < 0:
                raise OSError(errno.EINVAL, "Invalid argument")
            self.tcp[option] = value
            if option == TCP_NODELAY:
                super().setsockopt(level, _socket.TCP_NODELAY, value)
            return
        super().setsockopt(level, option, value, *rest)

    def getsockopt(self, level: int, option: int, *rest: Any) -> Any:  # type: ignore[override]
        if level == _socket.SOL_SOCKET and option == _socket.SO_ERROR:
            self._clock()
        if level == _socket.SOL_SOCKET and option == _socket.SO_ERROR and self.so_error:
            err, self.so_error = self.so_error, 0
            return err
        if level == _socket.SOL_SOCKET and option in (_socket.SO_SNDBUF, _socket.SO_RCVBUF) and not rest:
            return self.buffers.get(option, SOCKBUF_DEFAULT)
        if level == _socket.IPPROTO_TCP:
            if option not in TCP_DEFAULTS or rest:
                raise OSError(errno.ENOPROTOOPT, "Protocol not available")
            return self.option(option)
        return super().getsockopt(level, option, *rest)

    def option(self, option: int) -> int:
        """The TCP option `option` as this socket has it (set, inherited, or the default)."""
        return self.tcp.get(option, TCP_DEFAULTS[option])

    def accept(self) -> "tuple[XnuSocket, Any]":
        fd, addr = self._accept()  # type: ignore[attr-defined]
        sock = self.xnu.socket(self.family, self.type, self.proto, fileno=fd)
        sock.tcp = {k: v for k, v in self.tcp.items() if k in TCP_INHERITED}
        sock.buffers = dict(self.buffers)
        if _socket.getdefaulttimeout() is None and self.gettimeout():
            sock.setblocking(True)
        return sock, addr

    # -- faults ---------------------------------------------------------------------------------------------
    def drop(self, err: int = errno.ETIMEDOUT) -> None:
        """The kernel drops this connection with `err` (tcp_drop): what a retransmission timeout does."""
        self.dropped, self.so_error = True, err

    def _clock(self) -> None:
        """The kernel's timers, looked at now: drop a cut connection whose time has come."""
        if self.cut_at is None or self.dropped:
            return
        now = time.monotonic()
        if self.unanswered is not None:
            if now - self.unanswered >= drop_after(self.option(TCP_RXT_CONNDROPTIME)):
                self.drop(errno.ETIMEDOUT)
        elif super().getsockopt(_socket.SOL_SOCKET, _socket.SO_KEEPALIVE):
            if now - self.cut_at >= self.option(TCP_KEEPALIVE) + self.option(TCP_KEEPCNT) * self.option(TCP_KEEPINTVL):
                self.drop(errno.ETIMEDOUT)

    def fail_sends(self, *errs: int) -> None:
        """The next sends fail with these errnos, one each (ENOBUFS, EADDRNOTAVAIL ...)."""
        self.send_faults.extend(errs)

    def _sending(self, n: int) -> bool:
        """Whether a send of `n` bytes may go to the real socket (False: into a cut cable)."""
        self.largest = max(self.largest, n)
        if n > INT_MAX:
            raise OSError(errno.EINVAL, "Invalid argument (XNU: more than INT_MAX bytes in one call)")
        self._clock()
        if self.dropped:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        if self.send_faults:
            err = self.send_faults.popleft()
            raise OSError(err, os.strerror(err))
        if self.cut_at is not None:
            if self.unanswered is None:
                self.unanswered = time.monotonic()
            return False
        return True

    def _receiving(self, n: int) -> bool:
        """Whether a receive of `n` bytes may go to the real socket (False: end of stream)."""
        self.largest = max(self.largest, n)
        if n > INT_MAX:
            raise OSError(errno.EINVAL, "Invalid argument (XNU: more than INT_MAX bytes in one call)")
        self._clock()
        if self.so_error:
            err, self.so_error = self.so_error, 0
            raise OSError(err, os.strerror(err))
        return not self.dropped

    # -- data -----------------------------------------------------------------------------------------------
    def send(self, data: Any, *args: Any) -> int:  # type: ignore[override]
        n = memoryview(data).nbytes
        return super().send(data, *args) if self._sending(n) else n

    def sendall(self, data: Any, *args: Any) -> None:  # type: ignore[override]
        if self._sending(memoryview(data).nbytes):
            super().sendall(data, *args)

    def sendmsg(self, buffers: Iterable[Any], *args: Any) -> int:  # type: ignore[override]
        buffers = list(buffers)
        n = sum(memoryview(b).nbytes for b in buffers)
        return super().sendmsg(buffers, *args) if self._sending(n) else n

    def recv(self, n: int, *args: Any) -> bytes:  # type: ignore[override]
        return super().recv(n, *args) if self._receiving(n) else b""

    def recv_into(self, buf: Any, nbytes: int = 0, *args: Any) -> int:  # type: ignore[override]
        return super().recv_into(buf, nbytes, *args) if self._receiving(nbytes or memoryview(buf).nbytes) else 0

    def recvmsg_into(self, buffers: Iterable[Any], *args: Any) -> Any:  # type: ignore[override]
        buffers = list(buffers)
        if self._receiving(sum(memoryview(b).nbytes for b in buffers)):
            return super().recvmsg_into(buffers, *args)
        return 0, [], 0, None


def _module(xnu: Xnu) -> types.ModuleType:
    """Python's socket module as it is on macOS, over `xnu`'s sockets: macOS's TCP option names and numbers,
    none of Linux's, and `socket`/`create_connection`/`create_server` making `xnu`'s sockets."""
    mod = types.ModuleType("socket", "the socket module of an emulated macOS (torch_thunderbolt.testing.darwin)")
    mod.__dict__.update({k: v for k, v in vars(_socket).items() if k not in LINUX_NAMES and not k.startswith("__")})
    mod.__dict__.update(DARWIN_NAMES)
    mod.socket = xnu.socket  # type: ignore[attr-defined]

    def create_connection(address: Any, timeout: Any = _socket._GLOBAL_DEFAULT_TIMEOUT,  # type: ignore[attr-defined]
                          source_address: Any = None, **kwargs: Any) -> XnuSocket:
        return xnu.wrap(_socket.create_connection(address, timeout, source_address, **kwargs))

    def create_server(address: Any, **kwargs: Any) -> XnuSocket:
        return xnu.wrap(_socket.create_server(address, **kwargs))

    mod.create_connection = create_connection  # type: ignore[attr-defined]
    mod.create_server = create_server  # type: ignore[attr-defined]
    return mod


def sockets_off_the_model(t: Any) -> "list[str]":
    """The TCP streams of transport `t` whose socket is not one of a model's (each "stream S to rank P")."""
    return [f"stream {c.stream} to rank {c.peer}" for kind in t.kinds if kind.name == "tcp"
            for link in kind.links.values() for c in link.streams if not isinstance(c.sock, XnuSocket)]


ENV = "XNU_MODEL"  # "1" in a rank process's environment: its TCP set-up runs on the model


def install_from_env(environ: "dict[str, str] | None" = None) -> "Xnu | None":
    """In a rank process started with XNU_MODEL=1: put the model under its TCP set-up for the process's
    life (a rank process is the model's only user then). The kernel, or None without the variable."""
    env = os.environ if environ is None else environ
    if env.get(ENV) != "1":
        return None
    from torch_thunderbolt.rendezvous import tcp as rendezvous_tcp

    xnu = Xnu()
    rendezvous_tcp.socket = xnu.module  # type: ignore[attr-defined]
    rendezvous_tcp.current = lambda: DARWIN  # type: ignore[attr-defined]
    return xnu
