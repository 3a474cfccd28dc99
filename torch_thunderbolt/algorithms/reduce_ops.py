"""In-place element-wise reductions (dst ⊕= src) for each reduce op and dtype."""
from __future__ import annotations

from typing import Callable

import torch

Reducer = Callable[[torch.Tensor, torch.Tensor], object]  # return value ignored
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_BITWISE_OK = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _minimum(d: torch.Tensor, s: torch.Tensor) -> None:
    torch.minimum(d, s, out=d)


def _maximum(d: torch.Tensor, s: torch.Tensor) -> None:
    torch.maximum(d, s, out=d)


def make_reducer(op: str, dtype: torch.dtype) -> Reducer:
    """The in-place reducer; raises ValueError for combinations torch cannot compute."""
    if op in ("sum", "avg", "premul_sum"):
        if dtype == torch.bool:
            return lambda d, s: d.logical_or_(s)
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype}")
        return lambda d, s: d.add_(s)
    if op == "product":
        if dtype == torch.bool:
            return lambda d, s: d.logical_and_(s)
        return lambda d, s: d.mul_(s)
    if op in ("min", "max"):
        if dtype.is_complex:
            raise ValueError(f"ReduceOp.{op.upper()} is not defined for complex tensors ({dtype})")
        return _minimum if op == "min" else _maximum
    if op in ("band", "bor", "bxor"):
        if dtype not in _BITWISE_OK:
            raise ValueError(f"ReduceOp.{op.upper()} needs an integer or bool tensor, got {dtype}")
        fn = {"band": torch.Tensor.bitwise_and_, "bor": torch.Tensor.bitwise_or_,
              "bxor": torch.Tensor.bitwise_xor_}[op]
        return lambda d, s: fn(d, s)
    raise ValueError(f"unsupported reduce op {op!r}")
