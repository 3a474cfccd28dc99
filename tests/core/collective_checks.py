"""For rank programs: every collective of the torch API on W ranks, each result compared with exact values
(small integers, so every sum is exact in float32); what is wrong is collected in `bad`. Used by the lab
cluster tests and the hybrid transport tests (tests/*/programs), inside a started process group."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ExactChecks:
    """The checks of one rank; `bad` lists every wrong result (empty: all exact)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.bad: list[str] = []

    def data(self, n: int, r: int) -> torch.Tensor:
        # small integers: every sum below is exact in float32
        return (torch.arange(n, dtype=torch.float32) % 97) + 1000 * r

    def total(self, n: int) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.float32) % 97) * self.world + 1000 * sum(range(self.world))

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            diff = (got != want).nonzero()
            self.bad.append(f"{name}: {diff.numel()} wrong, first at {diff[:1].flatten().tolist()}")

    def every_collective(self) -> None:
        RANK, W, data, total, check = self.rank, self.world, self.data, self.total, self.check
        for label, n in (("small", 1000), ("large", (1 << 20) + 3)):
            t = data(n, RANK)
            dist.all_reduce(t)
            check(f"all_reduce sum {label}", t, total(n))
            t = data(n, RANK)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            check(f"all_reduce max {label}", t, data(n, W - 1))
            for root in range(W):
                t = data(n, RANK) if RANK == root else torch.zeros(n)
                dist.broadcast(t, src=root)
                check(f"broadcast root {root} {label}", t, data(n, root))
            for root in (0, W - 1):
                t = data(n, RANK)
                dist.reduce(t, dst=root)
                if RANK == root:
                    check(f"reduce root {root} {label}", t, total(n))
                else:  # non-roots keep their input
                    check(f"reduce input kept {root} {label}", t, data(n, RANK))
            outs = [torch.zeros(n) for _ in range(W)]
            dist.all_gather(outs, data(n, RANK))
            for r in range(W):
                check(f"all_gather from {r} {label}", outs[r], data(n, r))
            out = torch.zeros(n)
            dist.reduce_scatter(out, [data(n, RANK) + r for r in range(W)])
            check(f"reduce_scatter {label}", out, total(n) + W * RANK)
            outs = [torch.zeros(n) for _ in range(W)]
            dist.all_to_all(outs, [data(n, RANK) + 10 * r for r in range(W)])
            for r in range(W):
                check(f"all_to_all from {r} {label}", outs[r], data(n, r) + 10 * RANK)
            # send/recv between every ordered pair, cabled or not
            for src in range(W):
                for dst in range(W):
                    if src == dst:
                        continue
                    if RANK == src:
                        dist.send(data(n, src) + dst, dst=dst, tag=7)
                    elif RANK == dst:
                        t = torch.zeros(n)
                        dist.recv(t, src=src, tag=7)
                        check(f"send/recv {src}->{dst} {label}", t, data(n, src) + dst)
            dist.barrier()

    def check_barrier(self, delay: float) -> None:
        # barrier: nobody leaves before the last rank arrives
        if self.rank == self.world - 1:
            time.sleep(delay)
        stamp = torch.tensor([time.time()], dtype=torch.float64)
        dist.barrier()
        left = torch.tensor([time.time()], dtype=torch.float64)
        arrived = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(arrived, stamp)
        if left.item() < max(a.item() for a in arrived) - 0.05:
            self.bad.append("barrier: left before the last rank arrived")
