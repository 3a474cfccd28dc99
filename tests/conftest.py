"""A test session must leave nothing behind: no child or rank process, no listening socket, no lab namespace,
no shared-memory segment, except what existed before it started (other people's labs and jobs).

Checked once, after the last test, by a session fixture that every test uses: anything left fails the run
(an error at the teardown of the last test, listing what was found). The checks themselves are
torch_thunderbolt.testing.leftovers, whose unit tests are in tests/reliability/test_leftovers_checks.py.
"""
from __future__ import annotations

import fnmatch
import glob
from typing import Iterator

import pytest

from torch_thunderbolt.testing.leftovers import Snapshot, session_leftovers, take_snapshot

BEFORE = pytest.StashKey[Snapshot]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[BEFORE] = take_snapshot()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Torn down after every other fixture of the session (it is set up first), so module fixtures such as
    the labs of tests/lab_cluster are gone by the time it looks."""
    yield
    before = request.config.stash.get(BEFORE, None) or Snapshot(frozenset(), frozenset())
    found = {what: items for what, items in session_leftovers(before, tmp_path_factory.getbasetemp()).items()
             if items}
    assert not found, "the test session left these behind:\n" + "\n".join(
        f"{what}:\n  " + "\n  ".join(items) for what, items in found.items())


# Heavier variants left out of the default selection (`-m "not slow"`, pyproject's addopts) because a lighter
# sibling in the default selection runs the same code: node-id patterns (`*` is any text, brackets are
# literal; a pattern without `*` is a prefix), each with that sibling. `-m slow` runs them, `-m ""` runs
# everything. Tests that are slow through and through carry the mark in their own file.
SLOW_VARIANTS: dict[str, str] = {
    "tests/reliability/test_link_faults.py::test_cable_cut_with_a_second_cable": "tests/failover",
    "tests/reliability/test_link_faults.py::test_cable_cut_is_found_by_the_link": "test_cable_cut_mid_collective",
    "tests/reliability/test_link_faults.py::test_a_frozen_peer": "test_blame's sigstopped rank",
    "tests/hybrid/test_hybrid_lab.py": "tests/hybrid over loopback",
    "tests/core/test_device_threads.py::test_device_tensors_are_exact_and_only_touched_by_the_callers_threads[3-":
        "the world-2 cases",
    "tests/core/test_config_doctor.py::test_autoload_registers_and_can_be_disabled": "the bad-value autoload test",
    "tests/compression/test_compression_ranks.py::test_compressed_all_reduce_is_within_bound_and_identical_on_all_"
    "ranks[gloo]": "the thunderbolt case",
    "tests/shm/test_shm_algorithms.py::test_algorithm_grid_over_shm[4]": "worlds 2 and 3",
    "tests/shm/test_shm_algorithms.py::test_algorithm_grid_over_shm[5]": "worlds 2 and 3",
    "tests/hybrid/test_hybrid.py::test_stalled_rank_times_out": "tests/core/test_failures.py's stalled rank",
    "tests/reliability/test_blame.py::test_a_rank_that_dies_during_set_up_is_named_within_seconds[2]": "[1]",
    "tests/reliability/test_blame.py::test_sigstopped_rank_is_named_by_both_survivors_not_the_rank_waiting_on_it"
    "[1048576]": "[1024]",
    "tests/reliability/test_stall_mismatch.py::test_stalled_rank_is_named_on_every_waiting_rank[ring]": "[one-shot]",
    "tests/core/test_torch_regressions.py::test_cases_gloo_gets_right[3-": "the world-2 cases",
    "tests/core/test_torch_api.py::test_whole_api[3-shm]": "[3-tcp] and [2-shm]",
    "tests/core/test_rank_names.py::test_subgroup_peer_lost_names_global_ranks[shm]": "[tcp]",
    "tests/examples/test_example_runs.py::test_vit_ddp_loss_is_finite_and_decreases": "test_vit_ddp_on_thunderbolt",
    "tests/examples/test_example_runs.py::test_pipeline_on_thunderbolt_matches_single_process":
        "test_pipeline_tokens_equal_single_process",
    "tests/core/test_integrity.py::test_through_torch_with_integrity_on[hybrid]": "the tcp and shm cases",
    "tests/core/test_secret.py::test_warning_once_per_process_only_when_strangers_can_join[*-hybrid]":
        "the tcp and shm cases",
    "tests/core/test_stacks.py::test_pipelining_matches_single_process[1F1B]": "[GPipe]",
    "tests/reliability/test_kill.py::test_kill_9_every_survivor_raises_peer_lost_within_5s[29]": "the other seeds",
    "tests/hybrid/test_hybrid.py::test_kill_9_gives_peer_lost_on_every_survivor[1048576]": "[256]",
    "tests/core/test_failures.py::test_kill_9_mid_all_reduce_every_survivor_raises_peer_lost[4194304-shm]":
        "[4194304-tcp] and [1024-shm]",
    **{f"tests/failover/test_tcp_failover.py::test_transfers_survive_losing_one_of_two_cables[{case}-darwin]":
       "[0-plain-darwin] and [1-sealed-darwin]"
       for case in ("0-sealed", "1-plain", "2-plain", "2-sealed", "3-plain", "3-sealed", "4-plain", "4-sealed",
                    "5-plain", "5-sealed")},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = ["*".join(map(glob.escape, p.split("*"))) + ("" if "*" in p else "*") for p in SLOW_VARIANTS]
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, p) for p in patterns):
            item.add_marker(pytest.mark.slow)
