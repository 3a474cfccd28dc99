"""The runner every multi-process test relies on (torch_thunderbolt.testing.ranks): what each rank is told,
that a hung run is killed with everything it started, that failures name the rank, whether the ranks are
started as interpreters or forked from a zygote (testing.zygote); and that the library's runtime never
imports the testing package (a tool beside it)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from torch_thunderbolt.testing.ranks import LOOPBACK, REPO, run_ranks, start_ranks, start_zygote
from torch_thunderbolt.testing.zygote import Zygote

from .programs import runner_checks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def forks() -> Iterator[Zygote]:
    with start_zygote(preload=("torch_thunderbolt.testing.program",)) as z:
        yield z


@pytest.fixture(params=["spawn", "fork"])
def zygote(request: pytest.FixtureRequest) -> Zygote | None:
    return request.getfixturevalue("forks") if request.param == "fork" else None


def test_each_rank_gets_its_place_the_callers_env_and_none_of_ours(tmp_path, monkeypatch, zygote) -> None:
    monkeypatch.setenv("THUNDERBOLT_LEAK", "1")  # the test runner's settings must not reach the ranks
    setup = LOOPBACK.with_env({"TEST_GLOBAL": "setup", "TEST_MINE": "setup"})
    results = run_ranks(runner_checks, 2, tmp_path, args=["environment"], setup=setup, env={"TEST_GLOBAL": "call"},
                        per_rank={1: {"TEST_MINE": "rank 1"}}, timeout=30, zygote=zygote)
    outs = [res.json() for res in results]
    assert [o["rank"] for o in outs] == [0, 1]
    for r, o in enumerate(outs):
        assert o["cwd"] == str(tmp_path) and o["workdir"] == str(tmp_path), o
        assert o["env"] == {"WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "THUNDERBOLT_LEAK": None, "TEST_GLOBAL": "call",
                            "TEST_MINE": "rank 1" if r == 1 else "setup", "OMP_NUM_THREADS": "1"}, o


def test_a_program_given_by_path_runs_the_same(tmp_path, zygote) -> None:
    results = run_ranks(Path(runner_checks.__file__), 1, tmp_path, args=["environment"], timeout=30, zygote=zygote)
    assert results[0].json()["rank"] == 0


def test_a_hung_run_is_killed_with_what_its_ranks_started(tmp_path, zygote) -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks hung \(killed after 8"):
        run_ranks(runner_checks, 2, tmp_path, args=["hang"], timeout=8, zygote=zygote)
    assert time.monotonic() - t0 < 20
    pids = [int(p) for f in tmp_path.glob("pids_*") for p in f.read_text().split()]
    assert len(pids) == 4, pids  # every rank got as far as starting its child
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)]


def test_a_failing_rank_is_named_with_its_exit_code_and_stderr(tmp_path, zygote) -> None:
    with pytest.raises(AssertionError, match="rank 1 exited 3\nrank 1 says goodbye"):
        run_ranks(runner_checks, 2, tmp_path, args=["exit_code"], timeout=30, zygote=zygote)
    results = run_ranks(runner_checks, 2, tmp_path, args=["exit_code"], timeout=30, expect_ok=False, zygote=zygote)
    assert [res.returncode for res in results] == [0, 3]


def test_a_killed_rank_reports_the_signal_as_a_process_does(tmp_path, zygote) -> None:
    with start_ranks(runner_checks, 2, tmp_path, args=["hang"], zygote=zygote) as ranks:
        time.sleep(1.0)
        os.killpg(ranks[1].proc.pid, signal.SIGKILL)  # (its session: the child it started too)
        assert ranks[1].proc.wait(10) == -9
        assert ranks[0].proc.poll() is None
    assert ranks[0].proc.poll() == -9  # kill_all


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
