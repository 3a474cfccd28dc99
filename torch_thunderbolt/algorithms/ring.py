"""Pipelined ring algorithms: bandwidth-optimal reduce-scatter, all-gather and all-reduce.

Each segment is cut into chunks so that reducing chunk j overlaps the transfer of chunk j+1. The ring
follows `order` (a permutation of ranks), so the topology layer can lay it along the cables.
"""
from __future__ import annotations

from .layout import chunks, ring_neighbours, split_even
from .plan import Plan

Segments = list[tuple[int, int]]  # per rank: (offset, length) in elements


def _add_reduce_scatter(plan: Plan, order: list[int], segs: Segments, chunk: int, msg0: int = 0) -> dict:
    """Reduce every rank's segment into buffer "out" along the ring; returns {chunk key: last step}."""
    w = len(order)
    p, left, right = ring_neighbours(order, plan.rank)
    seg_at = lambda pos: segs[order[pos % w]]  # noqa: E731 - segment owned (at the end) by ring position
    pieces_len = max(len(chunks(*segs[r], chunk)) for r in range(w))
    # Scratch: two halves (steps alternate), piece j at a fixed slot, so a receive only ever overwrites
    # what the reduce two steps earlier read from that very slot.
    stride = max(n for r in range(w) for _, n in chunks(*segs[r], chunk))
    tmp_half = pieces_len * stride
    plan.tmp = max(plan.tmp, 2 * tmp_half)
    last: dict[tuple[int, int], int] = {}  # (segment pos, piece) -> step that last wrote it
    prev_use: dict[tuple[int, int], int] = {}  # (tmp half, piece) -> reduce step that read it (WAR)
    for s in range(w - 1):
        send_pos, recv_pos = (p - s - 1) % w, (p - s - 2) % w
        send_pieces = chunks(*seg_at(send_pos), chunk)
        recv_pieces = chunks(*seg_at(recv_pos), chunk)
        half = (s % 2) * tmp_half
        for j in range(pieces_len):
            msg = msg0 + s * pieces_len + j
            if j < len(send_pieces):
                off, n = send_pieces[j]
                dep = last.get((send_pos, j))
                plan.send(right, "out", off, n, msg, () if dep is None else (dep,))
            if j < len(recv_pieces):
                off, n = recv_pieces[j]
                toff = half + j * stride
                war = prev_use.get((s % 2, j))
                r = plan.recv(left, "tmp", toff, n, msg, () if war is None else (war,))
                deps = (r,) if (recv_pos, j) not in last else (r, last[(recv_pos, j)])
                red = plan.reduce("out", off, "tmp", toff, n, deps)
                last[(recv_pos, j)] = red
                prev_use[(s % 2, j)] = red
    return last


def _add_all_gather(plan: Plan, order: list[int], segs: Segments, chunk: int, last: dict, msg0: int) -> None:
    """Circulate every rank's finished segment of "out" to all ranks."""
    w = len(order)
    p, left, right = ring_neighbours(order, plan.rank)
    seg_at = lambda pos: segs[order[pos % w]]  # noqa: E731
    pieces_len = max(len(chunks(*segs[r], chunk)) for r in range(w))
    for s in range(w - 1):
        send_pos, recv_pos = (p - s) % w, (p - s - 1) % w
        send_pieces = chunks(*seg_at(send_pos), chunk)
        recv_pieces = chunks(*seg_at(recv_pos), chunk)
        for j in range(pieces_len):
            msg = msg0 + s * pieces_len + j
            if j < len(send_pieces):
                off, n = send_pieces[j]
                dep = last.get((send_pos, j))
                plan.send(right, "out", off, n, msg, () if dep is None else (dep,))
            if j < len(recv_pieces):
                off, n = recv_pieces[j]
                last[(recv_pos, j)] = plan.recv(left, "out", off, n, msg)


def ring_allreduce(rank: int, order: list[int], segs: Segments, chunk: int) -> Plan:
    """All-reduce of buffer "out" in place: reduce-scatter, then all-gather, both pipelined."""
    plan = Plan(rank, len(order), "ring")
    if len(order) == 1:
        return plan
    last = _add_reduce_scatter(plan, order, segs, chunk)
    w = len(order)
    pieces_len = max(len(chunks(*segs[r], chunk)) for r in range(w))
    _add_all_gather(plan, order, segs, chunk, last, msg0=(w - 1) * pieces_len)
    return plan


def ring_reduce_scatter(rank: int, order: list[int], segs: Segments, chunk: int) -> Plan:
    """Reduce "out" (a copy of the whole input) so that each rank's segment holds the full reduction."""
    plan = Plan(rank, len(order), "ring")
    if len(order) > 1:
        _add_reduce_scatter(plan, order, segs, chunk)
    return plan


def ring_all_gather(rank: int, order: list[int], segs: Segments, chunk: int) -> Plan:
    """Each rank's segment of "out" is already in place; fill in everyone else's."""
    plan = Plan(rank, len(order), "ring")
    if len(order) > 1:
        _add_all_gather(plan, order, segs, chunk, {}, 0)
    return plan


MERGE_MSG_OFFSET = 1 << 24


def merge(a: Plan, b: Plan) -> Plan:
    """One plan running `a` and `b` concurrently (disjoint data, their own scratch and message ids)."""
    out = Plan(a.rank, a.world, a.algo + "+" + b.algo, list(a.steps), a.tmp + b.tmp)
    # The message-id offset must be the same on every rank (each rank's plan `a` may end on another id).
    shift, msg_shift = len(a.steps), MERGE_MSG_OFFSET
    for s in b.steps:
        out.steps.append(s._replace(
            deps=tuple(d + shift for d in s.deps),
            msg=s.msg + msg_shift if s.msg >= 0 else s.msg,
            off=s.off + a.tmp if s.buf == "tmp" else s.off,
            src_off=s.src_off + a.tmp if s.src == "tmp" else s.src_off))
    return out


def bidirectional_ring_allreduce(rank: int, order: list[int], count: int, chunk: int) -> Plan:
    """Half the data around the ring one way, half the other way: every cable busy in both directions."""
    half = count // 2
    segs_a = [(o, n) for o, n in split_even(half, len(order))]
    segs_b = [(half + o, n) for o, n in split_even(count - half, len(order))]
    fwd = ring_allreduce(rank, order, segs_a, chunk)
    back = ring_allreduce(rank, [order[0]] + order[1:][::-1], segs_b, chunk)
    plan = merge(fwd, back)
    plan.algo = "biring"
    return plan
