"""What the engine is built from: a `Request` (one posted send or receive), a `Link` per peer and a
`LinkKind` per kind of link (TCP streams, shared-memory rings, in-process delivery).

The engine (`engine.Transport`) owns everything the kinds have in common: matching, waiting, BROKEN and
telling peers why. A new kind of link (an RDMA queue pair) is a Link and a LinkKind, not a new engine.
"""
from __future__ import annotations

import abc
import logging
import select
import socket
import threading
from typing import Any, Iterable, Sequence

from ..errors import (CollectiveTimeout, IntegrityError, MismatchError, PeerAbortedError, PeerLostError, ProtocolError,
                      peer_lost)
from ..protocol.framing import AbortInfo, Frame, Space

Key = tuple[int, int, int]  # (space, tag, seq)
ANY_SOURCE = -1


class CountedCondition(threading.Condition):
    """A lock (reentrant unless one is given) and a condition that counts the threads asleep on it: an
    engine's non-driving threads (the driving thread signals after every completion) and a group's callers
    waiting for its worker to go idle. With nobody asleep, the common case of one thread per group, a
    Condition's notify_all still costs a small op several Python calls; `signal` costs one test."""

    def __init__(self, lock: "threading.Lock | threading.RLock | None" = None) -> None:
        self.mutex = lock if lock is not None else threading.RLock()
        super().__init__(self.mutex)
        self.sleepers = 0
        # `with cond.mutex:` takes the same lock as `with cond:` without a Condition's Python-level
        # __enter__ and __exit__ (two calls each time, and a small op takes the engine's lock five times).

    def sleep(self, timeout: float | None = None) -> None:
        """Wait (lock held) until signalled or `timeout` seconds pass (None: until signalled)."""
        self.sleepers += 1
        try:
            self.wait(timeout)
        finally:
            self.sleepers -= 1

    def signal(self) -> None:
        """Wake every sleeper (lock held); nothing to do when there is none."""
        if self.sleepers:
            self.notify_all()


class Request:
    """One posted send or receive. `source` is the peer a receive actually came from."""

    __slots__ = ("peer", "key", "sig", "buf", "nbytes", "received", "done", "error", "source", "is_send", "pending")

    def __init__(self, peer: int, key: Key, sig: int, buf: memoryview, is_send: bool) -> None:
        self.peer = peer
        self.key = key
        self.sig = sig
        self.buf = buf
        self.nbytes = buf.nbytes
        self.received = 0
        self.done = False
        self.error: BaseException | None = None
        self.source = peer
        self.is_send = is_send
        self.pending = 0  # parts still in flight (sends striped over streams)

    def describe(self) -> str:
        what = "send to" if self.is_send else "receive from"
        peer = "any rank" if self.peer == ANY_SOURCE else f"rank {self.peer}"
        space = "p2p tag" if self.key[0] == Space.P2P else "op"
        return f"{what} {peer} ({space} {self.key[1]}, message {self.key[2]}, {self.nbytes} bytes)"


class Link(abc.ABC):
    """The engine's view of one peer over one kind of link (gloo's "pair"): TCP streams to a rank on another
    host, a shared-memory ring pair to a rank on this one, or a rank of the same process. The engine calls
    every method with its lock held, from whichever thread drives progress; a link never takes that lock.

    A link moves the bytes of posted requests and hands arriving parts to the engine's Matcher
    (`engine.matcher.match` / `part_done`, then `engine.signal()` when that completed a request); it
    reports what goes wrong to the engine (`engine.fail(engine.lost(...))`, an ABORT's AbortInfo to
    `engine.peer_aborted`), which owns BROKEN and tells the other peers. What a link says to its peer about
    the connection (BYE, ABORT, probes) is a control message (protocol/control.py), on the kind's own wire.

    Five calls every kind writes (`post_send`, `pump`, `gone`, `abort`, `close`); the rest have defaults
    that suit a link which never holds data back and has nothing to poll."""

    peer: int
    address: str  # where the peer is, for error messages ("10.0.0.2:41234", "shm pid 4242")
    engine: "Any"  # the Transport this link belongs to (set by Transport.__init__)

    # -- moving data ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def post_send(self, req: Request) -> None:
        """Start sending `req` (its bytes in the order posted, after every earlier send to this peer);
        mark it `done` once all of it is on its way. Raise PeerLostError if the peer has left."""

    @abc.abstractmethod
    def pump(self) -> bool:
        """Write what the peer can take and read what it sent, without blocking; True if anything moved."""

    def fds(self) -> "Iterable[tuple[int, int]]":
        """(file descriptor, poll events) to sleep on now; none for a link woken by its peer directly."""
        return ()

    def on_event(self, fd: int) -> None:
        """`fd` of this link woke a sleeping poll (control bytes or completion events to read first)."""

    def posted_recv(self) -> None:
        """A receive was posted for this peer: read what was held back waiting for one (`parked`)."""

    # -- what the link knows about the peer -------------------------------------------------------------------
    @abc.abstractmethod
    def gone(self) -> bool:
        """The peer has left in order (BYE) or is known dead: no more data will come from it."""

    def parked(self) -> "Frame | None":
        """The header of a collective message of the peer held back (parked) until its receive is posted,
        if any (the oldest): data for an op this rank has finished is a mismatch."""
        return None

    def has_unread(self) -> bool:
        """Data from the peer waits in a buffer this rank reads directly (a ring); False where unknowable."""
        return False

    # -- the end ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def abort(self, err: BaseException, body: "AbortInfo | None") -> "Farewell | None":
        """The group broke with `err`: every send not fully written gets `err` and is dropped. With `body`
        (what an ABORT says), tell the peer why in a control ABORT, after the rest of any message part it is
        half-way through reading: what is left of that (the engine drives it at most ABORT_GRACE seconds,
        then closes the link), or None when it is done or there is no one to tell."""

    @abc.abstractmethod
    def close(self, bye: bool) -> None:
        """Release the link; with `bye` (the orderly end) first tell the peer no more data comes (best
        effort). Shared resources go with the LinkKind's `release`."""

    # -- latency: optional fast paths -------------------------------------------------------------------------
    def send_now(self, key: Key, sig: int, buf: memoryview) -> "Request | None":
        """Post a send of message `key` (`buf`: bytes); None when it went at once and needs no Request (a
        link that can write a small message in one call says so), else the posted Request."""
        req = Request(self.peer, key, sig, buf, is_send=True)
        self.post_send(req)
        return req

    def quick_receive(self, key: Key, sig: int, dest: memoryview) -> "QuickReceive | None":
        """A receive of the peer's whole collective message `key` (signature `sig`) straight into `dest`,
        read by the engine's own looks (`QuickReceive.step`), with no Request and no matching; None when
        the link cannot do that now (something else is in flight on it): the engine posts a receive."""
        return None


class Farewell(abc.ABC):
    """What is left of a link's last words once its group broke (`Link.abort`). The engine drives the
    farewells of every link at once, for at most ABORT_GRACE seconds, and only then closes the links: a
    peer must read why before it sees the connection go."""

    def fds(self) -> "Iterable[tuple[int, int]]":
        """(file descriptor, poll events) to wait on now; none: `step` is called again after a short sleep."""
        return ()

    @abc.abstractmethod
    def step(self, fd: int, events: int) -> bool:
        """Move on (`events` happened on `fd`; fd -1: some time passed); True once over (the peer has it, or
        is gone)."""


class SocketFarewell(Farewell):
    """Last words over sockets: write each socket's bytes (the rest of a frame in flight, then the ABORT),
    then FIN; over once each peer has closed its end too (it read everything), reading and dropping what
    the peers send meanwhile: closing a socket with unread bytes makes the kernel send a reset and throw
    away what is still queued, the ABORT included, and the peer would then report "lost the connection"
    to us instead of the reason."""

    def __init__(self, writes: "Iterable[tuple[socket.socket, Sequence[memoryview]]]") -> None:
        self.todo = {s.fileno(): (s, [b for b in bufs if len(b)]) for s, bufs in writes if s.fileno() >= 0}
        self.sink = bytearray(1 << 16)

    def fds(self) -> "list[tuple[int, int]]":
        return [(fd, select.POLLIN | (select.POLLOUT if bufs else 0)) for fd, (_, bufs) in self.todo.items()]

    def step(self, fd: int, events: int) -> bool:
        entry = self.todo.get(fd)
        if entry is None:
            return not self.todo
        sock, bufs = entry
        try:
            if bufs and events & select.POLLOUT:
                while bufs:  # as much as the socket takes now (BlockingIOError when full)
                    _consume(bufs, sock.send(bufs[0], socket.MSG_DONTWAIT))
                sock.shutdown(socket.SHUT_WR)
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                while sock.recv_into(self.sink):
                    pass
                del self.todo[fd]  # the peer closed its end: it has read all we sent
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.todo.pop(fd, None)  # gone (the dead rank, or a peer that reset): nothing more to do
        return not self.todo


def _consume(bufs: "list[memoryview]", k: int) -> None:
    """Drop the first `k` bytes of the buffer list `bufs` (after a partial write)."""
    while k and bufs:
        if k >= len(bufs[0]):
            k -= len(bufs.pop(0))
        else:
            bufs[0] = bufs[0][k:]
            k = 0


class QuickReceive(abc.ABC):
    """A message being read by `Transport.exchange` outside the engine's matching (see
    `Link.quick_receive`). Every method is called with the engine's lock held."""

    peer: int
    key: Key
    dest: memoryview
    done = False  # the whole message is in `dest`

    @abc.abstractmethod
    def step(self) -> bool:
        """Read what has arrived, without blocking: True once this receive is over, `done` (the message is
        in) or not (something else came first, or the link failed: `hand_back` and receive it the general
        way, or find the engine broken)."""

    @abc.abstractmethod
    def hand_back(self) -> None:
        """Give up: return what was read so far to the link, so that the general path reads the stream as
        if this receive had never looked at it."""


class LinkKind:
    """What the links of one kind share inside an engine (a kind-wide thread, a segment, counters) and the
    engine's hooks for it. The defaults do nothing: a kind overrides what it needs."""

    name = "?"
    log: "logging.Logger | None" = None  # where entering BROKEN is reported (the in-memory kind stays quiet)
    spin = 0.0  # seconds worth spinning before sleeping, for this kind's latency
    bytes_sent = 0  # payload bytes moved over this kind's links (each kind counts its own)
    bytes_received = 0
    links: "dict[int, Link]"
    engine: "Any"
    threads: "Sequence[threading.Thread]" = ()  # the kind's own threads: the engine joins them after release
    probes = False  # the kind sends and answers PINGs: the engine's MismatchDetector must see every post

    def attach(self, engine: "Any") -> None:
        """Called once by the engine that owns these links."""
        self.engine = engine
        for link in self.links.values():
            link.engine = engine

    def note_post(self, key: Key, sig: int) -> None:
        """A message `key` of the op with signature `sig` is being posted (under the lock): publish what op
        this rank is in, if the kind can (the engine calls only a kind that overrides this)."""

    def after_pump(self) -> None:
        """After a round of pumping or posting: e.g. ring the doorbells of peers that now have work."""

    def ready(self) -> bool | None:
        """A cheap look without the lock or a system call: could a pump move anything? None: this kind
        cannot tell without polling its file descriptors."""
        return None

    def before_sleep(self, quiet: bool) -> float | None:
        """About to sleep in poll() (`quiet`: the last sleep passed with nothing to do): ask peers to wake
        us (e.g. raise a 'sleeping' flag they check). Returns the longest single sleep this kind allows
        (it may miss a wake-up), or None."""
        return None

    def after_sleep(self) -> None:
        """Back from poll()."""

    def idle(self, slept: bool) -> None:
        """Nothing moved and a wait goes on (`slept`: a whole sleep passed with nothing to do either):
        probe peers that went quiet, look for a peer visibly stuck in another op."""

    def release(self) -> None:
        """The engine closed: release what the kind holds (memory maps, segments). Called under the lock."""


def close_socket(sock: socket.socket) -> None:
    """Shut down both directions (so a peer blocked in recv sees EOF at once), then close; errors ignored:
    the socket may already be dead."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def close_control(sock: socket.socket, bye: "bytes | None") -> None:
    """Close the control socket of a link whose data goes another way (shared-memory rings, RDMA queue
    pairs), with `bye` (the orderly end's message, if any) sent first: blocking for half a second at most,
    as the peer may be gone or not reading; an error here is the peer gone, nothing to report."""
    if bye is not None:
        try:
            sock.setblocking(True)
            sock.settimeout(0.5)
            sock.sendall(bye)
        except OSError:
            pass
    close_socket(sock)


def bytes_view(buf: memoryview | bytearray | bytes) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


_REMOTE_ERRORS = {"MismatchError": MismatchError, "CollectiveTimeout": CollectiveTimeout,
                  "ProtocolError": ProtocolError, "PeerLostError": PeerLostError, "IntegrityError": IntegrityError}


def remote_error(rank: int, peer: int, info: AbortInfo) -> BaseException:
    """The error to raise on `rank` for the ABORT `peer` sent: the same class for the errors every rank knows,
    naming the ranks the ABORT names (the rank lost, the ranks a timeout blames), else PeerAbortedError."""
    cls = _REMOTE_ERRORS.get(info.error, PeerAbortedError)
    reason = info.reason if cls is not PeerAbortedError or info.error == "PeerAbortedError" else (
        f"{info.error}: {info.reason}")
    message = f"rank {rank}: rank {peer} aborted the group: {reason or info.error}"
    if cls is PeerLostError:  # the rank that was actually lost, not the messenger
        return peer_lost(rank, info.peer if info.peer >= 0 else peer, message.partition(": ")[2])
    if cls is CollectiveTimeout:  # the ranks the peer blamed, not the peer
        return CollectiveTimeout(message, ranks=list(info.ranks) or [peer])
    err = cls(message)
    if isinstance(err, PeerAbortedError):  # the rank that failed first, when the news was forwarded
        err.peer = info.peer if info.peer >= 0 else peer
    return err
