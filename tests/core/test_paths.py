"""algorithms.paths.choose: the one place that says how each collective runs. Pure."""
from __future__ import annotations

import pytest

from torch_thunderbolt.algorithms.paths import WINDOW_OPS, Group, choose

FLAT = Group(4, flat=True, one_shot_bytes=65536)
HOSTS = Group(4, per_host=True)
LINKS = Group(4)


@pytest.mark.parametrize("op", sorted(WINDOW_OPS))
def test_a_group_on_one_window_runs_the_window_ops_there(op: str) -> None:
    assert choose(op, 1 << 20, FLAT, "") == "window"


def test_a_small_all_reduce_on_the_window_is_one_shot() -> None:
    assert choose("all_reduce", 65536, FLAT, "") == "one_shot"
    assert choose("all_reduce", 65537, FLAT, "") == "window"
    assert choose("broadcast", 16, FLAT, "") == "window"


@pytest.mark.parametrize("op", ["reduce", "gather", "scatter", "all_to_all", "barrier"])
def test_ops_without_a_windowed_protocol_run_their_plan(op: str) -> None:
    for group in (FLAT, HOSTS, LINKS):
        assert choose(op, 100, group, "hier") == "plan"


@pytest.mark.parametrize("op", sorted(WINDOW_OPS))
def test_a_hierarchical_plan_runs_its_host_phases_on_the_window_where_there_is_one(op: str) -> None:
    assert choose(op, 1 << 20, HOSTS, "hier") == "hier"
    assert choose(op, 1 << 20, LINKS, "hier") == "plan"  # no window here: the whole plan over links
    assert choose(op, 1 << 20, HOSTS, "ring") == "plan"


def test_a_packed_all_reduce_takes_the_general_paths() -> None:
    assert choose("all_reduce", 100, FLAT, "", packed=True) == "window"
    assert choose("all_reduce", 100, LINKS, "direct", packed=True) == "plan"


def test_the_direct_all_reduce_runs_as_straight_code() -> None:
    assert choose("all_reduce", 100, LINKS, "direct") == "direct"
    assert choose("broadcast", 100, LINKS, "direct") == "plan"
    assert choose("all_reduce", 100, Group(1), "direct") == "plan"  # one rank: nothing to exchange
