"""Local rank supervision: environment, failure propagation, timeout, no leftover processes."""
import os
import subprocess
import sys
import time

import pytest

from torch_thunderbolt.bench import spawn
from torch_thunderbolt.errors import ThunderboltError


def test_child_env_is_torchrun_shaped():
    env = spawn.child_env({"PATH": "/bin", "PYTHONPATH": "/x"}, 1, 3, 29555)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "3", "1", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29555")
    assert "THUNDERBOLT_TRANSPORT" not in env and env["OMP_NUM_THREADS"] == "1"  # (--transport rides in argv)
    assert env["PYTHONPATH"].split(os.pathsep) == [spawn.PACKAGE_PARENT, "/x"]
    kept = spawn.child_env({"OMP_NUM_THREADS": "2", "THUNDERBOLT_TRANSPORT": "tcp"}, 0, 2, 1)
    assert kept["OMP_NUM_THREADS"] == "2" and kept["THUNDERBOLT_TRANSPORT"] == "tcp"


def test_child_command():
    assert spawn.child_command(["--iters", "3"], python="py") == ["py", "-m", "torch_thunderbolt", "bench",
                                                                  "--iters", "3"]


def _start(code):
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.fixture
def procs():
    started = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(30)
def test_first_failure_stops_the_other_ranks(procs):
    procs += [_start("import time; time.sleep(60)"), _start("import sys, time; time.sleep(0.3); sys.exit(3)")]
    start = time.monotonic()
    assert spawn.supervise(procs, timeout=60) == 3
    assert time.monotonic() - start < 20
    assert procs[0].poll() is not None  # the sleeper was ended, not left behind


@pytest.mark.timeout(30)
def test_timeout_ends_every_rank(procs):
    procs += [_start("import time; time.sleep(60)"), _start("import time; time.sleep(60)")]
    with pytest.raises(ThunderboltError, match="did not finish within --timeout 0.5 s"):
        spawn.supervise(procs, timeout=0.5)
    assert all(p.poll() is not None for p in procs)


@pytest.mark.timeout(30)
def test_all_successful(procs):
    procs += [_start("pass"), _start("pass")]
    assert spawn.supervise(procs, timeout=20) == 0


@pytest.mark.timeout(30)
def test_killed_rank_reports_signal_code(procs):
    procs += [_start("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]
    assert spawn.supervise(procs, timeout=20) == 128 + 9
