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
from typing import Any, Iterable

from ..errors import CollectiveTimeout, IntegrityError, MismatchError, PeerAbortedError, PeerLostError, ProtocolError
from ..protocol.framing import AbortInfo, Space

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
    every method with its lock held, from whichever thread drives progress.

    A link moves the bytes of posted requests and delivers arriving parts through the engine's Matcher; it
    reports what goes wrong to the engine (`engine.fail`), which owns BROKEN and tells the other peers."""

    peer: int
    engine: "Any"  # the Transport this link belongs to (set by Transport.__init__)

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where the peer is, for error messages ("10.0.0.2:41234", "shm pid 4242")."""

    def fds(self) -> "Iterable[tuple[int, int]]":
        """(file descriptor, poll events) to sleep on now; none for a link woken by its peer directly."""
        return ()

    @abc.abstractmethod
    def post_send(self, req: Request) -> None:
        """Queue a send and start writing it; raise PeerLostError if the peer has left."""

    def send_now(self, key: Key, sig: int, buf: memoryview) -> "Request | None":
        """Post a send of message `key` (`buf`: bytes); None when it went at once and needs no Request (a
        link that can write a small message in one call says so), else the posted Request."""
        req = Request(self.peer, key, sig, buf, is_send=True)
        self.post_send(req)
        return req

    def posted_recv(self) -> None:
        """A receive was posted for this peer: read what was held back waiting for one (parked data)."""

    def quick_receive(self, key: Key, sig: int, dest: memoryview) -> "QuickReceive | None":
        """A receive of the peer's whole collective message `key` (signature `sig`) straight into `dest`,
        read by the engine's own looks (`QuickReceive.step`), with no Request and no matching; None when
        the link cannot do that now (something else is in flight on it): the engine posts a receive."""
        return None

    @abc.abstractmethod
    def pump(self) -> bool:
        """Write what the peer can take and read what it sent, without blocking; True if anything moved."""

    def on_event(self, fd: int) -> None:
        """`fd` of this link woke a sleeping poll (control bytes to read before pumping)."""

    @abc.abstractmethod
    def gone(self) -> bool:
        """The peer has left in order (BYE) or is known dead: no more data will come from it."""

    def retire(self, tag: int) -> None:
        """Collective op `tag` finished on this rank: data still held for it (or older ops) is an error."""

    def parked_sig(self) -> int | None:
        """The op signature of collective data from the peer held back for a receive not posted yet."""
        return None

    def has_unread(self) -> bool:
        """Data from the peer waits in a buffer this rank reads directly (a ring); False where unknowable."""
        return False

    @abc.abstractmethod
    def queued(self) -> "list[Request]":
        """Sends not fully written, in order (they get the error when the engine breaks)."""

    def abort_writes(self, body: bytes) -> "list[tuple[socket.socket, list[memoryview]]]":
        """What to write on which socket to tell the peer why the group failed (`body`: "Class: reason"),
        after the rest of any frame in flight; drops the send queue. Empty when the link has no wire."""
        return []

    def say_bye(self) -> None:
        """The orderly end: tell the peer no more data comes (best effort)."""

    def close(self) -> None:
        """Close this link's sockets (the engine releases shared resources through the LinkKind)."""


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

    def attach(self, engine: "Any") -> None:
        """Called once by the engine that owns these links."""
        self.engine = engine
        for link in self.links.values():
            link.engine = engine

    def note_post(self, key: Key, sig: int) -> None:
        """A message `key` of the op with signature `sig` is being posted (under the lock): publish what op
        this rank is in, if the kind can."""

    def after_pump(self) -> None:
        """After a round of pumping or posting: e.g. ring the doorbells of peers that now have work."""

    def ready(self) -> bool | None:
        """A cheap look without the lock or a system call: could a pump move anything? None: this kind
        cannot tell without polling its file descriptors."""
        return None

    def sleep_cap(self, quiet: bool) -> float | None:
        """Longest single sleep this kind allows (it may miss a wake-up), or None."""
        return None

    def before_sleep(self) -> None:
        """About to sleep in poll(): ask peers to wake us (e.g. raise a 'sleeping' flag they check)."""

    def after_sleep(self) -> None:
        """Back from poll()."""

    def idle(self) -> None:
        """Nothing moved and a wait goes on (before the engine sleeps): probe peers that went quiet."""

    def quiet(self) -> None:
        """A whole sleep passed with nothing to do: look for a peer visibly stuck in another op."""

    def waits_on(self, peer: int, tags: "set[int]") -> int | None:
        """The rank `peer` said it waits on in one of the ops `tags`, if it said so."""
        return None

    def release(self) -> None:
        """The engine closed: release what the kind holds (memory maps, segments). Called under the lock."""

    def join(self) -> None:
        """After release, without the lock: wait for the kind's own threads."""


def close_socket(sock: socket.socket) -> None:
    """Shut down both directions (so a peer blocked in recv sees EOF at once), then close; errors ignored:
    the socket may already be dead."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


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
        return PeerLostError(message, rank=rank, peer=info.peer if info.peer >= 0 else peer)
    if cls is CollectiveTimeout:  # the ranks the peer blamed, not the peer
        return CollectiveTimeout(message, ranks=list(info.ranks) or [peer])
    err = cls(message)
    if isinstance(err, PeerAbortedError):  # the rank that failed first, when the news was forwarded
        err.peer = info.peer if info.peer >= 0 else peer
    return err
