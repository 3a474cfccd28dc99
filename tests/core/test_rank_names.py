"""Subgroup errors name global ranks too: in new_group([1, 2]) "rank 0" is global rank 1."""
from __future__ import annotations

import pytest

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.testing.ranks import run_ranks
from torch_thunderbolt.transport.names import RankNames

from .programs import rank_names


def test_group_ranks_get_their_global_rank_and_the_group() -> None:
    names = RankNames.for_group([1, 2], 2, "7")
    text = ("rank 0: lost the connection to rank 1 at 127.0.0.1:5 (stream 0): reset; "
            "ranks that did not arrive: [1]")
    out = names.rewrite(text)
    assert out.startswith("rank 0 (global rank 1) of process group 7: lost the connection to rank 1 (global rank 2)")
    assert "ranks that did not arrive: [1] (global ranks [2])" in out
    assert names.rewrite(out) == out  # a message relayed through a peer is not renamed twice


def test_a_relayed_message_keeps_one_group_prefix_per_reporting_rank() -> None:
    names = RankNames.for_group([3, 5, 6], 3, "g")
    inner = names.rewrite("rank 2: lost the connection to rank 1 at x (stream 0): reset")
    out = names.rewrite(f"rank 0: rank 2 aborted the group: {inner}")
    assert out.startswith("rank 0 (global rank 3) of process group g: rank 2 (global rank 6) aborted the group: "
                          "rank 2 (global rank 6) of process group g: lost the connection to rank 1 (global rank 5)")


def test_groups_whose_ranks_are_global_are_left_alone() -> None:
    assert RankNames.for_group([], 3, "0") is None  # the default group: torch passes no ranks
    assert RankNames.for_group([0, 1, 2], 3, "1") is None
    assert RankNames.for_group([0, 2], 3, "1") is None  # not this group's ranks: better unnamed than wrong


def test_apply_renames_the_error_in_place() -> None:
    err = PeerLostError("rank 1: lost the connection to rank 0", rank=1, peer=0)
    assert RankNames.for_group([4, 2], 2, "1").apply(err) is err
    assert str(err) == "rank 1 (global rank 2) of process group 1: lost the connection to rank 0 (global rank 4)"
    assert err.peer == 0  # the attribute stays the group rank (what the transport's peers are numbered by)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_subgroup_peer_lost_names_global_ranks(transport: str, tmp_path) -> None:
    """3 ranks; in new_group([1, 2]) global rank 2 (group rank 1) dies: global rank 1 must read that."""
    res = run_ranks(rank_names, 3, tmp_path, timeout=90, expect_ok=False, env={"THUNDERBOLT_TRANSPORT": transport})
    out = res[1].json()
    assert not out["ok"], out
    assert "rank 0 (global rank 1) of process group" in out["msg"], out
    assert "rank 1 (global rank 2)" in out["msg"], out
