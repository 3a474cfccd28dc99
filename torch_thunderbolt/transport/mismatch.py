"""The one place that decides, from what peers say about the op they are in, whether two ranks run
different ops (MismatchError) and whom a waiting rank waits on.

The kinds of link only deliver what peers say (protocol/control.py, on every kind's control wire): "peer P
waits for op X" (a PING's op announcement) and "peer P waits on rank Q in op X" (an ANSWER). The detector
compares each with what this rank posted or waits for, raises MismatchError naming both ops, and keeps whom
each peer waits on for the engine's timeout (which then blames the end of the chain).
It holds no lock of its own: the engine's lock is held by every caller.
"""
from __future__ import annotations

from typing import Iterable

from ..errors import MismatchError
from ..protocol.control import Op
from ..protocol.signature import describe_sig
from .base import ANY_SOURCE, Key
from .matching import Matcher

OPS_REMEMBERED = 256  # a PING names an op the peer waits for now: one this far behind us is long settled


class MismatchDetector:
    """What this rank knows of the ops its peers are in. `op_sigs`: the signature of each recent collective
    op this rank posted messages for (tag -> sig); `peer_waits`: peer -> (op tag, rank it waits on)."""

    def __init__(self, rank: int, matcher: Matcher, space: int = 0) -> None:
        self.rank = rank
        self.matcher = matcher
        self.space = space  # the group's collective space: what an announcement of no op names
        self.op_sigs: dict[int, int] = {}
        self.peer_waits: dict[int, tuple[int, int]] = {}

    def note_post(self, key: Key, sig: int) -> None:
        """A message of op `key` (signature `sig`) is being posted: remember the op's signature the first
        time, and forget the op OPS_REMEMBERED before (runs on every post: kept to a few steps)."""
        if not key[0] & 1 and sig:
            tag = key[1]
            op_sigs = self.op_sigs
            if tag not in op_sigs:
                op_sigs[tag] = sig
                op_sigs.pop(tag - OPS_REMEMBERED, None)

    # -- what this rank announces --------------------------------------------------------------------------
    def probes(self, peers: Iterable[int]) -> "dict[int, Op]":
        """The peers among `peers` this rank waits on (all of them for a receive from any rank), each with
        the op announcement a PING to it carries: the collective op this rank waits for from it, if any."""
        pending = self.matcher.pending()
        peers = set(peers)
        wanted = peers if any(r.peer == ANY_SOURCE for r in pending) else {r.peer for r in pending} & peers
        waiting = {r.peer: r for r in pending if not r.is_send and not r.key[0] & 1 and r.sig}
        out = {}
        for p in wanted:
            r = waiting.get(p)
            out[p] = Op(r.key[0], r.key[1], r.sig) if r is not None else Op(self.space)
        return out

    # -- what peers say ------------------------------------------------------------------------------------
    def peer_waits_for(self, peer: int, op: Op) -> "int | None":
        """`peer` waits for this rank's part of `op` (a PING): MismatchError if this rank ran that op with
        another signature; else the rank this rank waits on in that op itself, to answer (None: nothing)."""
        mine = self.op_sigs.get(op.tag) if op.sig else None
        if mine is not None and mine != op.sig:
            rank = self.rank
            raise MismatchError(
                f"rank {rank}: mismatched operation with rank {peer} (op #{op.tag}): rank {peer} waits for "
                f"rank {rank}'s part of {describe_sig(op.sig)}, but rank {rank} ran {describe_sig(mine)} "
                f"(different roots, collectives or order)")
        return self._waiting_on(op.tag, peer) if op.sig else None

    def peer_waits_on(self, peer: int, op: Op) -> None:
        """`peer` answered: in op `op.tag` it waits on rank `op.waits_on` itself."""
        if op.waits_on >= 0:
            self.peer_waits[peer] = (op.tag, op.waits_on)

    def waits_on(self, peer: int, tags: "set[int]") -> "int | None":
        """The rank `peer` said it waits on in one of the ops `tags`, if it said so."""
        known = self.peer_waits.get(peer)
        return known[1] if known is not None and known[0] in tags else None

    def _waiting_on(self, tag: int, asker: int) -> "int | None":
        """The rank this rank waits on in collective op `tag` (other than `asker`), or the one that rank
        said it waits on: the end of the chain as far as we know it."""
        waiting = [r for r in self.matcher.collective_waits() if r.peer != asker]
        peers = sorted({r.peer for r in waiting if r.key[1] == tag})
        if not peers:  # still stuck in an earlier op, so not in the asker's yet: whoever holds us up there
            peers = sorted({r.peer for r in waiting if r.key[1] < tag})
        for p in peers:
            known = self.peer_waits.get(p)
            far = known[1] if known is not None and known[0] == tag else None
            if far is not None and far not in (self.rank, asker, p):
                return far
        return peers[0] if peers else None
