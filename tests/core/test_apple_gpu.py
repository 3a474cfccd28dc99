"""The timed Apple-silicon GPU (torch_thunderbolt.testing.apple_gpu): kernels take their modelled time on
one in-order device timeline while the host returns at once; copies to the host, host reads, blocking
copies to the device, events and synchronize wait for the timeline; exact mode computes as the CPU;
timing-only mode builds GBs of model without touching them; collectives over this backend move the real
bytes with no device op on a backend thread.

Emulated: the GPU (a roofline per op on a timeline, with Apple's published peaks). Timings are checked
one-sided where the machine may be slow ("not earlier than"), and with room where it must be fast."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import timed_device

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def run(scenario, tmp_path, env=None):
    (res,) = run_ranks(timed_device, 1, tmp_path, args=[scenario], env=env, timeout=150)
    return res.json()


def test_a_matmul_takes_its_modelled_time_and_issuing_it_does_not(tmp_path):
    out = run("matmul_timing", tmp_path)
    n = out["n"]
    flops, moved = 2 * n**3, 3 * n * n * 4
    modelled = max(flops / out["peak_flops"], moved / out["bandwidth"]) + out["launch_s"]
    assert out["stats"]["flops"] == flops and out["stats"]["bytes"] == moved and out["stats"]["kernels"] == 1
    assert out["stats"]["busy_s"] == pytest.approx(modelled, rel=1e-9)
    assert modelled > 0.03  # the scenario's premise: long enough to tell waiting from not
    assert out["shape"] == [n, n] and out["on_device"]
    assert out["issue_s"] < modelled / 4, out  # the host does not spend the modelled time
    assert out["pending_s"] > modelled / 2, out
    assert out["done_s"] >= modelled * 0.999, out  # synchronize returns no earlier than the timeline drains


def test_host_reads_and_blocking_copies_wait_for_the_timeline_and_nothing_else_does(tmp_path):
    out = run("async_semantics", tmp_path)
    modelled = out["modelled_s"]
    assert modelled > 0.03
    assert out["copy_before_s"] < modelled / 2, out  # a copy issued before the matmul does not wait for it
    assert out["issue_s"] < modelled / 4, out
    assert out["event_query_at_issue"] is False and out["event_query_after_copy"] is True, out
    assert out["copy_after_s"] >= modelled * 0.999, out  # in-order queue: a later copy waits for the matmul
    assert out["copy_values_exact"] is True
    assert out["h2d_blocking_s"] >= modelled * 0.999, out
    assert out["h2d_non_blocking_s"] < modelled / 4, out
    assert out["d2h_non_blocking_s"] < modelled / 4, out
    assert out["event_synchronize_s"] >= modelled * 0.999, out
    assert out["item_s"] >= modelled * 0.999, out


def test_exact_mode_computes_as_the_cpu_and_timing_only_mode_computes_nothing(tmp_path):
    out = run("exact_matches_cpu", tmp_path)
    assert out["identical"] is True
    assert out["kernels"] > 10
    assert out["flops"] == out["expected_flops"]  # matmuls and the convolution, forward and backward
    assert out["timing_shape"] == [8, 4] and out["timing_zeros"] is True and out["timing_kernels"] > 0
    assert out["computed"] == []


def test_timing_only_mode_builds_gigabytes_of_weights_without_touching_them(tmp_path):
    out = run("large_model", tmp_path, env={"LAYERS": "24"})
    weights = out["weights"]
    assert weights > 1.5e9
    assert out["rss_build"] < 64 << 20 and out["rss_after"] < 128 << 20, out
    # batch 1: memory-bound, each weight read once
    stats = out["stats"]
    assert stats["kernels"] == 24 and stats["bytes"] >= weights
    assert stats["busy_s"] == pytest.approx(stats["bytes"] / out["bandwidth"] + 24 * out["launch_s"], rel=1e-6)


@pytest.mark.parametrize("exact", ["0", "1"], ids=["timing-only", "exact"])
def test_collectives_on_the_timed_device_move_real_bytes_from_the_issuing_threads(exact, tmp_path):
    for res in run_ranks(timed_device, 2, tmp_path, args=["collectives"], env={"EXACT": exact}, timeout=150):
        out = res.json()
        bad = {k: v for k, v in out.items() if k.startswith("all_reduce") and v is not True}
        assert not bad, f"rank {res.rank}: {bad}"
        assert out["ddp_steps"] is True and out["kernels"] > 0
        assert out["on_backend_threads"] == [], f"rank {res.rank}: device ops on backend threads: {out}"


def test_a_collective_on_tensors_the_device_has_not_reached_neither_blocks_nor_idles_it(tmp_path):
    # The host op waits for the device (done no earlier than the lead), the issuing thread does not (it
    # returns well before, and the kernels it issues next keep the timeline busy), and the values are exact.
    for res in run_ranks(timed_device, 2, tmp_path, args=["staging_overlaps"], timeout=150):
        out = res.json()
        lead = out["lead_s"]
        for name in ("all_reduce_1MB", "all_reduce_small", "all_gather_1MB", "all_reduce_transposed"):
            op = out[name]
            assert op["exact"] is True, f"rank {res.rank} {name}: {op}"
            assert op["issue_s"] < lead / 3, f"rank {res.rank} {name}: issuing waited for the device: {op}"
            assert op["complete_at_issue"] is False and op["done_s"] >= lead, f"rank {res.rank} {name}: {op}"
            assert op["idle_s"] < 0.02, f"rank {res.rank} {name}: the device idled between kernels: {op}"
        assert out["on_backend_threads"] == [], f"rank {res.rank}: device ops on backend threads: {out}"


def test_ddp_hands_every_bucket_over_without_waiting_for_the_device(tmp_path):
    # Each hook returns as soon as it is called (autograd's thread goes on issuing the backward pass) rather
    # than when the device reaches its bucket, near the backward's end; the gradients are still exact.
    for res in run_ranks(timed_device, 2, tmp_path, args=["ddp_hand_over"], timeout=150):
        out = res.json()
        assert out["exact"] is True, f"rank {res.rank}: {out}"
        assert out["hooks"] >= 3 and out["backward_s"] > 0.5, f"rank {res.rank}: {out}"
        assert out["last_return_s"] < 0.3 * out["backward_s"], f"rank {res.rank}: hooks waited: {out}"
        assert out["on_backend_threads"] == [], f"rank {res.rank}: device ops on backend threads: {out}"


def test_a_device_that_does_not_reach_an_ops_inputs_in_time_times_the_op_out(tmp_path):
    for res in run_ranks(timed_device, 2, tmp_path, args=["staging_timeout"], timeout=150):
        out = res.json()
        assert out["issue_s"] < 0.5, f"rank {res.rank}: {out}"
        assert "CollectiveTimeout" in out["error"] and "waiting for the device" in out["error"], out
        assert f"rank {res.rank}" in out["error"], out
        assert 1.0 <= out["raised_s"] < 3.0, f"rank {res.rank}: {out}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_calibration_table_holds_within_25_percent(tmp_path):
    pytest.importorskip("torch_thunderbolt.testing.models.llama")
    (res,) = run_ranks(timed_device, 1, tmp_path, args=["calibration"], timeout=1700)
    rows = res.json()
    assert len(rows) >= 4
    bad = [r for r in rows if abs(r["error"]) > 0.25]
    assert not bad, bad
