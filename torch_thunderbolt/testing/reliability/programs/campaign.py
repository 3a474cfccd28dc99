"""A rank of the fault campaign (testing.reliability.campaign): it runs its trial's script of steps through
torch's public API, checks every result it gets against the value it must have, and recovers from
failures the way docs/fault-tolerance.md tells a user to: `dist.shrink_group` with the ranks it knows are
lost, called again with what it learned whenever it fails.

The script (TB_CAMPAIGN, JSON: `Trial.spec()`) is the same on every rank; what it draws at random it draws
from keys in the script and the ranks of the current group, so the ranks that share a view of the group
make the same groups. Every step is followed by a status all_reduce on the default group, which carries
each rank's outcome (1 ok, 2 failed): the ranks stay in step, and a failure that did not break the default
group (a subgroup's, a split's) is known to all, who then forget that subgroup. When the default group
fails, the rank recovers: it adds the ranks the error names (a PeerLostError's peer, a CollectiveTimeout's
ranks, what a MismatchError or a shrink's notice says the others exclude) to the ranks it knows are lost,
and shrinks the default group without them, again after each failure, up to MAX_SHRINKS times; the
survivors then agree on the step to go on from (an op that failed on one rank may have completed on
another). A rank named lost, or excluded by a shrink, stops (OUT). Kills and stops are the runner's; a rank acts the
faults of its own script (`sleep`, `late_shrink`).

What a rank prints (testing.program.emit; every record has `t`, the wall clock), for the runner to judge:
  START {pid}, READY, INIT_FAILED {err}, CRASH {trace}
  STEP {i, kind, members}                 members: the default group's global ranks, as this rank sees them
  OP {i, what, on, members, ok, wrong, err, expect_fail}   every collective (and DDP step), checked exact
  VIEW {i, what, want, got, rank_want, rank_got}           every group made: torch's view of it
  SLEEP {i, seconds}, LATE {seconds}      the script's faults of this rank, as they start
  HOLD {name}                             waiting for the runner's go (before a kill or stop of it, and before
                                          the first shrink when the runner injects a fault there); NOTE {msg}
  RECOVER {why, err, lost}, SHRINK {attempt, exclude, members}, SHRINK_FAILED {attempt, err},
  SHRUNK {attempt, parent, want, got, rank, gid}           gid: the transport's group id (a diagnostic only)
  RESUME {mine, agreed}                   after a shrink: the step this rank would run next, and the one the
                                          survivors agreed on (the furthest any of them reached)
  EXCLUDED {i}, OUT {why}, DONE {members}, BYE
An error record: {type, msg, named (the global ranks it blames), learned (ranks others exclude), where,
via (the DDP's RuntimeError it came wrapped in)}.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import re
import signal
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt import errors
from torch_thunderbolt.testing.program import Exit, emit, main, pretend_hosts, rank, register_pid, world

SPEC_ENV = "TB_CAMPAIGN"
START_SECONDS = 120.0  # every rank of the trial up (python and torch imported on a busy machine)
MAX_SHRINKS = 4  # shrink_group calls of one recovery before the rank gives up
FINAL_ROUNDS = 3  # final checks (each may need a recovery) before the rank gives up
OK, FAILED = 1, 2  # a rank's outcome of a step in the status all_reduce
STATUS_DATA = 11  # exact-checked elements the status all_reduce carries besides the outcomes
GO_KEY = "campaign/go/"  # + hold name / rank: set by the runner when a held rank may go on
HOLD_SECONDS = 30.0  # a rank the runner does not let go in this long goes on by itself (a NOTE)
STATUS_TIMEOUTS = 2  # the status all_reduce's timeout, in group timeouts

_MAKES = re.compile(r"rank \d+ makes a group of ranks \[([\d, ]*)\]")  # a shrink's MismatchError
_EXCLUDING = re.compile(r"excluding ranks \[([\d, ]*)\]")  # a shrink's notice (the old group's ABORT)
_SHRUNK = ("shrunk to ranks", "by shrink_group")


def data(g: int, n: int, salt: int) -> torch.Tensor:
    """Global rank `g`'s input to an op: small integers, exact in float32 through a sum over 4 ranks, and
    different for every rank and op (`salt`), so data of another rank or op shows."""
    return ((torch.arange(n) + salt) % 97 + 1000 * (g + 1)).to(torch.float32)


def parts(members: list[int], step: dict[str, Any]) -> list[list[int]]:
    """The groups (global ranks) a new_group or split step makes of the default group `members`."""
    rng = random.Random(step["key"])
    k = max(2, min(len(members), step["size"]))
    shuffled = rng.sample(members, len(members))
    if step["kind"] == "split" and step.get("two") and len(members) >= 4:
        return [sorted(shuffled[:2]), sorted(shuffled[2:4])]
    return [sorted(shuffled[:k])]


def pick(members: list[int], key: int) -> int:
    """The member a shrink step excludes."""
    return members[random.Random(key).randrange(len(members))]


def ddp_batch(key: int, it: int, g: int, w: int) -> torch.Tensor:
    """Rank `g`'s batch in DDP iteration `it`: multiples of the world size `w`, so each rank's gradient
    divided by `w` (DDP's average) is an integer and every sum of them exact."""
    x = (torch.arange(8).reshape(2, 4) + key + it + 3 * g) % 5 - 2
    return (x * w).to(torch.float32)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, want {list(want.shape)}"
    bad = (got != want).nonzero().flatten()
    first = int(bad[0]) if bad.numel() else 0
    return (f"{bad.numel()} of {got.numel()} elements wrong, first at {first}: got {got.flatten()[first].item()}, "
            f"want {want.flatten()[first].item()}")


@contextlib.contextmanager
def _pretend_accelerator() -> Iterator[None]:
    """torch's split_group splits through the backend only where an accelerator is bound to the default group
    (a Mac's MPS device); here the CPU stands in for it, for the call only (as tests/fault_tolerance does)."""
    acc = torch.accelerator
    default = dist.group.WORLD
    saved = (acc.is_available, acc.current_accelerator, default.bound_device_id)
    default.bound_device_id = torch.device("cpu", 0)
    acc.is_available = lambda: True
    acc.current_accelerator = lambda *args, **kwargs: torch.device("cpu", 0)
    try:
        yield
    finally:
        acc.is_available, acc.current_accelerator = saved[0], saved[1]
        default.bound_device_id = saved[2]


@dataclass
class Sub:
    """A subgroup step's groups (process ranks; a split may make two), how torch should number each
    (`views`: its global ranks, as get_process_group_ranks must give them), and this rank's handle of its
    own (`pg`) with whether torch's view of it is right (`addressed`: global src/dst are mapped right;
    else this rank addresses its peers by group rank)."""
    parts: list[list[int]]
    views: list[list[int]]
    keys: list[tuple[int, ...]] = field(default_factory=list)  # the rank lists torch may have named it by
    pg: Any = None
    addressed: bool = True
    dead: bool = False  # some member failed with it: nobody uses it any more

    def mine(self, me: int) -> list[int] | None:
        return next((p for p in self.parts if me in p), None)

    def view_of(self, me: int) -> list[int]:
        return next(v for p, v in zip(self.parts, self.views) if me in p)


@dataclass
class Rank:
    """One rank's run of the script. `members` are the default group's process ranks (RANK at start: what
    faults and blame are judged in); torch numbers them 0..n-1 after a shrink of the default group (its
    `get_rank`, `src=`, `new_group` ranks), while `tview` is what it says get_process_group_ranks of the
    default group is. `names` counts the rank lists torch may have hashed into the names of live groups."""
    spec: dict[str, Any]
    me: int
    world: int
    store: Any
    members: list[int] = field(default_factory=list)
    tview: list[int] = field(default_factory=list)
    subs: dict[int, Sub] = field(default_factory=dict)
    names: Counter = field(default_factory=Counter)
    lost: set[int] = field(default_factory=set)
    late: float = 0.0  # the script's late_shrink: seconds to wait before this rank's next recovery
    out: str = ""  # why this rank stopped
    salt: int = 1 << 16  # for the ops of recoveries and final checks (steps salt with their index)
    recoveries: int = 0
    next_step: int = 0  # the script's step this rank runs next; the survivors of a shrink agree on it

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=float(self.spec["timeout"]))

    def torch_ranks(self, part: list[int]) -> list[int]:
        """How torch numbers `part` (process ranks of the default group) now."""
        return [self.members.index(g) for g in part]

    # -- the script ---------------------------------------------------------------------------------------
    def run(self) -> None:
        steps = self.spec["steps"]
        while self.next_step < len(steps):
            if self.out:
                return
            i = self.next_step
            self.next_step = i + 1
            step = steps[i]
            kind = step["kind"]
            emit("STEP", {"i": i, "kind": kind, "members": self.members, "t": time.time()})
            if kind == "fault":
                if step["victim"] == self.me and step["fault"] == "sleep":
                    emit("SLEEP", {"i": i, "seconds": step["hold"], "t": time.time()})
                    time.sleep(step["hold"])
                elif step["victim"] == self.me:
                    self.hold(f"fault{i}")  # the runner's kill or stop lands `delay` after it lets this rank go
                continue
            if kind == "late_shrink":
                if step["victim"] == self.me:
                    self.late = step["delay"]
                continue
            if kind == "shrink_world":
                self.shrink_world(i, step)
                continue
            code, broken = self.step(i, step)
            if broken is not None:
                self.recover(broken)
                continue
            self.status(i, code, step)
        if not self.out:
            self.finish()

    def hold(self, name: str) -> None:
        """Wait for the runner to let this rank go on (a key in the trial's store), so that the fault it
        injects then lands at a moment this rank's progress decides, not when the runner next looks."""
        emit("HOLD", {"name": name, "t": time.time()})
        try:
            self.store.wait([f"{GO_KEY}{name}/{self.me}"], timedelta(seconds=HOLD_SECONDS))
        except Exception as exc:  # noqa: BLE001 - go on without the runner; the record says so
            emit("NOTE", {"msg": f"the runner did not let hold {name} go: {type(exc).__name__}: {exc}",
                          "t": time.time()})

    def skip(self, i: int, why: str) -> None:
        """A step left out, the same way on every rank (what decides it is the same everywhere)."""
        emit("SKIP", {"i": i, "why": why, "t": time.time()})

    def step(self, i: int, step: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        """Run step `i`: this rank's outcome, and the error if it broke the default group."""
        kind = step["kind"]
        if kind == "op":
            if step["on"] == "world":
                err = self.op(i, step["op"], "world", None, self.members, step["n"], step["root"], step["redop"],
                              tranks=self.torch_ranks(self.members))
                return (FAILED, err) if err else (OK, None)
            sub = self.subs.get(step["on"])
            mine = sub.mine(self.me) if sub is not None and not sub.dead else None
            if sub is None or mine is None or sub.pg is None:
                return OK, None
            err = self.op(i, step["op"], step["on"], sub.pg, mine, step["n"], step["root"], step["redop"],
                          tranks=sub.view_of(self.me) if sub.addressed else None)
            return (FAILED if err else OK), None
        if kind in ("new_group", "split"):
            return self.make_sub(i, step), None
        if kind == "shrink_sub":
            return self.shrink_sub(i, step), None
        if kind == "ddp":
            err = self.ddp(i, step)
            return (FAILED, err) if err else (OK, None)
        raise ValueError(f"rank {self.me}: unknown step kind {kind!r}")

    # -- one collective, checked --------------------------------------------------------------------------
    def op(self, i: int, what: str, on: Any, pg: Any, members: list[int], n: int, root: int = 0,
           redop: str = "sum", salt: int | None = None, expect_fail: bool = False,
           tranks: list[int] | None = None) -> dict[str, Any] | None:
        """Collective `what` on `pg` (None: the default group; `members`: its process ranks in group order),
        every result compared with the value it must have; a root or peer is named by its global rank in
        torch's numbering (`tranks`), or by its group rank where torch's numbering of the group is wrong.
        Emits an OP record; returns the error record if it failed."""
        me, salt = self.me, i if salt is None else salt
        t0 = time.time()
        wrong: list[str] = []
        try:
            if what == "all_reduce":
                x = data(me, n, salt)
                dist.all_reduce(x, op=dist.ReduceOp.MAX if redop == "max" else dist.ReduceOp.SUM, group=pg)
                want = data(max(members), n, salt) if redop == "max" else sum(data(g, n, salt) for g in members)
                if not torch.equal(x, want):
                    wrong.append(f"all_reduce {redop}: {_describe(x, want)}")
            elif what == "broadcast":
                k = root % len(members)
                src = members[k]
                x = data(src, n, salt) if me == src else torch.full((n,), -1.0)
                if tranks is not None:
                    dist.broadcast(x, src=tranks[k], group=pg)
                else:
                    dist.broadcast(x, group=pg, group_src=k)
                if not torch.equal(x, data(src, n, salt)):
                    wrong.append(f"broadcast from {src}: {_describe(x, data(src, n, salt))}")
            elif what == "all_gather":
                outs = [torch.full((n,), -1.0) for _ in members]
                dist.all_gather(outs, data(me, n, salt), group=pg)
                for q, g in enumerate(members):
                    if not torch.equal(outs[q], data(g, n, salt)):
                        wrong.append(f"all_gather part {q} (rank {g}): {_describe(outs[q], data(g, n, salt))}")
            elif what == "p2p":
                k = members.index(me)
                nxt, prv = (k + 1) % len(members), (k - 1) % len(members)
                if nxt != k:
                    got = torch.full((n,), -1.0)
                    if tranks is not None:
                        req = dist.isend(data(me, n, salt), dst=tranks[nxt], group=pg)
                        dist.recv(got, src=tranks[prv], group=pg)
                    else:
                        req = dist.isend(data(me, n, salt), group=pg, group_dst=nxt)
                        dist.recv(got, group=pg, group_src=prv)
                    req.wait()
                    if not torch.equal(got, data(members[prv], n, salt)):
                        wrong.append(f"recv from {members[prv]}: {_describe(got, data(members[prv], n, salt))}")
            else:
                raise ValueError(f"rank {me}: unknown op {what!r}")
        except Exception as exc:  # noqa: BLE001 - the record is what the runner judges
            err = self.error(exc, members, what)
            emit("OP", {"i": i, "what": what, "on": on, "members": members, "ok": False, "wrong": [], "err": err,
                        "expect_fail": expect_fail, "t0": t0, "t": time.time()})
            return err
        emit("OP", {"i": i, "what": what, "on": on, "members": members, "ok": True, "wrong": wrong, "err": None,
                    "expect_fail": expect_fail, "t0": t0, "t": time.time()})
        return None

    def error(self, exc: BaseException, members: list[int], where: str) -> dict[str, Any]:
        """What `exc` says, in process ranks (`members`: the group's, in group order): whom it blames
        (`named`) and whom other ranks exclude (`learned`). DDP hands the group's error on as a RuntimeError;
        the group keeps the error itself (the docs' way to it)."""
        cause, via = exc, None
        if where == "ddp" and not isinstance(exc, errors.ThunderboltError):
            broken = getattr(getattr(dist.group.WORLD, "transport", None), "broken", None)
            if broken is not None:
                cause, via = broken, type(exc).__name__
        text = str(cause)
        named: list[int] = []
        learned: list[int] = []
        if isinstance(cause, errors.PeerLostError):
            named = [cause.peer]
        elif isinstance(cause, errors.CollectiveTimeout):
            named = list(cause.ranks)
        elif isinstance(cause, errors.PeerAbortedError) and not any(s in text for s in _SHRUNK):
            named = [cause.peer]  # (a shrink's notice names the rank that shrank, which blames nobody)
        if isinstance(cause, errors.MismatchError):
            for m in _MAKES.finditer(text):
                theirs = _ints(m.group(1))
                learned += [r for r in range(len(members)) if r not in theirs]
        for m in _EXCLUDING.finditer(text):
            learned += _ints(m.group(1))

        def process_ranks(rs: list[int]) -> list[int]:
            return sorted({members[r] for r in rs if isinstance(r, int) and 0 <= r < len(members)})

        return {"type": type(cause).__name__, "msg": text[:700], "named": process_ranks(named),
                "learned": process_ranks(learned), "raw": [r for r in named if isinstance(r, int)], "where": where,
                "via": via}

    # -- the status all_reduce after each step -------------------------------------------------------------
    def status(self, i: int, code: int, step: dict[str, Any] | None, what: str = "status") -> dict[str, Any] | None:
        """Every member's outcome of step `i` through an exact-checked all_reduce on the default group; a
        subgroup some member failed with is forgotten by all. Its timeout is STATUS_TIMEOUTS group timeouts:
        a member held up in a subgroup's op by a faulty rank arrives before it ends, so the faulty rank is
        the one that did not. Recovers if it fails; returns that error."""
        w0, me, t0 = self.world, self.me, time.time()
        v = torch.zeros(w0 + STATUS_DATA)
        v[me] = code
        v[w0:] = data(me, STATUS_DATA, i)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.timeout * STATUS_TIMEOUTS
        try:
            dist.group.WORLD.allreduce([v], opts).wait()
        except Exception as exc:  # noqa: BLE001 - recovered from below
            err = self.error(exc, self.members, what)
            emit("OP", {"i": i, "what": what, "on": "world", "members": self.members, "ok": False, "wrong": [],
                        "err": err, "expect_fail": False, "t0": t0, "t": time.time()})
            self.recover(err)
            return err
        wrong = []
        want = sum(data(g, STATUS_DATA, i) for g in self.members)
        if not torch.equal(v[w0:], want):
            wrong.append(f"{what} data: {_describe(v[w0:], want)}")
        slots = [int(x) for x in v[:w0].tolist()]
        if slots[me] != code or any(slots[g] not in (OK, FAILED) for g in self.members) or any(
                s != 0 for g, s in enumerate(slots) if g not in self.members):
            wrong.append(f"{what} outcomes {v[:w0].tolist()}: members {self.members}, this rank's {code}")
        emit("OP", {"i": i, "what": what, "on": "world", "members": self.members, "ok": True, "wrong": wrong,
                    "err": None, "expect_fail": False, "t0": t0, "t": time.time()})
        failed = {g for g in self.members if slots[g] == FAILED}
        if failed and step is not None and step["kind"] in ("op", "new_group", "split", "shrink_sub"):
            sid = i if step["kind"] in ("new_group", "split") else step.get("sub", step.get("on"))
            sub = self.subs.get(sid) if isinstance(sid, int) else None
            if sub is not None and any(g in p for p in sub.parts for g in failed):
                sub.dead = True
        return None

    # -- subgroups ------------------------------------------------------------------------------------------
    def make_sub(self, i: int, step: dict[str, Any]) -> int:
        """new_group (one group) or torch's split_group (one or two) of the default group's ranks; every
        rank of the default group calls it. The members check torch's view of it and all_reduce on it."""
        kind = step["kind"]
        ps = parts(self.members, step)
        views = [self.torch_ranks(p) for p in ps]
        if kind == "split":
            if self.tview != list(range(len(self.members))):
                # torch's split_group maps the parent's group ranks through the numbering the default group had
                # before it was shrunk (distributed_c10d.split_group: parent_global_to_group_ranks)
                self.skip(i, "torch's split_group after a shrink of the default group that renumbered it")
                return OK
            # torch names a split group by its ranks and the count of live groups: a live group of the same
            # ranks may have the name (RuntimeError "already registered", on some ranks only). Its members
            # destroy it first (every rank knows which it is).
            for sid, old in list(self.subs.items()):
                if any(tuple(v) in old.keys for v in views):
                    self.destroy(i, sid)
            if any(self.names[tuple(v)] for v in views):
                self.skip(i, "torch's split_group may name it as a live group of the same ranks")
                return OK
        sub = Sub(ps, views, [tuple(v) for v in views])
        self.subs[i] = sub
        self.names.update(sub.keys)
        mine = sub.mine(self.me)
        t0 = time.time()
        try:
            if kind == "new_group":
                pg = dist.new_group(views[0], timeout=self.timeout)
            else:
                with _pretend_accelerator():
                    pg = dist.split_group(split_ranks=views, timeout=self.timeout, group_desc=f"campaign-{i}")
        except Exception as exc:  # noqa: BLE001 - judged by the runner
            err = self.error(exc, self.members, kind)
            emit("OP", {"i": i, "what": kind, "on": i, "members": self.members, "ok": False, "wrong": [],
                        "err": err, "expect_fail": False, "t0": t0, "t": time.time()})
            sub.dead = True
            return FAILED
        if mine is None:
            return OK
        sub.pg = pg
        sub.addressed = self.view(i, kind, pg, mine, sub.view_of(self.me))
        return FAILED if self.op(i, "all_reduce", i, pg, mine, 257) else OK

    def destroy(self, i: int, sid: int) -> None:
        """destroy_process_group of subgroup `sid` on its members; every rank forgets it."""
        sub = self.subs.pop(sid)
        self.names.subtract(sub.keys)
        if sub.pg is None:
            return
        t0 = time.time()
        try:
            dist.destroy_process_group(sub.pg)
        except Exception as exc:  # noqa: BLE001 - judged by the runner
            emit("OP", {"i": i, "what": "destroy", "on": sid, "members": sub.mine(self.me), "ok": False,
                        "wrong": [], "err": self.error(exc, sub.mine(self.me) or [], "destroy"),
                        "expect_fail": False, "t0": t0, "t": time.time()})

    def view(self, i: int, what: str, pg: Any, mine: list[int], want: list[int]) -> bool:
        """torch's view of a group this rank made (its global ranks and this rank's place in it) against
        `want`; whether it is right."""
        try:
            got: Any = dist.get_process_group_ranks(pg)
            rank_got: Any = dist.get_rank(pg)
        except Exception as exc:  # noqa: BLE001 - a view torch cannot give is wrong too
            got, rank_got = f"{type(exc).__name__}: {exc}", None
        rank_want = mine.index(self.me)
        emit("VIEW", {"i": i, "what": what, "members": mine, "want": want, "got": got, "rank_want": rank_want,
                      "rank_got": rank_got, "t": time.time()})
        return got == want and rank_got == rank_want

    def shrink_sub(self, i: int, step: dict[str, Any]) -> int:
        """shrink_group of a subgroup without one of its members (each of a split's groups with two or more
        loses one): the others call it, the one left out checks that its old group refuses it."""
        sub = self.subs.get(step["sub"])
        if sub is None or sub.dead:
            return OK
        drop = [pick(p, step["key"]) if len(p) >= 2 else None for p in sub.parts]
        new_parts = [[g for g in p if g != x] for p, x in zip(sub.parts, drop)]
        # torch's view of the shrunk group: the parent's global ranks but the excluded one's, and what torch
        # 2.13 computes (distributed_c10d._finalize_shrunk_group drops the global ranks equal to the excluded
        # group ranks), whose name it may hash
        new_views = [[v[k] for k in range(len(p)) if p[k] != x] for p, v, x in zip(sub.parts, sub.views, drop)]
        torch_views = [[r for r in v if x is None or r != p.index(x)] for p, v, x in zip(sub.parts, sub.views, drop)]
        if any(self.names[tuple(v)] > 1 for v in sub.views):
            # torch names the shrunk group by the old one's ranks and the count of live groups, as it named
            # any other live group of those ranks
            self.skip(i, "torch's shrink_group may name it as a live group of the same ranks")
            return OK
        more = {tuple(v) for v in new_views + torch_views} - set(sub.keys)  # (named by the old ranks: kept)
        sub.keys += sorted(more)
        self.names.update(more)
        mine = sub.mine(self.me)
        old_pg, old_view = sub.pg, sub.view_of(self.me) if mine is not None else None
        sub.parts, sub.views = new_parts, new_views
        if mine is None or old_pg is None or len(mine) < 2:
            return OK
        x = pick(mine, step["key"])
        if x == self.me:
            self.op(i, "all_reduce", step["sub"], old_pg, mine, 33, expect_fail=True)
            sub.pg = None
            try:  # (torch keeps a group it registered until it is destroyed: it would name a later one alike)
                dist.destroy_process_group(old_pg)
            except Exception as exc:  # noqa: BLE001 - judged by the runner
                emit("OP", {"i": i, "what": "destroy", "on": step["sub"], "members": mine, "ok": False, "wrong": [],
                            "err": self.error(exc, mine, "destroy"), "expect_fail": False, "t0": time.time(),
                            "t": time.time()})
            return OK
        t0 = time.time()
        try:
            new = dist.shrink_group([mine.index(x)], group=old_pg)
        except Exception as exc:  # noqa: BLE001 - judged by the runner
            err = self.error(exc, mine, "shrink_sub")
            emit("OP", {"i": i, "what": "shrink_sub", "on": step["sub"], "members": mine, "ok": False,
                        "wrong": [], "err": err, "expect_fail": False, "t0": t0, "t": time.time()})
            sub.dead, sub.pg = True, None
            return FAILED
        now = sub.mine(self.me) or []
        sub.pg = new
        sub.addressed = self.view(i, "shrink_sub", new, now, sub.view_of(self.me))
        if not sub.addressed:
            emit("NOTE", {"msg": f"torch's view of subgroup {old_view} shrunk by its rank {mine.index(x)}: "
                                 f"predicted by torch's arithmetic {torch_views}", "t": time.time()})
        return FAILED if self.op(i, "all_reduce", step["sub"], new, now, 129) else OK

    # -- DDP ----------------------------------------------------------------------------------------------
    def ddp(self, i: int, step: dict[str, Any]) -> dict[str, Any] | None:
        """A few SGD steps of a tiny linear model under DDP on the default group; the weights after each
        compared with the update every member's batch gives (computed here alone, exact)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        key, w, members = step["key"], len(self.members), self.members
        want = (torch.arange(8).reshape(2, 4) % 3 - 1).to(torch.float32) * (1 + key % 3)
        net = nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            net.weight.copy_(want)
        wrong: list[str] = []
        t0 = time.time()
        model = None
        try:
            model = DDP(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            for it in range(step["iters"]):
                model(ddp_batch(key, it, self.me, w)).sum().backward()
                opt.step()
                opt.zero_grad()
                mean = sum(ddp_batch(key, it, g, w).sum(0) for g in members) / w
                want = want - 0.5 * mean.expand(2, 4)
                if not torch.equal(net.weight.detach(), want):
                    wrong.append(f"DDP iteration {it}: {_describe(net.weight.detach(), want)}")
        except Exception as exc:  # noqa: BLE001 - judged by the runner
            err = self.error(exc, members, "ddp")
            emit("OP", {"i": i, "what": "ddp", "on": "world", "members": members, "ok": False, "wrong": wrong,
                        "err": err, "expect_fail": False, "t0": t0, "t": time.time()})
            return err
        finally:
            del model
        emit("OP", {"i": i, "what": "ddp", "on": "world", "members": members, "ok": True, "wrong": wrong,
                    "err": None, "expect_fail": False, "t0": t0, "t": time.time()})
        return None

    # -- shrinking the default group -------------------------------------------------------------------------
    def shrink_world(self, i: int, step: dict[str, Any]) -> None:
        """The script's shrink of a healthy default group: one member (all alive) is left out; it checks
        that the old group refuses it and stops, the others shrink as a recovery does."""
        if len(self.members) < 3:
            return
        x = pick(self.members, step["key"])
        if x == self.me:
            self.op(i, "all_reduce", "world", None, self.members, 33, expect_fail=True)
            emit("EXCLUDED", {"i": i, "t": time.time()})
            self.stop("excluded by the script's shrink_group")
            return
        self.recover({"type": None, "named": [], "learned": [x]}, why="script", exclude=x)

    def recover(self, err: dict[str, Any], why: str = "error", exclude: int | None = None) -> None:
        """shrink_group of the default group without every rank known lost, again with what each failure
        adds, until the group it returns passes an all_reduce; stop when this rank is named lost. `exclude`:
        the rank the script's shrink leaves out."""
        self.lost |= set(err.get("named", [])) | set(err.get("learned", []))
        emit("RECOVER", {"why": why, "err": err.get("type"), "lost": sorted(self.lost), "exclude": exclude,
                         "t": time.time()})
        if self.me in self.lost:
            self.stop("named lost")
            return
        self.recoveries += 1
        if self.spec.get("hold_recovery"):
            self.hold(f"recover{self.recoveries}")  # the runner's fault in the survivors' shrink lands after it
        if self.late:
            emit("LATE", {"seconds": self.late, "t": time.time()})
            time.sleep(self.late)
            self.late = 0.0
        for attempt in range(MAX_SHRINKS):
            exclude = sorted(self.lost & set(self.members))
            if not exclude:
                self.stop("the default group failed, naming no rank to exclude")
                return
            emit("SHRINK", {"attempt": attempt, "exclude": exclude, "members": self.members, "t": time.time()})
            try:
                new = dist.shrink_group(self.torch_ranks(exclude))
            except Exception as exc:  # noqa: BLE001 - learn from it and call again, as the docs say
                e = self.error(exc, self.members, "shrink_group")
                emit("SHRINK_FAILED", {"attempt": attempt, "err": e, "t": time.time()})
                self.lost |= set(e["named"]) | set(e["learned"])
                if self.me in self.lost:
                    self.stop("named lost")
                    return
                continue
            parent, want = self.members, [g for g in self.members if g not in exclude]
            gone = self.torch_ranks(exclude)
            # A shrunk default group is the default group: torch numbers global ranks by it from then on.
            torch_want = list(range(len(want)))
            torch_arith = [r for r in self.tview if r not in gone]  # torch 2.13's (_finalize_shrunk_group)
            try:
                got: Any = dist.get_process_group_ranks(new)
                rank_got: Any = dist.get_rank()
            except Exception as exc:  # noqa: BLE001 - a view torch cannot give is wrong too
                got, rank_got = f"{type(exc).__name__}: {exc}", None
            emit("SHRUNK", {"attempt": attempt, "parent": parent, "want": want, "torch_view": got,
                            "torch_want": torch_want, "torch_arith": torch_arith, "rank": rank_got,
                            "rank_want": want.index(self.me),
                            "gid": getattr(getattr(new, "transport", None), "gid", None), "t": time.time()})
            self.names = Counter({tuple(self.tview): 1})  # (torch names it by the old group's ranks)
            self.members = want
            self.tview = got if isinstance(got, list) else torch_want
            self.subs.clear()  # (torch destroys every other group with the default one)
            self.salt += 1
            e2 = self.op(self.salt, "all_reduce", "world", None, self.members, 1000, salt=self.salt)
            if e2 is None:
                e2 = self.agree_step()
            if e2 is None:
                return
            self.lost |= set(e2["named"]) | set(e2["learned"])
            if self.me in self.lost:
                self.stop("named lost")
                return
        self.stop(f"no shrink_group worked in {MAX_SHRINKS} calls")

    def agree_step(self) -> dict[str, Any] | None:
        """The survivors of a shrink go on from the same step. An op that failed on one rank may have
        completed on another (it had every piece it needed before the fault), so one survivor may be a step
        ahead (docs/fault-tolerance.md, "Ops in flight"): every survivor goes on from the furthest step any
        of them reached (the script's steps do not depend on each other). Returns the error if it failed."""
        t0, mine = time.time(), self.next_step
        v = torch.tensor([float(mine)])
        try:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        except Exception as exc:  # noqa: BLE001 - the recovery goes on with what it names
            err = self.error(exc, self.members, "agree_step")
            emit("OP", {"i": self.salt, "what": "agree_step", "on": "world", "members": self.members, "ok": False,
                        "wrong": [], "err": err, "expect_fail": False, "t0": t0, "t": time.time()})
            return err
        self.next_step = int(v.item())
        emit("RESUME", {"mine": mine, "agreed": self.next_step, "t": time.time()})
        return None

    def finish(self) -> None:
        """The final status all_reduce (every member done, the same view), recovering as often as needed."""
        for _ in range(FINAL_ROUNDS):
            i = self.next_step
            self.next_step = i + 1
            if self.status(i, OK, None, what="final") is None:
                emit("DONE", {"members": self.members, "torch_view": self.tview, "t": time.time()})
                return
            if self.out:
                return
        self.stop(f"the final check failed {FINAL_ROUNDS} times")

    def stop(self, why: str) -> None:
        self.out = why
        emit("OUT", {"why": why, "t": time.time()})


def _destroy(seconds: float) -> None:
    """destroy_process_group; a rank whose destroy does not return in `seconds` says so and ends (the runner
    would take its silence for a hang anyway, later)."""
    def stuck() -> None:
        emit("CRASH", {"trace": f"destroy_process_group did not return in {seconds:.0f}s", "t": time.time()})
        os._exit(5)

    timer = threading.Timer(seconds, stuck)
    timer.daemon = True
    timer.start()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may say so as it ends; nothing is left to do
        emit("DESTROY", {"err": f"{type(exc).__name__}: {str(exc)[:300]}", "t": time.time()})
    finally:
        timer.cancel()


def trial() -> Exit:
    spec = json.loads(os.environ[SPEC_ENV])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the runner's look at a rank that hangs
    register_pid()
    pretend_hosts()
    me, w = rank(), world()
    emit("START", {"pid": os.getpid(), "t": time.time()})
    timeout = float(spec["timeout"])
    # What the first group and DDP's first construction import, before the group's short timeout counts
    import torch_thunderbolt.backend.process_group  # noqa: F401
    import torch_thunderbolt.rendezvous.group  # noqa: F401
    if any(s["kind"] == "ddp" for s in spec["steps"]):
        import torch._dynamo  # noqa: F401
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), w, False,
                              timeout=timedelta(seconds=timeout))
        # Every rank up before the group's short timeout starts counting (imports take long on a busy machine).
        if store.add("campaign/up", 1) == w:
            store.set("campaign/go", b"1")
        store.wait(["campaign/go"], timedelta(seconds=START_SECONDS))
        dist.init_process_group("thunderbolt", store=store, rank=me, world_size=w, timeout=timedelta(seconds=timeout))
        # ... and every rank set up before the first op's timeout starts counting
        if store.add("campaign/ready", 1) == w:
            store.set("campaign/start", b"1")
        store.wait(["campaign/start"], timedelta(seconds=START_SECONDS))
    except Exception as exc:  # noqa: BLE001 - the runner reports a trial that could not start
        emit("INIT_FAILED", {"err": f"{type(exc).__name__}: {str(exc)[:700]}", "t": time.time()})
        return Exit(3, hard=True)
    emit("READY", {"kind": getattr(getattr(dist.group.WORLD, "transport", None), "kind", None), "t": time.time()})
    r = Rank(spec, me, w, store, list(range(w)), list(range(w)))
    try:
        r.run()
    except Exception:  # noqa: BLE001 - a fault of the campaign's program itself, or an error no step expects
        emit("CRASH", {"trace": traceback.format_exc()[-3000:], "t": time.time()})
        return Exit(3, hard=True)
    _destroy(2 * timeout + 10)
    emit("BYE", {"t": time.time()})
    return Exit(0)


if __name__ == "__main__":
    main({"trial": trial})
