"""One-shot algorithms: every rank talks to every other rank directly, once.

Latency-optimal for small messages on the small full meshes Thunderbolt clusters are (2–5 Macs), and
the natural shape of gather, scatter and all-to-all. Reductions are applied in rank order, so every rank
computes bit-identical results.
"""
from __future__ import annotations

from .plan import Plan
from .segments import chunks, split_even

Segments = list[tuple[int, int]]


def peer_order(rank: int, world: int) -> tuple[list[int], list[int]]:
    """Send to rank+1, rank+2, ... and receive from rank-1, rank-2, ...: no rank is everyone's first."""
    return [(rank + k) % world for k in range(1, world)], [(rank - k) % world for k in range(1, world)]


def _rank_order_reduce(plan: Plan, dst: str, dst_off: int, n: int, source: dict[int, tuple[str, int]],
                       recv_step: dict[int, int], after: tuple[int, ...]) -> None:
    """dst := source[0] ⊕ source[1] ⊕ ... in rank order (source[r] = (buffer, offset))."""
    buf0, off0 = source[0]
    deps = after + ((recv_step[0],) if 0 in recv_step else ())
    prev = plan.copy(dst, dst_off, buf0, off0, n, deps) if (buf0, off0) != (dst, dst_off) else None
    for r in range(1, plan.world):
        buf, off = source[r]
        deps = ((recv_step[r],) if r in recv_step else ()) + ((prev,) if prev is not None else after)
        prev = plan.reduce(dst, dst_off, buf, off, n, deps)


def direct_allreduce(rank: int, world: int, count: int) -> Plan:
    plan = Plan(rank, world, "direct")
    if world == 1:
        return plan
    plan.tmp = world * count
    to, frm = peer_order(rank, world)
    sends = tuple(plan.send(p, "out", 0, count, 0) for p in to)
    recvs = {p: plan.recv(p, "tmp", p * count, count, 0) for p in frm}
    source = {p: ("tmp", p * count) for p in frm}
    after: tuple[int, ...] = sends
    if rank == 0:
        source[0] = ("out", 0)
    else:  # keep our own contribution, since "out" is overwritten with rank 0's first
        after = sends + (plan.copy("tmp", rank * count, "out", 0, count),)
        source[rank] = ("tmp", rank * count)
    _rank_order_reduce(plan, "out", 0, count, source, recvs, after)
    return plan


def _reduce_pieces(plan: Plan, pieces: list[list[tuple[int, int]]], src: str, dst: str,
                   dst_base: int) -> tuple[dict[int, list[int]], list[int]]:
    """The exchange of a direct reduce-scatter, piece by piece (`pieces[r]`: rank r's block in pieces,
    the same on every rank): each peer's pieces of `src` to that peer, and every piece of this rank's
    block reduced from all ranks' (in rank order) into `dst` at its offset less `dst_base` as soon as
    every peer's part of it is in. Where `dst` is `src`, our own piece goes to tmp first, since `dst`
    takes rank 0's first. Returns the sends by peer and, per own piece, the step that finishes it."""
    rank, world = plan.rank, plan.world
    my_off, my_n = pieces[rank][0][0], sum(n for _, n in pieces[rank])
    plan.tmp = world * my_n
    to, frm = peer_order(rank, world)
    sent = {p: [plan.send(p, src, off, n, j) for j, (off, n) in enumerate(pieces[p])] for p in to}
    recvs = {p: [plan.recv(p, "tmp", p * my_n + off - my_off, n, j) for j, (off, n) in enumerate(pieces[rank])]
             for p in frm}
    reduced = []
    for j, (off, n) in enumerate(pieces[rank]):
        rel = off - my_off
        source = {p: ("tmp", p * my_n + rel) for p in frm}
        after: tuple[int, ...] = ()
        if src != dst or rank == 0:
            source[rank] = (src, off)
        else:  # keep our own contribution
            after = (plan.copy("tmp", rank * my_n + rel, src, off, n),)
            source[rank] = ("tmp", rank * my_n + rel)
        _rank_order_reduce(plan, dst, off - dst_base, n, source, {p: recvs[p][j] for p in frm}, after)
        reduced.append(len(plan.steps) - 1)
    return sent, reduced


def mesh_allreduce(rank: int, world: int, count: int, chunk: int) -> Plan:
    """For a full mesh of cables: every rank sends each other rank that rank's block of "out" and reduces its
    own block from what it receives (in rank order), then sends its reduced block to every other rank. Each
    rank moves 2(W-1)/W of the data, over all its W-1 cables at once, one hop each; every rank ends with the
    same bits (each block is reduced once, by its owner). Blocks go in pieces of `chunk`: a piece is
    reduced as soon as every peer's part of it is in and sent on at once, so the reduction and the second
    exchange overlap the first instead of waiting for whole blocks."""
    plan = Plan(rank, world, "mesh")
    if world == 1:
        return plan
    pieces = [chunks(off, n, chunk) for off, n in split_even(count, world)]
    second = max(len(p) for p in pieces)  # message ids of the second exchange start here on every pair
    sent, reduced = _reduce_pieces(plan, pieces, "out", "out", 0)
    to, frm = peer_order(rank, world)
    # Plan order per pair stays first exchange, then second: the second's sends come after every first send.
    for j, (off, n) in enumerate(pieces[rank]):
        for p in to:
            plan.send(p, "out", off, n, second + j, (reduced[j],))
    for p in frm:  # overwrites the piece we sent that rank: only once it is on its way
        for j, (off, n) in enumerate(pieces[p]):
            plan.recv(p, "out", off, n, second + j, (sent[p][j],))
    return plan


def direct_reduce_scatter(rank: int, world: int, segs: Segments, chunk: int | None = None) -> Plan:
    """"in" holds every segment; "out" receives this rank's reduced segment. With `chunk` (the same on every
    rank), segments go in pieces and each piece is reduced once every peer's part of it is in, so the
    reduction overlaps what is still arriving."""
    plan = Plan(rank, world, "direct")
    pieces = [chunks(off, n, chunk) if chunk else [(off, n)] for off, n in segs]
    _reduce_pieces(plan, pieces, "in", "out", segs[rank][0])
    return plan


def direct_all_gather(rank: int, world: int, segs: Segments) -> Plan:
    """Every rank's segment of "out" is in place on that rank; send it to all, receive all others."""
    plan = Plan(rank, world, "direct")
    to, frm = peer_order(rank, world)
    for p in to:
        plan.send(p, "out", segs[rank][0], segs[rank][1], 0)
    for p in frm:
        plan.recv(p, "out", segs[p][0], segs[p][1], 0)
    return plan


def flat_broadcast(rank: int, world: int, root: int, count: int) -> Plan:
    plan = Plan(rank, world, "direct")
    if rank == root:
        for k in range(1, world):
            plan.send((root + k) % world, "out", 0, count, 0)
    elif world > 1:
        plan.recv(root, "out", 0, count, 0)
    return plan


def scatter_forward_broadcast(rank: int, world: int, root: int, count: int, chunk: int) -> Plan:
    """For a full mesh of cables: the root sends piece i of the message to the i-th other rank, each over
    its own cable, and every rank forwards its piece, chunk by chunk, to all the others: each of the root's
    cables carries 1/(W-1) of the message, so the root sends it in 1/(W-1) of the time one cable takes."""
    plan = Plan(rank, world, "scatter+fwd")
    others = [(root + k) % world for k in range(1, world)]
    msg = 0
    for owner, (off, n) in zip(others, split_even(count, len(others))):
        for j, (coff, cn) in enumerate(chunks(off, n, chunk)):
            if rank == root:
                plan.send(owner, "out", coff, cn, msg + j)
            elif rank == owner:
                got = plan.recv(root, "out", coff, cn, msg + j)
                for p in others:
                    if p != owner:
                        plan.send(p, "out", coff, cn, msg + j, (got,))
            else:
                plan.recv(owner, "out", coff, cn, msg + j)
        msg += len(chunks(off, n, chunk))
    return plan


def direct_reduce(rank: int, world: int, root: int, count: int) -> Plan:
    """Reduce "in" of every rank into "out" on root ("out" is "in" there)."""
    plan = Plan(rank, world, "direct")
    if world == 1:
        return plan
    if rank != root:
        plan.send(root, "in", 0, count, 0)
        return plan
    plan.tmp = world * count
    _, frm = peer_order(rank, world)
    recvs = {p: plan.recv(p, "tmp", p * count, count, 0) for p in frm}
    source = {p: ("tmp", p * count) for p in frm}
    after: tuple[int, ...] = ()
    if root == 0:
        source[0] = ("out", 0)
    else:
        after = (plan.copy("tmp", root * count, "in", 0, count),)
        source[root] = ("tmp", root * count)
    _rank_order_reduce(plan, "out", 0, count, source, recvs, after)
    return plan


def gather(rank: int, world: int, root: int, segs: Segments) -> Plan:
    """"in" of each rank lands in "out"[segs[rank]] on root."""
    plan = Plan(rank, world, "direct")
    if rank != root:
        plan.send(root, "in", 0, segs[rank][1], 0)
        return plan
    plan.copy("out", segs[root][0], "in", 0, segs[root][1])
    for p in peer_order(rank, world)[1]:
        plan.recv(p, "out", segs[p][0], segs[p][1], 0)
    return plan


def scatter(rank: int, world: int, root: int, segs: Segments) -> Plan:
    """Root's "in"[segs[p]] lands in "out" of rank p."""
    plan = Plan(rank, world, "direct")
    if rank != root:
        plan.recv(root, "out", 0, segs[rank][1], 0)
        return plan
    plan.copy("out", 0, "in", segs[root][0], segs[root][1])
    for p in peer_order(rank, world)[0]:
        plan.send(p, "in", segs[p][0], segs[p][1], 0)
    return plan


def all_to_all(rank: int, world: int, send_segs: Segments, recv_segs: Segments) -> Plan:
    """"in"[send_segs[p]] goes to rank p, which stores it at "out"[its recv_segs[rank]]."""
    plan = Plan(rank, world, "direct")
    plan.copy("out", recv_segs[rank][0], "in", send_segs[rank][0], send_segs[rank][1])
    to, frm = peer_order(rank, world)
    for p in to:
        plan.send(p, "in", send_segs[p][0], send_segs[p][1], 0)
    for p in frm:
        plan.recv(p, "out", recv_segs[p][0], recv_segs[p][1], 0)
    return plan


def barrier(rank: int, world: int) -> Plan:
    """Zero-byte messages to and from every rank: nobody leaves before everybody arrived."""
    plan = Plan(rank, world, "direct")
    to, frm = peer_order(rank, world)
    for p in to:
        plan.send(p, "out", 0, 0, 0)
    for p in frm:
        plan.recv(p, "out", 0, 0, 0)
    return plan
