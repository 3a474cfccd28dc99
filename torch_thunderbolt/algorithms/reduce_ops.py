"""Element-wise reductions for each reduce op and dtype: `out = a ⊕ b` (combiners) and `dst ⊕= src`."""
from __future__ import annotations

from typing import Callable

import torch

Reducer = Callable[[torch.Tensor, torch.Tensor], object]  # dst ⊕= src; return value ignored
Combiner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]  # (out, a, b): out = a ⊕ b
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_BITWISE_OK = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _out(fn: Callable) -> Combiner:
    def combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        fn(a, b, out=out)

    return combine


def make_combiner(op: str, dtype: torch.dtype) -> Combiner:
    """`out = a ⊕ b` in one pass (`out` may be `a`); raises ValueError for combinations torch cannot compute.
    avg and premul_sum combine as sums: the caller divides or pre-multiplies."""
    if op in ("sum", "avg", "premul_sum"):
        # Checked before the bool case: AVG or PREMUL_SUM of bools would reduce, then fail to divide or scale.
        if op in ("avg", "premul_sum") and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"ReduceOp.{op.upper()} needs a floating-point tensor, got {dtype}")
        if dtype == torch.bool:
            return _out(torch.logical_or)
        return _out(torch.add)
    if op == "product":
        return _out(torch.logical_and if dtype == torch.bool else torch.mul)
    if op in ("min", "max"):
        if dtype.is_complex:
            raise ValueError(f"ReduceOp.{op.upper()} is not defined for complex tensors ({dtype})")
        return _out(torch.minimum if op == "min" else torch.maximum)
    if op in ("band", "bor", "bxor"):
        if dtype not in _BITWISE_OK:
            raise ValueError(f"ReduceOp.{op.upper()} needs an integer or bool tensor, got {dtype}")
        return _out({"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op])
    raise ValueError(f"unsupported reduce op {op!r}")


def make_reducer(op: str, dtype: torch.dtype) -> Reducer:
    """The in-place reducer `dst ⊕= src`; raises ValueError like make_combiner."""
    combine = make_combiner(op, dtype)
    return lambda d, s: combine(d, d, s)
