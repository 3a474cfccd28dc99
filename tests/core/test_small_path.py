"""The small all_reduce without a plan walk (algorithms/small.py) against the direct plan it replaces."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from torch_thunderbolt.algorithms import direct
from torch_thunderbolt.algorithms.plan import run_plan
from torch_thunderbolt.algorithms.reduce_ops import array_combiner, make_reducer
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.worlds import memory_world

OPS = ("sum", "product", "min", "max")


def _input(rank: int, n: int, seed: int) -> torch.Tensor:
    # Normal floats: the sum's bits depend on the order of the additions, so "same bits as the plan"
    # checks the rank order too.
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _by_plan(comm, x: torch.Tensor, op: str) -> None:
    """The same all_reduce the general way, the direct plan walked: the small path must match it."""
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
        assert comm._small_ops, "the small path was not taken"
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
        return sorted(comm._small_ops, key=str)

    assert memory_world(2, body, Config())[0] == [(5, torch.float32, "sum"), (9, torch.float32, "sum")]


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


def _plans(rank: int, world: int, n: int):
    segs = [(r * n, n) for r in range(world)]
    return {
        "all_reduce": direct.direct_allreduce(rank, world, n),
        "reduce_scatter": direct.direct_reduce_scatter(rank, world, segs),
        "all_gather": direct.direct_all_gather(rank, world, segs),
        "broadcast": direct.flat_broadcast(rank, world, 1, n),
        "reduce": direct.direct_reduce(rank, world, world - 1, n),
        "all_to_all": direct.all_to_all(rank, world, segs, segs),
        "gather": direct.gather(rank, world, 0, segs),
        "scatter": direct.scatter(rank, world, world - 1, segs),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_one_phase_plans_run_without_the_walk_give_what_the_walk_gives(world: int) -> None:
    from torch_thunderbolt.algorithms.plan import _Run

    n = 50

    def body(comm):
        out = {}
        for name, plan in _plans(comm.rank, comm.world, n).items():
            assert plan.graph().one_phase, name
            got = []
            for walk in (False, True):
                g = torch.Generator().manual_seed(comm.rank)
                bufs = {"in": torch.randn(world * n, generator=g), "out": torch.randn(world * n, generator=g),
                        "tmp": torch.zeros(max(plan.tmp, 1))}
                comm.seq += 1
                if walk:
                    _Run(plan, comm.t, bufs, make_reducer("sum", torch.float32), comm.seq, 0).run(None, name)
                else:
                    run_plan(plan, comm.t, bufs, make_reducer("sum", torch.float32), tag=comm.seq)
                comm.t.retire(comm.seq)
                got.append(bufs["out"])
            out[name] = got
        return out

    for r, res in enumerate(memory_world(world, body, Config())):
        for name, (fast, walked) in res.items():
            assert torch.equal(fast, walked), (name, r)


def test_plans_with_dependent_messages_or_large_local_steps_keep_the_walk() -> None:
    from torch_thunderbolt.algorithms import ring
    from torch_thunderbolt.algorithms.segments import split_even

    assert not ring.ring_allreduce(0, [0, 1, 2], split_even(3000, 3), 100).graph().one_phase
    assert direct.direct_allreduce(0, 2, 1 << 20).graph().local_elems * 4 > (256 << 10)


_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_the_numpy_sums_give_torchs_bits(dtype: torch.dtype) -> None:
    """The kept small all_reduces add with numpy where `array_combiner` says its add is torch's: bit for bit,
    on the values where an add could differ (signed zeros, infinities, NaN, subnormals, overflow)."""
    g = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        edge = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny / 4, -info.tiny / 3, info.max,
                -info.max, info.eps, 1.0]
        a = torch.cat([torch.tensor(edge, dtype=dtype).repeat_interleave(len(edge)),
                       torch.randn(1000, generator=g, dtype=dtype) * 1e3])
        b = torch.cat([torch.tensor(edge, dtype=dtype).repeat(len(edge)), torch.randn(1000, generator=g, dtype=dtype)])
    else:
        info = torch.iinfo(dtype)
        edge = [0, 1, -1, info.max, info.min]
        a = torch.cat([torch.tensor(edge, dtype=dtype).repeat_interleave(len(edge)),
                       torch.randint(info.min, info.max, (1000,), generator=g, dtype=dtype)])
        b = torch.cat([torch.tensor(edge, dtype=dtype).repeat(len(edge)),
                       torch.randint(info.min, info.max, (1000,), generator=g, dtype=dtype)])
    fast = array_combiner("sum", dtype)
    assert fast is not None
    np_dtype, combine = fast
    out = np.empty(a.numel(), dtype=np_dtype)
    combine(out, a.numpy(), b.numpy())
    got, want = torch.from_numpy(out), torch.add(a, b)
    bits = _INT_VIEW.get(dtype)
    assert torch.equal(got.view(bits), want.view(bits)) if bits else torch.equal(got, want)


def test_other_ops_and_dtypes_keep_torchs_kernels() -> None:
    assert array_combiner("max", torch.float32) is None and array_combiner("product", torch.int64) is None
    assert array_combiner("sum", torch.bfloat16) is None and array_combiner("sum", torch.float16) is None
    assert array_combiner("sum", torch.bool) is None and array_combiner("sum", torch.complex64) is None
    assert array_combiner("avg", torch.float32) is not None  # a sum, divided afterwards


def test_the_numpy_sums_overflow_to_inf_silently_whatever_numpys_error_state() -> None:
    """An overflow to inf is a result (loss scaling looks for it), as in torch: no warning, and no
    FloatingPointError under a caller's `np.seterr(all="raise")`."""
    _, combine = array_combiner("sum", torch.float32)
    big = np.full(4, 3e38, dtype=np.float32)
    infs, opposite = (np.array([s * np.inf, -s * np.inf, 1.0, 1.0], dtype=np.float32) for s in (1, -1))
    out = np.empty(4, dtype=np.float32)
    old = np.seterr(all="raise")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            combine(out, big, big)
            assert np.isinf(out).all()
            combine(out, infs, opposite)  # inf + -inf: invalid, NaN
            assert np.isnan(out[:2]).all() and (out[2:] == 2).all()
            with pytest.raises(FloatingPointError):  # (the caller's own numpy still raises)
                np.add(big, big)
    finally:
        np.seterr(**old)
