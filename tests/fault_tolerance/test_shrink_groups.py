"""`dist.shrink_group` on any group, one process per rank over tcp and shm (world 4): the default group, a
`new_group`, each DeviceMesh dimension holding the lost rank (HSDP's case), and a group shrunk a second
time, with the SIGKILLed rank first, in the middle or last of the group (its rank 0 included). After the
shrink, torch's view of the new group (`get_process_group_ranks`, `get_rank`, `get_global_rank`,
`get_group_rank`, `size`) must be the backend's and the right one, and broadcast from every src (a global
rank, through torch), all_reduce and all_gather must give exactly the data of the right processes.

The expected global ranks are worked out here from the ranks the processes were started as: a group's
global ranks are its members', but a shrunk default group becomes the default group, and torch numbers
global ranks by it from then on (0..n-1). The ranks run programs/shrink_groups.py. The default selection
runs two cases; the grid is marked slow."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torch_thunderbolt.testing.ranks import RankResult, run_ranks

from .programs import shrink_groups
from .programs.shrink_groups import FIRST_LOST, value
from .test_shrink import SETUPS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
# (group kind, the rank lost): first, middle and last of the group; a 2x2 mesh's dimensions have no middle
# (rank 1 is last of its "shard" group [0, 1] and first of its "replicate" group [1, 3]); a group shrunk
# twice loses FIRST_LOST first, then the one named, among the three left
CASES = [("default", 0), ("default", 1), ("default", 3),
         ("sub", 1), ("sub", 2), ("sub", 3),
         ("mesh", 0), ("mesh", 1), ("mesh", 3),
         ("twice", 0), ("twice", 2), ("twice", 3),
         ("twice_default", 0), ("twice_default", 2), ("twice_default", 3)]
QUICK = [("sub", 1, "tcp"), ("mesh", 1, "shm")]  # group rank 0 lost from a new_group; HSDP's both dimensions


def expected(kind: str, lost: int, me: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The shrinks rank `me` takes part in, in order (the members that stay, by the rank each was started
    as, and the global ranks torch must then report), and the members of its groups that lost no rank."""
    if kind == "mesh":
        groups = {"replicate": sorted([me, me ^ 2]), "shard": sorted([me, me ^ 1])}
    elif kind == "sub":
        groups = {"sub": [1, 2, 3]} if me in (1, 2, 3) else {}
    else:
        groups = {kind: list(range(WORLD))}
    losses = [FIRST_LOST, lost] if kind.startswith("twice") else [lost]
    shrinks = []
    for step, victim in enumerate(losses):
        for label, members in groups.items():
            if victim in members:
                groups[label] = stay = [m for m in members if m != victim]
                shrinks.append({"label": label, "step": step, "stay": stay,
                                "global": list(range(len(stay))) if kind.endswith("default") else stay})
    touched = {s["label"] for s in shrinks}
    return shrinks, [members for label, members in groups.items() if label not in touched]


def check_shrunk(res: RankResult, got: dict[str, Any], want: dict[str, Any]) -> None:
    stay, ranks = want["stay"], want["global"]
    who = (res.rank, got["label"], got["step"])
    # the error names the lost rank as the group numbers it, which is what shrink_group takes
    before = sorted([*stay, got["lost"]])
    assert got["loss"]["type"] == "PeerLostError" and got["loss"]["peer"] == before.index(got["lost"]), \
        (who, got["loss"])
    mine = stay.index(res.rank)
    torch_view = got["torch"]
    assert torch_view == {"ranks": ranks, "rank": mine, "size": len(stay), "world": len(stay), "global_of": ranks,
                          "group_of": list(range(len(stay)))}, (who, torch_view, ranks)
    assert got["backend"] == {"global_ranks": ranks, "members": stay, "rank": mine}, (who, got["backend"])
    assert got["default"] == want["label"].endswith("default"), who
    # data: what the process of each global rank put in, in group rank order
    assert got["bcast"] == [[g, [value(m)]] for g, m in zip(ranks, stay)], (who, got["bcast"])
    assert got["sum"] == [sum(value(m) for m in stay)], (who, got["sum"])
    assert got["gathered"] == [[value(m)] for m in stay], (who, got["gathered"])


def check_case(kind: str, lost: int, setup: str, tmp_path: Path) -> None:
    runs = run_ranks(shrink_groups, WORLD, tmp_path / "run", args=["any_group"], setup=SETUPS[setup][0],
                     timeout=240, expect_ok=False, env={"TEST_GROUP": kind, "TEST_LOST": str(lost)})
    gone = {lost, FIRST_LOST} if kind.startswith("twice") else {lost}
    for res in runs:
        if res.rank in gone:
            assert res.returncode == -9, (res.rank, res.returncode, res.stderr[-2000:])
            continue
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
        shrinks, untouched = expected(kind, lost, res.rank)
        got = res.tagged("SHRUNK")
        assert [(g["label"], g["step"], g["stay"]) for g in got] == \
            [(w["label"], w["step"], w["stay"]) for w in shrinks], (res.rank, got, shrinks)
        for g, w in zip(got, shrinks):
            check_shrunk(res, g, w)
        # a group that lost no rank goes on (HSDP's other dimension)
        assert res.tagged("UNTOUCHED") == [[{"members": m, "sum": [sum(value(r) for r in m)]} for m in untouched]], \
            (res.rank, res.tagged("UNTOUCHED"), untouched)


@pytest.mark.parametrize("kind, lost, setup", QUICK)
def test_torch_sees_the_shrunk_group_as_the_backend_does(kind: str, lost: int, setup: str, tmp_path: Path) -> None:
    check_case(kind, lost, setup, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["tcp", "shm"])
@pytest.mark.parametrize("kind, lost", CASES)
def test_every_group_kind_and_lost_position(kind: str, lost: int, setup: str, tmp_path: Path) -> None:
    if (kind, lost, setup) in QUICK:
        pytest.skip("in the default selection")
    check_case(kind, lost, setup, tmp_path)
