"""Ranks of test_rank_names.py: an error in a subgroup, as the surviving rank reads it."""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, main, outcome, result


def subgroup_peer_lost() -> Exit | None:
    """3 ranks; in new_group([1, 2]) global rank 2 (group rank 1) dies: global rank 1 reports its error."""
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=30))
    r = dist.get_rank()
    g = dist.new_group([1, 2])
    if r == 0:
        time.sleep(4)  # keeps the store up while the others work
        result({"ok": True})
        return None
    x = torch.ones(1000)
    dist.all_reduce(x, group=g)
    if r == 2:
        return Exit(0, hard=True)  # gone without a word, as a crash would
    time.sleep(0.5)
    result(outcome(lambda: dist.all_reduce(x, group=g)))
    return Exit(0, hard=True)


if __name__ == "__main__":
    main({"subgroup_peer_lost": subgroup_peer_lost})
