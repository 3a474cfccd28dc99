"""A job that shrinks (examples/shrink_job.py: 3 ranks, rank 2 SIGKILLs itself at step 5 of 20, the others
`dist.shrink_group` it out and finish) run as users run it, on this host: under `launch --on-failure shrink`,
and under `torch-thunderbolt torchrun`, one per node (`--nnodes 3`, as one per Mac). The same on emulated
Macs: tests/lab_cluster/test_lab_shrink_job.py."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.testing.ranks import REPO, Ranks, free_port, rank_pids, start_ranks

from .programs import shrink_job

pytestmark = [pytest.mark.multiprocess]

EXAMPLE = REPO / "examples" / "shrink_job.py"
JOB = ["--steps", "20", "--kill-rank", "2", "--kill-step", "5", "--pace", "0.1"]
SECRET = "8d2f6b0a4e1c9f7d3b5a8e2c6f0d4b1a"  # any 32+ random characters, the same on every node


def reports(out: str) -> dict[int, dict]:
    """The SHRINK_JOB line of each rank that printed one, by its first rank (output prefixed or not)."""
    found = [json.loads(line.split("SHRINK_JOB ", 1)[1]) for line in out.splitlines() if "SHRINK_JOB " in line]
    return {r["first_rank"]: r for r in found}


def check_survivors(found: dict[int, dict]) -> None:
    """Ranks 0 and 1 finished every step on 2 ranks, having lost rank 2 at step 5, with every check true."""
    assert sorted(found) == [0, 1], found
    for first, r in found.items():
        assert r["ok"] and r["replicas_equal"] and r["max_relative_difference"] <= 1e-9, r
        assert (r["rank"], r["world"], r["first_world"], r["steps"]) == (first, 2, 3, 20), r
        assert [(lost["rank"], lost["step"]) for lost in r["lost"]] == [(2, 5)], r


def ranks_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launched ranks import this checkout and none of the test runner's THUNDERBOLT_* settings."""
    for name in list(os.environ):
        if name.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED", "MASTER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.timeout(180)
def test_launch_on_failure_shrink_keeps_the_survivors_and_exits_0(tmp_path, capsys, monkeypatch):
    ranks_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code = main(["launch", "--on-failure", "shrink", "--nproc-per-host", "3", "--grace", "2", "--",
                 sys.executable, str(EXAMPLE), *JOB])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    check_survivors(reports(out))
    said = [line for line in err.splitlines() if line.startswith("torch-thunderbolt launch: ")]
    assert said == ["torch-thunderbolt launch: rank 2 on localhost exited with code 137, killed by SIGKILL; lost: "
                    "the job goes on without it, 2 rank(s) still running (--on-failure shrink)",
                    "torch-thunderbolt launch: the job shrank from 3 to 2 rank(s): lost rank 2 on localhost (exit "
                    "code 137, killed by SIGKILL); rank(s) 0, 1 finished with code 0"], err[-4000:]


@pytest.mark.timeout(180)
def test_launch_by_default_stops_the_others_when_a_rank_is_lost(tmp_path, capsys, monkeypatch):
    """What --on-failure shrink changes: the same job without it ends when rank 2 dies."""
    ranks_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code = main(["launch", "--nproc-per-host", "3", "--grace", "2", "--", sys.executable, str(EXAMPLE), *JOB])
    out, err = capsys.readouterr()
    assert code == 137, err[-4000:]
    assert "rank 2 on localhost exited with code 137; stopping 2 other rank(s)" in err
    assert reports(out) == {}  # stopped 1.5 s before they could finish


def kill_workers(workdir: Path) -> None:
    """torchrun's workers lead sessions of their own: kill each registered one whatever happened."""
    for pid in rank_pids(workdir):
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def check_torchrun_nodes(agents: Ranks) -> float:
    """Node 2's agent failed and told the others; nodes 0 and 1 finished the job and exited 0. -> seconds
    from node 2's agent exiting to the last of the others exiting."""
    codes = [a.returncode for a in agents]
    detail = "\n".join(f"--- node {a.rank} (exit {a.returncode}):\n{a.stderr()[-2500:]}" for a in agents)
    assert codes == [0, 0, 1], detail
    assert "node 2's workers failed; counted as arrived at the exit barrier" in agents[2].stderr(), detail
    check_survivors({**reports(agents[0].stdout()), **reports(agents[1].stdout())})
    return max(agents[0].exited_at, agents[1].exited_at) - agents[2].exited_at


def torchrun_args(master_addr: str, master_port: int) -> list[str]:
    """One node's command line after `torch-thunderbolt`, as docs/fault-tolerance.md gives it, but for the
    node rank (PET_NODE_RANK, torchrun's variable for it) and the program (with its pid registered)."""
    return ["torchrun", "--nnodes", "3", "--nproc-per-node", "1", "--master-addr", master_addr,
            "--master-port", str(master_port), shrink_job.__file__, *JOB]


def test_the_documented_commands_are_the_ones_tested() -> None:
    import re

    text = (REPO / "docs" / "fault-tolerance.md").read_text()
    launched = re.findall(r"^torch-thunderbolt launch (.*)examples/shrink_job.py", text, re.M)
    assert launched and all("--on-failure shrink" in line for line in launched)
    lines = re.findall(r"^torch-thunderbolt (torchrun .*?) +# (\w+) Mac$", text, re.M)
    assert [which for _, which in lines] == ["first", "second", "third"]
    tested = torchrun_args("ADDR", 0)[:9] + ["examples/shrink_job.py"]  # its program: the example's wrapper

    def shape(words: list[str]) -> list[str]:
        return ["" if i in (6, 8) else w for i, w in enumerate(words)]  # the address and port aside

    for node, (line, _) in enumerate(lines):
        words = line.split()
        # What the tests do otherwise: the default timeout (the check-in must not need a short one), and the
        # node rank from PET_NODE_RANK.
        assert words[1:3] == ["--exit-barrier-timeout", "30"] and words[7:9] == ["--node-rank", str(node)], line
        assert shape(words[:1] + words[3:7] + words[9:]) == shape(tested), line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_one_per_node_survivors_exit_0_without_the_exit_barriers_wait(tmp_path):
    """torchrun's agents would wait 300 s (its exit barrier) for node 2's; here they leave with their workers."""
    args = torchrun_args("127.0.0.1", free_port())
    try:
        with start_ranks("torch_thunderbolt", 3, tmp_path, args=args, env={"THUNDERBOLT_SECRET": SECRET},
                         per_rank={n: {"PET_NODE_RANK": str(n)} for n in range(3)}) as agents:
            finished = agents.wait(time.time() + 240)
    finally:
        kill_workers(tmp_path)
    assert finished, "\n".join(a.stderr()[-2000:] for a in agents)
    assert check_torchrun_nodes(agents) < 120  # the barrier would hold them 300 s
