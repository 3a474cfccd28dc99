"""Conformance checks every implementation of window memory (transport/window.py `WindowMemory`) must pass,
as `conformance.CHECKS` are for kinds of links.

The checks hold window memory to the contract between its members, what the shared-window collectives
(algorithms/window.py) stand on; the memory ordering that gives it on each platform is argued in
transport/ordering.py and model-checked in tests/shm/test_ordering.py, not here:

- positions: `members` are the group ranks in ascending order, the same on every member, and `me` is this
  rank's index; each of a member's BUFFERS buffers is `nbytes` of writable memory;
- data: round after round, every member sees every other member's buffers (all BUFFERS, sizes up to
  `nbytes`) and their words as soon as `reached` says the owner published them, and at the end every buffer
  still holds its own bytes;
- words: `word(owner, k)` is the 64-bit word published with buffer k; a publish with k=None leaves the
  words alone;
- counter: a member's counter only grows and shows only values it published, and once it is settled every
  look shows what it last published (64-bit values);
- reached: False while some peer has not published the value (whatever the number of looks), True once all
  have, and it stays True;
- wake: a member asleep in its engine's poll() is woken by a peer's publish within WAKE seconds;
- release: once the work is over, `release()` and the transport's close leave nothing behind: no segment of
  the group's ranks, no mapping of the memory the window was in.

Each check is one function run by every member of a fresh group, `check(ctx)`, with conformance's runners:
`run_on_threads(make, world, suite=WINDOW)` (MemoryWindowMemory: transport.memory.MemoryHub with a window)
and `run_in_processes("shm", world, workdir, setup=testing.ranks.SHM, suite=WINDOW)` (ShmWindowMemory, in
rank processes set up as a job does: the window of a group all on one host). `MUTANTS` break window memory
on purpose; the checks must fail on them (tests/conformance shows they do).
"""
from __future__ import annotations

import ctypes
import os
import random
import struct
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from torch_thunderbolt.transport.window import BUFFERS

from .conformance import FAILED, Ctx, Suite, _seed, pattern, process_rank

if TYPE_CHECKING:
    from torch_thunderbolt.transport.engine import Transport
    from torch_thunderbolt.transport.window import WindowMemory

WAKE = 2.0  # seconds a publish may take to wake a sleeping member: far below a group timeout, generous when busy
SETTLE = 0.3  # seconds a publisher gives members that said they go to sleep to get there
ROUNDS = 3  # rounds of the data check: every buffer written, published and read this many times
LOOKS = (0, 1, 64)  # numbers of looks `reached` is asked with (0 still looks once)
SERIES = (*(3 * i + 1 for i in range(100)), 1 << 33, (1 << 62) + 7)  # what each member's counter shows in turn
MAPS = Path("/proc/self/maps")


def _memory(ctx: Ctx) -> "WindowMemory":
    wm = ctx.t.window_memory
    assert wm is not None, f"rank {ctx.rank}: the group has no window memory"
    return wm


def _others(wm: "WindowMemory") -> list[int]:
    return [o for o in range(len(wm.members)) if o != wm.me]


def _word(*parts: int) -> int:
    """A 64-bit word for `parts`, its top bit set (a word cut to 32 bits or made signed shows)."""
    return random.Random(_seed(*parts)).getrandbits(63) | (1 << 63)


def _put(wm: "WindowMemory", k: int, data: bytes) -> None:
    """Write `data` at the start of this member's buffer `k` (keeping no view: release() must be able to
    unmap)."""
    wm.buffer(wm.me, k)[: len(data)] = data


def _get(wm: "WindowMemory", owner: int, k: int, n: int) -> bytes:
    return bytes(wm.buffer(owner, k)[:n])


def _same(got: bytes, want: bytes, what: str) -> None:
    if got != want:
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise AssertionError(f"{what}: byte {at} of {len(want)} differs from what the owner wrote")


def _wait(ctx: Ctx, wm: "WindowMemory", peers: list[int], value: int, what: str) -> None:
    """Drive the engine, as a window wait does, until every owner in `peers` (positions) published `value`."""
    t = ctx.t
    deadline = ctx.deadline()
    ready = lambda: wm.reached(peers, value, 1)  # noqa: E731
    while not ready():
        now = time.monotonic()
        if now >= deadline:
            late = {wm.members[p]: wm.counter(p) for p in peers}
            raise AssertionError(f"rank {ctx.rank}: waited {ctx.wait:.0f} s for {what} (value {value}); the "
                                 f"counters of ranks {sorted(late)} show {list(late.values())}")
        if ctx.store.check([FAILED]):
            raise AssertionError(f"gave up waiting for {what}: another rank failed this check")
        t.check_usable()
        t.progress(min(0.2, deadline - now), until=ready)


# -- the checks ------------------------------------------------------------------------------------------------
def check_positions(ctx: Ctx) -> None:
    """`members` are the ranks sharing the memory in ascending order (a group all on one host: every rank),
    the same list on every member; `me` is this rank's index; every buffer of every member is `nbytes`
    (more than 0, the same on every member) of writable memory."""
    wm = _memory(ctx)
    assert wm.members == list(range(ctx.world)), f"rank {ctx.rank}: members {wm.members}, not every rank in order"
    assert 0 <= wm.me < len(wm.members) and wm.members[wm.me] == ctx.rank, (
        f"rank {ctx.rank}: me = {wm.me}, which is not this rank's position in {wm.members}")
    assert wm.nbytes > 0, f"rank {ctx.rank}: nbytes = {wm.nbytes}"
    for o in range(len(wm.members)):
        for k in range(BUFFERS):
            view = wm.buffer(o, k)
            shape = (view.nbytes, view.readonly)
            del view  # (no view kept: see _put)
            assert shape == (wm.nbytes, False), (
                f"rank {ctx.rank}: buffer {k} of rank {wm.members[o]} has {shape[0]} bytes (readonly: {shape[1]}), "
                f"not {wm.nbytes} writable ones")
    ctx.store.set(f"shape/{ctx.rank}", repr((wm.members, wm.nbytes)))
    ctx.sync("told")
    for r in range(ctx.world):
        theirs = ctx.store.get(f"shape/{r}").decode()
        assert theirs == repr((wm.members, wm.nbytes)), (
            f"rank {r} has (members, nbytes) = {theirs}, rank {ctx.rank} {(wm.members, wm.nbytes)}")
    ctx.sync("done")


def check_data(ctx: Ctx) -> None:
    """Each round, every member fills each of its BUFFERS (sizes from 1 byte to `nbytes`) and publishes it
    with its word; as soon as `reached` says an owner published, every other member sees those bytes and
    that word. The members then publish (k=None) that they are done reading, before the buffer is written
    again. At the end every buffer of every member still holds the bytes of its last round."""
    wm = _memory(ctx)
    others, top = _others(wm), wm.nbytes
    sizes = sorted({n for n in (1, 8, 4095, 4097, 65539, top // 2 + 1, top - 1, top) if 0 < n <= top})
    size = lambda o, r, k: sizes[(r * BUFFERS + k + o) % len(sizes)]  # noqa: E731 - each owner its own order
    value = 0
    for r in range(ROUNDS):
        for k in range(BUFFERS):
            _put(wm, k, pattern(_seed(wm.me, r, k), size(wm.me, r, k)))
            value += 1
            wm.publish(value, k, _word(wm.me, r, k))
            _wait(ctx, wm, others, value, f"round {r}'s buffer {k}")
            for o in others:
                owner = wm.members[o]
                got = wm.word(o, k)
                assert got == _word(o, r, k), (
                    f"rank {ctx.rank}: the word of rank {owner}'s buffer {k} is {got:#x} once its counter shows "
                    f"{value}; it published {_word(o, r, k):#x} with it")
                n = size(o, r, k)
                _same(_get(wm, o, k, n), pattern(_seed(o, r, k), n),
                      f"rank {ctx.rank}: rank {owner}'s buffer {k} in round {r} ({n} bytes)")
            value += 1
            wm.publish(value, None, 0)  # done reading: the owners may write their buffers k again
            _wait(ctx, wm, others, value, f"the reads of round {r}'s buffer {k}")
    last = ROUNDS - 1
    for o in range(len(wm.members)):
        for k in range(BUFFERS):
            n = size(o, last, k)
            _same(_get(wm, o, k, n), pattern(_seed(o, last, k), n),
                  f"rank {ctx.rank}: at the end, rank {wm.members[o]}'s buffer {k} ({n} bytes)")
    ctx.sync("done")


def check_words(ctx: Ctx) -> None:
    """`word(owner, k)` is the word the owner published with buffer k, each buffer its own (64-bit words);
    publishing k=None, whatever word comes with it, leaves every word alone; a new word for one buffer
    replaces that one only."""
    wm = _memory(ctx)
    others, everyone = _others(wm), range(len(wm.members))
    value = 0
    for k in range(BUFFERS):
        value += 1
        wm.publish(value, k, _word(wm.me, 0, k))
    for _ in range(2):
        value += 1
        wm.publish(value, None, _word(wm.me, 9))  # a word that must go nowhere
    _wait(ctx, wm, others, value, "the words")
    for o in everyone:
        for k in range(BUFFERS):
            got = wm.word(o, k)
            assert got == _word(o, 0, k), (
                f"rank {ctx.rank}: the word of rank {wm.members[o]}'s buffer {k} is {got:#x}; it published "
                f"{_word(o, 0, k):#x} with it" + (" (and a publish with k=None brought that one)"
                                                  if got == _word(o, 9) else ""))
    ctx.sync("read")  # before anyone publishes a new word
    value += 1
    wm.publish(value, 2, _word(wm.me, 1, 2))
    _wait(ctx, wm, others, value, "the new word of buffer 2")
    for o in everyone:
        for k in range(BUFFERS):
            want = _word(o, 1, 2) if k == 2 else _word(o, 0, k)
            got = wm.word(o, k)
            assert got == want, (f"rank {ctx.rank}: after rank {wm.members[o]} published a new word for buffer 2, "
                                 f"its buffer {k}'s word is {got:#x}, not {want:#x}")
    ctx.sync("done")


def check_counter(ctx: Ctx) -> None:
    """While every member publishes a rising series of values (up to 64-bit ones), it looks at the others'
    counters again and again: a counter never goes back and shows only values its owner published (or 0,
    before the first). Once every series is over, every look at every counter, one's own included, shows
    the last value its owner published."""
    wm = _memory(ctx)
    others = _others(wm)
    shown = {0, *SERIES}
    seen = dict.fromkeys(others, 0)
    last = SERIES[-1]
    deadline = ctx.deadline()
    i = 0
    while i < len(SERIES) or any(seen[o] < last for o in others):
        if i < len(SERIES):
            wm.publish(SERIES[i], None, 0)
            i += 1
        else:
            assert time.monotonic() < deadline, f"rank {ctx.rank}: the counters stopped at {seen}"
            if ctx.store.check([FAILED]):
                raise AssertionError("gave up: another rank failed this check")
            time.sleep(0)
        for o in others:
            c = wm.counter(o)
            assert c in shown, f"rank {ctx.rank}: rank {wm.members[o]}'s counter shows {c}, a value it never published"
            assert c >= seen[o], f"rank {ctx.rank}: rank {wm.members[o]}'s counter went back from {seen[o]} to {c}"
            seen[o] = c
    ctx.sync("settled")
    for o in range(len(wm.members)):
        for look in range(4):
            c = wm.counter(o)
            assert c == last, (f"rank {ctx.rank}: look {look} at rank {wm.members[o]}'s counter shows {c}; the last "
                               f"value it published is {last}")
    ctx.sync("done")


def check_reached(ctx: Ctx) -> None:
    """`reached(peers, value, looks)`, with any number of looks, is False while some owner in `peers` has not
    published `value` (with three members: one has, one has not), True once all have published it or more,
    and it stays True; over no peers it is True."""
    wm = _memory(ctx)
    others = _others(wm)

    def says(peers: list[int], value: int, want: bool, when: str) -> None:
        for looks in LOOKS:
            got = wm.reached(peers, value, looks)
            assert got is want, (f"rank {ctx.rank}: reached(ranks {[wm.members[p] for p in peers]}, {value}, "
                                 f"looks={looks}) is {got} {when}")

    says(others, 1, False, "before anyone published")
    says(others, 0, True, "(every counter is at least 0)")
    says([], 5, True, "over no peers")
    ctx.sync("looked")
    if wm.me == 0:
        wm.publish(1, None, 0)
    _wait(ctx, wm, [0], 1, f"rank {wm.members[0]}'s 1")
    says([0], 1, True, f"after rank {wm.members[0]} published 1")
    if wm.me != 0 and len(others) > 1:
        says(others, 1, False, f"while only rank {wm.members[0]} of them had published it")
    ctx.sync("one")
    if wm.me != 0:
        wm.publish(1, None, 0)
    _wait(ctx, wm, others, 1, "everyone's 1")
    says(others, 1, True, "after every peer published 1")
    says([*others, wm.me], 1, True, "after every member, this one included, published 1")
    says(others, 2, False, "when every peer had published 1")
    ctx.sync("two")
    wm.publish(3, None, 0)
    _wait(ctx, wm, others, 3, "everyone's 3")
    for value in (3, 2, 1):
        says(others, value, True, "after every peer published 3")
    says(others, 4, False, "when every peer had published 3")
    ctx.sync("done")


def _uncap(t: "Transport") -> None:
    """Lift each kind's cap on one sleep in poll() (its guard against a lost wake-up, a few ms): a publish
    that wakes nobody then leaves the sleeper asleep until its timeout."""
    for kind in t.kinds:
        capped = kind.before_sleep

        def before_sleep(quiet: bool, capped: Callable[[bool], "float | None"] = capped) -> None:
            capped(quiet)
        kind.before_sleep = before_sleep  # type: ignore[method-assign]


def check_wake(ctx: Ctx) -> None:
    """Each member in turn publishes (its buffer 0 holding when) while every other member waits for that
    value asleep in its engine's poll() (each kind's cap on one sleep lifted, so that only a wake-up ends
    it): every sleeper sees the value within WAKE seconds of the publish."""
    wm, t = _memory(ctx), ctx.t
    _uncap(t)
    for turn in range(len(wm.members)):
        ctx.sync(f"turn {turn}")
        if wm.me == turn:
            time.sleep(SETTLE)  # the others are asleep by now
            _put(wm, 0, struct.pack("<d", time.monotonic()))  # a clock every process of this host shares
            wm.publish(1, 0, _word(wm.me))
            continue
        deadline = time.monotonic() + max(ctx.wait, 3 * WAKE)
        ready = lambda: wm.reached([turn], 1, 1)  # noqa: E731
        while not ready():
            now = time.monotonic()
            assert now < deadline, f"rank {ctx.rank}: rank {wm.members[turn]}'s publish never showed"
            t.check_usable()
            t.progress(deadline - now, until=ready)  # one sleep, as long as it takes
        (published,) = struct.unpack("<d", _get(wm, turn, 0, 8))
        lag = time.monotonic() - published
        assert lag < WAKE, (f"rank {ctx.rank} saw rank {wm.members[turn]}'s publish {lag:.1f} s after it: it slept "
                            f"through it (a publish must wake members asleep in poll)")
    ctx.sync("done")


def _file_mappings() -> "dict[int, tuple[int, str]] | None":
    """This process's file-backed mappings, start address -> (end, 'dev inode path'); None where there is no
    /proc/self/maps."""
    try:
        lines = MAPS.read_text().splitlines()
    except FileNotFoundError:
        return None
    out = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out[start] = (end, " ".join(fields[3:]))
    return out


def _files_of(wm: "WindowMemory") -> set[str]:
    """The files (dev inode path, as /proc/self/maps says) the window's buffers are mapped from; none for
    plain process memory."""
    maps = _file_mappings() or {}
    files = set()
    for o in range(len(wm.members)):
        for k in range(BUFFERS):
            at = ctypes.addressof(ctypes.c_char.from_buffer(wm.buffer(o, k)))  # (a temporary export)
            files |= {f for start, (end, f) in maps.items() if start <= at < end}
    return files


def check_release(ctx: Ctx) -> None:
    """Once the work is over (a round published and read by every member), `release()` and then the
    transport's close (which may release again) leave nothing behind: no segment of the group's ranks
    exists, and this process maps none of the files the window was in (on Linux, from /proc/self/maps)."""
    from .leftovers import segments_and_doorbells

    wm = _memory(ctx)
    others = _others(wm)
    _put(wm, 1, pattern(_seed(wm.me, 7), 4096))
    wm.publish(1, 1, _word(wm.me, 7))
    _wait(ctx, wm, others, 1, "the round")
    for o in others:
        _same(_get(wm, o, 1, 4096), pattern(_seed(o, 7), 4096), f"rank {ctx.rank}: rank {wm.members[o]}'s buffer 1")
    files = _files_of(wm)
    ctx.store.set(f"pid/{ctx.rank}", str(os.getpid()))
    ctx.sync("read")  # nobody looks at the window any more
    wm.release()
    ctx.t.close()
    pids = {int(ctx.store.get(f"pid/{r}")) for r in range(ctx.world)}
    left = segments_and_doorbells(pids)
    assert not left, f"rank {ctx.rank}: segments or doorbells of the group's ranks left after release: {sorted(left)}"
    maps = _file_mappings() or {}
    still = files & {f for _, f in maps.values()}
    assert not still, f"rank {ctx.rank} still maps {sorted(still)} after release() and the transport's close"
    ctx.sync("done")


#: Every check, by name, in the order they run.
CHECKS: dict[str, Callable[[Ctx], None]] = {
    "positions": check_positions, "data": check_data, "words": check_words, "counter": check_counter,
    "reached": check_reached, "wake": check_wake, "release": check_release,
}


# -- mutants: window memory broken on purpose, which the checks must catch ---------------------------------------
def _word_late(wm: "WindowMemory") -> None:
    """publish stores the counter before the word (as a weak memory without the release fence may show them),
    the word only a while later: long enough for a reader to look in between."""
    publish = wm.publish

    def late(value: int, k: "int | None", word: int) -> None:
        publish(value, None, 0)
        if k is not None:
            time.sleep(0.05)
            publish(value, k, word)
    wm.publish = late  # type: ignore[method-assign]


def _silent(wm: "WindowMemory") -> None:
    """publish stores, and wakes nobody."""
    from torch_thunderbolt.transport.memory import MemoryWindowMemory
    from torch_thunderbolt.transport.shm_window import ShmWindowMemory

    if isinstance(wm, ShmWindowMemory):
        wm._wake = lambda: None
        return
    assert isinstance(wm, MemoryWindowMemory), type(wm)
    hub, publish = wm.hub, wm.publish

    def silent(value: int, k: "int | None", word: int) -> None:
        # Under the world's lock, which the members' transports take to go to sleep: the peers' wake-ups
        # are switched off for this publish only.
        with hub.cv:
            peers = [hub.transports[p] for p in wm.members if p != wm.rank]
            for t in peers:
                t.wake_sleeper = lambda: None  # type: ignore[method-assign]
            try:
                publish(value, k, word)
            finally:
                for t in peers:
                    del t.wake_sleeper
    wm.publish = silent  # type: ignore[method-assign]


def _counter_back(wm: "WindowMemory") -> None:
    """Every third look at a peer's counter shows one less than it holds: the counter goes back."""
    counter, looks = wm.counter, [0]

    def back(owner: int) -> int:
        value = counter(owner)
        if owner == wm.me or not value:
            return value
        looks[0] += 1
        return value - 1 if looks[0] % 3 == 0 else value
    wm.counter = back  # type: ignore[method-assign]


def _none_stores_word(wm: "WindowMemory") -> None:
    """A publish without a buffer stores its word as buffer 0's."""
    publish = wm.publish
    wm.publish = lambda value, k, word: publish(value, 0 if k is None else k, word)  # type: ignore[method-assign]


def _private_buffers(wm: "WindowMemory") -> None:
    """A peer's buffer is a copy taken when it is first asked for, not the peer's memory."""
    buffer, copies = wm.buffer, {}

    def private(owner: int, k: int) -> memoryview:
        if owner == wm.me:
            return buffer(owner, k)
        if (owner, k) not in copies:
            copies[(owner, k)] = memoryview(bytearray(buffer(owner, k)))
        return copies[(owner, k)]
    wm.buffer = private  # type: ignore[method-assign]


def _reached_any(wm: "WindowMemory") -> None:
    """reached is True once any one of the peers has published the value."""
    counter = wm.counter
    wm.reached = lambda peers, value, looks: not peers or any(counter(p) >= value for p in peers)  # type: ignore


def _wrong_me(wm: "WindowMemory") -> None:
    """`me` is the next member's position."""
    wm.me = (wm.me + 1) % len(wm.members)


def _keeps_mapping(wm: "WindowMemory") -> None:
    """release() releases nothing: the window's views keep the peers' segments mapped after the close."""
    wm.release = lambda: None  # type: ignore[method-assign]


MUTANTS: dict[str, Callable[["WindowMemory"], None]] = {
    "word_late": _word_late, "silent": _silent, "counter_back": _counter_back,
    "none_stores_word": _none_stores_word, "private_buffers": _private_buffers, "reached_any": _reached_any,
    "wrong_me": _wrong_me, "keeps_mapping": _keeps_mapping,
}


def mutate(t: "Transport", name: str) -> None:
    """Break the window memory of `t` the way mutant `name` does (on this rank only)."""
    assert t.window_memory is not None, f"rank {t.rank}: no window memory to break"
    MUTANTS[name](t.window_memory)


WINDOW = Suite(CHECKS, mutate, __name__)


if __name__ == "__main__":
    process_rank(sys.argv[1], sys.argv[2:] or list(CHECKS), WINDOW)
