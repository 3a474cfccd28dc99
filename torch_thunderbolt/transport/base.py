"""The transport interface every algorithm is written against.

A transport moves byte buffers between the ranks of one group: `isend`/`irecv` post a message and return a
`Request`; `wait` drives progress until the requests finish (or raises). Messages are matched by key
`(space, tag, seq)`; see `protocol.framing.Space`. Once a transport fails it is BROKEN for good: every
pending and later request gets the same error at once.
"""
from __future__ import annotations

import abc
import logging
import re
import socket
import threading
import time
from collections import defaultdict
from typing import Callable, Iterable, Sequence

from ..errors import (BackendClosedError, CollectiveTimeout, MismatchError, PeerAbortedError, PeerLostError,
                      ProtocolError)
from ..protocol.framing import Space
from .names import RankNames
from .window import Window

Key = tuple[int, int, int]  # (space, tag, seq)
ANY_SOURCE = -1


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


class Transport(abc.ABC):
    """Base class: request bookkeeping, p2p sequence numbers, the BROKEN state and `wait`."""

    _log: "logging.Logger | None" = None  # where entering BROKEN is reported (the in-memory one stays quiet)
    names: RankNames | None = None  # a subgroup's global ranks, for its error messages (set by the backend)

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.broken: BaseException | None = None
        self.closed = False
        self._p2p_send_seq: dict[tuple[int, int], int] = defaultdict(int)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._cv = threading.Condition(threading.RLock())
        # Memory every rank can read directly, for the collectives designed for it (ranks on one host).
        self.window: Window | None = None

    # -- to implement ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _post_send(self, req: Request) -> None: ...

    @abc.abstractmethod
    def _post_recv(self, req: Request) -> None: ...

    @abc.abstractmethod
    def _progress(self, timeout: float) -> None:
        """Make progress on posted requests, blocking at most `timeout` seconds."""

    @abc.abstractmethod
    def _shutdown(self) -> None: ...

    def peer_address(self, peer: int) -> str:
        return f"rank {peer}"

    def _waits_on(self, peer: int, tags: "set[int]") -> int | None:
        """The rank `peer` told us it waits on in one of the ops `tags`, if it did (TCP: PING answers)."""
        return None

    # -- public API ----------------------------------------------------------------------------------
    def isend(self, peer: int, key: Key, buf: memoryview, sig: int = 0) -> Request:
        self._check_usable()
        self._check_peer(peer)
        req = Request(peer, key, sig, _bytes_view(buf), is_send=True)
        self._post_send(req)
        return req

    def irecv(self, peer: int, key: Key, buf: memoryview, sig: int = 0) -> Request:
        self._check_usable()
        if peer != ANY_SOURCE:
            self._check_peer(peer)
        req = Request(peer, key, sig, _bytes_view(buf), is_send=False)
        self._post_recv(req)
        return req

    def isend_p2p(self, peer: int, tag: int, buf: memoryview) -> Request:
        with self._cv:
            seq = self._p2p_send_seq[(peer, tag)]
            self._p2p_send_seq[(peer, tag)] = seq + 1
        return self.isend(peer, (Space.P2P, tag, seq), buf)

    def irecv_p2p(self, peer: int, tag: int, buf: memoryview) -> Request:
        """Receive the next message with `tag` from `peer` (or from any peer with ANY_SOURCE)."""
        # The sequence number is assigned at match time (see matching.Matcher), so -1 here.
        return self.irecv(peer, (Space.P2P, tag, -1), buf)

    def wait(self, reqs: Sequence[Request], deadline: float | None = None, what: str = "") -> None:
        """Block until every request is done; raise its error, or CollectiveTimeout at `deadline`."""
        self._wait_until(reqs, all, deadline, what)

    def wait_any(self, reqs: Sequence[Request], deadline: float | None = None, what: str = "",
                 arrived: Iterable[int] = ()) -> None:
        """Block until at least one request is done (raising the first error found). `arrived`: peers
        already heard from in this op (named as "did not arrive" only if they are not)."""
        self._wait_until(reqs, any, deadline, what, arrived)

    def _wait_until(self, reqs: Sequence[Request], how: "Callable[[Iterable[bool]], bool]",
                    deadline: float | None, what: str, arrived: Iterable[int] = ()) -> None:
        while True:
            for r in reqs:
                if r.error is not None:
                    raise r.error
            if how(r.done for r in reqs):
                return
            if self.broken is not None:
                raise self.broken
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(reqs, what, arrived)
            self._progress(0.2 if deadline is None else min(0.2, deadline - now))

    def test(self, reqs: Iterable[Request]) -> bool:
        reqs = list(reqs)
        if not all(r.done for r in reqs) and self.broken is None:
            self._progress(0.0)
        for r in reqs:
            if r.error is not None:
                raise r.error
        return all(r.done for r in reqs)

    def abort(self, error: BaseException) -> None:
        """Enter the BROKEN state with `error` (and tell peers, where the transport can)."""
        with self._cv:
            if self.broken is None:
                self.broken = error
            self._cv.notify_all()

    def retire(self, tag: int) -> None:
        """Collective op `tag` finished on this rank: data for it (or older ops) that still arrives is an error."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._shutdown()

    # -- helpers for subclasses -------------------------------------------------------------------
    def _lost(self, peer: int, where: str, exc: BaseException, address: str = "") -> PeerLostError:
        """What a broken connection to `peer` becomes, with the OS error as its cause: the one place the
        engines turn a socket error into the error the user sees."""
        err = PeerLostError(f"rank {self.rank}: lost the connection to rank {peer} {where}: {exc}",
                            rank=self.rank, peer=peer, address=address)
        err.__cause__ = exc
        return err

    def _enter_broken(self, err: BaseException, queued: Iterable[Request]) -> None:
        """BROKEN for good: every posted receive and every queued send gets `err` at once; later operations
        get it from `_check_usable`. (Caller holds the lock, closes its sockets and notifies.)"""
        if self.names is not None:
            self.names.apply(err)
        if self._log is not None:
            self._log.error("%s", err)
        self.broken = err
        for r in self.matcher.pending():
            r.error = err
        for r in queued:
            r.error = err

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise BackendClosedError(f"rank {self.rank}: the transport is closed")

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"rank {self.rank}: invalid peer rank {peer} (group size {self.world})")

    def _timeout_error(self, reqs: Sequence[Request], what: str, arrived: Iterable[int] = ()) -> CollectiveTimeout:
        waiting = [r for r in reqs if not r.done]
        # A rank that sent us anything for this op has arrived; it may only be waiting on someone else.
        heard = set(arrived) | {r.peer for r in reqs if not r.is_send and (r.done or r.received)}
        awaited = {r.peer for r in waiting if not r.is_send}
        missing = sorted(awaited - heard)
        detail = "; ".join(r.describe() for r in waiting[:4])
        named = missing or sorted(awaited)
        # A rank we wait on may only be waiting on another one itself (it said so, answering our probe):
        # blame that one, not the rank stuck behind it.
        tags = {r.key[1] for r in waiting if r.key[0] == Space.COLL}
        via = {p: b for p in named if (b := self._waits_on(p, tags)) is not None and b not in (p, self.rank)}
        culprits = sorted({via.get(p, p) for p in named})
        if via:
            behind = "; ".join(f"rank {p} is itself waiting on rank {b}" for p, b in sorted(via.items()))
            who = f" ranks that stopped sending: {culprits} ({behind});"
        elif missing:
            who = f" ranks that did not arrive: {missing};"
        else:  # everyone arrived; some stopped part-way (frozen, or waiting on someone themselves)
            who = f" ranks that arrived but stopped sending: {sorted(awaited)};" if awaited else ""
        err = CollectiveTimeout(
            f"rank {self.rank}: Timed out waiting in {what or 'an operation'};{who} pending: {detail}",
            ranks=culprits)
        return err if self.names is None else self.names.apply(err)


def _bytes_view(buf: memoryview | bytearray | bytes) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class DrivenTransport(Transport):
    """A transport whose progress engine is driven by whichever thread waits: one thread at a time runs
    `_drive`, the others sleep on the condition until it reports completions (or 50 ms pass)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._progress_lock = threading.Lock()
        # A doorbell for the driving thread while it sleeps in poll(): other threads ring it when they
        # post work it must pick up. `_polling` says whether anyone is asleep there.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._polling = False

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    @abc.abstractmethod
    def _drive(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """Move data, blocking at most `timeout` seconds; called by one thread at a time. `until`: one more
        condition worth returning early for (a shared window's counters); transports without a window
        ignore it."""

    def _progress(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        if not self._progress_lock.acquire(blocking=False):
            with self._cv:  # another thread drives the engine; it notifies on completions
                if timeout > 0:
                    self._cv.wait(min(timeout, 0.05 if until is None else 0.001))
            return
        try:
            self._drive(timeout, until)
        finally:
            self._progress_lock.release()
            with self._cv:
                self._cv.notify_all()


_REMOTE_ERRORS = {"MismatchError": MismatchError, "CollectiveTimeout": CollectiveTimeout,
                  "ProtocolError": ProtocolError, "PeerLostError": PeerLostError}


def remote_error(rank: int, peer: int, text: str) -> BaseException:
    """The error to raise on `rank` for an ABORT "ErrorClass: reason" that `peer` sent (every transport)."""
    name, _, reason = text.partition(": ")
    cls = _REMOTE_ERRORS.get(name, PeerAbortedError)
    message = f"rank {rank}: rank {peer} aborted the group: {reason or name}"
    if cls is PeerLostError:  # name the rank that was actually lost, not the messenger
        lost = re.search(r"connection to rank (\d+)", reason)
        return PeerLostError(message, rank=rank, peer=int(lost.group(1)) if lost else peer)
    if cls is CollectiveTimeout:  # the ranks the peer blamed, not the peer
        blamed = re.search(r"(?:did not arrive|stopped sending): \[([\d, ]*)\]", reason)
        return CollectiveTimeout(message, ranks=[int(x) for x in blamed.group(1).split(",") if x.strip()]
                                 if blamed else [peer])
    err = cls(message)
    if isinstance(err, PeerAbortedError):
        err.peer = peer
    return err
