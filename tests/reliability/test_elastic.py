"""Elastic restarts with torchrun on one host: three torchrun agents on loopback stand for three Macs
(`--nnodes=2:3 --max-restarts=3 --rdzv-backend=c10d`, one worker each) running examples/elastic_train.py.
Mid-training one agent is killed with its worker (a Mac gone) or only its worker (a rank that crashed);
the agents left restart their workers, which re-form the group (2 ranks, or 3 again), resume from the last
checkpoint and finish. The final weights must equal the reference.

How the reference is built: the example's `--reference` mode trains the same model from the same seed, one
process without torch.distributed, on the whole global batch of each step (the batch of step s is made
from (seed, s) alone). The job's ranks train on equal slices of that same batch and DDP averages their
gradients, so at any world size, and across a restart that re-runs the steps after the last checkpoint
on the same batches, every step applies the full-batch gradient: the weights agree with the reference up
to the order of float64 additions (relative 1e-15 per step; the bound below is 1e-9). One step more or
less moves them by about 1e-3 (checked below), so the comparison tells a resumed run from a wrong one.

The emulated-Mac version (network namespaces): tests/lab_cluster/test_lab_elastic.py."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import free_port
from torch_thunderbolt.testing.reliability.elastic import (ElasticJob, Schedule, max_relative_difference,
                                                            reference_weights, restart_figures)

pytestmark = [pytest.mark.multiprocess]

TOLERANCE = 1e-9
SCHEDULE = Schedule(steps=40, every=5, pace=0.25)


def _kill_mid_training_and_finish(tmp_path, fault: str) -> tuple[ElasticJob, dict, dict]:
    """Three agents; once rank 0 checkpointed step 10 or later with 3 ranks, `fault` on agent 2 (agent 0
    holds the rendezvous store); the job must finish. Returns the job, the restart's figures and the
    final weights."""
    import torch

    with ElasticJob(tmp_path / "job", 3, ("127.0.0.1", free_port()), min_nodes=2, schedule=SCHEDULE,
                    env={"THUNDERBOLT_TRANSPORT": "tcp"}) as job:
        ready = job.wait_for(lambda e: e["event"] == "checkpoint" and e["world"] == 3 and e["step"] >= 10, 240)
        assert ready is not None, "the job never checkpointed with 3 ranks\n" + job.report()
        killed_at = job.kill_agent(2) if fault == "agent" else job.kill_worker(2)
        survivors = [0, 1] if fault == "agent" else [0, 1, 2]
        assert job.wait(survivors, 300), "the job did not finish after the kill\n" + job.report()
        for i in survivors:
            assert job.agents[i].proc.returncode == 0, job.report()
        figures = restart_figures(job.events(), killed_at)
        assert job.final.exists(), job.report()
        return job, figures, torch.load(job.final, weights_only=True)


@pytest.mark.timeout(420)
def test_a_mac_gone_mid_training_the_others_restart_with_two_ranks_and_reach_the_reference(tmp_path) -> None:
    job, figures, final = _kill_mid_training_and_finish(tmp_path, "agent")
    assert figures, "no restart after the kill\n" + job.report()
    assert figures["world"] == 2 and figures["restart"] >= 1, figures
    assert figures["from_step"] >= 10 and figures["from_step"] % SCHEDULE.every == 0, figures
    done = [e for e in job.events() if e["event"] == "done"]
    assert {e["world"] for e in done} == {2} and len(done) == 2, done
    reference = reference_weights(tmp_path, SCHEDULE)
    assert max_relative_difference(final, reference) < TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_crashed_rank_is_restarted_by_its_agent_and_the_three_reach_the_reference(tmp_path) -> None:
    job, figures, final = _kill_mid_training_and_finish(tmp_path, "worker")
    assert figures and figures["world"] == 3 and figures["from_step"] >= 10, (figures, job.report())
    reference = reference_weights(tmp_path, SCHEDULE)
    assert max_relative_difference(final, reference) < TOLERANCE


def test_the_comparison_tells_one_step_apart(tmp_path) -> None:
    """The reference after one step less is far outside the tolerance: a run that skipped or repeated a
    step after its restart would fail the tests above."""
    short = Schedule(steps=SCHEDULE.steps - 1, every=SCHEDULE.every)
    gap = max_relative_difference(reference_weights(tmp_path, short), reference_weights(tmp_path, SCHEDULE))
    assert gap > 1e4 * TOLERANCE, gap


def test_the_documented_torchrun_lines_are_the_ones_tested(tmp_path) -> None:
    """docs/fault-tolerance.md's command for the first Mac and the others: the options the tests run, in
    the same order, with the same rendezvous settings (values of addresses, ids and limits aside)."""
    import re

    from torch_thunderbolt.testing.ranks import REPO
    from torch_thunderbolt.testing.reliability.elastic import SHARED_STORE_OFF

    text = (REPO / "docs" / "fault-tolerance.md").read_text()
    assert f"export THUNDERBOLT_SECRET=@$HOME/.tb-secret {SHARED_STORE_OFF}=1" in text
    lines = re.findall(r"^torchrun (.*?) examples/elastic_train.py .*# (first Mac|other Macs)$", text, re.M)
    assert [which for _, which in lines] == ["first Mac", "other Macs"]
    job = ElasticJob(tmp_path, 3, ("10.77.0.1", 29400), min_nodes=2)

    def shape(words: list[str]) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for w in words:
            name, _, value = w.partition("=")
            if name == "--rdzv-conf":
                conf = dict(kv.split("=") for kv in value.split(","))
                out.append((name, [(k, conf[k] if k == "is_host" else "") for k in conf]))
            else:
                out.append((name, value if name in ("--nproc-per-node", "--rdzv-backend") else ""))
        return out

    for i, (line, _) in zip((0, 1), lines):
        assert shape(line.split()) == shape(job.options(i)), (line, job.options(i))
