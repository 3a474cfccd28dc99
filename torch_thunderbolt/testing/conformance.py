"""Conformance checks every kind of link must pass (as trio's `check_two_way_stream` is for its streams).

A kind of link is done when a group whose pairs all use it passes every check in CHECKS: ordering and
matching per peer and tag, zero-length and very large messages, partial writes and reads, many messages
in flight, a peer that stops reading, ABORT delivery with its structured details, a signature mismatch,
data left over from a finished op, BYE and close, byte counters, and a peer that dies. Each check is one
function run by every rank of a fresh group, `check(ctx)`, that raises AssertionError (or the group's
error) when the kind misbehaves.

Two ways to run them:

- `run_in_processes(kind, world, workdir, ...)`: real rank processes (testing.ranks), each connecting
  through the set-up a job uses (`rendezvous.group.connect`) with every pair on `kind`; a dying rank really
  dies (os._exit: the kernel closes what it had open). For any kind a job can use, and for the kinds only
  tests use (testing/kinds, added to the table). Settings for the kind come from `env` (THUNDERBOLT_SHM_SLOT, a fake
  fabric's THUNDERBOLT_VERBS ...).
- `run_on_threads(make, world, ...)`: ranks as threads of this process over transports `make` builds,
  for the in-memory kind.

`MUTANTS` break a kind on purpose (drop a message, send two out of order, swallow the ABORT): the
checks must fail on them (tests/conformance shows they do); `mutate(transport, name)` applies one.

The runners run any `Suite` (checks, mutants, the module of its rank processes): `LINKS` is this one, the
default; `window_conformance.WINDOW` checks window memory the same way.
"""
from __future__ import annotations

import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from torch_thunderbolt.transport.engine import Transport

WAIT = 30.0  # seconds any one wait of a check may take before the check fails (never reached by a good kind)
SIG = 0x0123_4567_89AB_CDEF  # the collective messages' op signature
OTHER_SIG = 0x0FED_CBA9_8765_4321  # another op's (the mismatch check)
LARGE = 24 << 20  # "very large": many socket buffers, shm slots, striping pieces, and two ring laps
BIG = 3 << 20  # larger than what a kind reads ahead of its receive (it parks it, where it parks at all)


FAILED = "flag/failed"  # set by a rank that failed the check: the others stop waiting for it


class Died(BaseException):
    """Ends a thread rank that `ctx.die()` killed (a process rank never returns from it)."""


@dataclass
class Ctx:
    """What a check sees on one rank: its transport `t` (a fresh group's), a store shared with the other
    ranks (for out-of-band syncs, never for data), and how to die."""

    rank: int
    world: int
    t: "Transport"
    store: Any
    die: Callable[[], None]
    check: str = ""
    alive: list[int] = field(default_factory=list)
    wait: float = WAIT  # seconds any one wait may take: a lost message fails the check after this long

    def __post_init__(self) -> None:
        self.alive = self.alive or list(range(self.world))

    def deadline(self) -> float:
        return time.monotonic() + self.wait

    def sync(self, name: str, ranks: "Sequence[int] | None" = None) -> None:
        """Wait until every rank of `ranks` (default: those alive) has reached `name`; through the store,
        never the kind. Raises at once when another rank has failed the check."""
        self.store.set(f"sync/{name}/{self.rank}", "1")
        self._wait([f"sync/{name}/{r}" for r in (self.alive if ranks is None else ranks)], name)

    def flag(self, name: str) -> None:
        self.store.set(f"flag/{name}", "1")

    def wait_flag(self, name: str) -> None:
        self._wait([f"flag/{name}"], name)

    def _wait(self, keys: list[str], what: str) -> None:
        deadline = self.deadline()
        while not self.store.check(keys):
            if self.store.check([FAILED]):
                raise AssertionError(f"gave up waiting for {what}: another rank failed this check")
            if time.monotonic() > deadline:
                raise AssertionError(f"the other ranks never reached {what}")
            time.sleep(0.005)

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.world) if p != self.rank]


def pattern(seed: int, n: int) -> bytearray:
    """`n` bytes that differ for every seed and (within 64K) every offset: a lost, stale or misplaced part
    shows."""
    block = random.Random(seed).randbytes(65521)  # a prime length: a shifted part does not line up
    out = bytearray(block * (n // len(block) + 1))
    del out[n:]
    return out


def _coll(tag: int, seq: int = 0) -> tuple[int, int, int]:
    from torch_thunderbolt.protocol.framing import Space

    return (int(Space.COLL), tag, seq)


def _mv(b: bytearray) -> memoryview:
    return memoryview(b)


def _seed(*parts: int) -> int:
    s = 17
    for p in parts:
        s = s * 1_000_003 + p
    return s & 0x7FFFFFFF


# -- the checks ------------------------------------------------------------------------------------------------
def check_order(ctx: Ctx) -> None:
    """Per peer, a link hands the engine the peer's messages in the order they were posted (the first part
    of each, as the receiving Matcher sees it; messages below any striping size, over p2p tags and
    collective keys), every byte right."""
    from torch_thunderbolt.protocol.framing import Space

    t = ctx.t
    seen: list[tuple[int, tuple]] = []
    match = t.matcher.match

    def recording(peer: int, frame: Any, early: int = -1) -> Any:
        if frame.offset == 0:
            seen.append((peer, frame.key))
        return match(peer, frame, early)

    t.matcher.match = recording  # type: ignore[method-assign]
    plan = [("p2p", 7, 1), ("coll", 1, 100), ("p2p", 3, 0), ("p2p", 7, 4096), ("coll", 2, 33), ("p2p", 9, 2000),
            ("p2p", 3, 7), ("p2p", 7, 512), ("coll", 3, 0), ("coll", 4, 1000), ("p2p", 9, 9), ("p2p", 7, 70)] * 2

    def messages(src: int, dst: int) -> list[tuple[tuple[int, int, int], bytearray]]:
        """(key, bytes) of what `src` sends `dst`, in order: a collective tag per message, p2p numbered."""
        out, seqs = [], {}
        for i, (space, tag, n) in enumerate(plan):
            if space == "coll":
                key = (int(Space.COLL), tag + 100 * i, 0)
            else:
                key = (int(Space.P2P), tag, seqs.get(tag, 0))
                seqs[tag] = key[2] + 1
            out.append((key, pattern(_seed(src, dst, i), n)))
        return out

    got = []
    for p in ctx.peers:
        mine = messages(p, ctx.rank)
        for key, data in reversed(mine):  # collective receives in the reverse order of the sends
            if key[0] == Space.COLL:
                buf = bytearray(len(data))
                got.append((t.irecv(p, key, _mv(buf), SIG), buf, data))
        for key, data in mine:  # (a p2p receive takes the next message of its tag: posted in order)
            if key[0] == Space.P2P:
                buf = bytearray(len(data))
                got.append((t.irecv_p2p(p, key[1], _mv(buf)), buf, data))
    ctx.sync("posted")
    sends = [t.isend(p, key, _mv(data), SIG) if key[0] == Space.COLL else t.isend_p2p(p, key[1], _mv(data))
             for p in ctx.peers for key, data in messages(ctx.rank, p)]
    t.wait([r for r, _, _ in got] + sends, ctx.deadline(), "order")
    for req, buf, data in got:
        assert buf == data, f"{req.describe()}: wrong bytes"
    for p in ctx.peers:
        order = list(dict.fromkeys(key for q, key in seen if q == p))
        sent = [key for key, _ in messages(p, ctx.rank)]
        assert order == sent, f"rank {p}'s messages reached rank {ctx.rank} in the order {order}, sent as {sent}"
    ctx.sync("done")


def check_matching(ctx: Ctx) -> None:
    """Messages find their receives by peer and tag whatever the order of posting: p2p tags interleaved and
    received tag by tag, a receive from any source, collective messages of several sizes."""
    from torch_thunderbolt.transport.base import ANY_SOURCE

    t = ctx.t
    sends = []
    for p in ctx.peers:
        for i in range(6):
            sends.append(t.isend_p2p(p, 20 + i % 2, _mv(pattern(_seed(ctx.rank, p, i), 50 + 300 * i))))
        sends.append(t.isend_p2p(p, 30, _mv(pattern(_seed(ctx.rank, p, 99), 64))))
        sends.append(t.isend(p, _coll(5, 1), _mv(pattern(_seed(ctx.rank, p, 51), 70000)), SIG))
        sends.append(t.isend(p, _coll(5, 0), _mv(pattern(_seed(ctx.rank, p, 50), 10)), SIG))
    got = []
    for p in reversed(ctx.peers):
        for tag in (21, 20):  # the odd tag first: each tag's messages in their own order
            for i in [i for i in range(6) if 20 + i % 2 == tag]:
                buf = bytearray(50 + 300 * i)
                got.append((t.irecv_p2p(p, tag, _mv(buf)), buf, pattern(_seed(p, ctx.rank, i), len(buf))))
        for seq, (n, s) in ((0, (10, 50)), (1, (70000, 51))):
            buf = bytearray(n)
            got.append((t.irecv(p, _coll(5, seq), _mv(buf), SIG), buf, pattern(_seed(p, ctx.rank, s), n)))
    anys = [(t.irecv_p2p(ANY_SOURCE, 30, _mv(buf)), buf) for buf in (bytearray(64) for _ in ctx.peers)]
    t.wait([r for r, _, _ in got] + [r for r, _ in anys] + sends, ctx.deadline(), "matching")
    for req, buf, want in got:
        assert buf == want, f"{req.describe()}: wrong bytes"
    sources = sorted(r.source for r, _ in anys)
    assert sources == ctx.peers, f"receives from any source came from {sources}"
    for req, buf in anys:
        assert buf == pattern(_seed(req.source, ctx.rank, 99), 64), f"{req.describe()}: wrong bytes"
    ctx.sync("done")


def check_one_by_one(ctx: Ctx) -> None:
    """A receiver that posts each receive only once the one before is in still gets every message, large ones
    included (a link may hold back a message whose receive is not posted, never one behind it)."""
    t, n, count = ctx.t, BIG, 4
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    sends = [t.isend(nxt, _coll(1, i), _mv(pattern(_seed(ctx.rank, i), n + i)), SIG) for i in range(count)]
    for i in range(count):
        buf = bytearray(n + i)
        t.wait([t.irecv(prv, _coll(1, i), _mv(buf), SIG)], ctx.deadline(), f"message {i}")
        assert buf == pattern(_seed(prv, i), n + i), f"message {i} from rank {prv}: wrong bytes"
    t.wait(sends, ctx.deadline(), "sends")
    ctx.sync("done")


def check_sizes(ctx: Ctx) -> None:
    """Zero-length messages, sizes around every power of two a kind might cut at, and a very large message
    both ways at once between ranks 0 and 1 (each writing while the other writes)."""
    t = ctx.t
    sizes = [0, 1, 4095, 4096, 4097, 65535, 65536, 65537, (1 << 20) + 3]
    sends, got = [], []
    for p in ctx.peers:
        for i, n in enumerate(sizes):
            sends.append(t.isend(p, _coll(1, i), _mv(pattern(_seed(ctx.rank, p, i), n)), SIG))
            sends.append(t.isend_p2p(p, 4, _mv(pattern(_seed(ctx.rank, p, i, 1), n))))
    if ctx.rank in (0, 1):
        sends.append(t.isend(1 - ctx.rank, _coll(2), _mv(pattern(_seed(ctx.rank, 2), LARGE)), SIG))
    for p in ctx.peers:
        for i, n in enumerate(sizes):
            a, b = bytearray(n), bytearray(n)
            got.append((t.irecv(p, _coll(1, i), _mv(a), SIG), a, pattern(_seed(p, ctx.rank, i), n)))
            got.append((t.irecv_p2p(p, 4, _mv(b)), b, pattern(_seed(p, ctx.rank, i, 1), n)))
    if ctx.rank in (0, 1):
        big = bytearray(LARGE)
        got.append((t.irecv(1 - ctx.rank, _coll(2), _mv(big), SIG), big, pattern(_seed(1 - ctx.rank, 2), LARGE)))
    t.wait([r for r, _, _ in got] + sends, ctx.deadline(), "sizes")
    for req, buf, want in got:
        assert len(buf) == len(want) and buf == want, f"{req.describe()}: wrong bytes"
    ctx.sync("done")


def check_partial(ctx: Ctx) -> None:
    """Partial writes and reads: a large message read while the receiver drives its engine in many short
    steps, and a p2p message whose receive is posted only after part of it has arrived."""
    t = ctx.t
    if ctx.rank == 0:
        a, b = pattern(_seed(1), BIG * 2), pattern(_seed(2), BIG)
        sends = [t.isend(1, _coll(1), _mv(a), SIG), t.isend_p2p(1, 6, _mv(b))]
        t.wait(sends, ctx.deadline(), "sends")
    elif ctx.rank == 1:
        a = bytearray(BIG * 2)
        req = t.irecv(0, _coll(1), _mv(a), SIG)
        deadline = ctx.deadline()
        while not t.test([req]):  # many short drives: the message comes in many parts
            assert time.monotonic() < deadline, "the large message never arrived"
            t.progress(0.001)
        assert a == pattern(_seed(1), BIG * 2), "the large message: wrong bytes"
        for _ in range(5):  # drive the engine with no receive posted for the p2p message
            t.progress(0.01)
        b = bytearray(BIG)
        t.wait([t.irecv_p2p(0, 6, _mv(b))], ctx.deadline(), "the p2p message")
        assert b == pattern(_seed(2), BIG), "the p2p message: wrong bytes"
    ctx.sync("done")


def check_many(ctx: Ctx) -> None:
    """Hundreds of messages in flight at once between every pair, both ways, received in a random order."""
    t = ctx.t
    count = 150
    rng = random.Random(_seed(ctx.rank, 5))
    size = lambda src, dst, i: (i * 37 + src * 5 + dst) % 9000  # noqa: E731
    sends = [t.isend_p2p(p, i % 5, _mv(pattern(_seed(ctx.rank, p, i), size(ctx.rank, p, i))))
             for i in range(count) for p in ctx.peers]
    todo = [(p, i) for p in ctx.peers for i in range(count)]
    by_tag: dict[tuple[int, int], list[int]] = {}
    for p, i in todo:
        by_tag.setdefault((p, i % 5), []).append(i)
    keys = list(by_tag)
    rng.shuffle(keys)  # tags in a random order; within a tag, messages in their order
    got = []
    for p, tag in keys:
        for i in by_tag[(p, tag)]:
            buf = bytearray(size(p, ctx.rank, i))
            got.append((t.irecv_p2p(p, tag, _mv(buf)), buf, pattern(_seed(p, ctx.rank, i), len(buf))))
    t.wait([r for r, _, _ in got] + sends, ctx.deadline(), "many")
    for req, buf, want in got:
        assert buf == want, f"{req.describe()}: wrong bytes"
    ctx.sync("done")


def check_stops_reading(ctx: Ctx) -> None:
    """A peer that stops reading (rank 1 does nothing with its engine for a while) blocks no other traffic:
    rank 0's large send to it returns at once and rank 0 goes on with rank 2; once rank 1 reads again,
    everything arrives intact."""
    t = ctx.t
    if ctx.rank == 0:
        data = pattern(_seed(7), LARGE)
        send = t.isend(1, _coll(1), _mv(data), SIG)  # (rank 1 has not even posted its receive)
        if ctx.world > 2:
            buf = bytearray(1000)
            t.wait([t.isend(2, _coll(2), _mv(pattern(_seed(8), 1000)), SIG),
                    t.irecv(2, _coll(2), _mv(buf), SIG)], ctx.deadline(), "the exchange with rank 2")
            assert buf == pattern(_seed(9), 1000), "rank 2's message: wrong bytes"
        ctx.flag("go")  # only now does rank 1 read again: had the send blocked, we would not be here
        t.wait([send], ctx.deadline(), "the send to rank 1")
    elif ctx.rank == 1:
        ctx.wait_flag("go")
        buf = bytearray(LARGE)
        t.wait([t.irecv(0, _coll(1), _mv(buf), SIG)], ctx.deadline(), "the message from rank 0")
        assert buf == pattern(_seed(7), LARGE), "wrong bytes after the pause"
    elif ctx.rank == 2:
        buf = bytearray(1000)
        t.wait([t.isend(0, _coll(2), _mv(pattern(_seed(9), 1000)), SIG),
                t.irecv(0, _coll(2), _mv(buf), SIG)], ctx.deadline(), "the exchange with rank 0")
        assert buf == pattern(_seed(8), 1000), "rank 0's message: wrong bytes"
    ctx.sync("done")


def _expect_abort(ctx: Ctx, make: Callable[[], BaseException], check: Callable[[BaseException], None],
                  big: bool = False) -> None:
    """Rank 0 fails with make() while every other rank waits for its data (with `big`, rank 1 is half-way
    through reading a large message from it); every other rank must fail with the error the ABORT
    describes, within the wait."""
    t = ctx.t
    if ctx.rank == 0:
        if big:
            t.isend(1, _coll(1), _mv(pattern(_seed(3), LARGE)), SIG)
        ctx.sync("waiting")
        t.abort(make())
    else:
        reqs = [t.irecv(0, _coll(2), _mv(bytearray(8)), SIG)]
        if big and ctx.rank == 1:
            reqs.insert(0, t.irecv(0, _coll(1), _mv(bytearray(LARGE)), SIG))
        ctx.sync("waiting")
        try:
            t.wait(reqs, ctx.deadline(), "a receive from rank 0")
        except Exception as exc:  # noqa: BLE001 - what the check looks at
            check(exc)
        else:
            raise AssertionError("the receive completed although rank 0 aborted")
    ctx.sync("done")


def check_abort_lost(ctx: Ctx) -> None:
    """An ABORT's details arrive as data: rank 0 fails because it lost the last rank; the others fail with
    PeerLostError naming that rank (not rank 0, the messenger)."""
    from torch_thunderbolt.errors import PeerLostError, peer_lost

    lost = ctx.world - 1

    def check(exc: BaseException) -> None:
        assert isinstance(exc, PeerLostError), f"expected PeerLostError, got {exc!r}"
        assert exc.peer == lost, f"names rank {exc.peer}, not the lost rank {lost}: {exc}"
        assert "the cable is gone" in str(exc), f"the reason did not arrive: {exc}"

    _expect_abort(ctx, lambda: peer_lost(0, lost, f"lost the connection to rank {lost}: the cable is gone"), check)


def check_abort_timeout(ctx: Ctx) -> None:
    """A CollectiveTimeout's blamed ranks arrive as data with its reason."""
    from torch_thunderbolt.errors import CollectiveTimeout

    blamed = [ctx.world - 1]

    def check(exc: BaseException) -> None:
        assert isinstance(exc, CollectiveTimeout), f"expected CollectiveTimeout, got {exc!r}"
        assert exc.ranks == blamed, f"blames {exc.ranks}, not {blamed}: {exc}"
        assert "Timed out waiting in op #12" in str(exc), f"the reason did not arrive: {exc}"

    _expect_abort(ctx, lambda: CollectiveTimeout(f"rank 0: Timed out waiting in op #12; ranks that did not "
                                                 f"arrive: {blamed}", ranks=blamed), check)


def check_abort_in_flight(ctx: Ctx) -> None:
    """An ABORT sent while a large message to the peer is half-way still arrives (after the rest of the part
    being written, never in the middle of it): the peer fails with the reason, not "lost the connection"."""
    from torch_thunderbolt.errors import MismatchError

    def check(exc: BaseException) -> None:
        assert isinstance(exc, MismatchError), f"expected MismatchError, got {exc!r}"
        assert "ran another op" in str(exc), f"the reason did not arrive: {exc}"

    _expect_abort(ctx, lambda: MismatchError("rank 0: rank 0 ran another op"), check, big=True)


def check_mismatch(ctx: Ctx) -> None:
    """A message carries its op signature: a receive expecting another signature fails with MismatchError,
    and so do the sender and a third rank, told by ABORTs (the receiver aborts the group as the algorithms
    do on any error; a kind that finds the mismatch while reading has done so already)."""
    from torch_thunderbolt.errors import MismatchError

    t = ctx.t
    if ctx.rank == 0:
        sent = t.isend(1, _coll(1), _mv(pattern(_seed(4), 100)), SIG)
        try:
            t.wait([sent, t.irecv(1, _coll(2), _mv(bytearray(8)), SIG)], ctx.deadline(), "the op")
        except MismatchError:
            pass
        else:
            raise AssertionError("rank 0 was never told of the mismatch")
    elif ctx.rank == 1:
        try:
            t.wait([t.irecv(0, _coll(1), _mv(bytearray(100)), OTHER_SIG)], ctx.deadline(), "the op")
        except MismatchError as exc:
            t.abort(exc)
        else:
            raise AssertionError("a message of another op was taken")
    else:  # told by rank 1 (and rank 0, which forwards it)
        try:
            t.wait([t.irecv(1, _coll(2), _mv(bytearray(8)), SIG)], ctx.deadline(), "the op")
        except MismatchError:
            pass
        else:
            raise AssertionError("the receive completed")
    ctx.sync("done")


def check_stray(ctx: Ctx) -> None:
    """Data of an op this rank has finished is a MismatchError when it finishes the op (`Transport.retire`),
    whether the link read it ahead or holds it back unread: rank 0 sends rank 1 a message for op 1 that
    rank 1's op 1 never takes."""
    from torch_thunderbolt.errors import MismatchError

    t = ctx.t
    if ctx.rank == 0:
        t.wait([t.isend(1, _coll(1), _mv(pattern(_seed(11), 200)), SIG)], ctx.deadline(), "the stray")
        ctx.flag("sent")
    elif ctx.rank == 1:
        ctx.wait_flag("sent")
        deadline = ctx.deadline()
        # until the engine holds it: read ahead (the Matcher keeps it) or held back by the link (parked)
        while t.held(0) is None and not any(p == 0 for p, _ in t.matcher.unexpected):
            assert time.monotonic() < deadline, "the message never reached rank 1"
            t.progress(0.01)
        try:
            t.retire(1)
        except MismatchError:
            pass
        else:
            raise AssertionError("op 1 finished with rank 0's data for it unread, and no error")
    ctx.sync("done")


def check_bye(ctx: Ctx) -> None:
    """Rank 0 sends, and closes its group in order (twice: harmless) as soon as its sends are done: nothing
    it sent is lost or overtaken by its goodbye, and a receive posted after it left fails with
    PeerLostError naming it."""
    from torch_thunderbolt.errors import PeerLostError

    t = ctx.t
    if ctx.rank == 0:
        ctx.sync("posted", [0, 1])
        sends = [t.isend_p2p(1, 1, _mv(pattern(_seed(i), 1000 * i))) for i in range(3)]
        sends.append(t.isend(1, _coll(1), _mv(pattern(_seed(5), 5000)), SIG))
        t.wait(sends, ctx.deadline(), "the sends")
        t.close()
        t.close()
        ctx.flag("closed")
    elif ctx.rank == 1:
        bufs = [bytearray(1000 * i) for i in range(3)]
        coll = bytearray(5000)
        reqs = [t.irecv_p2p(0, 1, _mv(b)) for b in bufs] + [t.irecv(0, _coll(1), _mv(coll), SIG)]
        ctx.sync("posted", [0, 1])
        t.wait(reqs, ctx.deadline(), "what rank 0 sent before it left")
        assert [bytes(b) for b in bufs] == [pattern(_seed(i), 1000 * i) for i in range(3)], "wrong p2p bytes"
        assert coll == pattern(_seed(5), 5000), "wrong collective bytes"
        ctx.wait_flag("closed")
        try:
            t.wait([t.irecv_p2p(0, 1, _mv(bytearray(4)))], ctx.deadline(), "a receive after rank 0 left")
        except PeerLostError as exc:
            assert exc.peer == 0, str(exc)
        else:
            raise AssertionError("a receive from a rank that had left completed")
    ctx.sync("done")


def check_bye_while_waiting(ctx: Ctx) -> None:
    """A rank waiting for data from a peer that closes its group in order fails with PeerLostError naming
    that peer, at once (not at the deadline)."""
    from torch_thunderbolt.errors import PeerLostError

    t = ctx.t
    if ctx.rank == 0:
        ctx.sync("waiting", [0, 1])
        t.close()
    elif ctx.rank == 1:
        req = t.irecv(0, _coll(9), _mv(bytearray(4)), SIG)
        ctx.sync("waiting", [0, 1])
        try:
            t.wait([req], ctx.deadline(), "a receive rank 0 will never answer")
        except PeerLostError as exc:
            assert exc.peer == 0, str(exc)
        else:
            raise AssertionError("the receive completed")
    ctx.sync("done")


def check_counters(ctx: Ctx) -> None:
    """bytes_sent and bytes_received count exactly the payload bytes moved (no headers, no control frames),
    whichever way a message went (isend/irecv, or a small op's exchange)."""
    t = ctx.t
    n0, r0 = t.bytes_sent, t.bytes_received
    ctx.sync("counted")  # before anyone sends
    sent = got = 0
    reqs = []
    for p in ctx.peers:
        for i, n in enumerate((0, 10, 5000, BIG)):
            reqs.append(t.isend(p, _coll(1, i), _mv(pattern(i, n)), SIG))
            reqs.append(t.irecv(p, _coll(1, i), _mv(bytearray(n)), SIG))
            sent += n
            got += n
    t.wait(reqs, ctx.deadline(), "counters")
    small = {p: bytearray(300) for p in ctx.peers}
    t.exchange([(p, _coll(2), _mv(pattern(2, 300))) for p in ctx.peers],
               [(p, _coll(2), _mv(small[p])) for p in ctx.peers], SIG, ctx.deadline(), "exchange")
    sent += 300 * len(ctx.peers)
    got += 300 * len(ctx.peers)
    assert all(b == pattern(2, 300) for b in small.values()), "exchange: wrong bytes"
    ctx.sync("moved")
    assert (t.bytes_sent - n0, t.bytes_received - r0) == (sent, got), (
        f"counted {t.bytes_sent - n0} bytes sent and {t.bytes_received - r0} received, moved {sent} and {got}")
    ctx.sync("done")


def check_peer_dies(ctx: Ctx) -> None:
    """The last rank dies abruptly while rank 0 is sending it a large message and everyone waits for its data:
    every survivor fails with PeerLostError naming it (directly or told by another survivor), and rank 0's
    send fails too; nobody waits for the deadline."""
    from torch_thunderbolt.errors import PeerLostError

    t, victim = ctx.t, ctx.world - 1
    if ctx.rank == victim:
        ctx.sync("waiting")
        ctx.die()
        return
    reqs = [t.irecv(victim, _coll(2), _mv(bytearray(16)), SIG)]
    if ctx.rank == 0:
        reqs.append(t.isend(victim, _coll(1), _mv(pattern(_seed(6), LARGE)), SIG))
    ctx.sync("waiting")
    try:
        t.wait(reqs, ctx.deadline(), "data from the dying rank")
    except PeerLostError as exc:
        assert exc.peer == victim, f"names rank {exc.peer}, not the dead rank {victim}: {exc}"
    else:
        raise AssertionError("a receive from a dead rank completed")
    ctx.alive = [r for r in ctx.alive if r != victim]
    ctx.sync("done")


#: Every check, by name, in the order they run (the one a rank dies in last).
CHECKS: dict[str, Callable[[Ctx], None]] = {
    "order": check_order, "matching": check_matching, "one_by_one": check_one_by_one, "sizes": check_sizes,
    "partial": check_partial, "many": check_many, "stops_reading": check_stops_reading,
    "abort_lost": check_abort_lost, "abort_timeout": check_abort_timeout, "abort_in_flight": check_abort_in_flight,
    "mismatch": check_mismatch, "stray": check_stray, "bye": check_bye, "bye_while_waiting": check_bye_while_waiting,
    "counters": check_counters, "peer_dies": check_peer_dies,
}


# -- running the checks ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How one check went on every rank: rank -> None (passed) or what went wrong."""

    check: str
    ranks: dict[int, "str | None"]

    @property
    def ok(self) -> bool:
        return all(v is None for v in self.ranks.values())

    def __str__(self) -> str:
        bad = {r: v for r, v in sorted(self.ranks.items()) if v is not None}
        return f"{self.check}: " + ("passed" if not bad else "; ".join(f"rank {r}: {v}" for r, v in bad.items()))


@dataclass(frozen=True)
class Suite:
    """Checks run the same way: by name, in the order they run; how mutant `name` breaks one rank's
    transport, `mutate(transport, name)`; and the module whose main runs a rank process of the suite."""

    checks: Mapping[str, Callable[[Ctx], None]]
    mutate: Callable[["Transport", str], None]
    program: str


def run_check(name: str, ctx: Ctx, suite: "Suite | None" = None) -> "str | None":
    """Run check `name` of `suite` (default: LINKS) as one rank: None if it passed, else what went wrong (the
    group is then aborted, so the other ranks stop waiting on this one)."""
    check = (suite or LINKS).checks[name]
    try:
        check(ctx)
        return None
    except Died:
        return None
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the caller reports
        ctx.store.set(FAILED, str(ctx.rank))
        try:
            ctx.t.abort(exc)
        except Exception:  # noqa: BLE001 - already broken or closed
            pass
        where = traceback.extract_tb(exc.__traceback__)
        line = next((f"line {f.lineno}" for f in reversed(where) if f.filename == check.__code__.co_filename), "")
        return f"{type(exc).__name__}: {exc} ({line})"


def run_on_threads(make: "Callable[[int], tuple[Sequence[Transport], Callable[[int], None]]]", world: int = 3,
                   checks: "Sequence[str] | None" = None, mutant: str | None = None,
                   wait: float = WAIT, suite: "Suite | None" = None) -> dict[str, Outcome]:
    """Every check of `suite` (default: LINKS) on `world` thread ranks, each over fresh transports
    `make(world)` returns, with the function that kills a rank (MemoryHub.kill, say). `wait`: seconds any
    one wait may take."""
    import torch.distributed as dist

    from .worlds import on_threads

    suite = suite or LINKS
    out = {}
    for name in checks or list(suite.checks):
        transports, kill = make(world)
        if mutant:
            for t in transports:
                suite.mutate(t, mutant)
        store = dist.HashStore()

        def rank(r: int) -> "str | None":
            def die() -> None:
                kill(r)
                raise Died
            ctx = Ctx(r, world, transports[r], dist.PrefixStore(f"{name}/", store), die, name, wait=wait)
            try:
                return run_check(name, ctx, suite)
            finally:
                transports[r].close()

        run = on_threads(world, rank, 4 * wait + 30)
        ranks = {r: run.results[r] for r in range(world)}
        ranks.update({r: f"{type(e).__name__}: {e}" for r, e in run.errors.items()})
        ranks.update({r: "hung" for r in run.hung})
        out[name] = Outcome(name, ranks)
    return out


def run_in_processes(kind: str, world: int, workdir: Path, *, checks: "Sequence[str] | None" = None,
                     env: "Mapping[str, str] | None" = None, setup: Any = None, mutant: str | None = None,
                     wait: float = WAIT, timeout: float = 300.0, suite: "Suite | None" = None) -> dict[str, Outcome]:
    """Every check of `suite` (default: LINKS) on `world` rank processes whose every pair uses `kind` (set up
    as a job does, through rendezvous.group.connect; the kinds of testing/kinds are added to the table).
    `env`: the kind's settings; `setup`: a testing.ranks.Setup; `wait`: seconds any one wait may take;
    `timeout`: for the whole run."""
    from . import ranks as rank_runs

    suite = suite or LINKS
    names = list(checks or suite.checks)
    extra = {"TB_CONFORMANCE_WAIT": str(wait), **({"TB_CONFORMANCE_MUTANT": mutant} if mutant else {})}
    results = rank_runs.run_ranks(suite.program, world, workdir, args=[kind, *names], env={**(env or {}), **extra},
                                  setup=setup or rank_runs.LOOPBACK, timeout=timeout, expect_ok=False)
    out = {}
    for name in names:
        ranks: dict[int, str | None] = {}
        for res in results:
            said = [x for x in res.tagged("CHECK") if x["check"] == name]
            ranks[res.rank] = said[-1]["error"] if said else (
                f"no outcome (exit code {res.returncode}): {res.stderr[-1500:]}")
        out[name] = Outcome(name, ranks)
    return out


def process_rank(kind: str, names: Sequence[str], suite: "Suite | None" = None) -> None:
    """One rank process of `run_in_processes` (a suite's main): each check of `suite` (default: LINKS) on a
    fresh group of `kind` links."""
    import dataclasses
    import datetime

    import torch.distributed as dist

    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.group import connect
    from torch_thunderbolt.rendezvous.kinds import KINDS

    from .darwin import install_from_env, sockets_off_the_model
    from .program import emit, rank, register_pid, world

    register_pid()
    xnu = install_from_env()  # XNU_MODEL=1: the TCP links run on the darwin socket model
    suite = suite or LINKS
    r, w = rank(), world()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0,
                          timeout=datetime.timedelta(seconds=WAIT * 4))
    from .kinds import ROWS

    table = [*KINDS, *ROWS]
    cfg = dataclasses.replace(Config.from_env(), transport=kind)  # every pair on `kind`
    mutant = os.environ.get("TB_CONFORMANCE_MUTANT")
    wait = float(os.environ.get("TB_CONFORMANCE_WAIT", WAIT))
    alive = list(range(w))
    for name in names:
        sub = dist.PrefixStore(f"{name}/", store)

        def die() -> None:
            emit("CHECK", {"check": name, "rank": r, "error": None})
            sys.stdout.flush()
            os._exit(0)  # as a crash: the kernel closes whatever this process had open

        try:
            t = connect(sub, r, w, cfg, wait, table=table).transport
        except Exception as exc:  # noqa: BLE001 - reported as this check's outcome
            emit("CHECK", {"check": name, "rank": r, "error": f"set-up failed: {type(exc).__name__}: {exc}"})
            continue
        if mutant:
            suite.mutate(t, mutant)
        ctx = Ctx(r, w, t, sub, die, name, alive=list(alive), wait=wait)
        links = sorted({type(link).__name__ for k in t.kinds for link in k.links.values()})
        error = run_check(name, ctx, suite) if t.kind == kind else f"the group runs over {t.kind!r} links, not {kind!r}"
        if error is None and os.environ.get("TB_CONFORMANCE_LINK") not in (None, *links):
            error = f"the group's links are {links}, not {os.environ['TB_CONFORMANCE_LINK']}"
        if error is None and xnu is not None and sockets_off_the_model(t):
            error = f"streams not on the darwin model: {sockets_off_the_model(t)}"
        t.close()
        alive = ctx.alive
        emit("CHECK", {"check": name, "rank": r, "error": error})
    # Rank 0 serves the store: it leaves last.
    store.set(f"left/{r}", "1")
    if r == 0:
        store.wait([f"left/{p}" for p in alive], datetime.timedelta(seconds=wait))


# -- mutants: kinds broken on purpose, which the checks must catch ----------------------------------------------
def _drop(link: Any) -> None:
    """The link loses the third message it is given: it says it went, and it never goes."""
    send, count = link.send, [0]

    def dropping(key: Any, sig: int, buf: memoryview) -> Any:
        count[0] += 1
        return None if count[0] == 3 else send(key, sig, buf)
    link.send = dropping


def _reorder(link: Any) -> None:
    """The link sends its second message after its third."""
    send, count, held = link.send, [0], []

    def reordering(key: Any, sig: int, buf: memoryview) -> Any:
        count[0] += 1
        if count[0] == 2:
            held.append((key, sig, buf))
            return None  # "went at once"; it goes after the next one
        req = send(key, sig, buf)
        while held:
            send(*held.pop())
        return req
    link.send = reordering


def _swallow_abort(link: Any) -> None:
    """The link drops its sends when the group breaks, but never tells the peer why."""
    abort = link.abort
    link.abort = lambda err, body: abort(err, None)


MUTANTS: dict[str, Callable[[Any], None]] = {"drop": _drop, "reorder": _reorder, "swallow_abort": _swallow_abort}


def mutate(t: "Transport", name: str) -> None:
    """Break every link of `t` the way mutant `name` does (on this rank only)."""
    for kind in t.kinds:
        for link in kind.links.values():
            MUTANTS[name](link)


LINKS = Suite(CHECKS, mutate, __name__)


if __name__ == "__main__":
    process_rank(sys.argv[1], sys.argv[2:] or list(CHECKS))
