"""What the engine is built from: a `Request` (one posted send or receive), a `Link` per peer and a
`LinkKind` per kind of link (TCP streams, shared-memory rings, in-process delivery).

The engine (`engine.Transport`) owns everything the kinds have in common: matching, waiting, BROKEN and
telling peers why. A new kind of link (an RDMA queue pair) is a Link and a LinkKind, not a new engine.
"""
from __future__ import annotations

import abc
import logging
import socket
import threading
from collections import deque
from typing import Any, Iterable, Sequence

from ..errors import (CollectiveTimeout, IntegrityError, MismatchError, PeerAbortedError, PeerLostError, ProtocolError,
                      peer_lost)
from ..protocol.framing import AbortInfo, Frame

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
        space = "p2p tag" if self.key[0] & 1 else "op"
        return f"{what} {peer} ({space} {self.key[1]}, message {self.key[2]}, {self.nbytes} bytes)"


# What `Link.take` says about the message it was asked for.
TAKEN = 1  # the whole message is in the destination
NOT_YET = 0  # nothing of it yet: look again
REFUSED = -1  # something else comes first, or the link cannot read it this way now: receive it the general way


class Sink(abc.ABC):
    """What a link reports to its engine, and the little it reads of it: a link never reaches further into
    the engine. Every call is made with the engine's lock held (a link is only ever called with it held).

    `delivered` and `completed` move data; `failed` and `said` are the two ways a link changes what the
    engine knows about a peer. The user's errors are built by the engine from what these calls say."""

    rank: int  # this rank (for the link's own messages)
    broken: "BaseException | None"  # set once the group failed: a link stops moving data then
    posts: int  # receives posted so far: a link holding back a frame looks again when this changes

    @abc.abstractmethod
    def delivered(self, peer: int, frame: Frame, early: int) -> "tuple[memoryview, object] | None":
        """A data frame's header arrived from `peer`: where its payload goes (a view, and the token that
        `completed` takes), or None to hold it back (its receive is not posted, and it is not read early).
        `early`: the largest collective message this link may read before its receive is posted (0: none,
        -1: any). Raises MismatchError or ProtocolError for data no receive may take."""

    @abc.abstractmethod
    def completed(self, peer: int, key: Key, target: object, nbytes: int) -> None:
        """`nbytes` payload bytes of message `key` landed in `target` (what `delivered` gave), or, with
        `target` a send's Request, that send is on its way whole."""

    @abc.abstractmethod
    def failed(self, peer: int, exc: BaseException, where: str = "", address: str = "") -> None:
        """The link cannot go on: an OSError (the connection, `where`: which one) becomes the PeerLostError
        naming `peer`; a ThunderboltError (a protocol violation, a mismatch) is the group's error as it is."""

    @abc.abstractmethod
    def said(self, peer: int, msg: "Any") -> None:
        """`peer` said control message `msg` (protocol/control.py: BYE once every data frame it sent is in,
        ABORT, PING, ANSWER, LEAVE, SHRINK). The engine acts on it, and answers through `Link.say`."""


class Link(abc.ABC):
    """The engine's view of one peer over one kind of link (gloo's "pair"): TCP streams to a rank on another
    host, a shared-memory ring pair to a rank on this one, or a rank of the same process. The engine calls
    every method with its lock held, from whichever thread drives progress; a link never takes that lock.

    A link moves the bytes of posted messages and reports what happens to its `sink` (the engine): arriving
    parts (`delivered`, `completed`), failures (`failed`) and what the peer said (`said`). What a link says
    to its peer about the connection (BYE, ABORT, probes, membership) is a control message
    (protocol/control.py) on the kind's own wire.

    Eight calls: five every kind writes (`send`, `pump`, `say`, `abort`, `close`) and three with defaults
    that suit a link which never holds data back, has nothing to poll and no shortcut for whole messages."""

    peer: int
    address: str  # where the peer is, for error messages ("10.0.0.2:41234", "shm pid 4242")
    sink: Sink  # the engine this link reports to (set by Transport.__init__ through LinkKind.attach)

    @abc.abstractmethod
    def send(self, key: Key, sig: int, buf: memoryview) -> "Request | None":
        """Send message `key` (`buf`: its bytes) after every earlier one to this peer: None when it went
        whole at once (no Request is made), else the Request, `done` once all of it is on its way (reported
        through `Sink.completed`). Raise PeerLostError if the peer has left."""

    @abc.abstractmethod
    def pump(self, woken: bool = False) -> bool:
        """Write what the peer can take and read what it sent, without blocking; True if anything moved.
        `woken`: one of `fds()` woke a sleeping poll (read the control wire or completion events too)."""

    def fds(self) -> "Iterable[tuple[int, int]]":
        """(file descriptor, poll events) to sleep on now; none for a link woken by its peer directly."""
        return ()

    def take(self, key: Key, sig: int, dest: memoryview) -> int:
        """Read the peer's whole collective message `key` (signature `sig`) straight into `dest`, without
        a Request or matching, if it is the next thing from the peer: TAKEN, NOT_YET (look again) or
        REFUSED (receive it the general way; whatever was read is the link's again). Called by the engine's
        spin for a small op's messages; a link may hold partial progress between calls and must give it
        back at its next `pump`. Default: REFUSED (the general path, always)."""
        return REFUSED

    def held(self) -> "Frame | None":
        """The header of the oldest collective frame the peer sent that this link holds back or has not
        read yet (parked until its receive is posted, or waiting in a ring), else None."""
        return None

    @abc.abstractmethod
    def say(self, msg: "Any") -> None:
        """Send control message `msg` to the peer (a PING, an ANSWER, LEAVE, SHRINK) after any frame in
        flight; a kind may add its own counters to an op announcement."""

    @abc.abstractmethod
    def abort(self, err: BaseException, body: "AbortInfo | None", group: int) -> None:
        """Group `group` broke with `err` (-1: every group, the link is done): its sends not yet on their way
        get `err` and are dropped, but for a message part the peer is half-way through reading (it would read
        what follows as the rest). With `body` (what an ABORT says), tell the peer why in a control ABORT,
        after that part. The link goes on for the other groups."""

    @abc.abstractmethod
    def close(self, bye: bool) -> None:
        """Release the link; with `bye` (the orderly end) first tell the peer no more data comes (best
        effort). Shared resources go with the LinkKind's `release`."""


class LinkKind:
    """What the links of one kind share inside an engine (a kind-wide thread, a segment, counters) and the
    engine's hooks for it. The defaults do nothing: a kind overrides what it needs. A kind (unlike its links)
    may use the engine's public calls: `pump_if_idle` from a thread of its own, `last_traffic`."""

    name = "?"
    log: "logging.Logger | None" = None  # where entering BROKEN is reported (the in-memory kind stays quiet)
    spin = 0.0  # seconds worth spinning before sleeping, for this kind's latency
    # After this many seconds without traffic the engine sends a PING to each peer of this kind it waits on
    # (protocol/control.py: the op it waits for); None: this kind's peers are never probed.
    probe_after: "float | None" = None
    bytes_sent = 0  # payload bytes moved over this kind's links (each kind counts its own)
    bytes_received = 0
    links: "dict[int, Link]"
    engine: "Any"
    threads: "Sequence[threading.Thread]" = ()  # the kind's own threads: the engine joins them after release
    window: "Any" = None  # memory this host's ranks read directly (window.WindowMemory), if the kind has some

    def attach(self, engine: "Any") -> None:
        """Called once by the engine that owns these links (their sink)."""
        self.engine = engine
        for link in self.links.values():
            link.sink = engine

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
        """Nothing moved and a wait goes on (`slept`: a whole sleep passed with nothing to do either): what
        the kind itself must look after then (frames a peer sent that never came, credits)."""

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


def write_some(sock: socket.socket, out: bytearray) -> None:
    """Write what the (non-blocking) control socket takes of `out` now, and drop that from it; on a dead socket
    drop all of it (the peer shows up as EOF on the next read)."""
    try:
        k = sock.send(out)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        out.clear()
        return
    del out[:k]


def drop_group(sendq: "deque[list]", err: BaseException, group: int) -> "deque[list]":
    """The queued sends (`[request, bytes handed out]`) of every group but `group` (-1: none); those of `group`
    get `err`. For links whose frames are each whole in themselves (rings, queue pairs): a message half sent
    may stop there, the peer drops its group's frames."""
    keep: deque[list] = deque()
    for item in sendq:
        if group < 0 or item[0].key[0] >> 1 == group:
            item[0].error = err
        else:
            keep.append(item)
    return keep


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
