"""The small all_reduce without a plan walk (algorithms/small.py) against the direct plan it replaces."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.algorithms import direct
from torch_thunderbolt.algorithms.plan import run_plan
from torch_thunderbolt.algorithms.reduce_ops import make_reducer
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.worlds import memory_world

OPS = ("sum", "product", "min", "max")


def _input(rank: int, n: int, seed: int) -> torch.Tensor:
    # Normal floats: the sum's bits depend on the order of the additions, so "same bits as the plan"
    # checks the rank order too.
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _by_plan(comm, x: torch.Tensor, op: str) -> None:
    """What the Communicator ran before the small path: the direct plan, walked."""
    n = x.numel()
    plan = direct.direct_allreduce(comm.rank, comm.world, n)
    comm.seq += 1
    tmp = torch.empty(plan.tmp, dtype=x.dtype)
    run_plan(plan, comm.t, {"in": x, "out": x, "tmp": tmp}, make_reducer(op, x.dtype), tag=comm.seq,
             deadline=None)
    comm.t.retire(comm.seq)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_same_bits_as_the_direct_plan_on_every_rank(world: int) -> None:
    sizes = (1, 7, 1000)

    def body(comm):
        out = []
        for seed, n in enumerate(sizes):
            for op in OPS:
                fast, slow = _input(comm.rank, n, seed), _input(comm.rank, n, seed)
                comm.all_reduce(fast, op)
                _by_plan(comm, slow, op)
                out.append((fast, slow))
        assert comm._small, "the small path was not taken"
        return out

    got = memory_world(world, body, Config())
    for i in range(len(sizes) * len(OPS)):
        for r in range(world):
            fast, slow = got[r][i]
            assert torch.equal(fast, slow), (world, i, r)
            assert torch.equal(fast, got[0][i][0]), "every rank must end with the same bits"


def test_a_rank_on_the_small_path_meets_a_rank_walking_the_plan() -> None:
    """The same frames either way: a rank of another build that still walks the plan can take part."""
    def body(comm):
        xs = [_input(comm.rank, 100, seed) for seed in range(3)]
        for x in xs:
            if comm.rank == 1:
                _by_plan(comm, x, "sum")
            else:
                comm.all_reduce(x, "sum")
        return xs

    got = memory_world(3, body, Config())
    for seed in range(3):
        want = _input(0, 100, seed) + _input(1, 100, seed) + _input(2, 100, seed)
        for r in range(3):
            assert torch.equal(got[r][seed], got[0][seed])
            assert torch.allclose(got[r][seed], want, atol=1e-5)


def test_the_buffers_are_kept_per_size_and_reused() -> None:
    def body(comm):
        for n in (5, 9, 5, 9, 5):
            comm.all_reduce(torch.ones(n))
        return sorted(comm._small)

    assert memory_world(2, body, Config())[0] == [(5, torch.float32), (9, torch.float32)]


def test_a_peer_sending_another_size_is_a_mismatch_not_a_wrong_result() -> None:
    def body(comm):
        try:
            comm.all_reduce(torch.ones(10 if comm.rank == 0 else 11))
        except Exception as exc:  # noqa: BLE001 - each rank's error is the result
            return str(exc)
        return "finished"

    errors = memory_world(2, body, Config(), comm_timeout=5)
    assert "finished" not in errors
    assert all("mismatched operation" in e for e in errors), errors  # both see it, neither waits it out
