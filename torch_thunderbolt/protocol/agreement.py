"""How the members of a new group agree on it over the live links, and which group ids are free (sans-IO).

A new group over an engine's links (`split`: new_group, a DeviceMesh dimension; `shrink`: the ranks that stay
after a loss) needs the same id on every member, an id no other group of any member is using, and no help
from the rendezvous store, which may have died with the rank that served it. Calls fail and are retried (a
timeout, a member lost, members that disagree on who is lost): nothing of a failed call may leak into a later
one, and a call returns a group on every member or, where a member's call failed after others returned, the
group they returned is broken, never used as if it were whole.

**The agreement.** Each call of a rank has a nonce (it only grows; (rank, nonce) names the call).
1. PROPOSE: the rank tells every other member the members it wants and the ids it cannot take (`used`).
   Each rank keeps, per peer, only the peer's latest proposal of a call that is not over.
2. COMMIT: once it holds a proposal from every member naming the same members, a rank decides: the
   `view` (each member's proposal nonce, in member order, its own included) and the id that follows from
   those proposals (the lowest id none of them uses: the same view gives the same id on every rank), and
   tells every other member (view, id). A call has one live commit: it commits again only once its last
   view can no longer be made (a member's call in it is over without making it).
3. The call returns once every other member committed to its last (view, id) under the nonces the view
   names. A commit counts only while no call it names is over without making it. A member's DONE saying
   it made that view counts as every member's commit: it made it only once all had committed.
4. DONE: a call that is over says so, with the view it made (none after an error). A peer drops that call's
   proposal; a group it returned from a view holding that call, other than the one it made, is broken: the
   rank that ended it will never have it.
A member whose latest proposal names other members is a disagreement, not yet an outcome: its call may be
over with its DONE on the way (a retry after a loss), so the caller gives up on it only if it lasts
(`disagreement`).

Why it cannot diverge: a rank returns view V only if every member committed V under the nonce V names,
and a call has one live commit at a time, committing anew only once its last view cannot be made: so no two
ranks return different views naming one call, and each call returns at most one (a rank returns its last
commit). Two calls of a member that return are two groups, each with its own id (an id is taken while its
group lives). `tests/core/test_agreement.py` checks this by exploring every interleaving of messages,
timeouts, retries, deaths and closes for small worlds (`testing/agreement_model.py`), and that a machine
without call identity fails that check.

**Ids.** A frame's space byte names its group (`2 * gid`, `2 * gid + 1`), so ids are few (`MAX_GID + 1`) and
are reused: an id is taken while a group of that id is live here, and after that until every other member
that may still send frames of it has said LEAVE (which comes behind a group's data on every kind), ended
the call that would have made it without making it, or is gone. A view of this rank's that can no longer
be made keeps its id taken the same way, so frames of a group a peer made from that commit are dropped, never held back
or taken for a later group's. What a frame for an id that is not live here means is `fate`'s: a later
group's (held back until it is made), or one that is over (dropped).

**Identity.** Each group has a 64-bit identity of its id, members and view (`identity`); the transport mixes
it into every message's signature, so two groups that share an id by any route fail with a MismatchError
instead of combining each other's data.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence, Union

from .control import MAX_GID, Commit, Done, Message, Propose

Send = tuple[int, Message]  # (peer engine rank, message)


@dataclass(frozen=True)
class Joined:
    """The call made a group: the same (gid, members, view) on every member."""
    gid: int
    members: tuple[int, ...]
    view: tuple[int, ...]


@dataclass(frozen=True)
class Disagree:
    """A member proposes a group of other members (its latest proposal, of a call not over)."""
    peer: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Exhausted:
    """Every group id is taken on some member."""
    used: int


@dataclass(frozen=True)
class Lost:
    """A member's link failed, or it said BYE: it cannot be in the group."""
    peer: int


Outcome = Union[Joined, Exhausted, Lost]


def decide(used: Sequence[int]) -> "int | None":
    """The group id a set of proposals gives: the lowest id none of them uses (None: every id is taken)."""
    taken = 0
    for u in used:
        taken |= u
    free = ~taken & ((1 << (MAX_GID + 1)) - 1)
    return (free & -free).bit_length() - 1 if free else None


def identity(gid: int, members: Sequence[int], view: Sequence[int]) -> int:
    """A group's 64-bit identity: its id, members and the proposals it was made from (the set-up group: none)."""
    text = f"{gid}|{','.join(map(str, members))}|{','.join(map(str, view))}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


@dataclass
class _Call:
    nonce: int
    members: tuple[int, ...]
    own: Propose
    commits: list[tuple[tuple[int, ...], int]] = field(default_factory=list)  # (view, gid) committed to, in order
    confirmed: dict[int, set[tuple[tuple[int, ...], int]]] = field(default_factory=dict)  # by peer
    outcome: "Outcome | None" = None
    # Each peer's proposal this call began with that was already there when the call before it failed.
    before: dict[int, int] = field(default_factory=dict)
    # Peers that proposed this call's members while it ran (or before, in a call then not over). One whose call
    # then ends without the group (its DONE drops the proposal) joined and gave up, as a peer whose deadline
    # came a moment before this rank's does: it is no member that did not join.
    joined: set[int] = field(default_factory=set)


@dataclass
class Record:
    """A group this rank made (or the set-up group), as the ledger keeps it."""
    gid: int
    members: tuple[int, ...]
    view: tuple[int, ...]  # () for the set-up group

    def nonce_of(self, peer: int) -> "int | None":
        return self.view[self.members.index(peer)] if self.view and peer in self.members else None


class Agreement:
    """One rank's side of every agreement over one engine, and its ledger of group ids. Messages in
    (`receive`), messages out (lists of (peer, message) to send, in order, on each peer's control wire: the
    kinds deliver one peer's control messages in the order said), no I/O and no clock: the caller decides
    when a call has waited long enough (`abandon`). One call at a time."""

    HISTORY = 16  # calls of each peer whose end is remembered (older ones count as over without a group)

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.nonce = 0  # this rank's last call
        self.heard: dict[int, Propose] = {}  # each peer's latest proposal of a call not over
        self.over: dict[int, dict[int, tuple[int, ...]]] = {}  # peer -> {its call: view made, () for none}
        self.spent: dict[int, int] = {}  # each peer's latest proposal this rank committed to in a call now over
        self.call: "_Call | None" = None
        self.groups: dict[int, Record] = {}  # live here
        # gid -> {peer: (its nonce, view)}: members that may still send frames of a group of that id
        self.awaiting: dict[int, dict[int, tuple["int | None", tuple[int, ...]]]] = {}
        self.lost: set[int] = set()  # peers whose link failed or who said BYE
        # The proposals held when this rank's last call ended without a group, by peer: their nonces.
        self.held_at_failure: dict[int, int] = {}

    # -- ids ------------------------------------------------------------------------------------------------
    def used(self) -> int:
        """The ids this rank cannot take now: live here, or awaiting a member's LEAVE."""
        bits = 0
        for gid in self.groups:
            bits |= 1 << gid
        for gid in self.awaiting:
            bits |= 1 << gid
        return bits

    def fate(self, peer: int, gid: int) -> str:
        """What a frame (or ABORT) from `peer` for group `gid` is: "live" (the group is here), "drop" (of a
        group that is over, or that will never be made here) or "hold" (of a group not made here yet)."""
        if gid in self.groups:
            return "live"
        if peer in self.awaiting.get(gid, ()) or peer in self.lost:
            return "drop"
        return "hold"

    def add(self, gid: int, members: Sequence[int], view: Sequence[int] = ()) -> Record:
        """A group made here: the set-up group (no view), or the outcome of a call (`finish`)."""
        if gid in self.groups or gid in self.awaiting:
            raise ValueError(f"rank {self.rank}: group id {gid} is taken here")
        rec = Record(gid, tuple(members), tuple(view))
        self.groups[gid] = rec
        return rec

    def closed(self, gid: int, left: Sequence[int] = ()) -> None:
        """Group `gid` is over here; `left`: members that already said LEAVE of it. Its id stays taken until
        the others have said LEAVE, ended the call that would have made it without making it, or are lost."""
        rec = self.groups.pop(gid, None)
        if rec is not None:
            self._await(rec, set(left))

    def _await(self, rec: Record, left: "set[int]") -> None:
        waiting = {p: (rec.nonce_of(p), rec.view) for p in rec.members
                   if p != self.rank and p not in left and p not in self.lost
                   and not (rec.view and self._unmade(p, rec.nonce_of(p), rec.view))}
        if waiting:
            self.awaiting.setdefault(rec.gid, {}).update(waiting)

    def _release(self, gid: int, peer: int) -> None:
        waiting = self.awaiting.get(gid)
        if waiting is not None:
            waiting.pop(peer, None)
            if not waiting:
                del self.awaiting[gid]

    def left(self, peer: int, gid: int) -> None:
        """`peer` said LEAVE of group `gid`: nothing of it comes from `peer` any more."""
        if gid not in self.groups:
            self._release(gid, peer)

    def peer_lost(self, peer: int) -> list[int]:
        """`peer`'s link failed or it said BYE: it sends nothing more. The live groups holding it (the engine
        fails those)."""
        self.lost.add(peer)
        self.heard.pop(peer, None)
        for gid in list(self.awaiting):
            self._release(gid, peer)
        call = self.call
        if call is not None and call.outcome is None and peer in call.members:
            call.outcome = Lost(peer)
        return [g for g, rec in self.groups.items() if peer in rec.members]

    # -- what peers' calls came to ----------------------------------------------------------------------------
    def _unmade(self, peer: int, nonce: "int | None", view: tuple[int, ...]) -> bool:
        """Whether `peer`'s call `nonce` is over without making the group of `view`."""
        if nonce is None:
            return False
        ends = self.over.get(peer)
        if not ends:
            return False
        if nonce in ends:
            return ends[nonce] != view
        return nonce < min(ends)  # older than what is remembered: long over

    def _dead(self, view: tuple[int, ...], members: tuple[int, ...]) -> bool:
        """Whether a view can no longer be made: one of its proposals is over without making it."""
        return any(self._unmade(m, view[i], view) for i, m in enumerate(members) if m != self.rank)

    # -- the agreement ----------------------------------------------------------------------------------------
    def begin(self, members: Sequence[int]) -> list[Send]:
        """Start a call for a group of engine ranks `members` (this rank among them)."""
        if self.call is not None:
            raise RuntimeError(f"rank {self.rank}: an agreement is already running")
        members = tuple(sorted(set(members)))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank}: a group of ranks {list(members)} does not hold this rank")
        self.nonce += 1
        own = Propose(self.nonce, members, self.used())
        self.call = _Call(self.nonce, members, own, before={p: m.nonce for p, m in self.heard.items()
                                                            if self.held_at_failure.get(p) == m.nonce},
                          joined={p for p, m in self.heard.items() if m.ranks == members})
        self.held_at_failure = {}
        gone = [p for p in members if p in self.lost]
        if gone:
            self.call.outcome = Lost(gone[0])
            return []
        sends: list[Send] = [(p, own) for p in members if p != self.rank]
        return sends + self._step()

    def receive(self, peer: int, msg: Message) -> tuple[list[Send], list[int]]:
        """An agreement message from `peer`: what to send, and the live groups to fail (made from a proposal of
        a call of `peer`'s that made another group or none: `peer` will never have them)."""
        broken: list[int] = []
        if isinstance(msg, Propose):
            latest = self.heard[peer].nonce if peer in self.heard else 0
            ends = self.over.get(peer)
            if msg.nonce > max(latest, max(ends) if ends else 0):
                self.heard[peer] = msg
                if self.call is not None and msg.ranks == self.call.members:
                    self.call.joined.add(peer)
        elif isinstance(msg, Commit):
            call = self.call
            if call is not None and msg.ranks == call.members and self._current(peer, msg):
                call.confirmed.setdefault(peer, set()).add((msg.view, msg.gid))
        elif isinstance(msg, Done):
            ends = self.over.setdefault(peer, {})
            ends[msg.nonce] = msg.view
            while len(ends) > self.HISTORY:
                del ends[min(ends)]
            if peer in self.heard and self.heard[peer].nonce <= msg.nonce:
                del self.heard[peer]
            call = self.call
            if call is not None and peer in call.confirmed:
                call.confirmed[peer] = {c for c in call.confirmed[peer] if not self._dead(c[0], call.members)}
            for gid in list(self.awaiting):
                nonce, view = self.awaiting[gid].get(peer, (None, ()))
                if view and self._unmade(peer, nonce, view):
                    self._release(gid, peer)
            broken = [g for g, rec in self.groups.items()
                      if rec.view and self._unmade(peer, rec.nonce_of(peer), rec.view)]
            if call is not None and msg.view and call.commits and peer in call.members:
                view, gid = call.commits[-1]
                if (msg.view == view and view[call.members.index(peer)] == msg.nonce
                        and not self._dead(view, call.members)):
                    # `peer` made the group of this call's live commit, which it does only once every member
                    # has committed to it: their commits count here too (one may be slow to arrive, or its
                    # sender stopped just after it reached `peer`).
                    for p in call.members:
                        if p != self.rank:
                            call.confirmed.setdefault(p, set()).add((view, gid))
        return self._step(), broken

    def _current(self, peer: int, msg: Commit) -> bool:
        """A commit that can make this call's group: its view holds this call's nonce here, and a proposal of
        `peer`'s whose call is not over without making it."""
        call = self.call
        assert call is not None
        if len(msg.view) != len(call.members) or msg.view[call.members.index(self.rank)] != call.nonce:
            return False
        return msg.view[call.members.index(peer)] == msg.nonce and not self._dead(msg.view, call.members)

    def _step(self) -> list[Send]:
        call = self.call
        if call is None or call.outcome is not None:
            return []
        others = [p for p in call.members if p != self.rank]
        proposals = []
        for p in others:
            got = self.heard.get(p)
            if got is None:
                continue
            if got.ranks != call.members:
                continue  # (a disagreement: see `disagreement`)
            proposals.append(got)
        sends: list[Send] = []
        last = call.commits[-1] if call.commits else None
        if last is not None and self._dead(last[0], call.members):
            # Members that made it before they learnt it cannot be whole may send frames of it: dropped here.
            self._await(Record(last[1], call.members, last[0]), set())
        if len(proposals) == len(others) and (last is None or self._dead(last[0], call.members)):
            # A call commits to a second view only once its last one can no longer be made: while a view may
            # still be confirmed, committing to another would let two ranks return two groups from one call.
            view = tuple(call.nonce if m == self.rank else self.heard[m].nonce for m in call.members)
            if last is None or view != last[0]:
                gid = decide([call.own.used, *(p.used for p in proposals)])
                if gid is None:
                    call.outcome = Exhausted(call.own.used)
                    return []
                last = (view, gid)
                call.commits.append(last)
                commit = Commit(call.nonce, call.members, view, gid)
                sends = [(p, commit) for p in others if p not in self.lost]
        if last is not None and all(last in call.confirmed.get(p, ()) for p in others):
            call.outcome = Joined(last[1], call.members, last[0])
        return sends

    def outcome(self) -> "Outcome | None":
        return None if self.call is None else self.call.outcome

    def disagreement(self) -> "Disagree | None":
        """A member whose latest proposal names other members than this call, if any. Not an outcome by itself:
        that proposal may be of a call of the peer's that is over (its DONE on its way) or the peer may be about
        to retry; the caller ends the call (`abandon`) if it lasts. A proposal of a call this rank worked with
        before (in a call now over) is not one: that peer's next proposal will come; nor is the next proposal of
        a peer that confirmed this call's group."""
        call = self.call
        if call is None or call.outcome is not None:
            return None
        last = call.commits[-1] if call.commits else None
        for p in call.members:
            got = self.heard.get(p)
            if got is None or got.ranks == call.members or got.nonce <= self.spent.get(p, 0):
                continue
            if last is not None and last in call.confirmed.get(p, ()):
                continue  # it confirmed this call's group and has gone on to its next call
            return Disagree(p, got.ranks)
        return None

    def held_before(self, peer: int) -> bool:
        """Whether `peer`'s latest proposal is one this rank already held when its previous call failed: a
        retry meets it again, and the peer has proposed nothing since. A peer that is alive and calls with
        other members answers a new call within its own disagreement grace (its call ends: DONE; or it calls
        again); one that was stopped in a call keeps its old proposal, so a retry waits for it as for a member
        that did not join instead of failing on it again and again."""
        call = self.call
        got = self.heard.get(peer)
        return call is not None and got is not None and call.before.get(peer) == got.nonce

    def waiting_for(self) -> tuple[list[int], list[int], list[int]]:
        """The members this call has no proposal from, those whose commit it still lacks, and those that
        joined it and then ended their own call without the group (and have not proposed since)."""
        call = self.call
        if call is None:
            return [], [], []
        others = [p for p in call.members if p != self.rank]
        ended = [p for p in others if p not in self.heard and p in call.joined]
        silent = [p for p in others
                  if p not in ended and (p not in self.heard or self.heard[p].ranks != call.members)]
        last = call.commits[-1] if call.commits else None
        unconfirmed = [p for p in others
                       if p not in silent and p not in ended and last not in call.confirmed.get(p, ())]
        return silent, unconfirmed, ended

    def finish(self) -> tuple[Record, list[Send]]:
        """The call's group (outcome Joined), now live here, and what to tell the other members: the call is
        over, having made it. The call is over."""
        call = self.call
        assert call is not None and isinstance(call.outcome, Joined)
        joined = call.outcome
        self.call = None
        for i, p in enumerate(joined.members):
            if p in self.heard and self.heard[p].nonce == joined.view[i]:
                del self.heard[p]  # that call of p's made this group: it proposes nothing more
            if p != self.rank:
                self.spent[p] = max(self.spent.get(p, 0), joined.view[i])
        # An id this call kept from a view of its own that could not be made: a member whose call makes this
        # group made no other (one group per call), so it sends no frame of that one.
        for p, (nonce, _) in list(self.awaiting.get(joined.gid, {}).items()):
            if p in joined.members and joined.view[joined.members.index(p)] == nonce:
                self._release(joined.gid, p)
        rec = self.add(joined.gid, joined.members, joined.view)
        done = Done(call.nonce, joined.view)
        return rec, [(p, done) for p in call.members if p != self.rank and p not in self.lost]

    def abandon(self) -> list[Send]:
        """The call ends without a group (an error, a timeout): every other member hears it is over. An id it
        committed to stays taken until each member that may have made that group leaves it or is done."""
        call = self.call
        if call is None:
            return []
        self.call = None
        self.held_at_failure = {p: m.nonce for p, m in self.heard.items()}
        for view, gid in call.commits:
            self._await(Record(gid, call.members, view), set())
            for i, p in enumerate(call.members):
                if p != self.rank:
                    self.spent[p] = max(self.spent.get(p, 0), view[i])
        done = Done(call.nonce)
        return [(p, done) for p in call.members if p != self.rank and p not in self.lost]
