"""Ranks of test_agree_ranks.py: each rank starts the default group with the THUNDERBOLT_* settings the test
gave it (they may differ between ranks) and reports how set-up went; when it worked, one all_reduce of 256 KB
of 1.5 + rank follows (above the default THUNDERBOLT_SMALL, so a compression setting applies)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, main, outcome, result


def init() -> Exit | None:
    got = outcome(lambda: dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=30)))
    if got["ok"]:
        x = torch.full((1 << 16,), 1.5 + dist.get_rank())
        got["op"] = outcome(lambda: dist.all_reduce(x))
        got["sum"] = [float(x[0]), float(x[-1])]
        dist.destroy_process_group()
    result(got)
    return None


if __name__ == "__main__":
    main({"init": init})
