"""Turning torch's tensor arguments into flat contiguous CPU buffers, and writing results back.

Tensors on other devices (mps, cuda) or non-contiguous ones are staged through a host copy; results are
copied back in place when the op finishes.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor", dist.ReduceOp.PREMUL_SUM: "premul_sum",
}


def reduce_op(op: object) -> tuple[str, object]:
    """(name, premul factor) of a torch ReduceOp (or RedOpType)."""
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"unsupported reduce op {op!r}")
    return name, getattr(op, "factor", None) if name == "premul_sum" else None


class Staged:
    """A flat CPU view of `t`, plus what it takes to put results back."""

    __slots__ = ("orig", "flat", "copied")

    def __init__(self, t: torch.Tensor, read: bool = True) -> None:
        self.orig = t
        if t.is_cpu and t.is_contiguous():
            self.flat = t.view(-1) if t.dim() != 1 else t
            self.copied = False
        else:
            src = t.detach().to("cpu") if read else torch.empty(t.shape, dtype=t.dtype)
            self.flat = src.contiguous().view(-1)
            self.copied = True

    def write_back(self) -> None:
        if self.copied:
            self.orig.copy_(self.flat.view(self.orig.shape))


def flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1 and tensors[0].is_cpu and tensors[0].is_contiguous():
        t = tensors[0]
        return t if t.dim() == 1 else t.view(-1)  # each torch call costs ~1 µs, as much as a small send
    return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors]) if tensors else torch.empty(0)


def split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    off = 0
    for o in outs:
        n = o.numel()
        o.copy_(flat[off : off + n].view(o.shape))
        off += n


def check_same_dtype(tensors: list[torch.Tensor], what: str, rank: int) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"rank {rank}: {what} got tensors of different dtypes {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def rows_to_elems(t: torch.Tensor, splits: list[int] | None, world: int, what: str, rank: int) -> list[int]:
    """all_to_all_single split sizes (in rows of dim 0) to element counts."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if rows % world:
            raise ValueError(f"rank {rank}: {what}: dim 0 ({rows}) is not divisible by world size {world}")
        return [rows // world * per_row] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"rank {rank}: {what}: split sizes {list(splits)} do not cover dim 0 ({rows}) "
                         f"for world size {world}")
    return [s * per_row for s in splits]


WriteBack = Callable[[], None]
