"""Process supervision with real local processes (no network)."""
import io
import sys
import time

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.launch.hostfile import Host
from torch_thunderbolt.launch.ranks import build_rank_specs
from torch_thunderbolt.launch.supervise import Shrinking, describe_code, exit_code, supervise

pytestmark = [pytest.mark.multiprocess]

JOB = r"""
import os, signal, subprocess, sys, time
rank = int(os.environ["RANK"])
mode = sys.argv[1]
print(f"hello {rank}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}", flush=True)
print(f"warn {rank}", file=sys.stderr, flush=True)
if mode == "ok":
    sys.stdout.write("no newline at the end")
    sys.exit(0)
if rank == 1:
    # Fail only once the others are fully running (files written), so the test never races them.
    others = [sys.argv[2] + f".{r}" for r in range(int(os.environ["WORLD_SIZE"])) if r != 1]
    deadline = time.time() + 20
    while not all(os.path.exists(p) and os.path.getsize(p) for p in others) and time.time() < deadline:
        time.sleep(0.02)
    if mode == "fail":
        sys.exit(7)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# The others would run for a long time; a grandchild too (it must die with its rank).
child = subprocess.Popen(["sleep", "60"])
open(sys.argv[2] + f".{rank}", "w").write(f"{os.getpid()} {child.pid}")
time.sleep(60)
"""


def _run(tmp_path, mode, nproc=3, grace=5.0):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    specs = build_rank_specs([Host(name="here")], nproc, [sys.executable, str(job), mode, str(tmp_path / "gc")],
                             cwd=str(tmp_path), master_port=29999)
    out, err, log = io.StringIO(), io.StringIO(), []
    start = time.monotonic()
    code = supervise(specs, grace=grace, stdout=out, stderr=err, log=log.append, poll_interval=0.02)
    return code, out.getvalue(), err.getvalue(), log, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"  # a zombie is dead for our purpose
    except FileNotFoundError:
        return False


def _dies(pid: int, within: float = 5.0) -> bool:
    """True once `pid` is gone; a SIGKILLed process takes a moment to finish exiting."""
    deadline = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.timeout(30)
def test_all_ranks_succeed_with_prefixed_output(tmp_path):
    code, out, err, log, _ = _run(tmp_path, "ok")
    assert code == 0 and log == []
    lines = sorted(out.splitlines())
    assert lines == ["[rank 0] hello 0/3 local 0", "[rank 0] no newline at the end",
                     "[rank 1] hello 1/3 local 1", "[rank 1] no newline at the end",
                     "[rank 2] hello 2/3 local 2", "[rank 2] no newline at the end"]
    assert sorted(err.splitlines()) == ["[rank 0] warn 0", "[rank 1] warn 1", "[rank 2] warn 2"]


@pytest.mark.timeout(30)
def test_one_failure_stops_everyone_and_its_code_is_returned(tmp_path):
    code, out, _, log, elapsed = _run(tmp_path, "fail")
    assert code == 7
    assert log == ["rank 1 on here exited with code 7; stopping 2 other rank(s)"]
    assert elapsed < 30  # the survivors were stopped, not waited for (they sleep 60 s)
    for rank in (0, 2):
        assert all(_dies(int(pid)) for pid in (tmp_path / f"gc.{rank}").read_text().split())


@pytest.mark.timeout(30)
def test_rank_killed_by_signal_reports_128_plus_signal(tmp_path):
    code, _, _, log, _ = _run(tmp_path, "killed", nproc=2)
    assert code == 128 + 9 and "exited with code 137" in log[0]


@pytest.mark.timeout(30)
def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path):
    code, _, _, log, _ = _run(tmp_path, "stubborn", nproc=2, grace=0.5)
    assert code == 137 and "stopping 1 other rank(s)" in log[0]
    rank0, grandchild = (int(pid) for pid in (tmp_path / "gc.0").read_text().split())
    assert _dies(rank0) and _dies(grandchild)


def test_exit_code_mapping():
    assert exit_code(0) == 0 and exit_code(3) == 3 and exit_code(-15) == 143


def test_missing_program_is_a_config_error(tmp_path):
    specs = build_rank_specs([Host(name="here")], 1, [str(tmp_path / "no-such-program")], cwd=str(tmp_path))
    with pytest.raises(ConfigError, match="cannot start rank 0 on here"):
        supervise(specs, stdout=io.StringIO(), stderr=io.StringIO())


# --on-failure shrink: rank 1 is lost (SIGKILL) while the others run; they go on and end as `mode` says.
SHRINKING = r"""
import os, signal, sys, time
rank, mode, base = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
open(f"{base}.{rank}.tmp", "w").write(str(os.getpid()))
os.rename(f"{base}.{rank}.tmp", f"{base}.{rank}")  # whole or absent
while not all(os.path.exists(f"{base}.{r}") for r in range(3)):
    time.sleep(0.02)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
lost = open(f"{base}.1").read()
while os.path.exists(f"/proc/{lost}"):
    time.sleep(0.02)  # until the launcher has seen rank 1 end (and reaped it)
if rank == 0:
    print("finished", flush=True)
    sys.exit(0)
time.sleep(0.5)  # rank 2 ends after rank 0 finished
sys.exit(0 if mode == "finish" else 3)
"""


def _run_shrinking(tmp_path, mode):
    job = tmp_path / "shrinking.py"
    job.write_text(SHRINKING)
    specs = build_rank_specs([Host(name="here")], 3, [sys.executable, str(job), mode, str(tmp_path / "pid")],
                             cwd=str(tmp_path), master_port=29999)
    out, err, log = io.StringIO(), io.StringIO(), []
    code = supervise(specs, grace=1.0, stdout=out, stderr=err, log=log.append, poll_interval=0.02,
                     on_failure="shrink")
    return code, out.getvalue(), log


@pytest.mark.timeout(30)
def test_on_failure_shrink_lets_the_others_finish_and_says_the_job_shrank(tmp_path):
    code, out, log = _run_shrinking(tmp_path, "finish")
    assert code == 0, log
    assert "[rank 0] finished" in out
    assert log == ["rank 1 on here exited with code 137, killed by SIGKILL; lost: the job goes on without it, "
                   "2 rank(s) still running (--on-failure shrink)",
                   "the job shrank from 3 to 2 rank(s): lost rank 1 on here (exit code 137, killed by SIGKILL); "
                   "rank(s) 0, 2 finished with code 0"]


@pytest.mark.timeout(30)
def test_on_failure_shrink_fails_when_a_rank_that_remained_fails(tmp_path):
    code, _, log = _run_shrinking(tmp_path, "fail")
    assert code == 3, log
    assert log[1:] == ["rank 2 on here exited with code 3 after the job shrank",
                       "the job shrank from 3 to 2 rank(s) (lost rank 1 on here (exit code 137, killed by SIGKILL)), "
                       "then rank 2 failed: exit code 3"]


def test_what_a_shrinking_job_counts_as_lost():
    job = Shrinking(4)
    assert job.ended(3, 137, running=3) == "lost"  # others still running, none finished yet
    assert job.ended(2, 1, running=2) == "lost"  # a second loss is a loss too
    assert job.ended(0, 0, running=1) == "finished"
    assert job.ended(1, 1, running=0) == "failed"  # after a rank finished: the job was ending
    assert job.code() == 1 and job.lost == [(3, 137), (2, 1)]
    last = Shrinking(2)
    assert last.ended(0, 137, running=1) == "lost" and last.ended(1, 1, running=0) == "failed"  # the last one
    assert last.code() == 1
    assert describe_code(143) == "code 143, killed by SIGTERM" and describe_code(1) == "code 1"


def test_on_failure_must_be_known(tmp_path):
    specs = build_rank_specs([Host(name="here")], 1, ["true"], cwd=str(tmp_path))
    with pytest.raises(ConfigError, match="--on-failure 'restart' is invalid: expected one of stop, shrink"):
        supervise(specs, on_failure="restart", stdout=io.StringIO(), stderr=io.StringIO())
