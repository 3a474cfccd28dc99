"""Every collective against the reference, over world sizes 1–5, awkward counts, dtypes, ops, algorithms."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.worlds import memory_world

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64]
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
CFGS = {
    "auto": Config(chunk_bytes=1024, small_bytes=256),
    "direct": Config(algo="direct"),
    "ring": Config(algo="ring", chunk_bytes=1024),
    "chain": Config(algo="chain", chunk_bytes=1024),
    "window": Config(chunk_bytes=1024, small_bytes=256),  # with a 256-byte shared window: many rounds
}
WINDOW_BYTES = {"window": 256}


def counts_for(world: int) -> list[int]:
    return sorted({0, 1, max(world - 1, 0), 7, 1000})


def make_input(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    x = torch.randint(1, 3, (n,), generator=g)  # 1..2: sums, products of 5 ranks fit in int8
    if dtype.is_complex:
        return torch.complex(x.float(), torch.randint(0, 3, (n,), generator=g).float()).to(dtype)
    return x.to(dtype)


def valid(op: str, dtype: torch.dtype) -> bool:
    if op == "avg":
        return dtype.is_floating_point or dtype.is_complex
    if op in ("min", "max"):
        return not dtype.is_complex
    if op in ("band", "bor", "bxor"):
        return dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    return True


def cases(world: int):
    i = 0
    for n in counts_for(world):
        for dtype in DTYPES:
            for op in OPS:
                if valid(op, dtype):
                    i += 1
                    yield i, n, dtype, op


@pytest.mark.parametrize("algo", ["auto", "direct", "ring", "window"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_all_reduce_grid(world: int, algo: str) -> None:
    todo = list(cases(world))

    def body(comm):
        out = []
        for seed, n, dtype, op in todo:
            x = make_input(comm.rank, n, dtype, seed)
            comm.all_reduce(x, op)
            out.append(x)
        return out

    got = memory_world(world, body, CFGS[algo], window_bytes=WINDOW_BYTES.get(algo, 0))
    for k, (seed, n, dtype, op) in enumerate(todo):
        want = ref.all_reduce([make_input(r, n, dtype, seed) for r in range(world)], op)
        for r in range(world):
            assert torch.equal(got[r][k], want[r]), (world, algo, n, dtype, op, r)


@pytest.mark.parametrize("algo", ["auto", "direct", "chain", "window"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_broadcast_and_reduce(world: int, algo: str) -> None:
    todo = [(s, n, dt, root) for s, (n, dt) in enumerate(
        (n, dt) for n in counts_for(world) for dt in (torch.float32, torch.int8, torch.bfloat16, torch.bool))
        for root in range(world)]

    def body(comm):
        out = []
        for seed, n, dtype, root in todo:
            x = make_input(comm.rank, n, dtype, seed)
            comm.broadcast(x, root)
            y = make_input(comm.rank, n, dtype, seed + 7)
            comm.reduce(y, root, "sum" if dtype != torch.bool else "bor")
            out.append((x, y))
        return out

    got = memory_world(world, body, CFGS[algo], window_bytes=WINDOW_BYTES.get(algo, 0))
    for k, (seed, n, dtype, root) in enumerate(todo):
        want_b = make_input(root, n, dtype, seed)
        op = "sum" if dtype != torch.bool else "bor"
        want_r = ref.reduce_all([make_input(r, n, dtype, seed + 7) for r in range(world)], op)
        for r in range(world):
            assert torch.equal(got[r][k][0], want_b)
        assert torch.equal(got[root][k][1], want_r)


@pytest.mark.parametrize("algo", ["auto", "direct", "ring", "window"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_gather_family(world: int, algo: str) -> None:
    todo = [(s, n, dt) for s, (n, dt) in enumerate(
        (n, dt) for n in counts_for(world) for dt in (torch.float32, torch.int64, torch.float16))]

    def uneven(n: int) -> list[int]:
        return [n + (r % 2) for r in range(world)]

    def body(comm):
        out = []
        w, r = comm.world, comm.rank
        for seed, n, dtype in todo:
            x = make_input(r, n, dtype, seed)
            ag = torch.empty(w * n, dtype=dtype)
            comm.all_gather(ag, x)
            counts = uneven(n)
            xv = make_input(r, counts[r], dtype, seed)
            agv = torch.empty(sum(counts), dtype=dtype)
            comm.all_gather(agv, xv, counts)
            full = make_input(r, sum(counts), dtype, seed + 1)
            rs = torch.empty(counts[r], dtype=dtype)
            comm.reduce_scatter(rs, full, counts, "sum")
            root = seed % w
            g = torch.empty(w * n, dtype=dtype) if r == root else None
            comm.gather(g, x, root, [n] * w)
            src = make_input(r, w * n, dtype, seed + 2) if r == root else None
            sc = torch.empty(n, dtype=dtype)
            comm.scatter(sc, src, root, [n] * w)
            send_counts = [(r + p + n) % 3 for p in range(w)]
            recv_counts = [(p + r + n) % 3 for p in range(w)]
            a2a_in = make_input(r, sum(send_counts), dtype, seed + 3)
            a2a_out = torch.empty(sum(recv_counts), dtype=dtype)
            comm.all_to_all(a2a_out, a2a_in, send_counts, recv_counts)
            comm.barrier()
            out.append((ag, agv, rs, g, sc, a2a_out))
        return out

    got = memory_world(world, body, CFGS[algo], window_bytes=WINDOW_BYTES.get(algo, 0))
    for k, (seed, n, dtype) in enumerate(todo):
        xs = [make_input(r, n, dtype, seed) for r in range(world)]
        counts = uneven(n)
        xvs = [make_input(r, counts[r], dtype, seed) for r in range(world)]
        rs_want = ref.reduce_scatter([make_input(r, sum(counts), dtype, seed + 1) for r in range(world)],
                                     "sum", counts)
        root = seed % world
        sc_want = torch.split(make_input(root, world * n, dtype, seed + 2), [n] * world)
        splits = [[(r + p + n) % 3 for p in range(world)] for r in range(world)]
        a2a_want = ref.all_to_all([make_input(r, sum(splits[r]), dtype, seed + 3) for r in range(world)], splits)
        for r in range(world):
            ag, agv, rs, g, sc, a2a = got[r][k]
            assert torch.equal(ag, torch.cat(xs))
            assert torch.equal(agv, torch.cat(xvs))
            assert torch.equal(rs, rs_want[r])
            assert torch.equal(sc, sc_want[r])
            assert torch.equal(a2a, a2a_want[r]), (world, n, r)
            if r == root:
                assert torch.equal(g, torch.cat(xs))


def test_results_identical_on_every_rank_for_floats() -> None:
    """Non-integer floats: every rank must hold bit-identical sums (no per-rank reduction order)."""
    for algo in ("direct", "ring"):
        def body(comm):
            x = torch.randn(5000, generator=torch.Generator().manual_seed(comm.rank))
            comm.all_reduce(x)
            return x
        got = memory_world(3, body, CFGS[algo])
        assert all(torch.equal(got[0], g) for g in got[1:])
