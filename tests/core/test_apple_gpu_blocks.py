"""Block-level kernels on the timed Apple-silicon GPU (torch_thunderbolt.testing.apple_gpu_blocks): a fused
block costs the timeline what the block op by op costs, as one entry each way, while the host runs a few
allocations for it instead of every op; every parameter gets its gradient; exact mode computes as the block.
And the workloads' other setting: with host copies off, a large copy to the host is timed and not done.

Emulated: the GPU (testing.apple_gpu). Only modelled times and op counts are compared, never host time."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import fused_blocks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def run(scenario, tmp_path):
    (res,) = run_ranks(fused_blocks, 1, tmp_path, args=[scenario], timeout=150)
    return res.json()


def test_a_fused_block_costs_the_timeline_what_its_ops_cost_and_the_host_little(tmp_path):
    out = run("timing_only", tmp_path)
    plain, fused = out["plain"][1], out["fused"]
    assert plain["forward_kernels"] >= 4 and plain["backward_kernels"] >= 4
    # The first fused step runs the block op by op (and a backward through it once more, to time it).
    (fwd_s, fwd_k, bwd_s, bwd_k), = out["measured"][:1]
    assert fwd_s == pytest.approx(plain["forward_s"], rel=0.02) and fwd_k == plain["forward_kernels"]
    assert bwd_s == pytest.approx(plain["backward_s"], rel=0.02) and bwd_k == plain["backward_kernels"]
    second = fused[1]
    assert second["forward_s"] == pytest.approx(fwd_s, rel=1e-9)
    assert second["backward_s"] == pytest.approx(bwd_s, rel=1e-9)
    assert second["forward_kernels"] == fwd_k
    assert second["forward_host_ops"] < plain["forward_host_ops"] / 3, (second, plain)
    assert second["host_ops"] < plain["host_ops"] / 3, (second, plain)
    assert out["grads"][1] == out["param_shapes"]  # every parameter's .grad, of its shape
    assert out["no_grad"]["shape"] == [64, 128, 256]
    assert out["no_grad"]["busy_s"] == pytest.approx(fwd_s, rel=0.02)


def test_a_fused_block_in_exact_mode_computes_as_the_block(tmp_path):
    assert run("exact", tmp_path)["equal"] is True


def test_with_host_copies_off_a_large_copy_is_timed_and_not_done(tmp_path):
    out = run("host_copies_off", tmp_path)
    assert out["big_untouched"] is True and out["big_kernels"] == 1
    assert out["big_busy_s"] >= 2 * (4 << 20) / out["bandwidth"]  # read and written, at the modelled bandwidth
    assert out["small_copied"] is True and out["on_again_copied"] is True
