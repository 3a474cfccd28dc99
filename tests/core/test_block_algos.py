"""Large all_gather, reduce_scatter and broadcast laid on the cables: along a line on a chain, both ways
round a ring, one hop on a full mesh (and the root's every cable for broadcast). Plans checked without
sockets (pairwise order, cabled neighbours only) and results over the in-memory transport."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.algorithms import chain, direct, ring, select
from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms.plan import RECV, SEND
from torch_thunderbolt.algorithms.segments import offsets
from torch_thunderbolt.algorithms.shape import Shape
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.worlds import memory_world

from .test_algorithms import make_input
from .test_plans import check_pairwise_order, talks_only_to


def line_shape(order: list[int]) -> Shape:
    adj = {r: set() for r in order}
    for a, b in zip(order, order[1:]):
        adj[a].add(b)
        adj[b].add(a)
    return Shape("chain", order, adj)


def ring_shape(order: list[int]) -> Shape:
    adj = {r: {order[(i - 1) % len(order)], order[(i + 1) % len(order)]} for i, r in enumerate(order)}
    return Shape("ring", order, adj)


COUNTS = {"even": lambda w: [300] * w, "uneven with zeros": lambda w: [(7 * r + 3) % 5 * 100 for r in range(w)],
          "tiny": lambda w: [1 + r % 2 for r in range(w)]}
CHUNK = 64


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("counts_kind", sorted(COUNTS))
def test_block_plans_keep_pairwise_order_and_use_only_cabled_neighbours(world: int, counts_kind: str) -> None:
    counts = COUNTS[counts_kind](world)
    segs = list(zip(offsets(counts), counts))
    order = list(range(world))[::-1]
    line, cycle = line_shape(order), ring_shape(order)
    for build, shape in [(chain.line_all_gather, line), (chain.line_reduce_scatter, line),
                         (ring.bidirectional_ring_all_gather, cycle), (ring.bidirectional_ring_reduce_scatter, cycle)]:
        plans = [build(r, order, segs, CHUNK) for r in range(world)]
        check_pairwise_order(plans)
        for p in plans:
            assert talks_only_to(p, shape.neighbours[p.rank]), (build.__name__, p.rank)
    for root in range(world):
        check_pairwise_order([direct.scatter_forward_broadcast(r, world, root, 1000, CHUNK) for r in range(world)])
    for count in (world, 1001, sum(counts)):
        for chunk in (CHUNK, 10**9):  # pieces, and whole blocks
            check_pairwise_order([direct.mesh_allreduce(r, world, count, chunk) for r in range(world)])


def test_a_line_moves_over_each_cable_no_more_than_the_blocks_behind_it() -> None:
    """Chain 0-1-2-3, all_gather of blocks of 100: the cable between positions i and i+1 carries, each way,
    exactly the blocks of the ranks on the far side (what any algorithm must move over it)."""
    world, order = 4, [0, 1, 2, 3]
    segs = list(zip(offsets([100] * world), [100] * world))
    plans = [chain.line_all_gather(r, order, segs, CHUNK) for r in range(world)]
    for i in range(world - 1):
        a, b = order[i], order[i + 1]
        right = sum(s.n for s in plans[a].steps if s.kind == SEND and s.peer == b)
        left = sum(s.n for s in plans[b].steps if s.kind == SEND and s.peer == a)
        assert right == 100 * (i + 1) and left == 100 * (world - 1 - i), (i, right, left)


def test_the_mesh_broadcast_root_uses_every_cable_once() -> None:
    plans = [direct.scatter_forward_broadcast(r, 4, 1, 3000, CHUNK) for r in range(4)]
    sent = {p: sum(s.n for s in plans[1].steps if s.kind == SEND and s.peer == p) for p in (0, 2, 3)}
    assert sent == {0: 1000, 2: 1000, 3: 1000}
    got = {r: sum(s.n for s in plans[r].steps if s.kind == RECV) for r in (0, 2, 3)}
    assert got == {0: 3000, 2: 3000, 3: 3000}


SHAPES = {"chain": line_shape, "ring": ring_shape, "mesh": None}


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("world", [3, 4])
def test_results_are_exact_on_every_shape(kind: str, world: int) -> None:
    cfg = Config(chunk_bytes=256, small_bytes=64)
    order = [(3 * r + 1) % world for r in range(world)] if world == 4 else [2, 0, 1]
    shape = SHAPES[kind](order) if SHAPES[kind] else Shape.full(world)
    cases = [(n, dt) for n in (world * 3, 1001, 4099) for dt in (torch.int64, torch.float32)]

    def body(comm):
        comm.shape = shape
        out = []
        for seed, (n, dt) in enumerate(cases):
            counts = [n // world + (r % 2) for r in range(world)]
            mine = make_input(comm.rank, counts[comm.rank], dt, seed)
            ag = torch.empty(sum(counts), dtype=dt)
            comm.all_gather(ag, mine, counts)
            rs = torch.empty(counts[comm.rank], dtype=dt)
            comm.reduce_scatter(rs, make_input(comm.rank, sum(counts), dt, seed + 1), counts, "sum")
            bc = make_input(comm.rank, n, dt, seed + 2)
            comm.broadcast(bc, seed % world)
            ar = make_input(comm.rank, n, dt, seed + 3)
            comm.all_reduce(ar, "sum")
            out.append((ag, rs, bc, ar))
        return out

    got = memory_world(world, body, cfg)
    for seed, (n, dt) in enumerate(cases):
        counts = [n // world + (r % 2) for r in range(world)]
        want_ag = torch.cat([make_input(r, counts[r], dt, seed) for r in range(world)])
        want_rs = ref.reduce_scatter([make_input(r, sum(counts), dt, seed + 1) for r in range(world)], "sum", counts)
        want_bc = make_input(seed % world, n, dt, seed + 2)
        want_ar = ref.reduce_all([make_input(r, n, dt, seed + 3) for r in range(world)], "sum")
        for r in range(world):
            ag, rs, bc, ar = got[r][seed]
            assert torch.allclose(ar.double(), want_ar.double(), rtol=1e-5, atol=1e-3), (kind, world, n, r)
            assert torch.equal(ar, got[0][seed][3]), "all_reduce must give the same bits on every rank"
            assert torch.equal(ag, want_ag), (kind, world, n, r)
            assert torch.allclose(rs.double(), want_rs[r].double(), rtol=1e-5, atol=1e-3), (kind, world, n, r)
            assert torch.equal(bc, want_bc), (kind, world, n, r)


def test_auto_lays_the_blocks_on_the_cables() -> None:
    cfg, big = Config(), [1 << 18] * 4
    assert select.all_gather_plan(cfg, 0, 4, big, 4, line_shape([0, 1, 2, 3])).algo == "line"
    assert select.reduce_scatter_plan(cfg, 0, 4, big, 4, line_shape([0, 1, 2, 3]))[0].algo == "line"
    assert select.all_gather_plan(cfg, 0, 4, big, 4, ring_shape([0, 1, 2, 3])).algo == "biring"
    assert select.reduce_scatter_plan(cfg, 0, 4, big, 4, ring_shape([0, 1, 2, 3]))[0].algo == "biring"
    assert select.all_gather_plan(cfg, 0, 4, big, 4, Shape.full(4)).algo == "direct"
    assert select.reduce_scatter_plan(cfg, 0, 4, big, 4, Shape.full(4)) [0].algo == "direct"
    assert select.broadcast_plan(cfg, 0, 4, 0, 1 << 20, 4, Shape.full(4)).algo == "scatter+fwd"
    assert select.allreduce_plan(cfg, 0, 4, 1 << 20, 4, Shape.full(4)).algo == "mesh"
    assert select.all_gather_plan(cfg, 0, 2, big[:2], 4, Shape.full(2)).algo == "ring"
    assert select.all_gather_plan(Config(algo="ring"), 0, 4, big, 4, Shape.full(4)).algo == "ring"


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("counts_kind", ["even", "uneven with zeros"])
def test_reduce_scatter_plans_read_the_input_where_it_lies_and_write_only_the_ranks_block(world, counts_kind):
    """The line and ring reduce-scatters need no working copy of the input: no step writes "in", and
    "out" is written only within this rank's block, from 0. Every reduce into "out" follows a copy into
    that very range from "in" (so the block starts from the rank's own data, not from garbage)."""
    from torch_thunderbolt.algorithms.plan import COPY, REDUCE

    counts = COUNTS[counts_kind](world)
    segs = list(zip(offsets(counts), counts))
    order = list(range(world))[::-1]
    builds = [chain.line_reduce_scatter, ring.bidirectional_ring_reduce_scatter, ring.ring_reduce_scatter_into]
    for build in builds:
        if build is ring.bidirectional_ring_reduce_scatter and min(counts) < 2:
            continue
        for r in range(world):
            plan = build(r, order, segs, CHUNK)
            assert all(s.buf != "in" for s in plan.steps if s.kind in (RECV, REDUCE, COPY)), (build.__name__, r)
            filled: set[int] = set()
            for i, s in enumerate(plan.steps):
                if s.buf != "out":
                    continue
                assert s.kind in (REDUCE, COPY) and 0 <= s.off and s.off + s.n <= counts[r], (build.__name__, r, s)
                if s.kind == COPY:
                    assert s.src == "in" and s.src_off == segs[r][0] + s.off
                    filled.add(i)
                else:
                    same = {f for f in filled if (plan.steps[f].off, plan.steps[f].n) == (s.off, s.n)}
                    assert same & _ancestors(plan, i), (build.__name__, r, s)
            written = sum(s.n for s in plan.steps if s.buf == "out" and s.kind == COPY)
            assert written == counts[r], (build.__name__, r)


def _ancestors(plan, i: int) -> set[int]:
    seen, todo = set(), list(plan.steps[i].deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(plan.steps[d].deps)
    return seen


def test_the_mesh_all_reduce_sends_a_reduced_piece_before_the_last_piece_is_in() -> None:
    """In pieces, the second exchange of piece 0 waits for piece 0 only: the reduction and the second
    exchange overlap the first (with whole blocks, nothing leaves before the whole block is in)."""
    world, count, chunk = 4, 4 * 1000, 250  # blocks of 1000, four pieces each
    for r in range(world):
        plan = direct.mesh_allreduce(r, world, count, chunk)
        recvs = [i for i, s in enumerate(plan.steps) if s.kind == RECV and s.buf == "tmp"]
        second = [i for i, s in enumerate(plan.steps) if s.kind == SEND and s.msg >= 4]
        assert len(recvs) == 3 * 4 and len(second) == 3 * 4
        last_piece_in = {i for i in recvs if plan.steps[i].msg == 3}
        assert not (_ancestors(plan, second[0]) & last_piece_in), r
        assert _ancestors(plan, second[-1]) & last_piece_in, r
    whole = direct.mesh_allreduce(0, world, count, count)
    first_out = next(i for i, s in enumerate(whole.steps) if s.kind == SEND and s.msg >= 1)
    assert {i for i, s in enumerate(whole.steps) if s.kind == RECV and s.buf == "tmp"} <= _ancestors(whole, first_out)
