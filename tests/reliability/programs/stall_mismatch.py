"""Ranks of test_stall_mismatch.py on 3 ranks (2 for "order"): one rank stalls, or the ranks make calls that
do not match; each rank reports how its call went and how the next all_reduce went.

- `stall`: rank 2 stops calling collectives for 4 s; the others all_reduce TB_NBYTES bytes.
- `mismatch`: each rank makes the call TB_KIND names (CALLS below).
Environment: TB_TIMEOUT (the group's timeout).
"""
from __future__ import annotations

import datetime
import os
import time
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, outcome, result

# Each kind: rank r's call. Every rank must fail with MismatchError (the test knows each kind's world size).
CALLS: Mapping[str, Callable[[int], object]] = MappingProxyType({
    "collective": lambda r: (dist.all_reduce(torch.ones(300)) if r != 1 else
                             dist.all_gather_into_tensor(torch.empty(300), torch.ones(100))),
    "order": lambda r: ((dist.all_reduce(torch.ones(50)), dist.broadcast(torch.ones(50), 0)) if r == 0 else
                        (dist.broadcast(torch.ones(50), 0), dist.all_reduce(torch.ones(50)))),
    "size-one-rank": lambda r: dist.all_reduce(torch.ones(1000 if r == 2 else 999)),
    "dtype-ring": lambda r: dist.all_reduce(torch.ones(1 << 20, dtype=torch.float32 if r else torch.int32)),
    "root": lambda r: dist.broadcast(torch.full((100,), float(r)), src=0 if r == 0 else 1),
})


def _init() -> int:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))
    return dist.get_rank()


def stall() -> None:
    r = _init()
    nbytes = int(os.environ["TB_NBYTES"])

    def op() -> None:
        if r == 2:
            time.sleep(4)  # stops calling collectives (the others time out at 2 s)
            return
        dist.all_reduce(torch.ones(nbytes // 4))
    result(outcome(op))


def mismatch() -> None:
    r = _init()
    call = CALLS[os.environ["TB_KIND"]]
    res = outcome(lambda: call(r))
    res["after"] = outcome(lambda: dist.all_reduce(torch.ones(3)))
    result(res)


if __name__ == "__main__":
    main({"stall": stall, "mismatch": mismatch})
