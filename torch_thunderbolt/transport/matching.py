"""Matching of incoming message parts to posted receives. No I/O: shared by every transport.

Keys are (space, tag, seq). Collective messages are matched exactly. Point-to-point messages carry the
sender's per-(peer, tag) counter as `seq`, so each pair's messages with one tag are received in order; a
receive from any source takes the next in-order message of that tag from whichever peer has one first.
Messages that arrive before their receive is posted are buffered ("unexpected"), except that a transport
may park collective messages instead (flow control keeps them in the kernel, no copy).
"""
from __future__ import annotations

from collections import defaultdict

from ..errors import MismatchError, ProtocolError
from ..protocol.framing import Frame
from ..protocol.signature import describe_message, sig_compatible
from .base import ANY_SOURCE, Key, Request


class Unexpected:
    __slots__ = ("buf", "total", "received", "sig", "claimed_by", "order")

    def __init__(self, total: int, sig: int, order: int) -> None:
        self.buf = bytearray(total)
        self.total = total
        self.received = 0
        self.sig = sig
        self.claimed_by: Request | None = None
        self.order = order


Target = "Request | Unexpected"
EARLY_BUDGET = 4  # collective messages a peer's link reads ahead of their receives, at most (see Matcher._park)


class Matcher:
    def __init__(self, rank: int, max_unexpected: int = 1 << 30) -> None:
        self.rank = rank
        self.posted: dict[tuple[int, Key], Request] = {}
        self.any_source: list[Request] = []
        self.recv_seq: dict[tuple[int, int], int] = defaultdict(int)
        self.unexpected: dict[tuple[int, Key], Unexpected] = {}
        self._arrivals = 0
        self.max_unexpected = max_unexpected

    # -- receives being posted -----------------------------------------------------------------------
    def post(self, req: Request) -> list[Request]:
        """Register a receive; returns the requests that completed right away."""
        space, tag, _ = req.key
        if space & 1 and req.peer != ANY_SOURCE:
            req.key = (space, tag, self._take_seq(req.peer, tag))
        if space & 1 and req.peer == ANY_SOURCE:
            found = self._oldest_unexpected_p2p(tag)
            if found is None:
                self.any_source.append(req)
                return []
            peer, key = found
            req.key, req.source = key, peer
            self._take_seq(peer, tag)
            return self._claim(peer, key, req)
        if (req.peer, req.key) in self.unexpected:
            return self._claim(req.peer, req.key, req)
        self.posted[(req.peer, req.key)] = req
        return []

    def _take_seq(self, peer: int, tag: int) -> int:
        seq = self.recv_seq[(peer, tag)]
        self.recv_seq[(peer, tag)] = seq + 1
        return seq

    def _oldest_unexpected_p2p(self, tag: int) -> tuple[int, Key] | None:
        best = None
        for (peer, key), u in self.unexpected.items():
            if key[0] & 1 and key[1] == tag and u.claimed_by is None:
                if key[2] == self.recv_seq[(peer, tag)] and (best is None or u.order < best[0]):
                    best = (u.order, peer, key)
        return None if best is None else (best[1], best[2])

    def _claim(self, peer: int, key: Key, req: Request) -> list[Request]:
        u = self.unexpected[(peer, key)]
        self._check(req, peer, u.total, u.sig)
        u.claimed_by = req
        return self._finish_unexpected(peer, key, u) if u.received == u.total else []

    def _finish_unexpected(self, peer: int, key: Key, u: Unexpected) -> list[Request]:
        req = u.claimed_by
        if req is None:
            return []
        del self.unexpected[(peer, key)]
        req.buf[: u.total] = u.buf
        req.received = u.total
        req.source = peer
        req.done = True
        return [req]

    # -- frames arriving -------------------------------------------------------------------------------
    def match(self, peer: int, frame: Frame, early: int = -1) -> tuple[memoryview, object] | None:
        """Where to put this frame's payload: (destination view, target), or None to hold it back (park it).
        `early`: for a collective frame that no posted receive takes and no earlier part began, the largest
        message the link may read ahead of its receive (-1: any, always read; 0: none, always park); a
        link reading early keeps at most EARLY_BUDGET such messages' worth per peer."""
        key = frame.key
        req = self.posted.get((peer, key))
        if req is None and frame.space & 1:
            req = self._bind_any_source(peer, key)
        if req is not None:
            self._check(req, peer, frame.total, frame.sig)
            return req.buf[frame.offset : frame.offset + frame.length], req
        u = self.unexpected.get((peer, key))
        if u is None:
            if early >= 0 and not frame.space & 1 and self._park(peer, frame, early):
                return None
            buffered = sum(x.total for x in self.unexpected.values())
            if buffered + frame.total > self.max_unexpected:  # a budget for all of them, not per message
                raise ProtocolError(f"rank {peer} sent an unsolicited {frame.total}-byte message; with "
                                    f"{buffered} bytes already buffered that exceeds {self.max_unexpected}")
            self._arrivals += 1
            u = self.unexpected[(peer, key)] = Unexpected(frame.total, frame.sig, self._arrivals)
        elif u.total != frame.total:
            raise ProtocolError(f"rank {peer}: parts of one message disagree on its size")
        return memoryview(u.buf)[frame.offset : frame.offset + frame.length], u

    def _park(self, peer: int, frame: Frame, early: int) -> bool:
        """Whether a collective frame whose receive is not posted is held back rather than read and kept:
        held unless it is small (`early`) and what this peer's data kept that way stays within the budget.
        A peer one op ahead sends its next small message at once; held, it would stop the link, and the
        peer's probes and ABORT behind it (a frozen rank's survivors then blamed each other). Large frames
        are held: flow control keeps them without a copy, and the budget stops a root that runs ahead
        through many small broadcasts the same way."""
        if frame.total > early:
            return True
        kept = sum(u.total for (p, key), u in self.unexpected.items() if p == peer and not key[0] & 1)
        return kept + frame.total > EARLY_BUDGET * early

    def _bind_any_source(self, peer: int, key: Key) -> Request | None:
        _, tag, seq = key
        if seq != self.recv_seq[(peer, tag)]:
            return None
        for i, req in enumerate(self.any_source):
            if req.key[1] == tag:
                del self.any_source[i]
                self._take_seq(peer, tag)
                req.key, req.source = key, peer
                self.posted[(peer, key)] = req
                return req
        return None

    def part_done(self, peer: int, key: Key, target: object, length: int) -> list[Request]:
        """Record `length` payload bytes written to `target`; returns requests that completed."""
        target.received += length
        if isinstance(target, Request):
            if target.received >= target.nbytes:
                self.posted.pop((peer, key), None)
                target.source = peer
                target.done = True
                return [target]
            return []
        if target.received >= target.total:
            return self._finish_unexpected(peer, key, target)
        return []

    def _check(self, req: Request, peer: int, total: int, sig: int) -> None:
        """Before any byte of the message lands in the receive's buffer: the same size and signature."""
        if total != req.nbytes or not sig_compatible(sig, req.sig):
            sent, expected = describe_message(sig, total), describe_message(req.sig, req.nbytes)
            where = f"tag {req.key[1]}" if req.key[0] & 1 else f"op #{req.key[1]}"
            same = (" (the same op, called with other element counts, split sizes, dtypes or layout on the two "
                    "ranks)" if sent == expected else "")
            raise MismatchError(
                f"rank {self.rank}: mismatched operation with rank {peer} ({where}): rank {peer} sent {sent}, "
                f"but rank {self.rank} expected {expected}{same}"
            )

    def pending(self) -> list[Request]:
        return list(self.posted.values()) + list(self.any_source) + [
            u.claimed_by for u in self.unexpected.values() if u.claimed_by is not None
        ]

    def collective_waits(self) -> list[Request]:
        """Pending collective receives from a named peer: what the mismatch checks look at."""
        return [r for r in self.pending()
                if not r.is_send and not r.done and not r.key[0] & 1 and r.peer != ANY_SOURCE]
