"""Ranks of test_large_messages.py: send/recv and all_to_all_single of one message over INT_MAX bytes between
two ranks (only the marked pages of the tensors are touched, so the rest stays unallocated)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, result


def over_int_max() -> None:
    INT_MAX = 2**31 - 1
    N = INT_MAX + 1 + 4099   # bytes to the peer, in one message
    SMALL = 3                # all_to_all: bytes each rank keeps for itself
    dist.init_process_group("thunderbolt")
    rank = dist.get_rank()
    marks = [0, 1, (1 << 30) - 1, 1 << 30, INT_MAX, INT_MAX + 1, N - 1]
    # all_to_all splits: rank 0 keeps its first SMALL bytes and sends the N after them; rank 1 sends its first N.
    splits = [SMALL, N] if rank == 0 else [N, SMALL]
    to_peer = slice(SMALL, SMALL + N) if rank == 0 else slice(0, N)
    from_peer = slice(SMALL, SMALL + N) if rank == 0 else slice(0, N)
    kept = slice(0, SMALL) if rank == 0 else slice(N, N + SMALL)
    # Only the marked pages of the input are touched: the rest stays unallocated (zero pages).
    inp = torch.empty(SMALL + N, dtype=torch.uint8)
    inp[kept] = 7
    for i, pos in enumerate(marks):
        inp[to_peer][pos] = 10 * rank + i + 1
    out = torch.zeros(SMALL + N, dtype=torch.uint8)
    t0 = time.monotonic()
    if rank == 0:
        dist.send(inp[to_peer], dst=1)
    else:
        dist.recv(out[from_peer], src=0)
    p2p = [int(out[from_peer][p]) for p in marks] if rank == 1 else None
    t1 = time.monotonic()
    out[from_peer][torch.tensor(marks)] = 0
    dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=splits)
    a2a = [int(out[from_peer][p]) for p in marks]
    kept = out[kept].tolist()
    t2 = time.monotonic()
    dist.destroy_process_group()
    result({"p2p": p2p, "a2a": a2a, "kept": kept, "seconds": [t1 - t0, t2 - t1]})


if __name__ == "__main__":
    main({"over_int_max": over_int_max})
