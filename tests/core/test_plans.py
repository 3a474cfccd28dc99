"""Plans checked without sockets: message order per pair, cabled neighbours only, shapes from subnets."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.algorithms import chain, direct, ring, select
from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms.segments import split_even
from torch_thunderbolt.algorithms.plan import RECV, SEND, Plan
from torch_thunderbolt.algorithms.shape import Shape, shape_from_networks
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.worlds import memory_world

from .test_algorithms import make_input


def check_pairwise_order(plans: list[Plan]) -> None:
    """What rank a sends to b, in plan order, is exactly what b receives from a, in plan order."""
    for a in plans:
        for b in plans:
            if a.rank == b.rank:
                continue
            sent = [(s.msg, s.n) for s in a.steps if s.kind == SEND and s.peer == b.rank]
            got = [(s.msg, s.n) for s in b.steps if s.kind == RECV and s.peer == a.rank]
            assert sent == got, (a.rank, b.rank, sent[:5], got[:5])


def talks_only_to(plan: Plan, neighbours: set[int]) -> bool:
    return {s.peer for s in plan.steps if s.kind in (SEND, RECV)} <= neighbours


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 1000, 4099])
def test_every_plan_keeps_pairwise_order(world: int, count: int) -> None:
    order = list(range(world))[::-1]
    segs = split_even(count, world)
    builders = [
        lambda r: ring.ring_allreduce(r, order, segs, 64),
        lambda r: ring.bidirectional_ring_allreduce(r, order, count, 64),
        lambda r: chain.chain_allreduce(r, order, count, 64),
        lambda r: chain.chain_broadcast(r, order, order[world // 2], count, 64),
        lambda r: chain.two_way_ring_broadcast(r, order, order[world // 2], count, 64),
        lambda r: chain.chain_reduce(r, order, order[world // 2], count, 64),
        lambda r: direct.direct_allreduce(r, world, count),
        lambda r: direct.all_to_all(r, world, [(i * count, count) for i in range(world)],
                                    [(i * count, count) for i in range(world)]),
    ]
    for build in builders:
        check_pairwise_order([build(r) for r in range(world)])


def test_shapes_from_subnets() -> None:
    assert shape_from_networks([["127.0.0.1/8"]] * 4).kind == "mesh"
    assert shape_from_networks([["127.0.0.1/8"]] * 3).kind == "ring"  # a 3-cycle is both; ring is the name
    # A–B–C daisy chain, one /30 per cable, ranks given out of cable order
    chain3 = shape_from_networks([["10.0.0.1/30"], ["10.0.0.6/30"], ["10.0.0.2/30", "10.0.0.5/30"]])
    assert chain3.kind == "chain" and chain3.order in ([0, 2, 1], [1, 2, 0])
    # 4-Mac ring 0-2-1-3-0
    ring4 = shape_from_networks([["10.0.0.1/30", "10.0.0.13/30"], ["10.0.0.6/30", "10.0.0.9/30"],
                                 ["10.0.0.2/30", "10.0.0.5/30"], ["10.0.0.10/30", "10.0.0.14/30"]])
    assert ring4.kind == "ring"
    o = ring4.order
    assert all(o[(i + 1) % 4] in ring4.neighbours[o[i]] for i in range(4))


def test_chain_plans_use_only_cables() -> None:
    shape = shape_from_networks([["10.0.0.1/30"], ["10.0.0.6/30"], ["10.0.0.2/30", "10.0.0.5/30"]])
    cfg = Config(chunk_bytes=1024)
    for r in range(3):
        for plan in (select.allreduce_plan(cfg, r, 3, 100_000, 4, shape),
                     select.broadcast_plan(cfg, r, 3, 1, 100_000, 4, shape),
                     select.reduce_plan(cfg, r, 3, 0, 100_000, 4, shape)):
            assert talks_only_to(plan, shape.neighbours[r]), (r, plan.algo)


def test_ring_plans_use_only_cables_on_a_cabled_ring() -> None:
    shape = shape_from_networks([["10.0.0.1/30", "10.0.0.13/30"], ["10.0.0.6/30", "10.0.0.9/30"],
                                 ["10.0.0.2/30", "10.0.0.5/30"], ["10.0.0.10/30", "10.0.0.14/30"]])
    cfg = Config(chunk_bytes=1024)
    for r in range(4):
        for plan in (select.allreduce_plan(cfg, r, 4, 100_000, 4, shape),
                     select.all_gather_plan(cfg, r, 4, [25_000] * 4, 4, shape),
                     select.broadcast_plan(cfg, r, 4, 2, 100_000, 4, shape)):
            assert talks_only_to(plan, shape.neighbours[r]), (r, plan.algo)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["chain", "biring"])
def test_topology_algorithms_give_exact_results(world: int, kind: str) -> None:
    order = [(3 * i + 1) % world for i in range(world)] if world != 3 else [2, 0, 1]
    shape = Shape("chain" if kind == "chain" else "ring", order, {})
    cfg = Config(algo=kind, chunk_bytes=1024)
    cases = [(n, dt, root) for n in (0, 1, world - 1, 7, 3001) for dt in (torch.float32, torch.int64)
             for root in range(world)]

    def body(comm):
        comm.shape = shape
        out = []
        for seed, (n, dt, root) in enumerate(cases):
            x = make_input(comm.rank, n, dt, seed)
            comm.all_reduce(x)
            b = make_input(comm.rank, n, dt, seed + 50)
            comm.broadcast(b, root)
            d = make_input(comm.rank, n, dt, seed + 90)
            comm.reduce(d, root)
            out.append((x, b, d))
        return out

    got = memory_world(world, body, cfg)
    for seed, (n, dt, root) in enumerate(cases):
        want = ref.reduce_all([make_input(r, n, dt, seed) for r in range(world)], "sum")
        want_r = ref.reduce_all([make_input(r, n, dt, seed + 90) for r in range(world)], "sum")
        for r in range(world):
            assert torch.equal(got[r][seed][0], want), (kind, world, n, r)
            assert torch.equal(got[r][seed][1], make_input(root, n, dt, seed + 50))
        assert torch.equal(got[root][seed][2], want_r)


def test_line_algorithms_pipeline_a_1mb_message_in_several_pieces() -> None:
    from torch_thunderbolt.algorithms.select import MIN_PIPELINE_PIECES

    shape = shape_from_networks([["10.0.0.1/30"], ["10.0.0.6/30"], ["10.0.0.2/30", "10.0.0.5/30"]])
    plan = select.allreduce_plan(Config(), 0, 3, 1 << 18, 4, shape)  # 1 MB of float32 on a chain
    assert plan.algo == "chain"
    sends = [s for s in plan.steps if s.kind == SEND]
    assert len(sends) >= MIN_PIPELINE_PIECES
    big = select.allreduce_plan(Config(), 0, 3, 1 << 24, 4, shape)  # 64 MB: the configured 1 MB chunks
    assert max(s.n for s in big.steps if s.kind == SEND) == Config().chunk_bytes // 4
