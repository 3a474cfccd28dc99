"""The hybrid on a lab (root only): two emulated Macs (network namespaces) with two ranks each, so `auto`
picks it from the real host identities; the same checks as test_hybrid.py over a veth cable."""
from __future__ import annotations

from typing import Iterator

import pytest

from torch_thunderbolt.lab.view import Lab
from torch_thunderbolt.testing.lab import lab_session, lab_setup, lab_world, skip_unless_lab
from torch_thunderbolt.testing.ranks import SegmentCheck, Setup, run_ranks

from .programs import hybrid

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess]


def _on_pair(lab: Lab) -> Setup:
    """Two ranks on each emulated Mac (rank r on host r // 2); no shm segment of the run may survive it."""
    return lab_setup(lab, per_host=2).but(segments=SegmentCheck.NEW)


@pytest.fixture(scope="module")
def pair() -> Iterator[Lab]:
    skip_unless_lab()
    with lab_session(2, "pair", cc="reno") as lab:
        yield lab


@pytest.mark.timeout(120)
def test_lab_every_collective_exact_same_host_off_tcp(pair, tmp_path) -> None:
    runs = run_ranks(hybrid, lab_world(pair, 2), tmp_path, args=["collectives"], setup=_on_pair(pair), timeout=100)
    for run in runs:
        got = run.json()
        assert got["kind"] == "shm+tcp", got
        assert got["bad"] == [], (run.rank, got["bad"])
        # No rank sent a byte over TCP while it exchanged with its same-host mate. (What it received there
        # may count a rank of the other host that went on to the next op: its small message is read ahead.)
        assert got["same_host"]["tcp"][0] == 0, (run.rank, got)
        assert min(got["same_host"]["shm"]) > 0 and min(got["tcp"]) > 0, (run.rank, got)


@pytest.mark.timeout(120)
def test_lab_kill_9_gives_peer_lost_on_every_survivor(pair, tmp_path) -> None:
    victim = 2  # on the second emulated Mac: rank 3 learns it over shm, ranks 0 and 1 over the cable
    runs = run_ranks(hybrid, lab_world(pair, 2), tmp_path, args=["kill"], setup=_on_pair(pair), timeout=100,
                     expect_ok=False, env={"TEST_SIZE": str(1 << 20), "TEST_VICTIM": str(victim)})
    assert runs[victim].returncode == -9
    for run in runs:
        if run.rank != victim:
            out = run.json()
            assert out["type"] == "PeerLostError" and out["peer"] == victim, (run.rank, out)
            assert out["seconds"] < 10, (run.rank, out)
