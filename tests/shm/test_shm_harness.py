"""The shared-memory leftovers check of runs with the SHM setup: it blames a run only for what the run's own
ranks left behind.

Several test runs may share a host (engineers, CI jobs): while one job sets up, its segments and doorbell
sockets exist; a run that ends at that moment must not report them as its own leftovers."""
from __future__ import annotations

import threading
import time

import pytest

from torch_thunderbolt.testing.leftovers import segments_and_doorbells
from torch_thunderbolt.testing.ranks import SHM, rank_pids, run_ranks
from torch_thunderbolt.transport import shm_segment

from .programs import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_another_jobs_segment_during_the_run_is_not_a_leftover(tmp_path) -> None:
    go = tmp_path / "go"
    foreign: list[shm_segment.Segment] = []

    def other_job() -> None:  # a job of another test run (alive, not one of our ranks) sets up meanwhile
        end = time.monotonic() + 30
        while len(list(tmp_path.glob("up_*"))) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        foreign.append(shm_segment.create(4096))
        go.touch()

    th = threading.Thread(target=other_job, daemon=True)
    th.start()
    try:
        run_ranks(harness, 2, tmp_path, args=["wait_for_go"], setup=SHM, timeout=60, env={"TEST_GO": str(go)})
        assert foreign and foreign[0].name in shm_segment.live_segments()  # it was there at the check
    finally:
        th.join(10)
        for seg in foreign:
            seg.unlink()
            seg.close()


def test_a_segment_left_by_one_of_our_ranks_is_reported(tmp_path) -> None:
    with pytest.raises(AssertionError, match="leftovers after the run"):
        run_ranks(harness, 2, tmp_path, args=["leak"], setup=SHM, timeout=60)
    assert not segments_and_doorbells(rank_pids(tmp_path))  # and the janitor removed it (its creator is gone)
