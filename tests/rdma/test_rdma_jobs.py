"""Whole jobs over a fake verbs fabric, one process per rank, THUNDERBOLT_TRANSPORT=rdma (or auto between
pretended hosts): every collective and point-to-point op exact at world 2, 3 and 4, DDP equal to one
process, and the failure semantics every kind keeps (a killed rank, a stalled one, mismatched calls, a
clean teardown), with the programs the other kinds are tested with."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.programs import failures, stacks
from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric
from torch_thunderbolt.testing.ranks import HYBRID, run_ranks

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
