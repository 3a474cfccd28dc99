"""Elastic restarts on three emulated Macs (network namespaces cabled in a ring): one torchrun agent per Mac,
`--nnodes=2:3 --max-restarts=3 --rdzv-backend=c10d` with the rendezvous store on mac0, each agent given its
Mac's cable address (`--local-addr`) and cables (THUNDERBOLT_IFNAME), running examples/elastic_train.py.
Mid-training mac2 is lost, either with its processes killed or with both its cables cut (it lives on,
unreachable); mac0 and mac1 restart, re-form as 2 ranks, resume from the last checkpoint and finish with
the reference's weights (how the reference is built: tests/reliability/test_elastic.py)."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab
from torch_thunderbolt.testing.reliability.elastic import (Schedule, cut_cables, lab_job, max_relative_difference,
                                                            reference_weights, restart_figures)

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

SECRET = "3c9e1f7a5b2d8e4c6a0f9b1d7e3c5a8f"  # any 32+ random characters, the same on every Mac
SCHEDULE = Schedule(steps=40, every=5, pace=0.25)
TOLERANCE = 1e-9


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["killed", "cables cut"])
def test_losing_one_of_three_macs_restarts_on_two_and_reaches_the_reference(fault: str, tmp_path) -> None:
    skip_unless_lab()
    with lab_session(3, "ring", cc="reno") as lab:
        with lab_job(lab, tmp_path / "job", schedule=SCHEDULE, env={"THUNDERBOLT_SECRET": SECRET}) as job:
            ready = job.wait_for(lambda e: e["event"] == "checkpoint" and e["world"] == 3 and e["step"] >= 10, 300)
            assert ready is not None, "the job never checkpointed on 3 Macs\n" + job.report()
            lost_at = job.kill_agent(2) if fault == "killed" else cut_cables(lab, 2)
            assert job.wait([0, 1], 400), "mac0 and mac1 did not finish after mac2 was lost\n" + job.report()
            assert [job.agents[i].proc.returncode for i in (0, 1)] == [0, 0], job.report()
            figures = restart_figures(job.events(), lost_at)
            final = torch.load(job.final, weights_only=True)
    assert figures and figures["world"] == 2 and figures["from_step"] >= 10, (figures, job.report())
    done = [e for e in job.events() if e["event"] == "done"]
    assert sorted(e["agent"] for e in done) == [0, 1] and {e["world"] for e in done} == {2}, done
    assert max_relative_difference(final, reference_weights(tmp_path, SCHEDULE)) < TOLERANCE
