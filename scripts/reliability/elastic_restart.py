"""Time from losing a Mac to the first training step after torchrun's elastic restart: three torchrun agents
(`--nnodes=2:3 --max-restarts=3 --rdzv-backend=c10d`, one worker each) run examples/elastic_train.py; once
rank 0 checkpointed step 10 with 3 ranks, the third is lost, and the two left restart and go on.

    python scripts/reliability/elastic_restart.py --where host --fault agent --repeats 3
    sudo .venv/bin/python scripts/reliability/elastic_restart.py --where lab --fault cut --repeats 3

--where host: three agents on loopback (THUNDERBOLT_TRANSPORT=tcp); lab: three emulated Macs in a ring
(root). --fault agent: the third agent and its worker killed; worker: only its worker killed (its agent
restarts it: 3 ranks again); cut (lab only): both of the third Mac's cables down. Each repeat prints the
restarted world, the step it resumed from, the seconds from the loss to the first agent seeing it (its
worker failed, or the group changed), to the agents launching new workers (rendezvous done), to
those workers' start
(group made, checkpoint loaded) and to their first step, and whether the final weights equal the
reference (examples/elastic_train.py --reference); then min-max over the repeats. The scenario:
torch_thunderbolt/testing/reliability/elastic.py. Exit status 1 if a repeat did not finish or its weights
differ.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.ranks import free_port  # noqa: E402
from torch_thunderbolt.testing.reliability.elastic import (ElasticJob, Schedule, cut_cables, lab_job,  # noqa: E402
                                                            max_relative_difference, reference_weights,
                                                            restart_figures)

SCHEDULE = Schedule(steps=40, every=5, pace=0.25)
SECRET = "3c9e1f7a5b2d8e4c6a0f9b1d7e3c5a8f"


def one_run(where: str, fault: str, workdir: Path, keep_alive: tuple[int, int]) -> dict:
    import contextlib

    import torch

    from torch_thunderbolt.testing.lab import lab_session

    with contextlib.ExitStack() as stack:
        if where == "lab":
            lab = stack.enter_context(lab_session(3, "ring", cc="reno"))
            job = stack.enter_context(lab_job(lab, workdir / "job", schedule=SCHEDULE, keep_alive=keep_alive,
                                              env={"THUNDERBOLT_SECRET": SECRET}))
        else:
            lab = None
            job = stack.enter_context(ElasticJob(workdir / "job", 3, ("127.0.0.1", free_port()), min_nodes=2,
                                                 schedule=SCHEDULE, keep_alive=keep_alive,
                                                 env={"THUNDERBOLT_TRANSPORT": "tcp"}))
        if job.wait_for(lambda e: e["event"] == "checkpoint" and e["world"] == 3 and e["step"] >= 10, 300) is None:
            return {"ok": False, "why": "never checkpointed with 3 ranks", "log": job.report()[-3000:]}
        if fault == "cut":
            lost_at = cut_cables(lab, 2)
        else:
            lost_at = job.kill_agent(2) if fault == "agent" else job.kill_worker(2)
        left = [0, 1, 2] if fault == "worker" else [0, 1]
        if not job.wait(left, 400) or any(job.agents[i].proc.returncode != 0 for i in left):
            return {"ok": False, "why": "did not finish", "log": job.report()[-3000:]}
        figures = restart_figures(job.events(), lost_at, job)
        gap = max_relative_difference(torch.load(job.final, weights_only=True), reference_weights(workdir, SCHEDULE))
    return {"ok": gap < 1e-9, **figures, "max_relative_difference": gap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--where", choices=("host", "lab"), default="host")
    ap.add_argument("--fault", choices=("agent", "worker", "cut"), default="agent")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-alive", default="2x3", metavar="SECONDSxTIMES",
                    help="rdzv-conf keep_alive_interval x keep_alive_max_attempt (torch's default: 5x3)")
    ap.add_argument("--json", help="write every repeat and the summary here")
    args = ap.parse_args()
    if args.fault == "cut" and args.where != "lab":
        ap.error("--fault cut needs --where lab (cables exist only between emulated Macs)")
    every, _, times = args.keep_alive.partition("x")
    keep_alive = (int(every), int(times))
    runs = []
    for k in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tb-elastic-") as tmp:
            runs.append(one_run(args.where, args.fault, Path(tmp), keep_alive))
        print(json.dumps({"repeat": k, **runs[-1]}), flush=True)
    good = [r for r in runs if r["ok"]]
    summary = {"where": args.where, "fault": args.fault, "keep_alive": args.keep_alive, "repeats": args.repeats,
               "ok": len(good)}
    for key in ("to_failure_seen_s", "to_launch_s", "to_start_s", "to_first_step_s"):
        values = [r[key] for r in good if key in r]
        summary[key] = [min(values), max(values)] if values else None
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0 if len(good) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
