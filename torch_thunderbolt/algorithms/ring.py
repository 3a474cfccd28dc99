"""Pipelined ring algorithms: bandwidth-optimal reduce-scatter, all-gather and all-reduce.

Each segment is cut into chunks so that reducing chunk j overlaps the transfer of chunk j+1. The ring
follows `order` (a permutation of ranks), so the topology layer can lay it along the cables.
"""
from __future__ import annotations

from .segments import chunks, ring_neighbours, split_even
from .plan import Plan

Segments = list[tuple[int, int]]  # per rank: (offset, length) in elements


def _ring_steps(order: list[int], rank: int, segs: Segments, chunk: int, lag: int, msg0: int):
    """Walk the ring schedule: at step s this rank sends the segment of position p-s-lag and receives
    that of p-s-lag-1, piece by piece. Yields (step, piece, msg, send_pos, send piece, recv_pos, recv piece);
    a piece is None where that segment has fewer pieces."""
    w = len(order)
    p = order.index(rank)
    pieces = {pos: chunks(*segs[order[pos]], chunk) for pos in range(w)}
    per_step = max(len(v) for v in pieces.values())
    for s in range(w - 1):
        send_pos, recv_pos = (p - s - lag) % w, (p - s - lag - 1) % w
        for j in range(per_step):
            sp = pieces[send_pos][j] if j < len(pieces[send_pos]) else None
            rp = pieces[recv_pos][j] if j < len(pieces[recv_pos]) else None
            yield s, j, msg0 + s * per_step + j, send_pos, sp, recv_pos, rp


def _scratch(plan: Plan, order: list[int], segs: Segments, chunk: int) -> tuple[int, int]:
    """A ring reduce-scatter's scratch: two halves (steps alternate), piece j at a fixed slot, so a receive
    only ever overwrites what was read from that very slot two steps earlier. Reserves it in `plan`;
    returns (slot stride, half size) in elements."""
    all_pieces = [c for r in range(len(order)) for c in chunks(*segs[r], chunk)]
    stride = max(n for _, n in all_pieces)
    tmp_half = max(len(chunks(*segs[r], chunk)) for r in range(len(order))) * stride
    plan.tmp = max(plan.tmp, 2 * tmp_half)
    return stride, tmp_half


def _add_reduce_scatter(plan: Plan, order: list[int], segs: Segments, chunk: int, msg0: int = 0) -> dict:
    """Reduce every rank's segment into buffer "out" along the ring; returns {chunk key: last step}."""
    _, left, right = ring_neighbours(order, plan.rank)
    stride, tmp_half = _scratch(plan, order, segs, chunk)
    last: dict[tuple[int, int], int] = {}  # (segment pos, piece) -> step that last wrote it
    prev_use: dict[tuple[int, int], int] = {}  # (tmp half, piece) -> reduce step that read it (WAR)
    for s, j, msg, send_pos, sp, recv_pos, rp in _ring_steps(order, plan.rank, segs, chunk, 1, msg0):
        if sp is not None:
            dep = last.get((send_pos, j))
            plan.send(right, "out", sp[0], sp[1], msg, () if dep is None else (dep,))
        if rp is not None:
            toff = (s % 2) * tmp_half + j * stride
            war = prev_use.get((s % 2, j))
            r = plan.recv(left, "tmp", toff, rp[1], msg, () if war is None else (war,))
            deps = (r,) if (recv_pos, j) not in last else (r, last[(recv_pos, j)])
            last[(recv_pos, j)] = prev_use[(s % 2, j)] = plan.reduce("out", rp[0], "tmp", toff, rp[1], deps)
    return last


def _add_reduce_scatter_into(plan: Plan, order: list[int], segs: Segments, chunk: int, out_base: int) -> None:
    """Reduce-scatter that reads "in" where it lies (never writing it) and writes only this rank's segment,
    into "out" at `out_base` less its offset in "in": no working copy of the whole input. A partial sum
    travels in "tmp": each rank adds its own "in" to the partial it receives and sends the sum on from
    there; the owner adds the last partial to its own "in" in "out". The partial and the own data meet
    in the other order than in `_add_reduce_scatter`: every reduce op is commutative element by element,
    so the bits are the same."""
    _, left, right = ring_neighbours(order, plan.rank)
    last_step = len(order) - 2
    stride, tmp_half = _scratch(plan, order, segs, chunk)
    partial: dict[int, int] = {}  # piece -> the reduce that left its partial in tmp half (step - 1) % 2
    read_by: dict[tuple[int, int], int] = {}  # (tmp half, piece) -> the send that last read it (WAR)
    for s, j, msg, _send_pos, sp, _recv_pos, rp in _ring_steps(order, plan.rank, segs, chunk, 1, 0):
        if sp is not None:
            if s == 0:  # our own data of the segment we never receive
                plan.send(right, "in", sp[0], sp[1], msg)
            else:
                half = (s - 1) % 2
                read_by[(half, j)] = plan.send(right, "tmp", half * tmp_half + j * stride, sp[1], msg,
                                               (partial[j],))
        if rp is not None:
            half = s % 2
            toff = half * tmp_half + j * stride
            war = read_by.get((half, j))
            r = plan.recv(left, "tmp", toff, rp[1], msg, () if war is None else (war,))
            if s < last_step:  # tmp = in ⊕ partial, written where the partial arrived
                partial[j] = plan.reduce("tmp", toff, "in", rp[0], rp[1], (r,))
            else:  # our own segment
                filled = plan.copy("out", rp[0] - out_base, "in", rp[0], rp[1])
                plan.reduce("out", rp[0] - out_base, "tmp", toff, rp[1], (r, filled))


def _add_all_gather(plan: Plan, order: list[int], segs: Segments, chunk: int, last: dict, msg0: int) -> None:
    """Circulate every rank's finished segment of "out" to all ranks."""
    _, left, right = ring_neighbours(order, plan.rank)
    for s, j, msg, send_pos, sp, recv_pos, rp in _ring_steps(order, plan.rank, segs, chunk, 0, msg0):
        if sp is not None:
            dep = last.get((send_pos, j))
            plan.send(right, "out", sp[0], sp[1], msg, () if dep is None else (dep,))
        if rp is not None:
            last[(recv_pos, j)] = plan.recv(left, "out", rp[0], rp[1], msg)


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


def ring_reduce_scatter_into(rank: int, order: list[int], segs: Segments, chunk: int,
                             out_base: int | None = None) -> Plan:
    """Reduce "in" so that this rank's segment of the reduction lands in "out" (just that segment, from
    offset 0; `out_base`: where "out" starts in "in", default this rank's segment)."""
    plan = Plan(rank, len(order), "ring")
    base = segs[rank][0] if out_base is None else out_base
    if len(order) > 1:
        _add_reduce_scatter_into(plan, order, segs, chunk, base)
    else:
        plan.copy("out", segs[rank][0] - base, "in", segs[rank][0], segs[rank][1])
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


def reversed_ring(order: list[int]) -> list[int]:
    """The same ring, travelled the other way round (same first rank)."""
    return [order[0]] + order[1:][::-1]


def bidirectional_ring_allreduce(rank: int, order: list[int], count: int, chunk: int) -> Plan:
    """Half the data around the ring one way, half the other way: every cable busy in both directions."""
    half = count // 2
    segs_a = [(o, n) for o, n in split_even(half, len(order))]
    segs_b = [(half + o, n) for o, n in split_even(count - half, len(order))]
    fwd = ring_allreduce(rank, order, segs_a, chunk)
    back = ring_allreduce(rank, reversed_ring(order), segs_b, chunk)
    plan = merge(fwd, back)
    plan.algo = "biring"
    return plan


def _halves(segs: Segments) -> tuple[Segments, Segments]:
    """Each segment cut in two: its first halves, and its second halves."""
    return [(o, n // 2) for o, n in segs], [(o + n // 2, n - n // 2) for o, n in segs]


def bidirectional_ring_all_gather(rank: int, order: list[int], segs: Segments, chunk: int) -> Plan:
    """`ring_all_gather` with each segment's first half travelling one way round and its second half the
    other: both directions of every cable carry (W-1)/2W of the output, where one way leaves one idle."""
    first, second = _halves(segs)
    plan = merge(ring_all_gather(rank, order, first, chunk),
                 ring_all_gather(rank, reversed_ring(order), second, chunk))
    plan.algo = "biring"
    return plan


def bidirectional_ring_reduce_scatter(rank: int, order: list[int], segs: Segments, chunk: int) -> Plan:
    """`ring_reduce_scatter_into` with the halves of each segment reduced in opposite directions round the
    ring: reads "in", writes this rank's segment to "out"."""
    first, second = _halves(segs)
    base = segs[rank][0]
    plan = merge(ring_reduce_scatter_into(rank, order, first, chunk, base),
                 ring_reduce_scatter_into(rank, reversed_ring(order), second, chunk, base))
    plan.algo = "biring"
    return plan
