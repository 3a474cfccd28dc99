"""The memory ordering of the shared-memory protocols, model-checked from traces of the code itself.

Each scenario runs the real methods (`RingWriter.put`, `RingReader.peek`/`payload`/`pop`/`pending`,
`RingWriter.free`, `ShmWindowMemory.publish`/`reached`, `ShmLinks.note_post`/`_check_peer_ops`/
`before_sleep`/`after_pump`/`wake_sleepers`, `Window.check_skipped`) one after the other on memory that
records every shared load and store, with `transport/ordering.py`'s fences replaced by recorders of the
fences a platform selects (`ordering.fences`): each side of a scenario becomes a straight-line program of
loads, stores and fences, exactly where the code placed them. Removing or moving a fence in the code
changes that program.

`executions` then runs every execution a memory model allows and the scenario looks for a bad outcome (a
reader that sees the new head or counter with old payload, a lost wake-up, a torn op board):

- "arm" (for the arm64 selection): a thread's accesses may be performed in any order, except two on the
  same location, or two separated by a fence that orders them (C11 semantics: `acquire` orders earlier
  loads before everything later, `release` everything earlier before later stores, `full` everything);
  dependencies order nothing. Stores reach every thread at once (multi-copy atomic, as ARMv8 is for other
  threads; a thread reading its own store early is not modelled, and no protocol here decides on that).
- "tso" (for the x86 selection, which makes acquire and release nothing): only a store may be performed
  after a later load of another location, unless a full fence separates them.

`test_every_fence_is_needed` drops each traced fence in turn: every fence the code places must be the one
that stops some bad outcome, so each op pays only what its protocol needs.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest

from torch_thunderbolt.platform import Platform
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.transport import ordering
from torch_thunderbolt.transport import shm_ring as ring
from torch_thunderbolt.transport.shm import ShmLinks
from torch_thunderbolt.transport.shm_window import ShmWindowMemory, area_bytes

ARM64 = Platform.for_system("darwin", "arm64")
X86 = Platform.for_system("linux", "x86_64")
MODELS = {"arm": ARM64, "tso": X86}


# -- programs and the checker ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    kind: str  # "load", "store" or "fence"
    loc: str  # the location; for a fence, its kind (acquire, release, full)
    value: Any = None  # what a store writes
    site: str = ""  # where the code placed a fence


def _ordered(a: Op, fences: list[Op], b: Op, model: str) -> bool:
    """Whether `a` must be performed before the later `b` of the same thread (`fences` between them)."""
    if a.loc == b.loc:
        return True
    if any(f.loc == "full" for f in fences):
        return True
    if model == "tso":
        return not (a.kind == "store" and b.kind == "load")
    return any((f.loc == "acquire" and a.kind == "load") or (f.loc == "release" and b.kind == "store")
               for f in fences)


def _preds(program: list[Op], model: str) -> tuple[list[Op], list[int]]:
    """The thread's accesses and, for each, a bit mask of the earlier ones it must follow."""
    accesses: list[tuple[int, Op]] = [(i, op) for i, op in enumerate(program) if op.kind != "fence"]
    masks = []
    for j, (pj, b) in enumerate(accesses):
        mask = 0
        for i, (pi, a) in enumerate(accesses[:j]):
            if _ordered(a, [f for f in program[pi + 1 : pj] if f.kind == "fence"], b, model):
                mask |= 1 << i
        masks.append(mask)
    return [op for _, op in accesses], masks


Outcome = dict[str, list[tuple[str, Any]]]  # per thread, what each of its loads read, in program order


def executions(threads: dict[str, list[Op]], initial: dict[str, Any], model: str) -> set[tuple]:
    """Every outcome `model` allows: per thread (in `threads` order), the (location, value) of its loads."""
    names = list(threads)
    progs = [_preds(threads[n], model) for n in names]
    locs = sorted({op.loc for ops, _ in progs for op in ops} | set(initial))
    index = {loc: i for i, loc in enumerate(locs)}
    seen: set = set()
    outcomes: set[tuple] = set()

    def step(done: tuple[int, ...], mem: tuple, loads: tuple) -> None:
        if (done, mem, loads) in seen:
            return
        seen.add((done, mem, loads))
        finished = True
        for t, (ops, masks) in enumerate(progs):
            for j, op in enumerate(ops):
                bit = 1 << j
                if done[t] & bit or masks[j] & ~done[t]:
                    continue
                finished = False
                now = done[:t] + (done[t] | bit,) + done[t + 1 :]
                i = index[op.loc]
                if op.kind == "load":
                    mine = tuple(sorted(loads[t] + ((j, op.loc, mem[i]),), key=lambda x: x[0]))
                    step(now, mem, loads[:t] + (mine,) + loads[t + 1 :])
                else:
                    step(now, mem[:i] + (op.value,) + mem[i + 1 :], loads)
        if finished:
            outcomes.add(tuple(tuple((loc, v) for _, loc, v in per) for per in loads))

    step((0,) * len(progs), tuple(initial.get(loc, 0) for loc in locs), ((),) * len(progs))
    return outcomes


def violations(threads: dict[str, list[Op]], initial: dict[str, Any], model: str,
               bad: Callable[[Outcome], bool]) -> list[Outcome]:
    names = list(threads)
    found = []
    for out in executions(threads, initial, model):
        outcome = {n: list(o) for n, o in zip(names, out)}
        if bad(outcome):
            found.append(outcome)
    return found


def loaded(out: list[tuple[str, Any]], loc: str) -> list[Any]:
    """The values a thread's loads of `loc` read, in program order."""
    return [v for where, v in out if where == loc]


# -- tracing the code -----------------------------------------------------------------------------------------
class Recorder:
    """The memory of one traced run (values as the code left them) and each thread's program."""

    def __init__(self, initial: dict[str, Any]) -> None:
        self.initial = dict(initial)
        self.mem = dict(initial)
        self.threads: dict[str, list[Op]] = {}
        self.current: list[Op] = []

    def run(self, thread: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` as (a further part of) `thread`'s program."""
        self.current = self.threads.setdefault(thread, [])
        return fn()

    def load(self, loc: str) -> Any:
        self.current.append(Op("load", loc))
        return self.mem.get(loc, 0)

    def store(self, loc: str, value: Any) -> None:
        self.current.append(Op("store", loc, value))
        self.mem[loc] = value

    def fence(self, kind: str) -> Callable[[], None]:
        def record() -> None:
            caller = sys._getframe(1)
            code = caller.f_code
            site = f"{kind} in {getattr(code, 'co_qualname', code.co_name)}:{caller.f_lineno}"
            self.current.append(Op("fence", kind, site=site))

        return record


class Cells:
    """u64 words (a ring's control block, a counter, a flag, an op board) whose accesses are recorded."""

    def __init__(self, rec: Recorder, names: dict[int, str]) -> None:
        self.rec, self.names = rec, names

    def __getitem__(self, i: int) -> Any:
        return self.rec.load(self.names[i])

    def __setitem__(self, i: int, value: Any) -> None:
        self.rec.store(self.names[i], value)


class Bytes:
    """A ring's slot payloads: a slice assignment is one store, taking a slice one load."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def __setitem__(self, key: slice, value: Any) -> None:
        self.rec.store(f"payload@{key.start}", bytes(value))

    def __getitem__(self, key: slice) -> Any:
        return self.rec.load(f"payload@{key.start}")


class Slots:
    """Stands in for shm_ring._SLOT: a slot header's pack and unpack are one store and one load."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def pack_into(self, buf: Any, off: int, *fields: int) -> None:
        self.rec.store(f"slot@{off}", fields)

    def unpack_from(self, buf: Any, off: int) -> tuple:
        fields = self.rec.load(f"slot@{off}")
        return fields if fields else (0,) * 9


class Link:
    """What ShmLinks' wake-ups see of a peer: its sleeping flag."""

    def __init__(self, rec: Recorder, flag: str) -> None:
        self.flag, self.eof = Cells(rec, {0: flag}), False

    def ring_bell(self) -> None:
        pass


@pytest.fixture
def trace(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, dict[str, Any]], Recorder]:
    """A Recorder for platform `model`'s fences: those `ordering.fences` makes `nothing` stay nothing."""

    def make(model: str, initial: dict[str, Any]) -> Recorder:
        rec = Recorder(initial)
        chosen = ordering.fences(MODELS[model], lambda name: lambda: None)
        for kind in ("acquire", "release", "full"):
            real = getattr(chosen, kind) is not ordering.nothing
            monkeypatch.setattr(ordering, kind, rec.fence(kind) if real else ordering.nothing)
        monkeypatch.setattr(ring, "_SLOT", Slots(rec))
        return rec

    return make


def ring_pair(rec: Recorder, slots: int = 2, head: int = 0, tail: int = 0) -> tuple[ring.RingWriter, ring.RingReader]:
    """A writer and a reader of one ring whose accesses `rec` records (head/tail as the ring starts)."""
    mv = memoryview(bytearray(ring.ring_bytes(slots, 64)))
    w, r = ring.RingWriter(mv, slots, 64), ring.RingReader(mv, slots, 64)
    for end in (w, r):
        end.ctl, end.mv = Cells(rec, {ring.HEAD_OFFSET // 8: "head", ring.TAIL_OFFSET // 8: "tail"}), Bytes(rec)
    w.head, w.tail_seen, r.tail, r.acquired = head, tail, tail, tail
    rec.mem.update(head=head, tail=tail)
    rec.initial.update(head=head, tail=tail)
    return w, r


def window_pair(rec: Recorder) -> list[ShmWindowMemory]:
    """Two members' ShmWindowMemory over recorded counters, words and flags (member p's flag: `flag{p}`)."""
    areas = {p: memoryview(bytearray(area_bytes(4096))) for p in (0, 1)}
    mems = []
    for me in (0, 1):
        kind = SimpleNamespace(_list=[Link(rec, f"flag{1 - me}")])
        m = ShmWindowMemory([0, 1], me, areas, 4096, lambda kind=kind: ShmLinks.wake_sleepers(kind))
        m._ctr = [Cells(rec, {0: f"ctr{p}"}) for p in (0, 1)]
        m._words = [Cells(rec, {k: f"word{p}.{k}" for k in range(4)}) for p in (0, 1)]
        mems.append(m)
    return mems


def sleeper(rec: Recorder, flag: str) -> Any:
    """The ShmLinks half a sleeping engine uses: its own flag."""
    return SimpleNamespace(_my_flag=Cells(rec, {0: flag}))


def waker(rec: Recorder, flag: str) -> Any:
    """The ShmLinks half that rings bells after a pump that moved data to or from the peer with `flag`."""
    return SimpleNamespace(to_ring={Link(rec, flag)})


MSG = memoryview(b"new!")


# -- the scenarios --------------------------------------------------------------------------------------------
@dataclass
class Scenario:
    threads: dict[str, list[Op]]
    initial: dict[str, Any]
    bad: Callable[[Outcome], bool]
    notes: str = field(default="")


def ring_publish(rec: Recorder) -> Scenario:
    """A reader that sees the head a slot's put stored must see that slot's header and payload."""
    w, r = ring_pair(rec)
    rec.run("writer", lambda: w.put(1, 1, 7, 9, 0, 0, MSG, 4))
    rec.run("reader", lambda: r.pending() and (r.peek(), bytes(r.payload(4)), r.pop()))
    slot, payload = rec.mem["slot@4096"], rec.mem["payload@4160"]

    def bad(out: Outcome) -> bool:
        mine = out["reader"]
        return all(h == 1 for h in loaded(mine, "head")) and (
            loaded(mine, "slot@4096") != [slot] or loaded(mine, "payload@4160") != [payload])

    return Scenario(rec.threads, rec.initial, bad)


def ring_reuse(rec: Recorder) -> Scenario:
    """A writer that sees the tail a reader's pop stored may rewrite that slot: the reader's loads of it
    must not see the rewrite."""
    w, r = ring_pair(rec, slots=1, head=1, tail=0)
    rec.mem.update({"slot@4096": (1,) * 9, "payload@4160": b"old!"})
    rec.initial.update({"slot@4096": (1,) * 9, "payload@4160": b"old!"})
    rec.run("reader", lambda: (r.peek(), bytes(r.payload(4)), r.pop()))
    rec.run("writer", lambda: w.free() > 0 and w.put(2, 1, 7, 9, 1, 0, MSG, 4))

    def bad(out: Outcome) -> bool:
        return loaded(out["writer"], "tail") == [1] and (
            loaded(out["reader"], "payload@4160") != [b"old!"] or loaded(out["reader"], "slot@4096") != [(1,) * 9])

    return Scenario(rec.threads, rec.initial, bad)


def ring_wake_reader(rec: Recorder) -> Scenario:
    """A reader going to sleep and a writer publishing a slot: one of them sees the other (no lost wake-up)."""
    w, r = ring_pair(rec)
    rec.run("writer", lambda: (w.put(1, 1, 7, 9, 0, 0, MSG, 4), ShmLinks.after_pump(waker(rec, "flagR"))))
    rec.run("reader", lambda: (ShmLinks.before_sleep(sleeper(rec, "flagR"), False), r.pending()))
    return Scenario(rec.threads, rec.initial,
                    lambda out: loaded(out["writer"], "flagR") == [0] and loaded(out["reader"], "head") == [0])


def ring_wake_writer(rec: Recorder) -> Scenario:
    """A writer asleep until the full ring has room and a reader freeing a slot: one sees the other."""
    w, r = ring_pair(rec, slots=1, head=1, tail=0)
    rec.run("reader", lambda: (r.peek(), bytes(r.payload(4)), r.pop(), ShmLinks.after_pump(waker(rec, "flagW"))))
    rec.run("writer", lambda: (ShmLinks.before_sleep(sleeper(rec, "flagW"), False), w.free()))
    return Scenario(rec.threads, rec.initial,
                    lambda out: loaded(out["reader"], "flagW") == [0] and loaded(out["writer"], "tail") == [0])


def window_publish(rec: Recorder) -> Scenario:
    """A member that sees a peer's counter reach a step sees that step's buffer and op word."""
    m0, m1 = window_pair(rec)
    rec.run("poster", lambda: (rec.store("buf0", "new"), m0.publish(1, 0, 0xAB)))
    rec.run("waiter", lambda: m1.reached([0], 1, 1) and (m1.word(0, 0), rec.load("buf0")))

    def bad(out: Outcome) -> bool:
        mine = out["waiter"]
        return loaded(mine, "ctr0") == [1] and (loaded(mine, "buf0") != ["new"] or loaded(mine, "word0.0") != [0xAB])

    return Scenario(rec.threads, rec.initial, bad)


def window_reuse(rec: Recorder) -> Scenario:
    """A member reads a peer's buffer, then posts that it is done with it; the peer waits for that post (a
    fresh look, then one remembered: a later wait for an earlier step) before rewriting the buffer."""
    m0, m1 = window_pair(rec)
    rec.initial["buf0"] = rec.mem["buf0"] = "old"
    rec.run("reader", lambda: (rec.load("buf0"), m1.publish(3, None, 0), m1.publish(4, 1, 0xCD)))
    rec.run("owner", lambda: m0.reached([1], 4, 1) and m0.reached([1], 3, 1) and rec.store("buf0", "next"))
    return Scenario(rec.threads, rec.initial,
                    lambda out: loaded(out["owner"], "ctr1") == [4] and loaded(out["reader"], "buf0") != ["old"])


def window_wake(rec: Recorder) -> Scenario:
    """A member going to sleep on a counter and the peer posting it: one of them sees the other."""
    m0, m1 = window_pair(rec)
    rec.run("poster", lambda: m0.publish(1, None, 0))
    rec.run("sleeper", lambda: (ShmLinks.before_sleep(sleeper(rec, "flag1"), False), m1.reached([0], 1, 1)))
    return Scenario(rec.threads, rec.initial,
                    lambda out: loaded(out["poster"], "flag1") == [0] and loaded(out["sleeper"], "ctr0") == [0])


def op_board(rec: Recorder) -> Scenario:
    """A reader of a peer's op board never pairs one op's tag with another op's signature."""
    rec.initial.update(tag=1, sig=0x111)
    rec.mem.update(tag=1, sig=0x111)
    board = Cells(rec, {0: "tag", 1: "sig"})
    runs: list[tuple[int, int]] = []
    engine = SimpleNamespace(matcher=SimpleNamespace(collective_waits=lambda: [SimpleNamespace(peer=1, sig=0x111)]),
                             ops=SimpleNamespace(peer_runs=lambda peer, tag, sig: runs.append((tag, sig))),
                             fail=lambda exc: None)
    rec.run("poster", lambda: ShmLinks.note_post(SimpleNamespace(_my_board=board), (Space.COLL, 2, 0), 0x222))
    rec.run("reader", lambda: ShmLinks._check_peer_ops(SimpleNamespace(engine=engine, _boards={1: board})))
    assert runs == [(2, 0x222)]  # the traced run itself read the new op whole

    def bad(out: Outcome) -> bool:
        tags, sigs = loaded(out["reader"], "tag"), loaded(out["reader"], "sig")
        accepted = len(set(tags)) == 1 and tags[0] != 0
        return accepted and (tags[0], sigs[0]) not in {(1, 0x111), (2, 0x222)}

    return Scenario(rec.threads, rec.initial, bad)


def window_skipped(rec: Recorder) -> Scenario:
    """`Window.check_skipped`: a member that sees a peer's counter beyond this op sees the ring data the peer
    sent before it posted (else it would call a mismatch that is none)."""
    from torch_thunderbolt.algorithms.window import Window

    m0, m1 = window_pair(rec)
    w, r = ring_pair(rec)
    failed: list[BaseException] = []
    req = SimpleNamespace(peer=1, key=(Space.COLL, 5, 0), sig=0x5)
    engine = SimpleNamespace(watchers={}, rank=0, matcher=SimpleNamespace(collective_waits=lambda: [req]),
                             has_unread=lambda peer: r.pending(), fail=failed.append)
    win = Window(engine, m0)
    rec.run("peer", lambda: (w.put(1, 1, 5, 5, 0, 0, MSG, 4), m1.publish(1, 0, 0x9)))
    rec.run("checker", win.check_skipped)
    assert not failed  # the traced run itself saw the ring data
    return Scenario(rec.threads, rec.initial,
                    lambda out: loaded(out["checker"], "ctr1") == [1] and loaded(out["checker"], "head") == [0])


SCENARIOS = [ring_publish, ring_reuse, ring_wake_reader, ring_wake_writer, window_publish, window_reuse,
             window_wake, op_board, window_skipped]


# -- the tests ------------------------------------------------------------------------------------------------
def test_the_checker_finds_the_classic_reorderings() -> None:
    """Message passing (MP), store buffering (SB) and load buffering (LB) without fences: what each model
    allows, and that the right fence forbids it (so the checker can fail)."""
    mp = {"w": [Op("store", "d", 1), Op("store", "f", 1)], "r": [Op("load", "f"), Op("load", "d")]}
    mp_bad = lambda out: out["r"] == [("f", 1), ("d", 0)]  # noqa: E731
    assert violations(mp, {}, "arm", mp_bad) and not violations(mp, {}, "tso", mp_bad)
    fenced = {"w": [mp["w"][0], Op("fence", "release"), mp["w"][1]],
              "r": [mp["r"][0], Op("fence", "acquire"), mp["r"][1]]}
    assert not violations(fenced, {}, "arm", mp_bad)
    assert violations({"w": fenced["w"], "r": mp["r"]}, {}, "arm", mp_bad)  # both halves are needed
    assert violations({"w": mp["w"], "r": fenced["r"]}, {}, "arm", mp_bad)

    sb = {"a": [Op("store", "x", 1), Op("load", "y")], "b": [Op("store", "y", 1), Op("load", "x")]}
    sb_bad = lambda out: out["a"] == [("y", 0)] and out["b"] == [("x", 0)]  # noqa: E731
    assert violations(sb, {}, "arm", sb_bad) and violations(sb, {}, "tso", sb_bad)
    acq_rel = {t: [ops[0], Op("fence", "release"), Op("fence", "acquire"), ops[1]] for t, ops in sb.items()}
    assert violations(acq_rel, {}, "arm", sb_bad)  # a store then a load: only a full fence orders it
    full = {t: [ops[0], Op("fence", "full"), ops[1]] for t, ops in sb.items()}
    assert not violations(full, {}, "arm", sb_bad) and not violations(full, {}, "tso", sb_bad)

    lb = {"a": [Op("load", "x"), Op("store", "y", 1)], "b": [Op("load", "y"), Op("store", "x", 1)]}
    lb_bad = lambda out: out["a"] == [("x", 1)] and out["b"] == [("y", 1)]  # noqa: E731
    assert violations(lb, {}, "arm", lb_bad) and not violations(lb, {}, "tso", lb_bad)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_no_execution_breaks_the_protocol(model: str, scenario, trace) -> None:
    s = scenario(trace(model, {}))
    found = violations(s.threads, s.initial, model, s.bad)
    assert not found, (f"{scenario.__name__} under {model}: {len(found)} bad outcome(s), e.g. {found[0]}\n"
                       f"programs: {s.threads}")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_fence_is_needed(model: str, trace) -> None:
    """Each fence the code places stops a bad outcome of some scenario when it is the one left out; and the
    traces are not empty of fences (the recorders saw the code's calls)."""
    sites: dict[str, bool] = {}
    for scenario in SCENARIOS:
        s = scenario(trace(model, {}))
        for name, program in s.threads.items():
            for i, op in enumerate(program):
                if op.kind != "fence":
                    continue
                without = dict(s.threads, **{name: program[:i] + program[i + 1 :]})
                needed = bool(violations(without, s.initial, model, s.bad))
                sites[op.site] = sites.get(op.site, False) or needed
    assert sites, "no fence was traced"
    spare = sorted(site for site, needed in sites.items() if not needed)
    assert not spare, f"fences no scenario needs under {model}: {spare}"
    if model == "tso":  # x86: acquire and release are nothing, only the sleep handshake's full fences are left
        assert all(site.startswith("full ") for site in sites), sorted(sites)


def _sites(model: str, trace) -> Iterator[str]:
    for scenario in SCENARIOS:
        for program in scenario(trace(model, {})).threads.values():
            yield from (op.site for op in program if op.kind == "fence")


def test_the_traces_hold_the_fences_the_protocols_need(trace) -> None:
    """The fences of ordering.py's table, where the table says (a guard against a scenario that traces
    nothing and so passes by checking nothing)."""
    arm = {site.split(":")[0] for site in _sites("arm", trace)}
    assert arm >= {"release in RingWriter.put", "acquire in RingReader.peek", "release in RingReader.pop",
                   "acquire in RingWriter.free", "release in ShmWindowMemory.publish",
                   "acquire in ShmWindowMemory.reached", "release in ShmLinks.note_post",
                   "acquire in ShmLinks._check_peer_ops", "full in ShmLinks.before_sleep",
                   "full in ShmLinks.after_pump", "full in ShmLinks.wake_sleepers",
                   "acquire in ShmWindowMemory.fence"}, sorted(arm)
