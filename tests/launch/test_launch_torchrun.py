"""`torch-thunderbolt torchrun`: torchrun whose agent, when its node's workers failed, checks in at the exit
barrier on its way out, so the other nodes' agents leave it when their own workers are done (torchrun's
would wait 300 s). Two nodes on this host, workers without torch: node 1's fails at once, node 0's finishes a
moment later. The job that shrinks under it: test_launch_shrink_job.py."""
from __future__ import annotations

import time

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.cli.torchrun import prepare_argv
from torch_thunderbolt.testing.ranks import free_port, start_ranks

WORKER = r"""
import os, sys, time
if os.environ["GROUP_RANK"] == "1":
    sys.exit(3)
time.sleep(2)  # node 0 finishes after node 1 failed
print("node 0 finished", flush=True)
"""


def test_our_option_comes_first_and_torchruns_pass_through() -> None:
    assert prepare_argv(["--nnodes", "2", "x.py", "--exit-barrier-timeout", "4"]) == \
        ["--", "--nnodes", "2", "x.py", "--exit-barrier-timeout", "4"]
    assert prepare_argv(["--exit-barrier-timeout", "5", "--nnodes", "2"]) == ["--exit-barrier-timeout", "5", "--",
                                                                               "--nnodes", "2"]
    assert prepare_argv(["--exit-barrier-timeout=5", "--", "x.py"]) == ["--exit-barrier-timeout=5", "--", "x.py"]
    assert prepare_argv(["--help"]) == ["--help"]


def test_bad_input_is_one_clear_error(capsys) -> None:
    assert main(["torchrun"]) == 2
    assert main(["torchrun", "--exit-barrier-timeout", "0", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "expected torchrun's arguments" in err and "--exit-barrier-timeout must be > 0 seconds, got 0.0" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_failed_node_does_not_hold_the_others_in_the_exit_barrier(tmp_path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    args = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), "--monitor-interval", "0.1", str(worker)]
    with start_ranks("torch_thunderbolt", 2, tmp_path, args=args, per_rank={n: {"PET_NODE_RANK": str(n)}
                                                                           for n in range(2)}) as agents:
        finished = agents.wait(time.time() + 120)
    detail = "\n".join(f"--- node {a.rank} (exit {a.returncode}):\n{a.stderr()[-2500:]}" for a in agents)
    assert finished, detail
    assert [a.returncode for a in agents] == [0, 1], detail
    assert "node 0 finished" in agents[0].stdout()
    assert "node 1's workers failed; counted as arrived at the exit barrier" in agents[1].stderr(), detail
    assert "exitcode  : 3" in agents[1].stderr()  # torchrun's own report of the failed worker
    # torchrun's barrier would hold node 0 for 300 s; here it leaves once its worker is done.
    assert agents[0].exited_at - agents[1].exited_at < 60, detail
