"""Groups split off a thunderbolt group over its links, one process per rank: a 2x2 DeviceMesh on one host and
over 2 pretended hosts (HSDP's layout: "replicate" across hosts, "shard" within one), every op family exact on
each dimension, each dimension's group over the default group's engine (no new connection); the backend's
split_group hook called as torch's split_group calls it; a subgroup destroyed while the parent goes on; and
subgroups of a broken default group, which every member sets up afresh. The ranks run programs/split.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from torch_thunderbolt.testing.ranks import SHM, RankResult, run_ranks

from .programs import split
from .test_shrink import links

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

TCP = SHM.with_env({"THUNDERBOLT_TRANSPORT": "tcp"})  # (SHM's segment check: none may be left either way)


def run(scenario: str, world: int, tmp_path: Path, setup=TCP) -> list[RankResult]:
    runs = run_ranks(split, world, tmp_path, args=[scenario], setup=setup, timeout=200, expect_ok=False)
    for res in runs:
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
    return runs


@pytest.mark.parametrize("kind", ["tcp", *(pytest.param(k, marks=pytest.mark.slow) for k in ("shm", "hier", "rdma"))])
def test_a_2x2_device_mesh_is_exact_on_every_dimension_over_the_parents_links(kind: str, tmp_path: Path) -> None:
    """On each kind of link (hier: 2 pretended hosts x 2 ranks; rdma: the fake fabric)."""
    with links(kind, 4, tmp_path) as setup:
        runs = run("mesh", 4, tmp_path / "run", TCP if kind == "tcp" else setup)
    for res in runs:
        dims = res.json()["dims"]
        # mesh [[0, 1], [2, 3]]: "replicate" joins ranks r and r ^ 2, "shard" r and r ^ 1
        assert dims["replicate"]["ranks"] == sorted([res.rank, res.rank ^ 2]), dims
        assert dims["shard"]["ranks"] == sorted([res.rank, res.rank ^ 1]), dims
        for dim, got in dims.items():
            assert got["same_engine"], (res.rank, dim, got)
            assert got["bad"] == [], (res.rank, dim, got["bad"])
        if kind == "hier":  # each dimension's group knows where its ranks are
            host = f"test-host-{res.rank // 2}"
            assert dims["shard"]["hosts"] == [host, host], dims
            assert sorted(dims["replicate"]["hosts"]) == ["test-host-0", "test-host-1"], dims


def test_split_group_as_torch_calls_it_and_a_non_member_gets_none(tmp_path: Path) -> None:
    runs = run("split_group", 3, tmp_path)
    assert runs[1].json() == {"member": False}
    for res in (runs[0], runs[2]):
        out = res.json()
        assert out["member"] and out["size"] == 2 and out["rank"] == res.rank // 2, out
        assert out["same_engine"] and out["name"] == "split-0-2" and out["desc"] == "split test", out
        assert out["sum"] == [4.0] and out["bcast"] == [2.0] and out["gathered"] == [0.0, 1.0], out


def test_torchs_split_group_on_a_mac_with_an_accelerator(tmp_path: Path) -> None:
    runs = run("torch_split_group", 3, tmp_path)
    assert runs[1].json() == {"member": False}
    for res in (runs[0], runs[2]):
        out = res.json()
        assert out == {"member": True, "rank": res.rank // 2, "ranks": [0, 2], "same_engine": True, "sum": [4.0],
                       "bcast": [2.0]}, out


def test_a_subgroup_destroyed_while_the_parent_goes_on(tmp_path: Path) -> None:
    runs = run("destroy_sub", 3, tmp_path)
    for res in runs:
        out = res.json()
        assert out["bad"] == [], (res.rank, out["bad"])
        if res.rank in (0, 1):
            assert out["sub_bad"] == [] and out["sub_same_engine"] and out["sub_gone"], (res.rank, out)
        if res.rank in (1, 2):
            assert out["other_bad"] == [] and out["other_same_engine"], (res.rank, out)


def test_subgroups_of_a_broken_default_group_are_set_up_afresh(tmp_path: Path) -> None:
    runs = run("broken_default", 3, tmp_path)
    for res in runs[:2]:
        out = res.json()
        assert out["loss"]["type"] == "PeerLostError" and out["loss"]["peer"] == 2, (res.rank, out)
        assert out["fresh"] and out["bad"] == [], (res.rank, out)


def test_members_that_disagree_on_splitting_all_set_up_afresh(tmp_path: Path) -> None:
    runs = run("half_broken", 2, tmp_path)
    assert [res.json()["usable"] for res in runs] == [False, True]  # rank 1 could have split
    for res in runs:
        out = res.json()
        assert out["fresh"] and out["bad"] == [], (res.rank, out)
