"""Hierarchical collectives whose per-host phases run on each host's shared window (in-memory hosts):
exact results on every layout, the cable phase interoperating with hosts that run the full plan, nothing
but the leaders' cable phase leaving a host, and a rank running another op found on every rank."""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from torch_thunderbolt.algorithms import hierarchy
from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.algorithms.plan import RECV, SEND
from torch_thunderbolt.algorithms.select import MIN_PIPELINE_PIECES
from torch_thunderbolt.algorithms.shape import Shape
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import MismatchError, PeerLostError
from torch_thunderbolt.transport.memory import MemoryHub

from .test_algorithms import make_input
from .test_plans import check_pairwise_order

# Hosts in cable order, each host's first rank its leader. Consecutive ranks per host, so all_gather and
# reduce_scatter run hierarchically too.
LAYOUTS = {
    "2x2": [[0, 1], [2, 3]],
    "3x2": [[0, 1], [2, 3], [4, 5]],
    "2x3": [[0, 1, 2], [3, 4, 5]],
    "2+1+2, leader not the lowest": [[1, 0], [2], [4, 3]],
    "2x3, leader the highest": [[2, 0, 1], [5, 4, 3]],
}
# Small pieces and no one-shot path: every op above 64 bytes takes the hierarchical plan.
CFG = Config(chunk_bytes=1024, small_bytes=64)


def run_hosts(groups: list[list[int]], body: Callable[[Communicator], Any], window_hosts: list[list[int]] | None = None,
              window_bytes: int = 512, timeout: float = 60.0, errors: list | None = None) -> list[Any]:
    """`body(comm)` on every rank of an in-memory world shaped into `groups`; the hosts in `window_hosts`
    (default: every host with two or more ranks) share window memory, the others run the full plans.
    Re-raises the first rank's error, or with `errors` (a list) fills it with every rank's error instead."""
    world = sum(map(len, groups))
    shared = [g for g in groups if len(g) > 1] if window_hosts is None else window_hosts
    hub = MemoryHub(world, window_bytes, hosts=shared)
    shape = Shape("mesh", [r for g in groups for r in g], {}, groups)
    results: list[Any] = [None] * world
    raised: list[BaseException | None] = [None] * world

    def rank(r: int) -> None:
        try:
            results[r] = body(Communicator(hub.transports[r], CFG, timeout=20, shape=shape))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            raised[r] = exc
            hub.kill(r)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    if errors is not None:
        errors.extend(raised)
        return results
    first = next((e for e in raised if e is not None), None)
    if first is not None:
        raise first
    return results


def every_op(comm: Communicator) -> dict:
    """Each hierarchical collective on a few sizes and dtypes; what the window and the links saw."""
    w, r = comm.world, comm.rank
    out: dict = {"ar": [], "bc": [], "ag": [], "rs": []}
    roots = 0  # bytes this rank sent as a broadcast root (a root feeds the cables itself), or in a broadcast
    # too large for the hierarchical form (pipelined through every rank by design: select.broadcast_plan)
    for seed, (n, dt) in enumerate([(w, torch.int64), (301, torch.int64), (1000, torch.float32),
                                    (4099, torch.float64)]):
        x = make_input(r, n, dt, seed)
        comm.all_reduce(x, "sum")
        out["ar"].append(x)
        y = make_input(r, n, dt, seed + 1)
        before = comm.t.bytes_sent
        comm.broadcast(y, (seed * 5) % w)
        ring = n * y.element_size() > CFG.chunk_bytes * MIN_PIPELINE_PIECES
        roots += comm.t.bytes_sent - before if r == (seed * 5) % w or ring else 0
        out["bc"].append(y)
        counts = [n // w + (q % 2) * (seed + 1) for q in range(w)]
        ag = torch.empty(sum(counts), dtype=dt)
        ag[sum(counts[:r]) : sum(counts[: r + 1])] = make_input(r, counts[r], dt, seed + 2)
        comm.all_gather(ag, ag[sum(counts[:r]) : sum(counts[: r + 1])].clone(), counts)
        out["ag"].append(ag)
        rs = torch.empty(counts[r], dtype=dt)
        comm.reduce_scatter(rs, make_input(r, sum(counts), dt, seed + 3), counts, "max" if seed % 2 else "sum")
        out["rs"].append(rs)
        if seed == 0:  # the one case up to THUNDERBOLT_SMALL: one-shot exchanges among all ranks
            roots, small = 0, comm.t.bytes_sent
    out["rounds"] = comm.window.rounds if comm.window is not None else 0
    out["sent"] = comm.t.bytes_sent - small - roots
    return out


def expected(w: int) -> dict:
    want: dict = {"ar": [], "bc": [], "ag": [], "rs": []}
    for seed, (n, dt) in enumerate([(w, torch.int64), (301, torch.int64), (1000, torch.float32),
                                    (4099, torch.float64)]):
        want["ar"].append(ref.reduce_all([make_input(q, n, dt, seed) for q in range(w)], "sum"))
        want["bc"].append(make_input((seed * 5) % w, n, dt, seed + 1))
        counts = [n // w + (q % 2) * (seed + 1) for q in range(w)]
        want["ag"].append(torch.cat([make_input(q, counts[q], dt, seed + 2) for q in range(w)]))
        fulls = [make_input(q, sum(counts), dt, seed + 3) for q in range(w)]
        want["rs"].append(ref.reduce_scatter(fulls, "max" if seed % 2 else "sum", counts))
    return want


def assert_exact(got: list[dict], w: int) -> None:
    want = expected(w)
    for r in range(w):
        for i, (a, b) in enumerate(zip(got[r]["ar"], want["ar"])):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4) and torch.equal(a, got[0]["ar"][i]), ("ar", r, i)
        for i, (a, b) in enumerate(zip(got[r]["bc"], want["bc"])):
            assert torch.equal(a, b), ("bc", r, i)
        for i, (a, b) in enumerate(zip(got[r]["ag"], want["ag"])):
            assert torch.equal(a, b), ("ag", r, i)
        for i, (a, b) in enumerate(zip(got[r]["rs"], want["rs"])):
            assert torch.allclose(a, b[r], rtol=1e-5, atol=1e-4), ("rs", r, i)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_collective_is_exact_with_the_host_phases_on_the_window(layout: str) -> None:
    groups = LAYOUTS[layout]
    got = run_hosts(groups, every_op)
    w = sum(map(len, groups))
    assert_exact(got, w)
    leaders = {g[0] for g in groups}
    for g in groups:
        for r in g:
            if len(g) > 1:  # the host phases ran on the window ...
                assert got[r]["rounds"] > 0, (r, got[r]["rounds"])
            if r not in leaders:  # ... and past the small first case only leaders and broadcast roots sent
                assert got[r]["sent"] == 0, (layout, r, got[r]["sent"])


@pytest.mark.parametrize("layout", ["2x2", "3x2"])
def test_a_host_without_a_window_runs_the_full_plan_alongside(layout: str) -> None:
    """Only the first host shares window memory; the others run the hierarchical plans in full (their
    host phases over the links): the cable phases must still pair up, and every result be exact."""
    groups = LAYOUTS[layout]
    got = run_hosts(groups, every_op, window_hosts=[groups[0]])
    assert_exact(got, sum(map(len, groups)))
    assert got[groups[0][1]]["rounds"] > 0 and got[groups[0][1]]["sent"] == 0
    assert got[groups[1][1]]["rounds"] == 0 and got[groups[1][1]]["sent"] > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cable_phases_are_the_middle_of_the_full_plans(layout: str) -> None:
    """The same steps with the same message ids: what lets hosts differ in how they run their own phases."""
    groups = LAYOUTS[layout]
    world = sum(map(len, groups))
    counts = [300 + r for r in range(world)]
    for r in range(world):
        pairs = [(hierarchy.hierarchical_allreduce(r, groups, 5000, 100),
                  hierarchy.cable_allreduce(r, groups, 5000, 100)),
                 (hierarchy.hierarchical_broadcast(r, groups, 2, 5000, 100),
                  hierarchy.cable_broadcast(r, groups, 2, 5000, 100, False))]
        if hierarchy.contiguous_hosts(groups):
            pairs += [(hierarchy.hierarchical_all_gather(r, groups, counts, 100),
                       hierarchy.cable_all_gather(r, groups, counts, 100)),
                      (hierarchy.hierarchical_reduce_scatter(r, groups, counts, 100),
                       hierarchy.cable_reduce_scatter(r, groups, counts, 100))]
        host = next(g for g in groups if r in g)
        for full, cable in pairs:
            across = [(s.kind, s.peer, s.buf, s.off, s.n, s.msg) for s in full.steps
                      if s.kind in (SEND, RECV) and s.peer not in host]
            mine = [(s.kind, s.peer, s.buf, s.off, s.n, s.msg) for s in cable.steps if s.kind in (SEND, RECV)]
            assert mine == across, (layout, r, full.algo)
    check_pairwise_order([hierarchy.hierarchical_broadcast(r, groups, 2, 5000, 100) for r in range(world)])


def test_a_rank_running_another_collective_is_a_mismatch() -> None:
    def body(comm):
        x = torch.ones(1000)
        if comm.rank == 3:  # a non-leader: it meets its host only on the window
            comm.broadcast(x, 0)
        else:
            comm.all_reduce(x)

    errors: list = []
    run_hosts(LAYOUTS["2x2"], body, errors=errors)
    # Its host finds it on the window; whoever did not find it first learns of it as the loss of the rank
    # that did (the in-memory kind has no wire to send the reason on, as a real link would).
    assert any(isinstance(errors[r], MismatchError) for r in (2, 3)), errors
    assert all(isinstance(e, MismatchError) or (isinstance(e, PeerLostError) and e.peer in (2, 3))
               for e in errors), errors
