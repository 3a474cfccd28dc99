"""A job that shrinks on 3 emulated Macs (root only): examples/shrink_job.py loses mac2's rank (it SIGKILLs
itself at step 5 of 20), mac0's and mac1's ranks shrink it out and finish. Under `launch --lab NAME
--on-failure shrink`, and under one `torch-thunderbolt torchrun` per Mac (the commands of
docs/fault-tolerance.md, "Running a job that shrinks"). The same on one host:
tests/launch/test_launch_shrink_job.py."""
from __future__ import annotations

import sys
import time

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.testing.lab import lab_session, lab_setup, skip_unless_lab, unique_lab_name
from torch_thunderbolt.testing.ranks import start_ranks

from ..launch.test_launch_shrink_job import (EXAMPLE, JOB, SECRET, check_survivors, check_torchrun_nodes,
                                             kill_workers, ranks_env, reports, torchrun_args)

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

PORT = 29623  # inside the lab's namespaces


@pytest.mark.timeout(240)
def test_launch_lab_on_failure_shrink(tmp_path, capsys, monkeypatch):
    skip_unless_lab()
    ranks_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    name, state = unique_lab_name(), tmp_path / "state"
    with lab_session(3, "ring", cc="reno", name=name, state_directory=str(state)):
        code = main(["launch", "--lab", name, "--lab-state-dir", str(state), "--on-failure", "shrink",
                     "--master-port", str(PORT), "--grace", "2", "--", sys.executable, str(EXAMPLE), *JOB])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    check_survivors(reports(out))
    said = [line for line in err.splitlines() if line.startswith("torch-thunderbolt launch: ")]
    assert said == ["torch-thunderbolt launch: rank 2 on mac2 exited with code 137, killed by SIGKILL; lost: "
                    "the job goes on without it, 2 rank(s) still running (--on-failure shrink)",
                    "torch-thunderbolt launch: the job shrank from 3 to 2 rank(s): lost rank 2 on mac2 (exit "
                    "code 137, killed by SIGKILL); rank(s) 0, 1 finished with code 0"], err[-4000:]


@pytest.mark.timeout(360)
def test_torchrun_one_per_emulated_mac(tmp_path):
    skip_unless_lab()
    with lab_session(3, "ring", cc="reno") as lab:
        args = torchrun_args(lab.addresses(0)[0], PORT)
        try:
            with start_ranks("torch_thunderbolt", 3, tmp_path, args=args, setup=lab_setup(lab),
                             env={"THUNDERBOLT_SECRET": SECRET},
                             per_rank={n: {"PET_NODE_RANK": str(n)} for n in range(3)}) as agents:
                finished = agents.wait(time.time() + 280)
        finally:
            kill_workers(tmp_path)
    assert finished, "\n".join(a.stderr()[-2000:] for a in agents)
    assert check_torchrun_nodes(agents) < 120  # torchrun's exit barrier would hold them 300 s
