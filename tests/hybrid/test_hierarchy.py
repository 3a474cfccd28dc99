"""Hierarchical all-reduce and all-gather plans (within a host, among leaders, back within a host):
pairwise message order, who talks to whom, and exact results over the in-memory transport."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms import select
from torch_thunderbolt.algorithms.hierarchy import (hierarchical_all_gather, hierarchical_allreduce,
                                                     hierarchical_reduce_scatter)
from torch_thunderbolt.algorithms.plan import RECV, SEND
from torch_thunderbolt.algorithms.shape import Shape
from torch_thunderbolt.config import Config

from ..core.test_algorithms import make_input
from ..core.test_plans import check_pairwise_order
from torch_thunderbolt.testing.worlds import memory_world

LAYOUTS = {
    "2x2": [[0, 1], [2, 3]],
    "3x2 interleaved": [[0, 3], [1, 4], [2, 5]],
    "3+1+2": [[4, 0, 2], [1], [5, 3]],
}


def assert_only_leaders_cross_hosts(plans, groups: list[list[int]]) -> None:
    host = {r: i for i, g in enumerate(groups) for r in g}
    leaders = {g[0] for g in groups}
    for plan in plans:
        for s in plan.steps:
            if s.kind in (SEND, RECV) and host[s.peer] != host[plan.rank]:
                assert plan.rank in leaders and s.peer in leaders, (groups, plan.rank, s)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("line", [False, True])
@pytest.mark.parametrize("count", [6, 1001, 4099])
def test_plans_keep_pairwise_order_and_cross_hosts_only_between_leaders(layout: str, line: bool,
                                                                          count: int) -> None:
    groups = LAYOUTS[layout]
    world = sum(map(len, groups))
    plans = [hierarchical_allreduce(r, groups, count, 100, line) for r in range(world)]
    check_pairwise_order(plans)
    assert_only_leaders_cross_hosts(plans, groups)


def test_auto_picks_it_only_for_large_messages_with_host_groups() -> None:
    cfg = Config()
    groups = [[0, 1], [2, 3]]
    shape = Shape("mesh", [0, 1, 2, 3], {}, groups)
    assert select.allreduce_plan(cfg, 0, 4, 1 << 20, 4, shape).algo == "hier"
    assert select.allreduce_plan(cfg, 0, 4, 100, 4, shape).algo != "hier"
    assert select.allreduce_plan(cfg, 0, 4, 1 << 20, 4, Shape.full(4)).algo != "hier"
    assert select.allreduce_plan(Config(algo="ring"), 0, 4, 1 << 20, 4, shape).algo == "ring"


def run_on_hosts(groups: list[list[int]], body) -> list:
    """`body(comm)` on every rank of an in-memory world whose shape groups the ranks into `groups` (hosts),
    with small pipeline pieces and no one-shot path, so every op takes the pipelined plans."""
    order = [r for g in groups for r in g]

    def on_host(comm):
        comm.shape = Shape("mesh", order, {}, groups)
        return body(comm)

    return memory_world(len(order), on_host, Config(chunk_bytes=1024, small_bytes=0))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_results_are_exact_and_identical_on_every_rank(layout: str) -> None:
    groups = LAYOUTS[layout]
    world = sum(map(len, groups))
    cases = [(n, dt) for n in (world, 7, 3001) for dt in (torch.float32, torch.int64)]

    def body(comm):
        out = []
        for seed, (n, dt) in enumerate(cases):
            x = make_input(comm.rank, n, dt, seed)
            comm.all_reduce(x)
            out.append(x)
        return out

    got = run_on_hosts(groups, body)
    for seed, (n, dt) in enumerate(cases):
        want = ref.reduce_all([make_input(r, n, dt, seed) for r in range(world)], "sum")
        for r in range(world):
            if dt == torch.int64:
                assert torch.equal(got[r][seed], want), (layout, n, r)
            else:
                assert torch.allclose(got[r][seed], want, rtol=1e-5, atol=1e-4), (layout, n, r)
            assert torch.equal(got[r][seed], got[0][seed]), "results must be bit-identical on every rank"


# -- all_gather and reduce_scatter ---------------------------------------------------------------------------
# Hierarchical only when each host's ranks are consecutive (its blocks form one range).
BLOCK_LAYOUTS = {
    "2x2": [[0, 1], [2, 3]],
    "3x2": [[0, 1], [2, 3], [4, 5]],
    "2+1+2, leader not the lowest": [[1, 0], [2], [4, 3]],
}
BUILDERS = {"all_gather": hierarchical_all_gather, "reduce_scatter": hierarchical_reduce_scatter}


def plan_of(op: str, cfg: Config, world: int, counts: list[int], shape: Shape):
    if op == "all_gather":
        return select.all_gather_plan(cfg, 0, world, counts, 4, shape)
    return select.reduce_scatter_plan(cfg, 0, world, counts, 4, shape)[0]


@pytest.mark.parametrize("op", sorted(BUILDERS))
@pytest.mark.parametrize("layout", sorted(BLOCK_LAYOUTS))
@pytest.mark.parametrize("counts_kind", ["even", "uneven with zeros"])
def test_block_plans_keep_pairwise_order_and_cross_hosts_only_between_leaders(op: str, layout: str,
                                                                                counts_kind: str) -> None:
    groups = BLOCK_LAYOUTS[layout]
    world = sum(map(len, groups))
    counts = [300] * world if counts_kind == "even" else [(7 * r + 3) % 5 * 100 for r in range(world)]
    plans = [BUILDERS[op](r, groups, counts, 128) for r in range(world)]
    check_pairwise_order(plans)
    assert_only_leaders_cross_hosts(plans, groups)


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_block_ops_pick_the_hierarchy_only_for_large_messages_and_consecutive_hosts(op: str) -> None:
    cfg = Config()
    big = [1 << 18] * 4
    shape = Shape("mesh", [0, 1, 2, 3], {}, [[0, 1], [2, 3]])
    assert plan_of(op, cfg, 4, big, shape).algo == "hier"
    assert plan_of(op, cfg, 4, [10] * 4, shape).algo != "hier"
    interleaved = Shape("mesh", [0, 2, 1, 3], {}, [[0, 2], [1, 3]])  # a host's blocks are not one range
    assert plan_of(op, cfg, 4, big, interleaved).algo != "hier"
    assert plan_of(op, cfg, 4, big, Shape.full(4)).algo != "hier"
    assert plan_of(op, Config(algo="ring"), 4, big, shape).algo != "hier"


CASES = [("all_gather", torch.float32, "sum"), ("all_gather", torch.int64, "sum"),
         ("reduce_scatter", torch.int64, "sum"), ("reduce_scatter", torch.float64, "max")]


@pytest.mark.parametrize("layout", sorted(BLOCK_LAYOUTS))
def test_block_op_results_are_exact(layout: str) -> None:
    groups = BLOCK_LAYOUTS[layout]
    world = sum(map(len, groups))
    sizes = [[n] * world for n in (1, 7, 3001)] + [[(5 * r + 1) % 4 * 333 for r in range(world)]]

    def body(comm):
        out = []
        for seed, counts in enumerate(sizes):
            for op, dt, red in CASES:
                if op == "all_gather":
                    x = make_input(comm.rank, counts[comm.rank], dt, seed)
                    y = torch.full((sum(counts),), -1, dtype=dt)
                    comm.all_gather(y, x, counts)
                else:
                    x = make_input(comm.rank, sum(counts), dt, seed)
                    y = torch.full((counts[comm.rank],), -1, dtype=dt)
                    comm.reduce_scatter(y, x, counts, red)
                out.append(y)
        return out

    got = run_on_hosts(groups, body)
    k = 0
    for seed, counts in enumerate(sizes):
        for op, dt, red in CASES:
            if op == "all_gather":
                want = ref.all_gather([make_input(r, counts[r], dt, seed) for r in range(world)])
            else:
                want = ref.reduce_scatter([make_input(r, sum(counts), dt, seed) for r in range(world)], red, counts)
            for r in range(world):
                assert torch.equal(got[r][k], want[r]), (layout, op, counts, dt, red, r)
            k += 1
