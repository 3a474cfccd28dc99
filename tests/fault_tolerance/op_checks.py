"""For rank programs: every op family of the torch API on one group (`group=`, group ranks through
`group_src`/`group_dst`), each result compared with the reference computed on this rank alone
(algorithms/reference.py over every rank's input, which each rank can make: `data`). What is wrong is
collected in `bad` (empty: all exact). Values are small integers, so every sum, product and average is exact
in each dtype used, whatever order an algorithm reduces in."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from torch_thunderbolt.algorithms import reference

# (dtype, reduce ops) of the all_reduces: floats and integers, the bitwise ops on integers only
ALL_REDUCE = ((torch.float32, ("sum", "product", "min", "max", "avg")), (torch.float64, ("sum", "max")),
              (torch.bfloat16, ("sum",)), (torch.int64, ("sum", "product", "min", "band", "bor", "bxor")),
              (torch.int32, ("max", "sum")), (torch.uint8, ("bor",)))
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
SMALL, LARGE = 100, (1 << 18) + 3  # one message; many chunks (and the hierarchical plans between hosts)


class GroupChecks:
    """The checks of this rank in `group` (None: the default group); `bad` lists every wrong result."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.bad: list[str] = []

    def data(self, n: int, r: int, dtype: torch.dtype = torch.float32, op: str = "sum") -> torch.Tensor:
        """Rank r's input: small integers (1 or 2 for a product, a multiple of the world for an average)."""
        base = torch.arange(n, dtype=torch.int64)
        if op == "product":
            x = (base + r) % 2 + 1
        elif op == "avg":
            x = ((base % 13) + r) * self.world
        elif dtype in (torch.bfloat16, torch.uint8):
            x = (base % 7) + 3 * r + 1
        else:
            x = (base % 97) + 1000 * r + 1
        return x.to(dtype)

    def inputs(self, n: int, dtype: torch.dtype = torch.float32, op: str = "sum") -> list[torch.Tensor]:
        return [self.data(n, r, dtype, op) for r in range(self.world)]

    def total(self, n: int) -> torch.Tensor:
        """The sum of every rank's `data(n, r)`."""
        return reference.reduce_all(self.inputs(n), "sum")

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape:
            self.bad.append(f"{name}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
        elif not torch.equal(got, want):
            diff = (got != want).nonzero()
            self.bad.append(f"{name}: {diff.numel()} wrong, first at {diff[:1].flatten().tolist()}")

    def every_op(self) -> list[str]:
        """Every op family once or more; returns `bad`."""
        self.all_reduces()
        for label, n in (("small", SMALL), ("large", LARGE)):
            self.rooted(label, n)
            self.gathers(label, n)
            self.point_to_point(label, n)
        self.objects()
        self.barrier(0.2)
        return self.bad

    def all_reduces(self) -> None:
        g, r = self.group, self.rank
        for dtype, ops in ALL_REDUCE:
            for op in ops:
                sizes = (SMALL, LARGE) if dtype == torch.float32 and op in ("sum", "max") else (SMALL,)
                for n in sizes:
                    t = self.data(n, r, dtype, op)
                    dist.all_reduce(t, op=OPS[op], group=g)
                    want = reference.reduce_all(self.inputs(n, dtype, op), op)
                    self.check(f"all_reduce {op} {dtype} {n}", t, want.to(dtype))

    def rooted(self, label: str, n: int) -> None:
        g, r, w = self.group, self.rank, self.world
        for root in range(w):
            t = self.data(n, r) if r == root else torch.zeros(n)
            dist.broadcast(t, group=g, group_src=root)
            self.check(f"broadcast root {root} {label}", t, self.data(n, root))
        for root in (0, w - 1):
            t = self.data(n, r)
            dist.reduce(t, group=g, group_dst=root)
            self.check(f"reduce root {root} {label}", t,
                       reference.reduce_all(self.inputs(n), "sum") if r == root else self.data(n, r))
        root = w - 1
        outs = [torch.zeros(n) for _ in range(w)] if r == root else None
        dist.gather(self.data(n, r), outs, group=g, group_dst=root)
        if r == root:
            for q in range(w):
                self.check(f"gather from {q} {label}", outs[q], self.data(n, q))
        t = torch.zeros(n)
        dist.scatter(t, [self.data(n, q) + 5 for q in range(w)] if r == 0 else None, group=g, group_src=0)
        self.check(f"scatter {label}", t, self.data(n, r) + 5)

    def gathers(self, label: str, n: int) -> None:
        g, r, w = self.group, self.rank, self.world
        outs = [torch.zeros(n) for _ in range(w)]
        dist.all_gather(outs, self.data(n, r), group=g)
        self.check(f"all_gather {label}", torch.cat(outs), reference.all_gather(self.inputs(n))[r])
        flat = torch.zeros(n * w, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, self.data(n, r, torch.int64), group=g)
        self.check(f"all_gather_into_tensor {label}", flat, reference.all_gather(self.inputs(n, torch.int64))[r])
        # reduce_scatter of w blocks of n: rank q's input is its data over every block, plus the block's index
        blocks = [torch.cat([self.data(n, q) + b for b in range(w)]) for q in range(w)]
        want = reference.reduce_scatter(blocks, "sum", [n] * w)[r]
        out = torch.zeros(n)
        dist.reduce_scatter(out, list(blocks[r].split(n)), group=g)
        self.check(f"reduce_scatter {label}", out, want)
        out = torch.zeros(n)
        dist.reduce_scatter_tensor(out, blocks[r], group=g)
        self.check(f"reduce_scatter_tensor {label}", out, want)
        # all_to_all with uneven splits: rank q sends q + p + 1 elements of its data to rank p
        splits = [[q + p + 1 for p in range(w)] for q in range(w)]
        sends = [self.data(sum(s), q) for q, s in enumerate(splits)]
        want = reference.all_to_all(sends, splits)[r]
        outs = [torch.zeros(splits[q][r]) for q in range(w)]
        dist.all_to_all(outs, list(sends[r].split(splits[r])), group=g)
        self.check(f"all_to_all {label}", torch.cat(outs), want)
        out = torch.zeros(want.numel())
        dist.all_to_all_single(out, sends[r], [splits[q][r] for q in range(w)], splits[r], group=g)
        self.check(f"all_to_all_single {label}", out, want)

    def point_to_point(self, label: str, n: int) -> None:
        g, r, w = self.group, self.rank, self.world
        for src in range(w):
            for dst in range(w):
                if src == dst:
                    continue
                if r == src:
                    dist.send(self.data(n, src) + dst, group=g, group_dst=dst, tag=7)
                elif r == dst:
                    t = torch.zeros(n)
                    dist.recv(t, group=g, group_src=src, tag=7)
                    self.check(f"send/recv {src}->{dst} {label}", t, self.data(n, src) + dst)
        reqs, got = [], {}
        for p in range(w):
            if p != r:
                reqs.append(dist.isend(self.data(n, r) * 2, group=g, group_dst=p, tag=8))
                got[p] = torch.zeros(n)
                reqs.append(dist.irecv(got[p], group=g, group_src=p, tag=8))
        for req in reqs:
            req.wait()
        for p, t in got.items():
            self.check(f"isend/irecv {p}->{r} {label}", t, self.data(n, p) * 2)

    def objects(self) -> None:
        g, r, w = self.group, self.rank, self.world
        objs: list[Any] = [None] * w
        dist.all_gather_object(objs, {"rank": r, "text": "x" * r}, group=g)
        if objs != [{"rank": q, "text": "x" * q} for q in range(w)]:
            self.bad.append(f"all_gather_object: {objs}")
        box: list[Any] = [("root", w - 1)] if r == w - 1 else [None]
        dist.broadcast_object_list(box, group=g, group_src=w - 1)
        if box != [("root", w - 1)]:
            self.bad.append(f"broadcast_object_list: {box}")

    def barrier(self, delay: float) -> None:
        """Nobody leaves the barrier before the last rank arrives (it comes `delay` seconds late)."""
        g, r, w = self.group, self.rank, self.world
        if r == w - 1:
            time.sleep(delay)
        stamp = torch.tensor([time.time()], dtype=torch.float64)
        dist.barrier(group=g)
        left = time.time()
        arrived = [torch.zeros(1, dtype=torch.float64) for _ in range(w)]
        dist.all_gather(arrived, stamp, group=g)
        if left < max(a.item() for a in arrived) - 0.05:
            self.bad.append("barrier: left before the last rank arrived")
