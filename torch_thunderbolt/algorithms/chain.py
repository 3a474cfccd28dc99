"""Pipelined lines: broadcast, reduce and all-reduce along a line of ranks, chunk by chunk.

A line matches daisy-chained Macs (A–B–C with no A–C cable): every message crosses one cable, each byte
crosses each cable once per direction, and the pipeline keeps all cables busy at once. The root may sit
anywhere on the line; data then flows out along (or in from) both branches.
"""
from __future__ import annotations

from .segments import chunks
from .plan import Plan
from .ring import merge


def _towards_and_away(line: list[int], rank: int, root: int) -> tuple[int | None, list[int]]:
    """(neighbour towards the root or None at the root, neighbours away from the root)."""
    p, q = line.index(rank), line.index(root)
    left = line[p - 1] if p > 0 else None
    right = line[p + 1] if p + 1 < len(line) else None
    if p == q:
        return None, [x for x in (left, right) if x is not None]
    if p < q:
        return right, [left] if left is not None else []
    return left, [right] if right is not None else []


def add_line_broadcast(plan: Plan, line: list[int], root: int, count: int, chunk: int, msg0: int = 0,
                       ready: dict[int, int] | None = None, after: dict[int, tuple[int, ...]] | None = None,
                       base: int = 0) -> None:
    """Broadcast "out"[base : base + count] from `root`. `ready[j]`: step after which chunk j is final on
    the root; `after[j]`: steps a receive into chunk j must wait for (it overwrites them)."""
    towards, away = _towards_and_away(line, plan.rank, root)
    for j, (off, n) in enumerate(chunks(base, count, chunk)):
        if towards is None:
            deps: tuple[int, ...] = (ready[j],) if ready and j in ready else ()
        else:
            deps = (plan.recv(towards, "out", off, n, msg0 + j, (after or {}).get(j, ())),)
        for nxt in away:
            plan.send(nxt, "out", off, n, msg0 + j, deps)


def add_line_reduce(plan: Plan, line: list[int], root: int, count: int, chunk: int, base: int = 0,
                    msg0: int = 0, tmp0: int = 0, out_base: int | None = None) -> dict[int, int]:
    """Reduce "in"[base : base + count] of every rank into "out" on root; "in" of other ranks is not
    modified. Scratch from `tmp0` on, message ids from `msg0` on (for several reductions in one plan).
    With `out_base` None the root's "out" holds its own data at the same offsets (it may be "in"); else
    the root fills "out"[off - out_base] from its "in" first and "in" is never written.
    Returns, per chunk, the step that finishes it on the root (or that last read it elsewhere)."""
    towards, away = _towards_and_away(line, plan.rank, root)
    plan.tmp = max(plan.tmp, tmp0 + count * max(1, len(away)))
    done: dict[int, int] = {}
    for j, (off, n) in enumerate(chunks(base, count, chunk)):
        rel = tmp0 + off - base
        if not away:  # a line end: send our own data
            done[j] = plan.send(towards, "in", off, n, msg0 + j)
            continue
        recvs = [plan.recv(src, "tmp", k * count + rel, n, msg0 + j) for k, src in enumerate(away)]
        if towards is None:  # root: out ⊕= every branch's partial
            dst = off if out_base is None else off - out_base
            last = None if out_base is None else plan.copy("out", dst, "in", off, n)
            for k, r in enumerate(recvs):
                last = plan.reduce("out", dst, "tmp", k * count + rel, n, (r,) if last is None else (r, last))
            done[j] = last
        else:  # middle: partial ⊕= own data, pass it on
            red = plan.reduce("tmp", rel, "in", off, n, (recvs[0],))
            done[j] = plan.send(towards, "tmp", rel, n, msg0 + j, (red,))
    return done


def chain_broadcast(rank: int, line: list[int], root: int, count: int, chunk: int) -> Plan:
    plan = Plan(rank, len(line), "chain")
    if len(line) > 1:
        add_line_broadcast(plan, line, root, count, chunk)
    return plan


def two_way_ring_broadcast(rank: int, order: list[int], root: int, count: int, chunk: int) -> Plan:
    """On a ring: the first half travels one way round from the root, the second half the other way, so
    every cable carries half the message in each direction (a line from the root carries all of it one
    way: twice the time on full-duplex cables)."""
    p = order.index(root)
    one_way = order[p:] + order[:p]
    other_way = [root] + one_way[1:][::-1]
    half = count // 2
    first, second = Plan(rank, len(order), "line"), Plan(rank, len(order), "line")
    add_line_broadcast(first, one_way, root, half, chunk)
    add_line_broadcast(second, other_way, root, count - half, chunk, base=half)
    plan = merge(first, second)
    plan.algo = "ring2"
    return plan


def chain_reduce(rank: int, line: list[int], root: int, count: int, chunk: int) -> Plan:
    plan = Plan(rank, len(line), "chain")
    if len(line) > 1:
        add_line_reduce(plan, line, root, count, chunk)
    return plan


def chain_allreduce(rank: int, line: list[int], count: int, chunk: int) -> Plan:
    """Reduce towards the middle of the line, then broadcast back, pipelined: each cable carries the data
    once per direction (a ring laid on a line would push its closing edge through every middle host), and
    with the root in the middle both branches work at once, so the pipeline fills in half the hops."""
    plan = Plan(rank, len(line), "chain")
    if len(line) == 1:
        return plan
    root = line[(len(line) - 1) // 2]
    done = add_line_reduce(plan, line, root, count, chunk)
    n_chunks = len(chunks(0, count, chunk))
    if rank == root:
        add_line_broadcast(plan, line, root, count, chunk, msg0=n_chunks, ready=done)
    else:  # our "in" is our "out": a result chunk may land only after we sent our partial of it
        add_line_broadcast(plan, line, root, count, chunk, msg0=n_chunks,
                           after={j: (s,) for j, s in done.items()})
    return plan


def line_all_gather(rank: int, line: list[int], segs: list[tuple[int, int]], chunk: int) -> Plan:
    """Every rank's segment of "out" (in place there) to every rank along the line, out along both
    branches from its owner, pipelined: a cable carries, each way, the segments of the ranks behind it, as
    little as any algorithm can move over it. `segs` by rank."""
    plan = Plan(rank, len(line), "line")
    msg = 0
    for owner in line:  # one order on every rank: pairwise message order holds
        off, n = segs[owner]
        add_line_broadcast(plan, line, owner, n, chunk, msg0=msg, base=off)
        msg += len(chunks(off, n, chunk))
    return plan


def line_reduce_scatter(rank: int, line: list[int], segs: list[tuple[int, int]], chunk: int) -> Plan:
    """Each rank's segment reduced onto it along the line, in from both branches, pipelined (the mirror of
    `line_all_gather`). Reads "in" (never written) and writes this rank's segment to "out" from 0."""
    plan = Plan(rank, len(line), "line")
    msg = tmp = 0
    for owner in line:
        off, n = segs[owner]
        add_line_reduce(plan, line, owner, n, chunk, base=off, msg0=msg, tmp0=tmp, out_base=segs[rank][0])
        msg += len(chunks(off, n, chunk))
        tmp = plan.tmp
    return plan
