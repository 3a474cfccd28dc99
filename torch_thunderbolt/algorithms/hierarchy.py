"""Hierarchical collectives for jobs whose hosts run several ranks.

all_reduce: reduce within each host to its leader (shared memory), all-reduce among the leaders (the
cables), broadcast within each host. Each byte crosses the cables 2(H-1)/H times for H hosts instead of
2(W-1)/W for W ranks, and the same-host phases never touch the network.

broadcast: the root to one rank per host over the cables (itself for its own host, the leader for the
others), then a pipelined chain within each host: the message crosses each cable once.

all_gather: gather within each host to its leader, all-gather of whole host blocks among the leaders,
broadcast of the result within each host: a cable carries (H-1)/H of the output instead of (W-1)/W.
reduce_scatter: the mirror image: reduce within each host to its leader, reduce-scatter of host blocks
among the leaders, each leader hands its ranks their blocks.

The three phases run one after the other on each rank (a zero-length join step between them), so their
scratch can be shared; a leader's cable phase starts as soon as its own host is done, without waiting
for the other hosts. Pure plan builders.

Where a host's ranks share a window (shared memory), the Communicator runs that host's phases on it
(`windowed.py`) and only the cable phase as a plan: the `cable_*` builders give exactly the middle phase
of the full plans (same steps, same message ids), so hosts that run their phases on a window and hosts
that run the full plan (a host with one rank, or without a window) take part in one op together.
"""
from __future__ import annotations

from typing import Callable

from . import chain, ring
from .segments import offsets, split_even
from .plan import COPY, RECV, SEND, Plan
from .ring import Segments

PHASE_MSG = 1 << 28  # message ids of phase k start at k * PHASE_MSG (a biring uses ids up to ~1 << 24 + n)


def then(first: Plan, second: Plan, msg_shift: int) -> Plan:
    """`first`, then `second` once every step of `first` on this rank has finished."""
    out = Plan(first.rank, max(first.world, second.world), first.algo + ">" + second.algo, list(first.steps),
               max(first.tmp, second.tmp))
    if not second.steps:
        return out
    join: tuple[int, ...] = ()
    if first.steps:
        join = (out.copy("out", 0, "out", 0, 0, tuple(range(len(first.steps)))),)
    shift = len(out.steps)
    for s in second.steps:
        deps = tuple(d + shift for d in s.deps) or join
        msg = s.msg + msg_shift if s.kind != COPY and s.msg >= 0 else s.msg
        out.steps.append(s._replace(deps=deps, msg=msg))
    return out


def relabel(plan: Plan, names: list[int]) -> Plan:
    """A plan built for ranks 0..n-1 of a sub-group, talking to the group's real ranks `names[i]`."""
    steps = [s._replace(peer=names[s.peer]) if s.kind in (SEND, RECV) else s for s in plan.steps]
    return Plan(names[plan.rank], plan.world, plan.algo, steps, plan.tmp)


def leaders_allreduce(rank: int, leaders: list[int], count: int, chunk: int, line: bool) -> Plan:
    """All-reduce among the hosts' leaders (in cable order): along the line on a chain of hosts, else a
    (bi)ring. Built over positions 0..H-1 (the ring builders index segments by rank), then relabelled."""
    if rank not in leaders or len(leaders) == 1:
        return Plan(rank, len(leaders), "none")
    me, h = leaders.index(rank), len(leaders)
    if line:
        plan = chain.chain_allreduce(me, list(range(h)), count, chunk)
    elif h > 2 and count >= 2 * h:
        plan = ring.bidirectional_ring_allreduce(me, list(range(h)), count, chunk)
    else:
        plan = ring.ring_allreduce(me, list(range(h)), split_even(count, h), chunk)
    return relabel(plan, leaders)


def shifted(plan: Plan, msg_shift: int) -> Plan:
    """`plan` with its message ids moved by `msg_shift` (a phase of a hierarchical plan, run alone)."""
    return then(Plan(plan.rank, plan.world, plan.algo), plan, msg_shift)


def cable_allreduce(rank: int, groups: list[list[int]], count: int, chunk: int, line: bool = False) -> Plan:
    """The cable phase of `hierarchical_allreduce`, alone."""
    return shifted(leaders_allreduce(rank, [g[0] for g in groups], count, chunk, line), PHASE_MSG)


def hierarchical_allreduce(rank: int, groups: list[list[int]], count: int, chunk: int, line: bool = False) -> Plan:
    """`groups`: each host's ranks, hosts in cable order, the first rank of each group its leader."""
    mine = next(g for g in groups if rank in g)
    leader = mine[0]
    world = sum(len(g) for g in groups)
    local_reduce = chain.chain_reduce(rank, mine, leader, count, chunk)
    across = leaders_allreduce(rank, [g[0] for g in groups], count, chunk, line)
    local_bcast = chain.chain_broadcast(rank, mine, leader, count, chunk)
    plan = then(then(local_reduce, across, PHASE_MSG), local_bcast, 2 * PHASE_MSG)
    plan.world, plan.algo = world, "hier"
    return plan


def contiguous_hosts(groups: list[list[int]]) -> bool:
    """Each host's ranks are consecutive numbers, so its blocks of an all_gather form one range."""
    return all(sorted(g) == list(range(min(g), min(g) + len(g))) for g in groups)


def hierarchical_all_gather(rank: int, groups: list[list[int]], counts: list[int], chunk: int) -> Plan:
    """"out" holds this rank's block in place (blocks of `counts`, rank order); fill in all the others.
    Needs `contiguous_hosts(groups)`; the first rank of each group is its leader."""
    mine = next(g for g in groups if rank in g)
    leader = mine[0]
    starts = offsets(counts)
    world = sum(len(g) for g in groups)
    local_gather = Plan(rank, world, "gather")
    if rank != leader:
        local_gather.send(leader, "out", starts[rank], counts[rank], 0)
    else:
        for p in mine[1:]:
            local_gather.recv(p, "out", starts[p], counts[p], 0)
    across = leaders_ring(ring.ring_all_gather, rank, groups, starts, counts, chunk)
    local_bcast = chain.chain_broadcast(rank, mine, leader, sum(counts), chunk)
    plan = then(then(local_gather, across, PHASE_MSG), local_bcast, 2 * PHASE_MSG)
    plan.world, plan.algo = world, "hier"
    return plan


def cable_all_gather(rank: int, groups: list[list[int]], counts: list[int], chunk: int) -> Plan:
    """The cable phase of `hierarchical_all_gather`, alone."""
    return shifted(leaders_ring(ring.ring_all_gather, rank, groups, offsets(counts), counts, chunk), PHASE_MSG)


def cable_reduce_scatter(rank: int, groups: list[list[int]], counts: list[int], chunk: int) -> Plan:
    """The cable phase of `hierarchical_reduce_scatter`, alone."""
    return shifted(leaders_ring(ring.ring_reduce_scatter, rank, groups, offsets(counts), counts, chunk), PHASE_MSG)


def leaders_ring(build: Callable[[int, list[int], Segments, int], Plan], rank: int, groups: list[list[int]],
                  starts: list[int], counts: list[int], chunk: int) -> Plan:
    """A ring all-gather or reduce-scatter (`build`) among the leaders, each host's blocks as one segment."""
    leaders = [g[0] for g in groups]
    if rank not in leaders or len(leaders) == 1:
        return Plan(rank, len(leaders), "none")
    host_blocks = [(starts[min(g)], sum(counts[p] for p in g)) for g in groups]
    return relabel(build(leaders.index(rank), list(range(len(leaders))), host_blocks, chunk), leaders)


def hierarchical_reduce_scatter(rank: int, groups: list[list[int]], counts: list[int], chunk: int) -> Plan:
    """Reduce "in" (aliasing "out": a full working copy) so that this rank's block of "out" holds the
    reduction over every rank. Needs `contiguous_hosts(groups)`; the first rank of each group leads."""
    mine = next(g for g in groups if rank in g)
    leader = mine[0]
    starts = offsets(counts)
    world = sum(len(g) for g in groups)
    local_reduce = chain.chain_reduce(rank, mine, leader, sum(counts), chunk)
    across = leaders_ring(ring.ring_reduce_scatter, rank, groups, starts, counts, chunk)
    local_scatter = Plan(rank, world, "scatter")
    if rank == leader:
        for p in mine[1:]:
            local_scatter.send(p, "out", starts[p], counts[p], 0)
    else:
        local_scatter.recv(leader, "out", starts[rank], counts[rank], 0)
    plan = then(then(local_reduce, across, PHASE_MSG), local_scatter, 2 * PHASE_MSG)
    plan.world, plan.algo = world, "hier"
    return plan


def broadcast_entries(groups: list[list[int]], root: int) -> list[int]:
    """The rank of each host that receives a broadcast over the cables: the root on its own host, the
    leader on the others."""
    return [root if root in g else g[0] for g in groups]


def cable_broadcast(rank: int, groups: list[list[int]], root: int, count: int, chunk: int, line: bool) -> Plan:
    """Broadcast from `root` among the hosts' entries (`broadcast_entries`), in cable order: along the line
    on a chain of hosts, both ways round a ring of three or more, pipelined in every case. Ranks that are
    no entry have nothing to do. (The first phase of `hierarchical_broadcast`, alone.)"""
    entries = broadcast_entries(groups, root)
    if rank not in entries or len(entries) == 1:
        return Plan(rank, len(entries), "none")
    if not line and len(entries) >= 3 and count >= 2:
        return chain.two_way_ring_broadcast(rank, entries, root, count, chunk)
    return chain.chain_broadcast(rank, entries, root, count, chunk)


def hierarchical_broadcast(rank: int, groups: list[list[int]], root: int, count: int, chunk: int,
                           line: bool = False) -> Plan:
    """`cable_broadcast`, then a pipelined chain from the entry within each host."""
    mine = next(g for g in groups if rank in g)
    entry = root if root in mine else mine[0]
    world = sum(len(g) for g in groups)
    across = cable_broadcast(rank, groups, root, count, chunk, line)
    local_bcast = chain.chain_broadcast(rank, mine, entry, count, chunk)
    plan = then(across, local_bcast, PHASE_MSG)
    plan.world, plan.algo = world, "hier"
    return plan
