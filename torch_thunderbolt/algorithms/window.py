"""The shared-window protocol: how the ranks of one host run collectives on memory they all read directly.

The transport gives the memory (`transport.window.WindowMemory`: BUFFERS buffers, an op word per buffer
and a progress counter per member, stores ordered and sleepers woken on publish); this module holds what
the algorithms (`windowed.py`) do with it. A rank writes into its own buffer, then posts: word and payload
stores first, the counter store last. Peers wait for the counter before reading. Counters only grow over
the group's life, so no two ops can confuse each other's steps; a peer still in an earlier step is
simply waited for.

Waiting drives the group's engine (`Transport.progress` with `until`), so a window wait keeps the links
moving, notices a dead peer and an ABORT like any receive. The window also watches the engine while it
idles in a plan: a ring receive from a member that has already begun a windowed op this rank has not
reached can never complete (see `check_skipped`).

Positions: the algorithms number the members 0..n-1 (`rank`, `world` here are positions in `members`,
the group ranks that share the memory); errors name group ranks.
"""
from __future__ import annotations

import time
from typing import Iterable

from ..errors import CollectiveTimeout, MismatchError
from ..protocol.signature import describe_sig
from ..transport.engine import Transport
from ..transport.window import BUFFERS, WindowMemory

PRESPIN_LOOKS = 128  # tight looks at the peers' counters before a wait drives the engine (~10 us)
STEPS = 3  # counter values per round: a step is `round * STEPS + phase`, phase 1..STEPS (see windowed.py)

__all__ = ["BUFFERS", "STEPS", "Window"]


class Window:
    """The window of one rank: `memory` shared with `memory.members`, waits driven by `engine`."""

    def __init__(self, engine: Transport, memory: WindowMemory) -> None:
        self.engine, self.memory = engine, memory
        self.members = memory.members
        self.rank, self.world, self.nbytes = memory.me, len(memory.members), memory.nbytes
        self.cache: dict = {}  # tensor views of the buffers, kept across ops; dropped by release()
        self._position = {g: i for i, g in enumerate(self.members)}
        self.others = [p for p in range(self.world) if p != self.rank]  # every member but this rank
        # Every protocol state is read off the memory (our own counter and words), so several windows over
        # one memory (one per Communicator of a transport) agree; the latest one's check stands for all.
        engine.watchers["window"] = self.check_skipped

    @property
    def rounds(self) -> int:
        """Rounds completed by the ops run so far (the same on every member between ops), read off our own
        counter: every op leaves it at the end of a round, but a broadcast root, whose last round stays at
        ARRIVED until `windowed.settle` has checked its peers (see `unchecked`)."""
        return -(-self.memory.counter(self.rank) // STEPS)

    @property
    def unchecked(self) -> tuple[int, int] | None:
        """A broadcast root's last round whose peers' op words are still to be checked, with its word: the
        root returns without waiting for its peers and checks them when it starts its next windowed op."""
        value = self.memory.counter(self.rank)
        if value % STEPS == 0:
            return None
        g = value // STEPS
        return g, self.memory.word(self.rank, g % BUFFERS)

    def spans(self, ranks: Iterable[int]) -> bool:
        """Whether the members are exactly `ranks` (group ranks)."""
        return sorted(ranks) == self.members

    # -- the memory -----------------------------------------------------------------------------------------
    def buffer(self, owner: int, k: int) -> memoryview:
        return self.memory.buffer(owner, k)

    def counter(self, owner: int) -> int:
        return self.memory.counter(owner)

    def word(self, owner: int, k: int) -> int:
        return self.memory.word(owner, k)

    def post(self, value: int, k: int | None = None, word: int = 0) -> None:
        # A broken group must not run more ops, even ones whose steps its peers happen to have posted already.
        self.engine.check_usable()
        self.memory.publish(value, k, word)

    # -- waiting --------------------------------------------------------------------------------------------
    def wait(self, value: int, peers: Iterable[int], deadline: float, what: object) -> None:
        """Until every member in `peers` (positions) posted at least `value`; CollectiveTimeout at `deadline`."""
        memory, engine = self.memory, self.engine
        counter = memory.counter
        peers = peers if type(peers) is list else list(peers)  # (callers mostly pass `others`)
        # Everyone there already costs one load per peer; a peer a few us away is caught by a short tight
        # spin (only while the engine would spin at all: never when ranks outnumber cores).
        if memory.reached(peers, value, 1) or (engine.eager() and memory.reached(peers, value, PRESPIN_LOOKS)):
            return
        ready = lambda: memory.reached(peers, value, 1)  # noqa: E731 - one acquire fence when it is True
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(value, peers, what)
            engine.check_usable()
            engine.progress(min(0.2, deadline - now), until=ready)
            engine.check_usable()
            self._check_stray(peers, value, what)

    def _timeout(self, value: int, peers: list[int], what: object) -> CollectiveTimeout:
        """The timeout of a wait for step `value`: it blames the members furthest behind. Every step waits for
        steps the others post, so a member that has posted more than the furthest behind but not `value` is
        waiting for them (a healthy rank held up by a stopped one); it is named apart, never blamed."""
        behind = {self.members[p]: self.memory.counter(p) for p in peers if self.memory.counter(p) < value}
        low = min(behind.values(), default=value)
        late = [g for g, c in behind.items() if c == low]
        held = [g for g, c in behind.items() if c != low]
        also = f"; ranks {held} were further on, waiting for them" if held else ""
        return CollectiveTimeout(
            f"rank {self.engine.rank}: Timed out waiting in {what} (shared-memory window, step {value}); "
            f"ranks that did not arrive: {late}{also}", ranks=late)

    def _check_stray(self, peers: list[int], value: int, what: object) -> None:
        """A member we wait for that sent ring data of a collective has skipped this op: had it run it, it
        would have posted the step we wait for before sending anything later (counters only grow). So its
        counter is read again *after* its ring data was seen: a post that came first shows by then."""
        counter = self.memory.counter
        for peer in [self.members[p] for p in peers if counter(p) < value]:
            held = self.engine.held(peer)
            if held is None or held.space != self.engine.coll:
                continue
            self.memory.fence()  # the ring was read first: the counter load must not move before it
            if counter(self._position[peer]) < value:
                raise MismatchError(
                    f"rank {self.engine.rank}: mismatched operation with rank {peer}: rank {peer} sent data of "
                    f"{describe_sig(held.sig)}, but rank {self.engine.rank} is in {what}")

    def started_beyond(self, owner: int) -> bool:
        """`owner` has posted a step of a round this rank has not started (between ops only: it has begun
        a windowed op this rank has not reached)."""
        return self.memory.counter(owner) > STEPS * self.rounds

    def check_skipped(self) -> None:
        """(An engine watcher.) A collective receive from a member that has already begun a windowed op this
        rank has not reached can never complete: the member skipped this op (its sends would be in the ring
        before it moved on). Without this, a ring op that only receives (a gather's root) facing a windowed
        op would time out."""
        engine = self.engine
        for req in engine.matcher.collective_waits():
            owner = self._position.get(req.peer)
            if owner is None or owner == self.rank or not self.started_beyond(owner):
                continue
            # The counter was read first: ring writes made before that post show now (past the fence).
            self.memory.fence()
            if engine.held(req.peer) is None:
                engine.fail(MismatchError(
                    f"rank {engine.rank}: mismatched operation with rank {req.peer}: rank {req.peer} has begun "
                    f"a shared-memory collective while rank {engine.rank} waits for its data in "
                    f"{describe_sig(req.sig)} (op {req.key[1]})"))
                return

    def release(self) -> None:
        """Drop the tensor views (the transport unmaps the memory when it closes)."""
        self.cache.clear()
        if self.engine.watchers.get("window") == self.check_skipped:
            del self.engine.watchers["window"]
