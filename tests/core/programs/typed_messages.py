"""Ranks of test_typed_messages.py: two ranks whose calls pair up but whose bytes mean different things (the
same byte count, another dtype or packing). Each scenario (TEST_CASE) makes one such pair of calls, then
every rank calls a barrier; both outcomes are reported, with whether the receiving tensor was left as it
was. TEST_N: elements per tensor; TEST_EARLY=1: the receiving rank posts its receive only after the message
is in (it arrived early and was kept).

- `p2p_dtype`: rank 0 sends float32[n], rank 1 receives into int32[n] (filled with 7).
- `p2p_any_source`: the same, received from any source.
- `coalesced_dtype`: all_gather_coalesced of [float32[n]] on rank 0, [int32[n]] on rank 1.
- `coalesced_layout`: all_reduce_coalesced of [float32[n], float32[n]] on rank 0, [float32[2n]] on rank 1.
- `sparse_shape`: all_reduce of a sparse COO tensor of shape (n,) on rank 0 and (2n,) on rank 1, same entries.
- `compressed_dtype`: all_reduce of float32[n] on rank 0 and float64[n] on rank 1 under THUNDERBOLT_COMPRESSION
  (both compressed to the same bytes).
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, outcome, result

SENTINEL = 7


def typed() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("TB_TIMEOUT", "20")))
    dist.init_process_group("thunderbolt", timeout=timeout)
    r = dist.get_rank()
    case, n = os.environ["TEST_CASE"], int(os.environ.get("TEST_N", "2"))
    early = os.environ.get("TEST_EARLY") == "1"
    dist.barrier()  # every rank connected: a rank that fails below cannot look like a slow start to the other
    kept: dict = {}

    def call() -> None:
        if case in ("p2p_dtype", "p2p_any_source"):
            if r == 0:
                dist.send(torch.arange(n, dtype=torch.float32) + 1.5, 1)
            else:
                y = kept["y"] = torch.full((n,), SENTINEL, dtype=torch.int32)
                if early:
                    time.sleep(1.0)  # the message is in before the receive is posted
                dist.recv(y, None if case == "p2p_any_source" else 0)
        elif case == "coalesced_dtype":
            dtype = torch.float32 if r == 0 else torch.int32
            x = torch.arange(n).to(dtype) + 1
            outs = kept["outs"] = [[torch.full((n,), SENTINEL, dtype=dtype)] for _ in range(2)]
            dist.all_gather_coalesced(outs, [x])
        elif case == "coalesced_layout":
            xs = [torch.ones(n), torch.ones(n)] if r == 0 else [torch.ones(2 * n)]
            kept["xs"] = xs
            dist.all_reduce_coalesced(xs)
        elif case == "compressed_dtype":
            dist.all_reduce(torch.ones(n, dtype=torch.float32 if r == 0 else torch.float64))
        elif case == "sparse_shape":
            size = n if r == 0 else 2 * n
            s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (size,))
            kept["s"] = s
            dist.all_reduce(s)
        else:
            raise ValueError(case)

    got = outcome(call)
    got["after"] = outcome(dist.barrier)
    if "y" in kept:
        got["untouched"] = bool((kept["y"] == SENTINEL).all())
    if "outs" in kept:  # this rank's own block may be filled in before any traffic; the peer's must not be
        got["untouched"] = bool((kept["outs"][1 - r][0] == SENTINEL).all())
    result(got)


if __name__ == "__main__":
    main({"typed": typed})
