"""`dist.shrink_group` on thunderbolt groups, one process per rank, over tcp, shm, hierarchical (2 pretended
hosts x 2 ranks) and rdma (the fake verbs fabric): after a loss (a rank exits hard right after an op, or is
SIGKILLed with its ops in flight) and on a healthy group (the excluded ranks alive), at 3->2, 4->3 and 4->2.

Each rank that stays checks every op family on the shrunk group against the reference it computes alone
(op_checks.py); the ops in flight at the loss fail with PeerLostError naming a lost rank, and none completes
with a wrong result; the shrunk group runs over the links it had (the same engine: no new connection). An
excluded rank that is alive gets an error naming the shrink from every op it calls on the old group (a slow
one the others timed out waiting for: their timeout, from the op they gave up on too). Also: shrinking
twice, a new_group of the shrunk group, and survivors that disagree on whom to exclude. The ranks run
programs/shrink.py. The default selection runs two cases; the grid is marked slow."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric
from torch_thunderbolt.testing.ranks import HYBRID, LOOPBACK, SHM, RankResult, Setup, run_ranks

from .programs import shrink

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# the kinds of link, and the `kind` the engine reports over them
SETUPS: dict[str, tuple[Setup, str]] = {
    "tcp": (LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "tcp"}), "tcp"),
    "shm": (SHM.with_env({"THUNDERBOLT_TRANSPORT": "shm"}), "shm"),
    "hier": (HYBRID, "shm+tcp"),  # ranks 0, 1 on one pretended host, 2, 3 on the other
    "rdma": (LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "rdma"}), "rdma"),
}
# (world, excluded): rank 0 (which serves the store) is among the excluded in some; 4->2 on the hierarchical
# setup leaves one host (its shared memory), 4->3 one rank alone on the other host
SHAPES = {"3to2": (3, [0]), "4to3": (4, [3]), "4to2": (4, [2, 3])}


@contextlib.contextmanager
def links(name: str, world: int, tmp_path: Path) -> Iterator[Setup]:
    """The setup of kind `name` for `world` ranks (rdma: over a fake fabric of one device per rank, removed
    at the end)."""
    setup = SETUPS[name][0]
    if name != "rdma":
        yield setup
        return
    with fake_fabric(tmp_path / "fab", devices={f"rdma_fake{i}": f"10.201.0.{i + 1}" for i in range(world)}) as fab:
        yield setup.with_env(fabric_env(fab))


def run(name: str, world: int, tmp_path: Path, scenario: str = "shrink", **env: str) -> list[RankResult]:
    with links(name, world, tmp_path) as setup:
        return run_ranks(shrink, world, tmp_path / "run", args=[scenario], setup=setup, timeout=240,
                         expect_ok=False, env=env)


def check_shrunk(res: RankResult, world: int, excluded: list[int], kind: str) -> dict[str, Any]:
    """What a rank that stays must have seen: the shrunk group of the others, over the same engine, its new
    rank in order, every op exact."""
    assert res.returncode == 0, (res.rank, res.stderr[-3000:])
    assert res.results(), (res.rank, res.stdout[-2000:], res.stderr[-3000:])
    out = res.results()[0]  # (SUB and AGAIN lines may follow)
    stay = [r for r in range(world) if r not in excluded]
    shrunk = out["shrunk"]
    assert shrunk["world"] == len(stay) and shrunk["rank"] == stay.index(res.rank), (res.rank, shrunk)
    assert shrunk["default"] and shrunk["same_engine"] and shrunk["ones"], (res.rank, shrunk)
    assert shrunk["kind"] == kind and not shrunk["old_usable"], (res.rank, shrunk)
    assert out["bad"] == [], (res.rank, out["bad"])
    return out


def check_loss(out: dict[str, Any], rank: int, excluded: list[int]) -> None:
    """The ops in flight at the loss failed with PeerLostError naming a lost rank; none completed wrong."""
    loss = out["loss"]
    assert loss["type"] == "PeerLostError" and loss["peer"] in excluded, (rank, loss)
    assert loss["wrong"] == [], (rank, loss)


def check_case(name: str, shape: str, how: str, tmp_path: Path, excluded: "list[int] | None" = None,
               **env: str) -> list[RankResult]:
    world, excluded = SHAPES[shape][0], excluded if excluded is not None else SHAPES[shape][1]
    runs = run(name, world, tmp_path, TEST_EXCLUDE=",".join(map(str, excluded)), TEST_HOW=how, **env)
    for res in runs:
        if res.rank in excluded:
            if how == "kill":
                assert res.returncode == -9, (res.rank, res.returncode, res.stderr[-2000:])
            elif how == "exit":
                assert res.returncode == 0 and not res.results(), (res.rank, res.stderr[-2000:])
            else:
                check_excluded(res)
            continue
        kind = SETUPS[name][1]
        if name == "hier" and res.rank == world - 1 and world % 2:
            kind = "tcp"  # alone on its pretended host
        out = check_shrunk(res, world, excluded, kind)
        first = out["first"]  # (SHRINK_ABORT only: the op before the shrink, which another's shrink may end)
        assert first is None or first["ok"] or "by shrink_group, excluding ranks" in first["msg"], (res.rank, first)
        if how == "healthy":
            assert out["loss"] is None
        else:
            check_loss(out, res.rank, excluded)
    return runs


def check_excluded(res: RankResult) -> None:
    """An excluded rank that is alive: every op it calls on the old group fails at once, naming the shrink."""
    assert res.returncode == 0, (res.rank, res.stderr[-3000:])
    out = res.json()
    assert out["excluded"], out
    first = out["first"]  # (in flight when the others shrank, or done before)
    assert first["exact"] if first["ok"] else "by shrink_group, excluding ranks" in first["msg"], (res.rank, first)
    for call in out["calls"]:
        assert not call["ok"], (res.rank, call)
        assert call["type"] != "CollectiveTimeout", (res.rank, call)
        assert "shrunk to ranks" in call["msg"] and "by shrink_group, excluding ranks" in call["msg"], (res.rank, call)


@pytest.mark.parametrize("name, shape, how", [("rdma", "3to2", "exit"), ("shm", "4to2", "healthy")])
def test_shrink_after_a_loss_and_healthy(name: str, shape: str, how: str, tmp_path: Path) -> None:
    check_case(name, shape, how, tmp_path)


@pytest.mark.parametrize("how", ["exit", "healthy"])
def test_shrink_with_shrink_abort(how: str, tmp_path: Path) -> None:
    """SHRINK_ABORT: the old group ends before the ranks that stay agree; the outcome is the same."""
    check_case("tcp", "4to3", how, tmp_path, TEST_FLAGS="abort")


@pytest.mark.parametrize("flags", ["default", pytest.param("abort", marks=pytest.mark.slow)])
def test_an_op_pending_on_the_old_group_fails_naming_the_shrink(flags: str, tmp_path: Path) -> None:
    """An op of the old group still pending when the group ends fails on every rank, naming the shrink, never
    with a wrong result; one waited for before the call is exact. SHRINK_DEFAULT ends the old group once every
    rank that stays has called shrink_group (rank 1's op is still pending at its call), SHRINK_ABORT as soon
    as the first of them calls it (rank 1's op is over, failed, before its own call)."""
    runs = run("tcp", 3, tmp_path, "pending", TEST_FLAGS=flags)
    for res in runs:
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
        out = res.json()
        assert out["e_exact"], (res.rank, out)
        assert not out["l"]["ok"] and not out["l_wrong"], (res.rank, out)
        assert out["l"]["type"] in ("BackendClosedError", "PeerAbortedError"), (res.rank, out)
        assert "by shrink_group, excluding ranks [2]" in out["l"]["msg"], (res.rank, out)
        if res.rank == 1:
            assert out["l_over_before_call"] == (flags == "abort"), out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill", "healthy"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(SETUPS))
def test_every_op_family_is_exact_after_a_shrink(name: str, shape: str, how: str, tmp_path: Path) -> None:
    check_case(name, shape, how, tmp_path)


@pytest.mark.parametrize("name", ["tcp", pytest.param("hier", marks=pytest.mark.slow)])
def test_shrink_twice_and_a_new_group_of_the_shrunk_group(name: str, tmp_path: Path) -> None:
    """4 ranks: rank 0 is SIGKILLed (with it the store), the others shrink to 3, make a new_group of their
    ranks 0 and 2 over the same links (no store round: its store is gone), then their rank 1 exits and the
    two left shrink again."""
    runs = check_case(name, "4to3", "kill", tmp_path, [0], TEST_CHECKS="one", TEST_SUBGROUP="1", TEST_AGAIN="1")
    for res in runs[1:]:
        [sub] = res.tagged("SUB")
        assert sub["member"] == (res.rank in (1, 3)), (res.rank, sub)
        if sub["member"]:
            assert sub["same_engine"] and sub["bad"] == [] and sub["world"] == 2, (res.rank, sub)
        if res.rank == 2:  # rank 1 of the shrunk group: it went
            continue
        [again] = res.tagged("AGAIN")
        assert again["loss"]["type"] == "PeerLostError" and again["loss"]["peer"] == 1, (res.rank, again)
        assert again["shrunk"]["world"] == 2 and again["shrunk"]["same_engine"], (res.rank, again)
        assert again["bad"] == [], (res.rank, again["bad"])


@pytest.mark.parametrize("name, op", [("tcp", "all_reduce"), ("shm", "all_reduce"),
                                      *(pytest.param(n, "broadcast", marks=pytest.mark.slow) for n in ("tcp", "shm"))])
def test_an_excluded_rank_that_comes_late_gets_the_groups_error(name: str, op: str, tmp_path: Path) -> None:
    """3 ranks: ranks 0 and 1 time out waiting for rank 2 and shrink it away; rank 2 comes to that op later,
    finding all it needs there (an all_reduce) or only sending (its broadcast): the op fails with the old
    group's error, as every later one does."""
    runs = run(name, 3, tmp_path, "late", TEST_TIMEOUT="2", TEST_OP=op)
    for res in runs:
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
    for res in runs[:2]:
        out = res.json()
        assert out["timed_out"]["type"] == "CollectiveTimeout" and out["exact"], (res.rank, out)
    out = runs[2].json()
    for call in [out["first"], *out["calls"]]:
        assert not call["ok"] and call["type"] == "CollectiveTimeout", call
        assert "aborted the group" in call["msg"] and "did not arrive: [2]" in call["msg"], call


def test_survivors_that_disagree_on_whom_to_exclude_get_a_mismatch_naming_both(tmp_path: Path) -> None:
    """4 ranks, rank 3 exits; rank 0 excludes [3], rank 1 [2, 3], rank 2 [1, 3]: each gets a MismatchError
    naming the rank it disagrees with and both lists; then all retry with [3] and the group works. Rank 0's
    first call names that very group: if the others' retries reach it before its own grace for the
    disagreement runs out, it returns the group with them instead (the same group on every member)."""
    runs = run("tcp", 4, tmp_path, "mismatch", TEST_CHECKS="one")
    ours = {0: [0, 1, 2], 1: [0, 1], 2: [0, 2]}
    for res in runs[:3]:
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
        out = res.json()
        first = out["first"]
        if res.rank == 0 and first["ok"]:
            assert out["bad"] == [], out
            continue
        assert first["type"] == "MismatchError", (res.rank, first)
        msg = first["msg"]
        other = {0: 1, 1: 0, 2: 0}[res.rank]  # (rank 0 names the first rank it disagrees with)
        assert f"rank {other} makes a group of ranks {ours[other]}" in msg, (res.rank, msg)
        assert f"this rank one of ranks {ours[res.rank]}" in msg, (res.rank, msg)
        assert out["retry"]["ok"] and out["bad"] == [], (res.rank, out)
