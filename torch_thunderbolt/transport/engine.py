"""The one progress engine of a process's links, and the groups (`Transport`) that run over them.

An `Engine` holds the links to every peer of the group it was set up for (`kinds`, each a LinkKind with its
links by peer) and drives them; a `Transport` is one group over that engine: the ranks it spans (`members`,
engine ranks), its own numbering (rank `i` of the group is engine rank `members[i]`), its own messages and
its own failure. The group made at set-up spans every engine rank; a group split from it (`split`: a
DeviceMesh dimension, `new_group`) or shrunk from it after a rank was lost (`shrink`) runs over the same
links, with no new connection.

- **Messages** are keyed `(space, tag, seq)` (see `protocol.framing`): a group's collectives use space
  `2 * gid` and its point-to-point messages `2 * gid + 1`, so each frame names its group; each group matches
  its own messages (its `Matcher`, in group ranks).
- **Driving.** Whichever thread waits drives progress (MPI style), one at a time: it pumps every link,
  spins briefly while traffic flows, then sleeps in one poll() over every link's file descriptors plus a
  wake-up socket that threads posting new work ring. Other waiting threads sleep on the condition until
  the driver reports completions.
- **BROKEN** is a group's state, not the links': a group that fails (`Transport.fail`) gives every pending
  and later request of its own the error, tells its members why (an ABORT naming the group), and drops
  what it still had queued; frames of a broken or closed group that arrive later are discarded. The links
  stay: the other groups over them go on, and the survivors of a lost rank can shrink to a new group over
  the same links. A link that fails (the peer died, a cable went) is closed, and every group that holds
  that peer fails with a PeerLostError naming it.
- **Closing** a group tells its members it left (LEAVE); the engine closes with its last group: BYE on
  every link, then the kinds release what they hold (segments, threads).

A job with ranks on several hosts and several ranks per host is one engine holding TCP and shared-memory
links; the in-memory transport of the tests is one more kind of link.
"""
from __future__ import annotations

import select
import socket
import threading
import time
from collections import defaultdict
from typing import Callable, Iterable, Sequence

from ..errors import (BackendClosedError, CollectiveTimeout, MismatchError, PeerAbortedError, PeerLostError,
                      ProtocolError, ThunderboltError, peer_lost, peer_shut_down)
from ..protocol import control
from ..protocol.agreement import Agreement, Disagree, Exhausted, Joined, Lost, Record, identity
from ..protocol.framing import DISCARD, AbortInfo, Frame, is_p2p
from ..protocol.signature import describe_sig
from .base import (ANY_SOURCE, NOT_YET, TAKEN, CountedCondition, Key, Link, LinkKind, Request, Sink, bytes_view,
                   remote_error)
from .matching import Matcher
from .mismatch import MismatchDetector
from .names import RankNames
from .spin import SLOW_YIELD, SpinGuard, yield_cpu
from .window import WindowMemory

# How long an engine keeps writing what a failed group still had to say (its ABORTs, behind the rest of a
# frame in flight) when nobody else drives it. Normally a few milliseconds; only a peer that reads nothing
# (frozen, or itself stuck) uses it all.
ABORT_GRACE = 2.0
# How long a member's proposal of other members must last before a new group's agreement gives up on it: its
# call may be over already (a retry after a disagreement) with the news on its way.
MISMATCH_GRACE = 1.0


def _never() -> bool:
    return False


class Engine(Sink):
    """The links of one process to its peers (engine ranks 0..world-1, this process `rank`) and the one loop
    that drives them, for every group over them (`groups`, by gid)."""

    def __init__(self, rank: int, world: int, kinds: Sequence[LinkKind], cv: CountedCondition | None = None) -> None:
        self.rank = rank
        self.world = world
        self.kinds = list(kinds)
        self.broken: BaseException | None = None  # (Sink.broken) the engine itself is closed
        self.closed = False
        self.last_traffic = time.monotonic()
        # One lock for the engine; the in-memory kind passes one shared by its whole world.
        self._cv = cv or CountedCondition()
        self._lock = self._cv.mutex  # the same lock, taken without the Condition's wrappers
        # What completes a request (lock held): wakes the threads asleep waiting for one (a single test when
        # nobody sleeps). Links never take or hold the engine's lock themselves.
        self.signal = self._cv.signal
        self.groups: dict[int, "Transport"] = {}
        # The agreement on new groups and the ledger of group ids (protocol/agreement.py): which ids are
        # live, which are over but may still see frames, what a frame for an id not live here means.
        self.agreement = Agreement(rank)
        self._agreeing = threading.Lock()  # one agreement at a time over this engine
        self._orphans: list[tuple[int, Frame, bytes]] = []  # whole frames for a group not made here yet
        self._early: list[tuple[int, control.Abort]] = []  # ABORTs of a group not made here yet
        # Memory this host's ranks read directly, for the collectives designed for it (a kind that has some
        # offers it: shm); the group made at set-up uses it.
        self.window_memory: WindowMemory | None = None
        # Checks the layers above add, by name (the shared window's): run when a whole sleep passed with
        # nothing to do, to find a peer visibly in another op. Each raises nothing; it fails its group.
        self.watchers: dict[str, Callable[[], None]] = {}
        self._route: dict[int, Link] = {}
        for kind in self.kinds:
            for peer, link in kind.links.items():
                link.peer = peer
                self._route[peer] = link
            kind.attach(self)
            if kind.window is not None:
                self.window_memory = kind.window
        self._links = [self._route[p] for p in sorted(self._route)]
        self.posts = 0  # (Sink.posts) receives posted, groups failed or made: links re-offer held frames
        self._gone: set[int] = set()  # peers that said BYE: they send nothing more
        self._dead: set[int] = set()  # peers whose link failed
        self._failing: set[int] = set()  # peers whose link is failing now (its groups are being told)
        self._flusher: threading.Thread | None = None  # writes what failed groups still have to say
        self._flush_until = 0.0
        # Kinds with something to do after a round of posting or pumping (ring doorbells): only those.
        self._after = [k.after_pump for k in self.kinds if type(k).after_pump is not LinkKind.after_pump]
        self._last_probe = time.monotonic()  # (probes: see `_probe`)
        self.probes_sent = 0
        self._by_fd: dict[int, Link] = {}
        self._progress_lock = threading.Lock()
        # A doorbell for the driving thread while it sleeps in poll(): other threads ring it when they post
        # work it must pick up. `_polling` says whether anyone is asleep there.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._polling = False
        self._quiet = False  # the last sleep passed with nothing to do
        self._spinner = SpinGuard()
        self.spin = max((k.spin for k in self.kinds), default=0.0)
        # Kinds that can tell cheaply whether a pump would move anything; for the others a spin polls fds.
        self._lookers = [k for k in self.kinds if k.ready() is not None]
        self._polled = len(self._lookers) < len(self.kinds)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent, over every kind of link."""
        return sum(k.bytes_sent for k in self.kinds)

    @property
    def bytes_received(self) -> int:
        return sum(k.bytes_received for k in self.kinds)

    @property
    def kind(self) -> str:
        """What the links are: "tcp", "shm", "memory", or "shm+tcp" for a multi-host job."""
        return "+".join(sorted(k.name for k in self.kinds)) or "none"

    def link_kind(self, name: str) -> LinkKind | None:
        for k in self.kinds:
            if k.name == name:
                return k
        return None

    def link(self, peer: int) -> Link | None:
        return self._route.get(peer)

    # -- groups ---------------------------------------------------------------------------------------------
    def add_group(self, rec: Record, names: RankNames | None = None) -> "Transport":
        """(Lock held.) The group the agreement made (`rec`, live in its ledger). Frames that came for it before
        it was made are its own now; a member already lost makes it fail at once."""
        if self.closed:
            raise BackendClosedError(f"rank {self.rank}: the transport is closed")
        group = Transport.__new__(Transport)
        group._init_view(self, rec.gid, list(rec.members), names, identity(rec.gid, rec.members, rec.view))
        group.view = rec.view
        self.groups[rec.gid] = group
        self._reoffer()
        gone = [m for m in rec.members if m in self._dead or m in self._gone]
        if gone and group.broken is None:
            gr = group.rank_of[gone[0]]
            group.fail(peer_lost(group.rank, gr, f"rank {gr} was lost before the new group was made",
                                 address=self.peer_address(gone[0])))
        return group

    def _reoffer(self) -> None:
        """(Lock held.) The ledger changed: what was held back for a group not made here yet is offered again
        (made now: its own; over for good: dropped)."""
        orphans, self._orphans = self._orphans, []
        for peer, frame, data in orphans:  # (only the in-memory kind, which never holds a frame back)
            self.delivered_whole(peer, frame, data)
        early, self._early = self._early, []
        for peer, msg in early:
            self.said(peer, msg)
        self.posts += 1  # links offer again the frames they hold back

    def _group_closed(self, group: "Transport") -> None:
        """`group` is over (lock held): its id stays taken until its members are done with it; the engine
        closes with its last group."""
        self.groups.pop(group.gid, None)
        self.agreement.closed(group.gid, [group.members[r] for r in group._gone])
        self.posts += 1  # its frames still held back are discarded now
        if not self.groups:
            self._close()

    def _say(self, sends: "Iterable[tuple[int, control.Message]]") -> None:
        """(Lock held.) The agreement's messages, each to its peer while its link is up."""
        for peer, msg in sends:
            if peer not in self._dead and peer not in self._gone:
                self._route[peer].say(msg)

    # -- the sink: what the links report (lock held) ----------------------------------------------------------
    def delivered(self, peer: int, frame: Frame, early: int) -> "tuple[memoryview, object] | None":
        gid = frame.space >> 1
        group = self.groups.get(gid)
        if group is None:
            # Of a group that is over here (or will never be made here): dropped; else of a group not made
            # here yet: held back until it is (`add_group`).
            return DISCARD if self.agreement.fate(peer, gid) == "drop" else None
        if group.broken is not None:
            return DISCARD
        gr = group.rank_of.get(peer)
        if gr is None:
            raise ProtocolError(f"rank {self.rank}: rank {peer} sent a frame of group {gid}, which it is not in")
        try:
            if not frame.space & 1 and frame.tag <= group.retired:
                raise group.stray(gr, frame.sig, frame.tag)  # no receive can be waiting for it
            return group.matcher.match(gr, frame, early)
        except (MismatchError, ProtocolError) as exc:  # the group's error (nothing was copied): not the link's
            group.fail(exc)
            return DISCARD

    def delivered_whole(self, peer: int, frame: Frame, data: "bytes | memoryview") -> None:
        """A whole message of one part, delivered at once (the in-memory kind, whose sends never wait): kept
        here until its group is made, or dropped when the group is over."""
        got = self.delivered(peer, frame, -1)
        if got is None:
            self._orphans.append((peer, frame, bytes(data)))
        elif got is not DISCARD:
            view, target = got
            view[:] = data
            self.completed(peer, frame.key, target, frame.length)

    def completed(self, peer: int, key: Key, target: object, nbytes: int) -> None:
        if type(target) is Request and target.is_send:
            target.done = True
            self.signal()
            return
        group = self.groups.get(key[0] >> 1)
        if group is not None and group.matcher.part_done(group.rank_of[peer], key, target, nbytes):
            self.signal()

    def failed(self, peer: int, exc: BaseException, where: str = "", address: str = "") -> None:
        """The link to `peer` cannot go on: every group holding `peer` fails, naming it, and tells every member
        why, `peer` too where its link can still carry it (RDMA's control connection outlives its queue pairs;
        over a TCP stream the peer reset, the attempt fails quietly). The link is used no more; its sockets
        stay until the engine closes, so that what was said reaches the peer."""
        if peer in self._dead or peer in self._failing or self.closed:
            return
        self._failing.add(peer)
        lost = not isinstance(exc, ThunderboltError)
        link = self._route.get(peer)
        address = address or (link.address if link is not None else "")
        for group in list(self.groups.values()):
            gr = group.rank_of.get(peer)
            if gr is None or group.broken is not None:
                continue
            if not lost and not isinstance(exc, PeerLostError):
                err: BaseException = exc if len(self.groups) == 1 else type(exc)(str(exc))  # each its own copy
            elif isinstance(exc, PeerLostError):
                err = exc if len(self.groups) == 1 else peer_lost(group.rank, gr, str(exc).partition(": ")[2],
                                                                  address=address)
            else:
                err = group.lost(gr, where, exc, address)
            group.fail(err)
            if link is not None and lost:  # its sends queued to the dead peer: its error too (fail skips them)
                link.abort(err, None, group.gid)
        self._dead.add(peer)
        self._failing.discard(peer)
        self.agreement.peer_lost(peer)
        self._reoffer()
        if link is not None:
            link.abort(exc, None, -1)
        self.signal()

    def said(self, peer: int, msg: "control.Message") -> None:
        if isinstance(msg, control.Bye):
            self._gone.add(peer)
            self.agreement.peer_lost(peer)
            for group in list(self.groups.values()):
                if peer in group.rank_of:
                    group.peer_left(group.rank_of[peer], f"({self.peer_address(peer)})")
            self._reoffer()
            self.signal()
            return
        if isinstance(msg, (control.Propose, control.Commit, control.Done)):
            sends, broken = self.agreement.receive(peer, msg)
            self._say(sends)
            for gid in broken:
                group = self.groups[gid]
                gr = group.rank_of[peer]
                group.fail(PeerAbortedError(
                    f"rank {group.rank}: rank {gr} gave up making this group (its call ended with an error after "
                    f"the others had made it): call it again on every rank that stays"))
            if isinstance(msg, control.Done):
                self._reoffer()
            self.signal()
            return
        gid = (msg.info.group if isinstance(msg, control.Abort) else msg.epoch if isinstance(msg, control.Leave)
               else msg.op.space >> 1 if isinstance(msg, (control.Ping, control.Answer)) else -1)
        group = self.groups.get(gid)
        if group is None or peer not in group.rank_of:
            if isinstance(msg, control.Ping):  # (a group over here, or not made yet: nothing to tell)
                self._route[peer].say(control.Answer(control.Op(msg.op.space, msg.op.tag, msg.op.sig, -1)))
            elif isinstance(msg, control.Leave) and group is None:
                self.agreement.left(peer, gid)
                self._reoffer()
            elif isinstance(msg, control.Abort) and group is None and self.agreement.fate(peer, gid) == "hold":
                self._early.append((peer, msg))  # the group it failed may still be made here: it fails then
            return
        group.heard(group.rank_of[peer], msg)

    # -- waiting --------------------------------------------------------------------------------------------
    def progress(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """Move data, blocking at most `timeout` seconds. `until`: one more condition worth returning early
        for (a shared window's counters). One thread drives at a time; the others sleep until it reports
        completions (or 50 ms pass)."""
        if not self._progress_lock.acquire(blocking=False):
            with self._lock:  # another thread drives the engine; it notifies on completions
                if timeout > 0:
                    self._cv.sleep(min(timeout, 0.05 if until is None else 0.001))
            return
        try:
            self._drive(timeout, until or _never)
        finally:
            self._progress_lock.release()
            with self._lock:
                self._cv.signal()

    def pump_if_idle(self) -> None:
        """Pump once if no thread drives the engine now (a kind's own thread keeping its protocol going)."""
        if not self._progress_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                if self.broken is None:
                    self._pump()
        finally:
            self._progress_lock.release()
            with self._lock:  # a waiter that found the engine taken sleeps until notified
                self._cv.signal()

    def _drive(self, timeout: float, done: Callable[[], bool]) -> None:
        with self._lock:
            if self._pump() or timeout <= 0 or self.broken is not None or done():
                self._quiet = False
                return
            for kind in self.kinds:
                kind.idle(False)
            self._probe()
            spin_poll = self._poll_set() if self._polled and not self._quiet and self.spin > 0 else None
        # Spin only when traffic is flowing; a rank that already slept through a whole poll is waiting for
        # something slow (a late peer, the user's compute) and spinning would just burn CPU.
        if not self._quiet and self._spinner.spin(min(self.spin, timeout), lambda: self._look(done, spin_poll)):
            return
        with self._lock:
            caps = [c for kind in self.kinds if (c := kind.before_sleep(self._quiet)) is not None]
            if self._pump() or self.broken is not None or done():
                for kind in self.kinds:
                    kind.after_sleep()
                return
            poller = self._poll_set()
            self._polling = True
        try:
            events = poller.poll(min([timeout, *caps]) * 1000.0)
        finally:
            self._polling = False
            for kind in self.kinds:
                kind.after_sleep()
        self._drain_wake()
        with self._lock:
            woken = {self._by_fd[fd] for fd, _ in events if fd in self._by_fd}
            moved = self._pump(woken)
            self._quiet = not moved and not events
            if self._quiet and self.broken is None:
                for check in list(self.watchers.values()):
                    check()
                for kind in self.kinds:
                    if self.broken is None:
                        kind.idle(True)
                self._probe()

    def _look(self, done: Callable[[], bool], poller: "select.poll | None") -> bool:
        """One look while spinning: cheap checks first (no lock, no system call), then pump if worth it."""
        if done():
            return True
        if not any(k.ready() for k in self._lookers) and not (poller is not None and poller.poll(0)):
            return False
        with self._lock:
            return self._pump() or self.broken is not None

    def _pump(self, woken: "set[Link] | None" = None) -> bool:
        """Every live link writes and reads what it can without blocking (`woken`: links whose descriptors
        woke a poll); True if anything moved (or broke)."""
        moved = False
        dead = self._dead
        for link in self._links:
            if self.broken is not None:
                return True
            if link.peer not in dead:
                moved |= link.pump(woken is not None and link in woken)
        for after in self._after:
            after()
        if moved:
            self.last_traffic = time.monotonic()
        return moved

    def _probe(self) -> None:
        """Nothing moved for the kinds' `probe_after` seconds: a PING to each probed peer a group waits on,
        naming the collective op it waits for (space, tag and signature). A peer that ran that op differently
        (another root, another collective) sends us nothing for it and would otherwise only be found by the
        group timeout; its MismatchDetector compares and fails the group, and its ANSWER says whom it waits
        on itself."""
        now = time.monotonic()
        if now - max(self.last_traffic, self._last_probe) < min(
                (k.probe_after for k in self.kinds if k.probe_after is not None), default=float("inf")):
            return
        self._last_probe = now
        probed = {p for k in self.kinds if k.probe_after is not None for p in k.links}
        for group in list(self.groups.values()):
            if group.broken is not None:
                continue
            members = group.members
            for gr, op in group.ops.probes([group.rank_of[p] for p in probed if p in group.rank_of]).items():
                peer = members[gr]
                if peer not in self._gone and peer not in self._dead:
                    self.probes_sent += 1
                    self._route[peer].say(control.Ping(op))

    def look(self) -> None:
        """Read what the links already hold, without waiting: one poll(0) over their descriptors, then a pump
        of every link, those found readable woken."""
        with self._lock:
            if self.broken is not None:
                return
            poller = self._poll_set()
            by_fd = self._by_fd
            self._pump({by_fd[fd] for fd, _ in poller.poll(0) if fd in by_fd})
            # A thread asleep in the engine's poll() would miss what this pump read (it drained the descriptors
            # that were to wake that thread): it goes round its loop again.
            self.wake_sleeper()

    def _poll_set(self) -> "select.poll":
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd = {}
        for link in self._links:
            if link.peer in self._dead:
                continue
            for fd, events in link.fds():
                poller.register(fd, events)
                by_fd[fd] = link
        self._by_fd = by_fd
        return poller

    def wake_sleeper(self) -> None:
        """Wake the thread asleep in this engine's poll(), if any (a peer of the same process has news)."""
        if self._polling:
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def flush_soon(self) -> None:
        """(Lock held.) What the links still have to write (a failed group's ABORTs, behind the rest of a frame
        in flight) is written by a thread of the engine's, for at most ABORT_GRACE seconds, whether or not
        anyone drives the engine: the rank that failed may return to a user who never calls it again, or exits
        (closing the group first waits for it)."""
        self._flush_until = time.monotonic() + ABORT_GRACE
        if self._flusher is None or not self._flusher.is_alive():
            flusher = threading.Thread(target=self._flush, name=f"tb-flush-r{self.rank}", daemon=True)
            flusher.start()
            self._flusher = flusher  # (seen started only: wait_flushed reads it without the lock)

    def _flush(self) -> None:
        while time.monotonic() < self._flush_until and not self.closed:
            self.pump_if_idle()
            with self._lock:
                if self.closed or not any(events & select.POLLOUT for link in self._links if link.peer not in self._dead
                                          for _, events in link.fds()):
                    return
            time.sleep(0.001)

    def wait_flushed(self) -> None:
        """Until the flusher is done (outside the lock)."""
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(max(0.0, self._flush_until - time.monotonic()) + 0.1)

    def eager(self) -> bool:
        """Whether a waiter may busy-poll now: this engine spins at all, its last wait did not sleep through
        a whole poll, and its core is not contended (see spin.py)."""
        return self.spin > 0 and not self._quiet and not self._spinner.paused()

    # -- the end --------------------------------------------------------------------------------------------
    def _close(self) -> None:
        """The last group is closed (lock held): BYE on every live link, release the kinds, join their
        threads (outside the lock: a kind's thread may need it to finish)."""
        if self.closed:
            return
        self.closed = True
        for link in self._links:  # a dead peer's link too: its sockets are released now, not by the collector
            link.close(bye=link.peer not in self._dead)
        self.broken = BackendClosedError(f"rank {self.rank}: the transport is closed")
        for s in (self._wake_r, self._wake_w):
            s.close()
        for kind in self.kinds:
            kind.release()
        self._cv.signal()

    def join_threads(self) -> None:
        for kind in self.kinds:
            for thread in kind.threads:
                if thread is not threading.current_thread():
                    thread.join(1.0)

    def held(self, peer: int) -> Frame | None:
        """The header of the oldest frame from engine rank `peer` its link holds back or has not read yet
        (see `Link.held`), or None."""
        with self._lock:
            link = self._route.get(peer)
            return link.held() if link is not None and peer not in self._dead else None

    def peer_address(self, peer: int) -> str:
        link = self._route.get(peer)
        return link.address if link is not None else f"rank {peer}"


class Transport:
    """One group over an engine: what the algorithms and the backend move bytes with. `Transport(rank, world,
    kinds)` makes an engine over `kinds` and the group of all its ranks; `split` and `shrink` make more
    groups over the same engine. Ranks here are the group's (0..world-1); `members[i]` is group rank i's
    engine rank. `names`: how errors name the ranks of a subgroup (None: its ranks are the global ones)."""

    def __init__(self, rank: int, world: int, kinds: Sequence[LinkKind], cv: CountedCondition | None = None,
                 names: RankNames | None = None) -> None:
        engine = Engine(rank, world, kinds, cv)
        members = list(range(world))
        # The set-up group's mark is 0: its signatures are the algorithms' own, and any agreed group's differs.
        self._init_view(engine, 0, members, names, 0)
        engine.agreement.add(0, members)
        engine.groups[0] = self
        self.window_memory = engine.window_memory

    def _init_view(self, engine: Engine, gid: int, members: list[int], names: RankNames | None, ident: int) -> None:
        self.engine = engine
        self.gid = gid
        self.members = members
        self.view: tuple[int, ...] = ()  # the proposals it was agreed from (none: the group made at set-up)
        # Mixed into the low half of every message signature of this group (its readable half stays), so a
        # frame of another group that shares this id by any route is a MismatchError, never taken as data.
        self.mark = (ident ^ (ident >> 32)) & 0xFFFFFFFF
        self.rank = members.index(engine.rank)
        self.world = len(members)
        self.rank_of = {e: i for i, e in enumerate(members)}
        self.coll, self.p2p = 2 * gid, 2 * gid + 1  # the spaces of this group's messages
        self.names = names
        self.broken: BaseException | None = None
        self.closed = False
        self.retired = 0  # every collective op up to this tag has finished on this rank
        self.matcher = Matcher(self.rank)
        # What peers say about the op they are in, whichever kind carries it: mismatches are decided there,
        # and whom a peer waits on (a timeout then blames the end of the chain).
        self.ops = MismatchDetector(self.rank, self.matcher, self.coll)
        self._p2p_send_seq: dict[tuple[int, int], int] = defaultdict(int)
        self._gone: set[int] = set()  # group ranks that left this group (their LEAVE, or BYE)
        # The link of each group rank (None: this rank), and the lock: the engine's.
        self._link_of: list[Link | None] = [engine._route.get(e) for e in members]
        self._lock = engine._lock
        self._cv = engine._cv
        self.window_memory: WindowMemory | None = None  # (the set-up group's: the engine's window memory)

    # -- what the engine has ---------------------------------------------------------------------------------
    @property
    def kinds(self) -> list[LinkKind]:
        return self.engine.kinds

    @property
    def kind(self) -> str:
        return self.engine.kind

    def link_kind(self, name: str) -> LinkKind | None:
        return self.engine.link_kind(name)

    @property
    def bytes_sent(self) -> int:
        return self.engine.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.engine.bytes_received

    @property
    def last_traffic(self) -> float:
        return self.engine.last_traffic

    @property
    def spin(self) -> float:
        return self.engine.spin

    @property
    def watchers(self) -> dict[str, Callable[[], None]]:
        return self.engine.watchers

    @property
    def probes_sent(self) -> int:
        return self.engine.probes_sent

    def eager(self) -> bool:
        return self.engine.eager()

    def progress(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        self.engine.progress(timeout, until)

    def pump_if_idle(self) -> None:
        self.engine.pump_if_idle()

    def wake_sleeper(self) -> None:
        self.engine.wake_sleeper()

    # -- what peers said about this group (engine lock held) ---------------------------------------------------
    def heard(self, peer: int, msg: "control.Message") -> None:
        """Group rank `peer` said `msg` about this group (PING, ANSWER, ABORT or LEAVE)."""
        try:
            if isinstance(msg, control.Ping):
                behind = self.ops.peer_waits_for(peer, msg.op)  # MismatchError when we ran that op otherwise
                op = msg.op
                waits_on = -1 if behind is None else self.members[behind]
                self._link_of[peer].say(control.Answer(control.Op(op.space, op.tag, op.sig, waits_on)))
            elif isinstance(msg, control.Answer):
                op = msg.op
                gr = self.rank_of.get(op.waits_on, -1)
                self.ops.peer_waits_on(peer, control.Op(op.space, op.tag, op.sig, gr, op.counters))
            elif isinstance(msg, control.Abort):
                self.peer_aborted(peer, msg.info)
            elif isinstance(msg, control.Leave):
                self._gone.add(peer)
                self.peer_left(peer, f"({self.peer_address(peer)})")
        except ThunderboltError as exc:
            self.fail(exc)

    # -- posting --------------------------------------------------------------------------------------------
    def isend(self, peer: int, key: Key, buf: memoryview, sig: int = 0) -> Request:
        self._check_peer(peer)
        if sig:
            sig ^= self.mark
        view = bytes_view(buf)
        with self._lock:
            self.check_usable()
            self.ops.note_post(key, sig)
            engine = self.engine
            req = self._link_of[peer].send(key, sig, view)
            engine._quiet = False
            for after in engine._after:
                after()
            if req is None:  # it went at once: the caller still gets a Request to wait on
                req = Request(peer, key, sig, view, is_send=True)
                req.done = True
            else:
                req.peer = peer  # (the link made it with its engine rank)
                if engine._polling and not req.done:
                    engine._wake()
        return req

    def irecv(self, peer: int, key: Key, buf: memoryview, sig: int = 0) -> Request:
        return self._irecv(peer, key, buf, sig ^ self.mark if sig else 0)

    def _irecv(self, peer: int, key: Key, buf: memoryview, sig: int) -> Request:
        """irecv with `sig` already marked with this group's identity."""
        if peer != ANY_SOURCE:
            self._check_peer(peer)
        req = Request(peer, key, sig, bytes_view(buf), is_send=False)
        with self._lock:
            self.check_usable()
            self.ops.note_post(req.key, req.sig)
            try:
                self.matcher.post(req)  # it may match a message that arrived before the peer said BYE
            except MismatchError as exc:  # an early message of another type: nothing was copied into `buf`
                self.fail(exc)  # the sender is told too, as when the message arrives after the receive
                raise
            engine = self.engine
            engine.posts += 1  # a link holding back a frame looks at it again at its next pump
            engine._quiet = False
            if not req.done and peer != ANY_SOURCE and (peer in self._gone or self.members[peer] in engine._gone):
                self.matcher.posted.pop((peer, req.key), None)
                raise peer_shut_down(self.rank, peer, f"data for this receive ({req.describe()})",
                                     address=self.peer_address(peer))
            if req.done:
                engine.signal()
            elif engine._polling:
                engine._wake()
        return req

    def isend_p2p(self, peer: int, tag: int, buf: memoryview, sig: int = 0) -> Request:
        """Send `buf` to `peer` as its next message with `tag`. `sig`: what the bytes are (the backend's
        dtype and element count, protocol.signature), checked against the receive's before any byte lands."""
        with self._lock:
            seq = self._p2p_send_seq[(peer, tag)]
            self._p2p_send_seq[(peer, tag)] = seq + 1
        return self.isend(peer, (self.p2p, tag, seq), buf, sig)

    def irecv_p2p(self, peer: int, tag: int, buf: memoryview, sig: int = 0) -> Request:
        """Receive the next message with `tag` from `peer` (or from any peer with ANY_SOURCE); `sig` as for
        isend_p2p (0 takes any message of the right size)."""
        # The sequence number is assigned at match time (see matching.Matcher), so -1 here.
        return self.irecv(peer, (self.p2p, tag, -1), buf, sig)

    def exchange(self, sends: Sequence[tuple[int, Key, memoryview]], recvs: Sequence[tuple[int, Key, memoryview]],
                 sig: int, deadline: float | None, what: object = "", retire: int = 0) -> None:
        """Send each (peer, key, bytes) of `sends`, receive each of `recvs`, and wait for all of them: the
        messages of one collective op (collective keys, signature `sig`), sends first. The one path of a
        small op's messages, taken under the engine's lock once: every send its link writes whole at once
        needs no Request, and once all are written, every receive whose link can take its peer's whole
        message itself (`Link.take`) is read in this thread's own spin, with no Request, matching or poll().
        What is not in when the spin ends, or finds something else first, goes the general way.
        `retire`: the op's tag when these are all its messages (the op is retired here, see `retire`)."""
        if not sends and not recvs:
            return
        if sig:
            sig ^= self.mark
        reqs: list[Request] = []
        left: Sequence[tuple[int, Key, memoryview]] = recvs
        with self._lock:
            if self.broken is not None or self.closed:
                self.check_usable()
            self.ops.note_post((sends or recvs)[0][1], sig)
            link_of = self._link_of
            for peer, key, buf in sends:
                r = link_of[peer].send(key, sig, buf)
                if r is not None:
                    r.peer = peer
                    reqs.append(r)
            engine = self.engine
            for after in engine._after:
                after()
            engine._quiet = False
            if recvs and not reqs:  # (a send still to write needs pumping: the spin below only reads)
                left = self._take(recvs, sig, deadline)
                if not left and retire:
                    self._retire(retire)
                    return
            if engine._polling and reqs:
                engine._wake()
        for peer, key, buf in left:
            reqs.append(self._irecv(peer, key, buf, sig))
        for r in reqs:
            if not r.done:
                self.wait(reqs, deadline, what)
                break
        if retire:
            self.retire(retire)

    def _take(self, recvs: Sequence[tuple[int, Key, memoryview]], sig: int,
              deadline: float | None) -> Sequence[tuple[int, Key, memoryview]]:
        """`exchange`'s receives read by the links themselves (`Link.take`) while this thread spins, the lock
        held; returns those left to receive the general way. One message per peer at most (two readers of
        one stream would take each other's bytes), none that a link already delivered to the matcher."""
        unexpected = self.matcher.unexpected
        if unexpected and any((p, key) in unexpected for p, key, _ in recvs):
            return recvs
        link_of = self._link_of
        if len(recvs) == 1:  # (two ranks: one message, looked at without a list of its own)
            peer, key, dest = recvs[0]
            link = link_of[peer]
            got = link.take(key, sig, dest)
            if got == NOT_YET:
                got = self._spin_take(link, key, sig, dest, deadline)
            return () if got == TAKEN else recvs
        if len({p for p, _, _ in recvs}) < len(recvs):
            return recvs
        refused: list[tuple[int, Key, memoryview]] = []
        todo = self._look_all(recvs, sig, refused)
        engine = self.engine
        spinner = engine._spinner
        if not todo or engine.spin <= 0 or spinner.paused():
            return refused + todo
        now = time.monotonic()
        end = now + (engine.spin if deadline is None else min(engine.spin, deadline - now))
        while todo and now < end:
            yield_cpu()
            after = time.monotonic()
            if after - now > SLOW_YIELD:
                spinner.slow(after)
                return refused + todo
            now = after
            todo = self._look_all(todo, sig, refused)
            if self.broken is not None:
                raise self.broken
        spinner.calm()
        return refused + todo

    def _look_all(self, recvs: Sequence[tuple[int, Key, memoryview]], sig: int,
                  refused: list[tuple[int, Key, memoryview]]) -> list[tuple[int, Key, memoryview]]:
        """One `take` per receive: those still to come (refused ones are added to `refused`)."""
        link_of = self._link_of
        todo = []
        for r in recvs:
            got = link_of[r[0]].take(r[1], sig, r[2])
            if got == NOT_YET:
                todo.append(r)
            elif got != TAKEN:
                refused.append(r)
        return todo

    def _spin_take(self, link: Link, key: Key, sig: int, dest: memoryview, deadline: float | None) -> int:
        """Look for one message again and again (yielding the core between looks) for up to the engine's spin:
        TAKEN, NOT_YET (the spin is over) or REFUSED. A yield that took long (another thread wanted this
        core) ends the spin: the general path sleeps in poll() instead."""
        engine = self.engine
        spinner = engine._spinner
        if engine.spin <= 0 or spinner.paused():
            return NOT_YET
        now = time.monotonic()
        end = now + (engine.spin if deadline is None else min(engine.spin, deadline - now))
        while now < end:
            yield_cpu()
            after = time.monotonic()
            if after - now > SLOW_YIELD:
                spinner.slow(after)
                return NOT_YET
            now = after
            got = link.take(key, sig, dest)
            if got != NOT_YET:
                spinner.calm()
                if self.broken is not None:
                    raise self.broken
                return got
        spinner.calm()
        return NOT_YET

    # -- waiting --------------------------------------------------------------------------------------------
    def wait(self, reqs: Sequence[Request], deadline: float | None = None, what: object = "") -> None:
        """Block until every request is done; raise its error, or CollectiveTimeout at `deadline`. `what`:
        the op, as errors name it (anything printable: formatted only when an error needs it)."""
        self._wait_until(reqs, all, deadline, what)

    def wait_any(self, reqs: Sequence[Request], deadline: float | None = None, what: object = "",
                 arrived: Iterable[int] = ()) -> None:
        """Block until at least one request is done (raising the first error found). `arrived`: peers
        already heard from in this op (named as "did not arrive" only if they are not)."""
        self._wait_until(reqs, any, deadline, what, arrived)

    def _wait_until(self, reqs: Sequence[Request], how: "Callable[[Iterable[bool]], bool]",
                    deadline: float | None, what: object, arrived: Iterable[int] = ()) -> None:
        late = False  # the deadline passed and the links were pumped once more since
        while True:
            for r in reqs:
                if r.error is not None:
                    raise r.error
            if how(r.done for r in reqs):
                return
            if self.broken is not None:
                raise self.broken
            if self.closed:
                self.check_usable()
            if late:
                raise self._timeout_error(reqs, what, arrived)
            now = time.monotonic()
            # At the deadline, what the peers said while this rank was away (a frozen rank woken late: their
            # ABORT naming it) is read before this rank blames anyone: one more pump, then the checks above.
            late = deadline is not None and now >= deadline
            self.engine.progress(0.0 if late else 0.2 if deadline is None else min(0.2, deadline - now))

    def test(self, reqs: Iterable[Request]) -> bool:
        reqs = list(reqs)
        if not all(r.done for r in reqs) and self.broken is None:
            self.engine.progress(0.0)
        for r in reqs:
            if r.error is not None:
                raise r.error
        return all(r.done for r in reqs)

    # -- life cycle -----------------------------------------------------------------------------------------
    def retire(self, tag: int) -> None:
        """Collective op `tag` finished on this rank: data for it (or older ops) that still arrives is an
        error, and so is data for it a link read ahead and kept that no receive took."""
        with self._lock:
            self._retire(tag)

    def _retire(self, tag: int) -> None:
        self.retired = max(self.retired, tag)
        coll = self.coll
        for gr, link in enumerate(self._link_of):
            held = link.held() if link is not None else None
            if held is not None and held.space == coll and held.tag <= tag and self.broken is None:
                self.fail(self.stray(gr, held.sig, held.tag))
        if self.matcher.unexpected and self.broken is None:
            for (peer, key), u in self.matcher.unexpected.items():
                if key[0] == coll and key[1] <= tag and u.claimed_by is None:
                    self.fail(self.stray(peer, u.sig, key[1]))
                    break
        if self.broken is not None:
            raise self.broken

    def abort(self, error: BaseException) -> None:
        """Enter the BROKEN state with `error` and tell every peer why, so they fail fast and clearly too."""
        self.fail(error)

    def stray(self, peer: int, sig: int, tag: int) -> MismatchError:
        """What collective data from `peer` for op `tag`, which this rank finished without taking it, means."""
        return MismatchError(
            f"rank {self.rank}: rank {peer} sent {describe_sig(sig)} data for op #{tag}, which this rank "
            f"finished without expecting data from rank {peer} (different collectives, roots or order)")

    def lost(self, peer: int, where: str, exc: BaseException, address: str = "") -> PeerLostError:
        """What a broken connection to group rank `peer` becomes, with the OS error as its cause: the one
        place a socket error turns into the error the user sees."""
        return peer_lost(self.rank, peer, f"lost the connection to rank {peer} {where}", cause=exc, address=address)

    def fail(self, err: BaseException, tell_peers: bool = True) -> None:
        """Enter BROKEN for good: every pending and queued request of this group gets `err` at once, later
        operations get it from `check_usable`, and the members learn the root cause (an ABORT naming this
        group, with the ranks it names as engine ranks). The links stay: frames of this group that still
        arrive are dropped, and other groups over them go on."""
        engine = self.engine
        with self._lock:
            if self.broken is not None:
                return
            if self.names is not None:
                self.names.apply(err)
            for kind in engine.kinds:  # once, through the first kind that reports (each has its logger)
                if kind.log is not None:
                    kind.log.error("%s", err)
                    break
            self.broken = err
            for r in self.matcher.pending():
                r.error = err
            info = None
            if tell_peers:
                info = AbortInfo.of(err, self.rank)
                members = self.members
                on_engine = (lambda r: members[r] if 0 <= r < self.world else r)  # noqa: E731
                info = AbortInfo(info.error, info.reason, engine.rank, on_engine(info.peer),
                                 tuple(on_engine(r) for r in info.ranks), self.gid)
            for gr, link in enumerate(self._link_of):
                if link is not None and self.members[gr] not in engine._dead:
                    link.abort(err, info if self.members[gr] not in engine._gone else None, self.gid)
            engine.posts += 1  # frames of this group held back by a link are dropped at its next pump
            if info is not None:
                engine.flush_soon()
            engine.signal()

    def peer_aborted(self, peer: int, info: AbortInfo) -> None:
        """Group rank `peer` told us why it failed (an ABORT's AbortInfo, ranks as engine ranks): fail with its
        reason, and forward it."""
        rank_of = self.rank_of
        local = AbortInfo(info.error, info.reason, rank_of.get(info.rank, info.rank), rank_of.get(info.peer, info.peer),
                          tuple(rank_of.get(r, r) for r in info.ranks), self.gid)
        self.fail(remote_error(self.rank, peer, local))

    def peer_left(self, peer: int, where: str) -> None:
        """Group rank `peer` left the group in order (its LEAVE, or BYE): fine unless we still expect data
        from it."""
        waiting = [r for r in self.matcher.pending() if r.peer == peer and not r.is_send]
        if waiting:
            self.fail(peer_shut_down(self.rank, peer, f"data from it {where} ({waiting[0].describe()})",
                                     address=self.peer_address(peer)))

    def close(self) -> None:
        """This group is over on this rank: its members hear LEAVE (a wait for our data fails at once), and
        the engine closes with its last group (once what failed groups had to say is written)."""
        engine = self.engine
        if len(engine.groups) <= 1:
            engine.wait_flushed()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.broken is None:
                err = BackendClosedError(f"rank {self.rank}: the process group was shut down")
                for r in self.matcher.pending():
                    r.error = err
                if len(engine.groups) > 1:  # (the last group's BYE says it for every group)
                    for gr, link in enumerate(self._link_of):
                        if link is not None and self.members[gr] not in engine._dead | engine._gone:
                            link.say(control.Leave(self.gid))
            if self.window_memory is not None:
                self.window_memory = None
            engine._group_closed(self)
        if engine.closed:
            engine.join_threads()

    # -- more groups over the same links ------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], deadline: float, what: object = "split_group",
              names: RankNames | None = None) -> "Transport":
        """A new group of this group's ranks `ranks` (this rank among them), over the same links: every rank
        of `ranks` calls this together (the others need not). They agree on the new group's id over the
        links (`_agree`); nothing else is set up, and this group goes on beside it. `names`: how the new
        group's errors name its ranks."""
        members = sorted({self.members[r] for r in ranks})
        if self.engine.rank not in members:
            raise ValueError(f"rank {self.rank}: {what} of ranks {sorted(ranks)}, which this rank is not in")
        return self._agree(members, deadline, what, names)

    def shrink(self, excluded: Sequence[int], deadline: float, what: object = "shrink_group",
               names: RankNames | None = None, abort: bool = True) -> "Transport":
        """The group of this group's ranks but `excluded`, over the same links, made by the ranks that stay
        (each calls this): the ranks that stay agree on the new group as `split` does, and this group is over
        (its ops in flight fail, never with a wrong result: if no loss broke it already, its members hear why
        in an ABORT, the excluded ones too). Frames of this group still on their way are dropped. `abort`:
        this group is over before the agreement, ending the ops in flight of every member at once; else
        after it, so that each rank that stays finishes the ops it runs before its own call (a healthy
        group shrunk right after an op: the others may still be in that op when this rank is done)."""
        excluded = sorted(set(excluded))
        if self.rank in excluded:
            raise ValueError(f"rank {self.rank}: {what} excludes this rank itself (only the ranks that stay call it)")
        stay = [r for r in range(self.world) if r not in excluded]
        over = BackendClosedError(
            f"rank {self.rank}: this group was shrunk to ranks {stay} by {what}, excluding ranks {excluded}: the "
            f"ranks that stay go on in the group it returned; an excluded rank must stop or start again")
        if abort:
            self.fail(over)
        try:
            return self.split(stay, deadline, what, names)
        finally:
            self.fail(over)

    def _agree(self, members: list[int], deadline: float, what: object, names: RankNames | None) -> "Transport":
        """A new group over engine ranks `members`, agreed with every other member over the live links
        (protocol/agreement.py): made on every member, or on none that goes on using it. MismatchError when a
        member proposes other members, PeerLostError when one is lost or gone, CollectiveTimeout naming those
        that did not join or confirm by `deadline`; errors name this group's ranks."""
        engine = self.engine
        name = lambda e: self.rank_of.get(e, e)  # noqa: E731 - engine rank as this group names it
        ours = sorted(name(m) for m in members)
        if not engine._agreeing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeout(f"rank {self.rank}: Timed out in {what}: another group was being made over "
                                    f"these links by another thread", ranks=[])
        against: tuple[object, float] = (None, 0.0)  # a disagreement, and since when it lasts
        proposed: tuple[int, tuple[int, ...]] | None = None  # a silent member's old proposal of other members
        try:
            with self._lock:
                engine._say(engine.agreement.begin(members))
            while True:
                with self._lock:
                    out = engine.agreement.outcome()
                    if isinstance(out, Joined):
                        rec, sends = engine.agreement.finish()
                        engine._say(sends)
                        return engine.add_group(rec, names)
                    now = time.monotonic()
                    disagree = engine.agreement.disagreement()
                    if disagree != against[0]:
                        against = (disagree, now)
                    # A proposal this rank already held when its previous call failed, met again by a retry, may
                    # be a stopped rank's: it gets until the deadline, and is then named as a member that did not
                    # join, not as one that disagrees (a MismatchError names nobody a caller could exclude).
                    stale = disagree is not None and engine.agreement.held_before(disagree.peer)
                    if disagree is not None and not stale and now - against[1] >= MISMATCH_GRACE:
                        out = disagree
                    if out is not None or now >= deadline:
                        out = out or (None if stale else disagree)
                        silent, unconfirmed, ended = engine.agreement.waiting_for()
                        if stale and disagree.peer in silent:
                            proposed = (disagree.peer, disagree.ranks)
                        engine._say(engine.agreement.abandon())
                        engine._reoffer()
                        break
                engine.progress(min(0.2, max(0.0, deadline - time.monotonic())))
        finally:
            engine._agreeing.release()
        if isinstance(out, Lost):
            p = out.peer
            raise peer_lost(self.rank, name(p), f"rank {name(p)} is gone, so it cannot be in the new group of "
                            f"ranks {ours} ({what})", address=engine.peer_address(p))
        if isinstance(out, Disagree):
            raise MismatchError(
                f"rank {self.rank}: {what}: rank {name(out.peer)} makes a group of ranks "
                f"{sorted(name(e) for e in out.ranks)}, this rank one of ranks {ours} (every rank must name the "
                f"same ranks; after a loss, exclude every rank lost, and call again)")
        if isinstance(out, Exhausted):
            raise RuntimeError(f"rank {self.rank}: {what}: every group id is in use on some member of ranks {ours} "
                               f"(at most {bin(out.used).count('1')} groups at once over one set of links); destroy "
                               f"groups you no longer use")
        late = sorted(name(p) for p in silent) or sorted(name(p) for p in unconfirmed)
        how = "did not join the new group" if silent else "joined but did not confirm the new group"
        if not late and ended:
            # Every member joined; some gave up first (their deadline came a moment before this one): nobody to
            # exclude, so the call is simply made again.
            gave_up = sorted(name(p) for p in ended)
            raise CollectiveTimeout(f"rank {self.rank}: Timed out in {what}: ranks {gave_up} joined the new group "
                                    f"but their calls ended first (timed out or failed): call again on every rank "
                                    f"that stays", ranks=[])
        note = ""
        if proposed is not None:
            note = (f" (rank {name(proposed[0])} proposed nothing during this call; the last it proposed, before "
                    f"it, makes a group of ranks {sorted(name(e) for e in proposed[1])}: it may be stopped, or "
                    f"calling with other ranks)")
        raise CollectiveTimeout(f"rank {self.rank}: Timed out in {what}: ranks that {how}: {late}{note}", ranks=late)

    # -- checks and errors ----------------------------------------------------------------------------------
    def held(self, peer: int) -> Frame | None:
        """The header of the oldest frame from group rank `peer` its link holds back or has not read yet (see
        `Link.held`), or None."""
        return self.engine.held(self.members[peer])

    def peer_address(self, peer: int) -> str:
        return self.engine.peer_address(self.members[peer]) if 0 <= peer < self.world else f"rank {peer}"

    def source(self, req: Request) -> int:
        """The group rank a receive's message came from."""
        return req.source

    def check_usable(self, look: bool = False) -> None:
        """Raise the group's error if it broke or was closed. `look`: first read what the links already hold,
        without waiting (one poll(0) over their descriptors, then a pump of every link, those it found
        readable woken): an op that took every byte it needed without the engine's loop (a link's `take`,
        a window's published steps) or needed none (it only sends) has read nothing behind them, such as
        an ABORT its peers sent when they gave up on the group."""
        if look and self.broken is None and not self.closed:
            self.engine.look()
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise BackendClosedError(f"rank {self.rank}: the transport is closed")

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world or peer == self.rank or self._link_of[peer] is None:
            raise ValueError(f"rank {self.rank}: invalid peer rank {peer} (group size {self.world})")

    def _timeout_error(self, reqs: Sequence[Request], what: object, arrived: Iterable[int] = ()) -> CollectiveTimeout:
        waiting = [r for r in reqs if not r.done]
        # A rank that sent us anything for this op has arrived; it may only be waiting on someone else.
        heard = set(arrived) | {r.peer for r in reqs if not r.is_send and (r.done or r.received)}
        awaited = {r.peer for r in waiting if not r.is_send}
        missing = sorted(awaited - heard)
        # A send that never finished: its peer took none of the rest for the whole timeout (frozen, or not
        # reading): named when no receive says more (a broadcast's root, a send to a stopped rank).
        untaken = sorted({r.peer for r in waiting if r.is_send and r.peer != ANY_SOURCE} - awaited)
        detail = "; ".join(r.describe() for r in waiting[:4])
        named = missing or sorted(awaited) or untaken
        # A rank we wait on may only be waiting on another one itself (it said so, answering our probe):
        # blame that one, not the rank stuck behind it.
        tags = {r.key[1] for r in waiting if not is_p2p(r.key[0])}
        via = {p: b for p in named if (b := self.ops.waits_on(p, tags)) is not None and b not in (p, self.rank)}
        culprits = sorted({via.get(p, p) for p in named})
        if via:
            behind = "; ".join(f"rank {p} is itself waiting on rank {b}" for p, b in sorted(via.items()))
            who = f" ranks that stopped sending: {culprits} ({behind});"
        elif missing:
            who = f" ranks that did not arrive: {missing};"
        elif awaited:  # everyone arrived; some stopped part-way (frozen, or waiting on someone themselves)
            who = f" ranks that arrived but stopped sending: {sorted(awaited)};"
        else:
            who = f" ranks that did not take what this rank sends: {untaken};" if untaken else ""
        err = CollectiveTimeout(
            f"rank {self.rank}: Timed out waiting in {what or 'an operation'};{who} pending: {detail}",
            ranks=culprits)
        return err if self.names is None else self.names.apply(err)
