"""An exhaustive explorer of the group agreement (`protocol/agreement.py`): every interleaving of its messages,
with timeouts, retries, deaths and group closes at every step, for small worlds, checked against what the
agreement promises. In the spirit of TLA+'s model checker and FoundationDB's simulation, but over the real
sans-IO state machine, not a model of it: each simulated rank is an `Agreement`.

The world: ranks joined pairwise by FIFO channels (a kind delivers one peer's control messages in order).
A state is every rank's machine and what it did (calls left, groups made, groups broken, frames held back)
plus what is in flight on every channel. Events, any enabled one at any time:
- `begin`: a rank with calls left starts a call for the members it believes alive (a retry after an error
  leaves out the ranks it knows are lost, as docs/fault-tolerance.md advises);
- `deliver`: the oldest message on a channel reaches its rank (agreement messages, LEAVE, a data frame of a
  group, or the news that the sender's link failed);
- `timeout`: a rank's call gives up (the caller's deadline), within the fault budget;
- `mismatch`: a rank whose call sees a member propose other members gives up on it (after its grace);
- `die`: a rank dies, within the fault budget; what it had sent is delivered, or lost, in two branches;
- `close`: a rank closes a group it made (LEAVE to its members), so ids are reused;
A rank that makes a group sends each member one data frame of it at once (to check where it lands).

Checked in every state: no two ranks hold unbroken groups of one id with different identities; a data frame
is never taken by a group of another identity; a call that times out names as members that did not join none
whose proposal of its members reached it during the call (the explorer keeps what reached each rank apart
from its machine), even if that member's call has ended since. In every quiet state (nothing but a fault can happen): every
unbroken group
is held, unbroken, by every member, all alive; no frame is left held back (a held frame stops its stream);
and where no fault happened and every rank asked for the same members, every call made its group.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ..protocol.agreement import Agreement, Joined, identity
from ..protocol.control import Commit, Done, Leave, Propose

DEAD = "dead"  # on a channel: the sender's link failed (after what it sent before, or instead of it)


@dataclass(frozen=True)
class Data:
    gid: int
    ident: int


@dataclass
class Rank:
    machine: Agreement
    calls: int  # calls left to begin
    wants: tuple[int, ...]  # the members it asks for (minus the ranks it learns are lost)
    alive: bool = True
    calling: bool = False
    made: int = 0  # calls that made a group
    broken: set[int] = field(default_factory=set)  # live gids broken here
    held: list[tuple[int, Data]] = field(default_factory=list)  # frames held back: (from, frame)
    left: dict[int, set[int]] = field(default_factory=dict)  # live gid -> members that said LEAVE
    # What reached this rank, kept by the explorer apart from the machine, to judge whom a timeout blames: each
    # peer's last PROPOSE (nonce, members), the last call of each peer that said DONE, and the peers that joined
    # the call running here (their PROPOSE of its members reached it while it ran, or before it of a call then
    # not over).
    proposals: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    ended: dict[int, int] = field(default_factory=dict)  # (and the calls whose group this rank made)
    joined: frozenset[int] = frozenset()
    key: object = None  # (the explorer's) this rank's part of the state key, once computed; ranks are shared
    # between states until an event changes them (then copied, key unset)


@dataclass
class World:
    ranks: list[Rank]
    chans: dict[tuple[int, int], tuple[object, ...]]
    faults: int  # faults still allowed
    faulted: bool = False
    misblame: str = ""  # set by the event that made this state: a timeout that blamed a member wrongly


@dataclass(frozen=True)
class Scenario:
    """`wants[r]`: the members rank r first asks for (None: r takes no part: already dead). `calls`: calls per
    rank (retries included); `faults`: timeouts and deaths allowed in one run; `closes`: whether ranks close
    the groups they made (ids reused); `again`, `then`: see below."""
    name: str
    wants: tuple["tuple[int, ...] | None", ...]
    calls: int = 2
    faults: int = 1
    closes: bool = False
    # Whether a rank that made its group calls again (a second group; `then[r]`: its members, None: it makes
    # no other; no `then`: the same members), or only retries after an error.
    again: bool = True
    then: tuple["tuple[int, ...] | None", ...] = ()
    dead_news: tuple[tuple[int, int], ...] = ()  # (dead rank, rank): the news is on its way at the start


class Violation(AssertionError):
    pass


@dataclass
class Report:
    states: int
    finals: int
    transitions: int


def _rank_key(r: Rank) -> object:
    if r.key is None:
        m = r.machine
        c = m.call
        call = None if c is None else (c.nonce, c.members, c.own.used, tuple(c.commits),
                                       tuple(sorted((p, tuple(sorted(s))) for p, s in c.confirmed.items())),
                                       repr(c.outcome), tuple(sorted(c.joined)))
        machine = (m.nonce, tuple(sorted((p, x.nonce, x.ranks, x.used) for p, x in m.heard.items())),
                   tuple(sorted((p, tuple(sorted(o.items()))) for p, o in m.over.items())),
                   tuple(sorted(m.spent.items())), call,
                   tuple(sorted((g, rec.members, rec.view) for g, rec in m.groups.items())),
                   tuple(sorted((g, tuple(sorted(a.items()))) for g, a in m.awaiting.items())), tuple(sorted(m.lost)))
        r.key = (machine, r.calls, r.wants, r.alive, r.calling, r.made, tuple(sorted(r.broken)), tuple(r.held),
                 tuple(sorted((g, tuple(sorted(s))) for g, s in r.left.items())), tuple(sorted(r.proposals.items())),
                 tuple(sorted(r.ended.items())), tuple(sorted(r.joined)))
    return r.key


def _key(w: World) -> object:
    return tuple(_rank_key(r) for r in w.ranks), tuple(sorted(w.chans.items())), w.faults, w.faulted


def _clone_machine(m: Agreement) -> Agreement:
    """A copy of `m` whose state changes apart from m's (messages and records are never changed in place)."""
    c = copy.copy(m)
    c.heard, c.spent = dict(m.heard), dict(m.spent)
    c.over = {p: dict(o) for p, o in m.over.items()}
    c.groups, c.lost = dict(m.groups), set(m.lost)
    c.awaiting = {g: dict(a) for g, a in m.awaiting.items()}
    if m.call is not None:
        call = c.call = copy.copy(m.call)
        call.commits = list(call.commits)
        call.confirmed = {p: set(v) for p, v in call.confirmed.items()}
        call.joined = set(call.joined)
    return c


def _clone_rank(r: Rank) -> Rank:
    return Rank(_clone_machine(r.machine), r.calls, r.wants, r.alive, r.calling, r.made, set(r.broken), list(r.held),
                {g: set(x) for g, x in r.left.items()}, proposals=dict(r.proposals), ended=dict(r.ended),
                joined=r.joined)


def _ident(m: Agreement, gid: int) -> int:
    rec = m.groups[gid]
    return identity(gid, rec.members, rec.view)


class Explorer:
    """Explores every state of a scenario reachable from its start (depth first, each state once), raising
    Violation with the path that reached a bad state. `machine`: the Agreement class (a mutant, to show
    that the checks can fail)."""

    def __init__(self, scenario: Scenario, machine: Callable[[int], Agreement] = Agreement,
                 limit: int = 2_000_000) -> None:
        self.scenario = scenario
        self.machine = machine
        self.limit = limit

    def start(self) -> World:
        sc = self.scenario
        n = len(sc.wants)
        ranks = []
        for r, wants in enumerate(sc.wants):
            m = self.machine(r)
            m.add(0, tuple(range(n)))  # the set-up group of every rank (its id taken)
            rank = Rank(m, sc.calls if wants is not None else 0, wants or (), alive=wants is not None)
            ranks.append(rank)
        chans = {(a, b): () for a in range(n) for b in range(n) if a != b}
        for dead, r in sc.dead_news:
            chans[(dead, r)] = (DEAD,)
        return World(ranks, chans, sc.faults)

    def run(self) -> Report:
        start = self.start()
        seen = {_key(start)}
        stack: list[tuple[World, tuple[str, ...]]] = [(start, ())]
        finals = transitions = 0
        while stack:
            w, path = stack.pop()
            moved = False
            for label, nxt in self._successors(w):
                if not label.startswith(("timeout", "die")):
                    moved = True
                transitions += 1
                self._check(nxt, path + (label,))
                k = _key(nxt)
                if k not in seen:
                    seen.add(k)
                    if len(seen) > self.limit:
                        raise RuntimeError(f"{self.scenario.name}: more than {self.limit} states")
                    stack.append((nxt, path + (label,)))
            if not moved:
                finals += 1
                self._check_final(w, path)
        return Report(len(seen), finals, transitions)

    # -- events ----------------------------------------------------------------------------------------------
    def _successors(self, w: World) -> Iterator[tuple[str, World]]:
        n = len(w.ranks)
        for r, rank in enumerate(w.ranks):
            if not rank.alive:
                continue
            if not rank.calling and rank.calls > 0 and (self.scenario.again or rank.made == 0):
                yield f"begin r{r}", self._begin(w, r)
            if rank.calling and w.faults > 0:
                yield f"timeout r{r}", self._timeout(w, r)
            if rank.calling and rank.machine.disagreement() is not None:
                yield f"mismatch r{r}", self._mismatch(w, r)
            if w.faults > 0:
                yield f"die r{r} (sent arrives)", self._die(w, r, keep=True)
                if any(w.chans[(r, b)] for b in range(n) if b != r):
                    yield f"die r{r} (sent lost)", self._die(w, r, keep=False)
            if self.scenario.closes:
                for gid in sorted(rank.machine.groups):
                    if gid != 0 and not rank.calling:
                        yield f"close r{r} g{gid}", self._close(w, r, gid)
        for (a, b), q in w.chans.items():
            if q:
                yield f"deliver {a}->{b} {_show(q[0])}", self._deliver(w, a, b)

    def _copy(self, w: World, r: int) -> World:
        """A new state from `w` in which only rank `r` (and the channels) may change."""
        ranks = list(w.ranks)
        ranks[r] = _clone_rank(ranks[r])
        return World(ranks, dict(w.chans), w.faults, w.faulted)

    def _post(self, w: World, r: int, sends: Sequence[tuple[int, object]]) -> None:
        for peer, msg in sends:
            if w.ranks[r].alive:
                w.chans[(r, peer)] = w.chans[(r, peer)] + (msg,)

    def _begin(self, w: World, r: int) -> World:
        w = self._copy(w, r)
        rank = w.ranks[r]
        rank.calls -= 1
        rank.calling = True
        wants = tuple(m for m in rank.wants if m not in rank.machine.lost)
        members = tuple(sorted(set(wants)))
        rank.joined = frozenset(p for p, (nonce, ranks) in rank.proposals.items()
                                if ranks == members and nonce > rank.ended.get(p, 0))
        self._post(w, r, rank.machine.begin(wants))
        self._settle(w, r)
        return w

    def _timeout(self, w: World, r: int) -> World:
        w = self._copy(w, r)
        rank, call = w.ranks[r], w.ranks[r].machine.call
        if call is not None:
            for p in rank.machine.waiting_for()[0]:
                if p in rank.joined and rank.proposals[p][1] == call.members:
                    w.misblame = (f"rank {r} timed out naming rank {p} as a member that did not join, though its "
                                  f"proposal of members {list(call.members)} reached it during the call")
        w.faults -= 1
        w.faulted = True
        self._end_call(w, r)
        return w

    def _mismatch(self, w: World, r: int) -> World:
        """Rank r gives up on a member that proposes other members (a MismatchError to its caller)."""
        w = self._copy(w, r)
        self._end_call(w, r)
        return w

    def _end_call(self, w: World, r: int) -> None:
        rank = w.ranks[r]
        rank.calling = False
        self._post(w, r, rank.machine.abandon())
        self._rehold(w, r)

    def _die(self, w: World, r: int, keep: bool) -> World:
        w = self._copy(w, r)
        w.faults -= 1
        w.faulted = True
        w.ranks[r].alive = False
        w.ranks[r].calling = False
        for b in range(len(w.ranks)):
            if b != r:
                w.chans[(r, b)] = (w.chans[(r, b)] if keep else ()) + (DEAD,)
                w.chans[(b, r)] = ()
        return w

    def _close(self, w: World, r: int, gid: int) -> World:
        w = self._copy(w, r)
        rank = w.ranks[r]
        rec = rank.machine.groups[gid]
        left = rank.left.pop(gid, set())
        rank.broken.discard(gid)
        rank.machine.closed(gid, left)
        self._post(w, r, [(p, Leave(gid)) for p in rec.members if p != r and p not in rank.machine.lost])
        self._rehold(w, r)
        return w

    def _send(self, w: World, r: int, gid: int) -> None:
        """Rank r's first data frame of its new group `gid`, to every member, sent as soon as it is made (the
        earliest a frame can come: the hardest case for the receivers' ledger)."""
        rank = w.ranks[r]
        rec = rank.machine.groups[gid]
        frame = Data(gid, _ident(rank.machine, gid))
        self._post(w, r, [(p, frame) for p in rec.members if p != r and p not in rank.machine.lost])

    def _deliver(self, w: World, a: int, b: int) -> World:
        w = self._copy(w, b)
        msg = w.chans[(a, b)][0]
        w.chans[(a, b)] = w.chans[(a, b)][1:]
        rank = w.ranks[b]
        if not rank.alive:
            return w
        m = rank.machine
        if msg == DEAD:
            for gid in m.peer_lost(a):
                rank.broken.add(gid)
            self._settle(w, b)
        elif isinstance(msg, Leave):
            if msg.epoch in m.groups:
                rank.left.setdefault(msg.epoch, set()).add(a)
            else:
                m.left(a, msg.epoch)
            self._rehold(w, b)
        elif isinstance(msg, Data):
            self._land(w, b, a, msg)
        else:
            if isinstance(msg, Propose):
                rank.proposals[a] = (msg.nonce, msg.ranks)
                if rank.calling and m.call is not None and msg.ranks == m.call.members:
                    rank.joined = rank.joined | {a}
            elif isinstance(msg, Done):
                rank.ended[a] = max(rank.ended.get(a, 0), msg.nonce)
            sends, broken = m.receive(a, msg)
            rank.broken.update(broken)
            self._post(w, b, sends)
            self._settle(w, b)
        return w

    def _land(self, w: World, r: int, sender: int, frame: Data) -> None:
        rank = w.ranks[r]
        fate = rank.machine.fate(sender, frame.gid)
        if fate == "hold":
            rank.held.append((sender, frame))
        elif fate == "live" and frame.gid not in rank.broken:
            if _ident(rank.machine, frame.gid) != frame.ident:
                raise Violation(f"rank {r} took a frame of group {frame.gid} from rank {sender} into another "
                                f"group of that id")

    def _rehold(self, w: World, r: int) -> None:
        """Frames held back are offered again after any change of the ledger."""
        rank = w.ranks[r]
        held, rank.held = rank.held, []
        for sender, frame in held:
            self._land(w, r, sender, frame)

    def _settle(self, w: World, r: int) -> None:
        """After a step of rank r's machine: a call that has an outcome ends (a group made, or an error)."""
        rank = w.ranks[r]
        m = rank.machine
        out = m.outcome()
        if out is None or not rank.calling:
            if out is not None and not rank.calling:
                raise Violation(f"rank {r}: an outcome without a call")
            return
        if isinstance(out, Joined):
            for p, nonce in zip(out.members, out.view):
                if p != r:
                    rank.ended[p] = max(rank.ended.get(p, 0), nonce)
            rec, sends = m.finish()
            self._post(w, r, sends)
            rank.calling = False
            rank.made += 1
            if self.scenario.then:
                if self.scenario.then[r] is None:
                    rank.calls = 0
                else:
                    rank.wants = self.scenario.then[r]
            self._send(w, r, rec.gid)
        else:
            self._end_call(w, r)
            return
        self._rehold(w, r)

    # -- checks -----------------------------------------------------------------------------------------------
    def _check(self, w: World, path: tuple[str, ...]) -> None:
        if w.misblame:
            raise Violation(w.misblame + _trace(path))
        idents: dict[int, tuple[int, int]] = {}
        for r, rank in enumerate(w.ranks):
            if not rank.alive:
                continue
            for gid in rank.machine.groups:
                if gid in rank.broken:
                    continue
                ident = _ident(rank.machine, gid)
                if gid in idents and idents[gid][1] != ident:
                    raise Violation(f"ranks {idents[gid][0]} and {r} hold unbroken groups of id {gid} that differ"
                                    + _trace(path))
                idents[gid] = (r, ident)

    def _check_final(self, w: World, path: tuple[str, ...]) -> None:
        for r, rank in enumerate(w.ranks):
            if not rank.alive:
                continue
            if rank.held:
                raise Violation(f"rank {r} still holds back frames {rank.held} at the end" + _trace(path))
            for gid, rec in rank.machine.groups.items():
                if gid == 0 or gid in rank.broken:
                    continue
                for p in rec.members:
                    if p in rank.left.get(gid, ()):
                        continue  # it closed the group: over there, by its user's choice
                    other = w.ranks[p]
                    if not other.alive or gid not in other.machine.groups or gid in other.broken or \
                            _ident(other.machine, gid) != _ident(rank.machine, gid):
                        raise Violation(f"rank {r} holds group {gid} {rec.members}, unbroken, which rank {p} does not"
                                        + _trace(path))
        sc = self.scenario
        first = {wants for wants in sc.wants if wants is not None}
        if not w.faulted and len(first) == 1 and not sc.dead_news:
            for r, rank in enumerate(w.ranks):
                expect = 1 if not sc.again or (sc.then and sc.then[r] is None) else sc.calls
                if rank.alive and (rank.calling or rank.made < expect):
                    raise Violation(f"rank {r} made {rank.made} of its {expect} groups in a run without faults"
                                    + _trace(path))


def _show(msg: object) -> str:
    if isinstance(msg, Propose):
        return f"PROPOSE(n{msg.nonce} {list(msg.ranks)})"
    if isinstance(msg, Commit):
        return f"COMMIT(n{msg.nonce} view {list(msg.view)} g{msg.gid})"
    if isinstance(msg, Done):
        return f"DONE(n{msg.nonce}{' made ' + str(list(msg.view)) if msg.view else ''})"
    if isinstance(msg, Leave):
        return f"LEAVE(g{msg.epoch})"
    if isinstance(msg, Data):
        return f"DATA(g{msg.gid})"
    return str(msg).upper()


def _trace(path: tuple[str, ...]) -> str:
    return "\n  after: " + "\n         ".join(path)


def explore(scenario: Scenario, machine: Callable[[int], Agreement] = Agreement) -> Report:
    return Explorer(scenario, machine).run()


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("2 ranks, two groups, retries, 1 fault", ((0, 1), (0, 1))),
    Scenario("2 ranks, two groups with closes, 1 fault", ((0, 1), (0, 1)), closes=True),
    Scenario("3 ranks, a group, a retry, 1 fault", ((0, 1, 2),) * 3, again=False),
    Scenario("3 ranks, a group, 2 faults", ((0, 1, 2),) * 3, calls=1, faults=2),
    Scenario("3 ranks, a group then a group of 2", ((0, 1, 2),) * 3, faults=0, then=((0, 1), (0, 1), None)),
    Scenario("3 ranks, a group then a group of 2, 1 fault", ((0, 1, 2),) * 3, then=((0, 1), (0, 1), None)),
    Scenario("3 ranks shrink to 2: rank 2 dead, news on its way, retries", ((0, 1), (0, 1), None),
             dead_news=((2, 0), (2, 1)), calls=3),
    Scenario("4 ranks, ranks 2 and 3 dead, survivors disagree, retries", ((0, 1), (0, 1, 2), None, None),
             dead_news=((2, 0), (3, 0), (2, 1), (3, 1)), calls=3, faults=0),
)
