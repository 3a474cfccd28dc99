"""Whole jobs over a fake verbs fabric, one process per rank, THUNDERBOLT_TRANSPORT=rdma (or auto between
pretended hosts): every collective and point-to-point op exact at world 2, 3 and 4, DDP equal to one
process, and the failure semantics every kind keeps (a killed rank, a stalled one, mismatched calls, a
clean teardown), with the programs the other kinds are tested with; under auto, an RDMA set-up that fails
falls back to TCP (a forced rdma fails at once instead)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.programs import failures, stacks
from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric
from torch_thunderbolt.testing.ranks import HYBRID, run_ranks

from .fabric_ends import make_end
from .programs import rdma_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]


def _devices(n: int) -> dict[str, str]:
    return {f"rdma_fake{i}": f"10.201.0.{i + 1}" for i in range(n)}


def _env(fabric, transport: str = "rdma") -> dict[str, str]:
    return {**fabric_env(fabric), "THUNDERBOLT_TRANSPORT": transport}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_and_p2p_op_is_exact(world: int, tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(world)) as fab:
        results = run_ranks(rdma_job, world, tmp_path / "run", args=["collectives"], env=_env(fab), timeout=500)
    for res in results:
        out = res.json()
        assert out["bad"] == [] and out["kind"] == "rdma", out
        assert out["dropped"] == [0] * world  # flow control: no send ever went without a receive posted
        assert out["peers"] == [p for p in range(world) if p != res.rank]
        assert out["sent"] > 30 << 20 and out["received"] > 30 << 20
        assert out["lanes"] == ([2] if world < 4 else [1])  # world 4: one queue pair per peer (device budget)


def test_auto_takes_rdma_between_hosts_and_shared_memory_within(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        results = run_ranks(rdma_job, 4, tmp_path / "run", args=["collectives"], env=_env(fab, "auto"),
                            setup=HYBRID, timeout=500)
    for res in results:
        out = res.json()
        assert out["bad"] == [] and out["kind"] == "rdma+shm", out
        assert out["peers"] == [p for p in range(4) if p // 2 != res.rank // 2]


def _wedged_after_a_failed_set_up(fab, device: str) -> None:
    """`device`'s port wedges at the next queue pair's RTR, as a Mac's does after a set-up that failed: a
    queue pair of it was destroyed (here by this process). Its probe still finds it usable until then."""
    make_end("fake", str(fab.path), device).close()
    fab.set_fault(device, "wedge_on_reconnect", 1)
    assert all(not fab.live_qps(i) and not fab.live_mrs(i) for i in range(len(fab.devices)))


@pytest.mark.parametrize("fault, says, device", [
    pytest.param("wedged", "wedged after a failed set-up (a known fault of Apple's provider): reboot this Mac",
                 "rdma_fake1", id="wedged"),
    pytest.param("queue pairs", "no free queue pair on this device", "rdma_fake", id="queue-pairs")])
def test_auto_falls_back_to_tcp_for_every_pair_when_rdma_set_up_fails(fault: str, says: str, device: str,
                                                                       tmp_path: Path) -> None:
    """Two pretended hosts, their ranks on rdma_fake0 and rdma_fake1. `wedged`: rdma_fake1's port wedges at
    its first RTR (its ranks fail once both ends published their queue pairs); `queue pairs`: the devices
    have 3 queue pairs, the job needs 4 on each (some rank fails before publishing its own). The probe
    passed, so auto chose RDMA between the hosts; every rank learns that its set-up failed and the job runs
    over TCP between hosts (shared memory within), each rank saying why once."""
    limits = {"max_qp": 3} if fault == "queue pairs" else {}
    with fake_fabric(tmp_path / "fab", devices=_devices(2), **limits) as fab:
        if fault == "wedged":
            _wedged_after_a_failed_set_up(fab, "rdma_fake1")
        results = run_ranks(rdma_job, 4, tmp_path / "run", args=["fallback"], setup=HYBRID, timeout=300,
                            env={**_env(fab, "auto"), "THUNDERBOLT_CONNECT_TIMEOUT": "240"})
    for res in results:
        out = res.json()
        assert out["init"]["ok"] and out["init"]["seconds"] < 120, (res.rank, out)  # no rank waited a timeout
        assert out["bad"] == [] and out["kind"] == "shm+tcp", (res.rank, out)
        assert out["qps"] == [0, 0] and out["mrs"] == [0, 0], out  # nothing of the failed attempt is left
        said = [line for line in res.stderr.splitlines() if "RDMA set-up failed" in line]
        assert len(said) == 1, res.stderr
        others = [p for p in range(4) if p // 2 != res.rank // 2]
        assert said[0].startswith(f"rank {res.rank}: RDMA set-up failed on rank ") and f"({device}" in said[0]
        assert says in said[0] and "torch-thunderbolt doctor" in said[0], said[0]
        assert f"using TCP instead with rank(s) {others}" in said[0], said[0]


def test_a_forced_rdma_fails_at_once_on_every_rank_when_its_set_up_fails(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        _wedged_after_a_failed_set_up(fab, "rdma_fake1")
        results = run_ranks(rdma_job, 4, tmp_path / "run", args=["fallback"], timeout=300, expect_ok=False,
                            env={**_env(fab, "rdma"), "THUNDERBOLT_CONNECT_TIMEOUT": "240"}, setup=HYBRID)
    for res in results:
        got = res.json()["init"]
        assert got["ok"] is False and got["type"] in ("RdmaError", "PeerLostError"), (res.rank, got)
        assert "rdma_fake1" in got["msg"] and "wedged" in got["msg"], (res.rank, got)  # the reason, on every rank
        assert "timed out waiting" not in got["msg"] and got["seconds"] < 120, (res.rank, got)  # not a timeout


def test_ddp_matches_single_process(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        results = run_ranks(stacks, 2, tmp_path / "run", args=["ddp"], env=_env(fab), timeout=300)
    for res in results:
        out = res.json()
        for k in ("plain", "small_buckets", "no_sync", "unused_params"):
            assert out[k] < 1e-5, (k, out)
        assert out["fp16_hook"] < 1e-2, out


def test_a_killed_rank_is_named_by_every_survivor(tmp_path: Path) -> None:
    """No connection state on a UC queue pair: the control connection's EOF says the process died."""
    with fake_fabric(tmp_path / "fab", devices=_devices(3)) as fab:
        results = run_ranks(failures, 3, tmp_path / "run", args=["kill_9"], timeout=120, expect_ok=False,
                            env={**_env(fab), "TEST_SIZE": str(4096)})
    assert results[2].returncode == -9
    for res in results[:2]:
        out = res.json()
        assert out["ok"] is False and out["type"] == "PeerLostError" and out["peer"] == 2, out
        assert out["seconds"] < 30, out


def test_a_stalled_rank_gives_a_collective_timeout_naming_it(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        results = run_ranks(failures, 2, tmp_path / "run", args=["stalled"], timeout=120, expect_ok=False,
                            env={**_env(fab), "TB_TIMEOUT": "2"})
    out = results[0].json()
    assert out["type"] == "CollectiveTimeout" and "[1]" in out["msg"] and 1.5 < out["seconds"] < 10, out


@pytest.mark.parametrize("kind", ["size", "op"])
def test_mismatched_calls_raise_on_every_rank(kind: str, tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        results = run_ranks(failures, 2, tmp_path / "run", args=["mismatched"], timeout=120, expect_ok=False,
                            env={**_env(fab), "TB_TIMEOUT": "20", "TEST_KIND": kind})
    for res in results:
        out = res.json()
        assert out["ok"] is False and out["type"] == "MismatchError", (res.rank, out)
        assert out["seconds"] < 10 and out["after"]["ok"] is False, out


def test_destroy_releases_connections(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=_devices(2)) as fab:
        results = run_ranks(failures, 2, tmp_path / "run", args=["destroy"], timeout=120, env=_env(fab))
        assert not list((fab.path / "rdma_fake0").glob("qp*")) and not list((fab.path / "rdma_fake1").glob("qp*"))
    for res in results:
        out = res.json()
        assert out["conns_during"] >= 1 and out["conns_after"] == 0, out
        assert out["threads_after"] <= out["threads_before"], out
