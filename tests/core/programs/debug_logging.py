"""Ranks of test_debug_logging.py: a group's set-up and two ops, whatever THUNDERBOLT_DEBUG says to log."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, result


def two_ops() -> None:
    dist.init_process_group("thunderbolt")
    x = torch.ones(1000)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    dist.broadcast(x, 0)
    result({"ok": True})


if __name__ == "__main__":
    main({"two_ops": two_ops})
