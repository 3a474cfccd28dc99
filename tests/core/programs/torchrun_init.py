"""A worker of test_torchrun_init.py, started by torchrun: it starts the default group with
init_method=thunderbolt://127.0.0.1:TB_PORT (another port than torchrun's own store, or that one) and
reports (RESULT, with its rank) whether that worked and what one all_reduce gave."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, outcome, register_pid, result


def init() -> None:
    register_pid()  # torchrun starts workers in sessions of their own: the test kills them by pid
    port = os.environ["TB_PORT"] or os.environ["MASTER_PORT"]
    got = outcome(lambda: dist.init_process_group("thunderbolt", init_method=f"thunderbolt://127.0.0.1:{port}",
                                                  timeout=datetime.timedelta(seconds=30)))
    got["rank"] = int(os.environ["RANK"])
    if got["ok"]:
        x = torch.ones(4) * (dist.get_rank() + 1)
        dist.all_reduce(x)
        got["sum"] = x.tolist()
        dist.barrier()  # rank 0 serves the store: nobody leaves while a peer still needs it
        dist.destroy_process_group()
    result(got)


if __name__ == "__main__":
    main({"init": init})
