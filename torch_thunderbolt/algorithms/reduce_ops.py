"""Element-wise reductions for each reduce op and dtype: `out = a ⊕ b` (combiners) and `dst ⊕= src`."""
from __future__ import annotations

import contextvars
from typing import Callable

import numpy as np
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


# The sums numpy computes bit for bit as torch does: one IEEE-754 add (round to nearest) per element of a
# real float, two's-complement wrap-around for the integers; both in the calling thread, under its
# floating-point flags (flush-to-zero too). Other ops and dtypes (min/max of signed zeros, half types
# numpy lacks, bool) stay with torch.
_ARRAY_SUMS = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
ArrayCombiner = Callable[[np.ndarray, np.ndarray, np.ndarray], object]  # (out, a, b): out = a ⊕ b


def _quiet() -> contextvars.Context:
    """A context in which numpy ignores floating-point errors, as torch does: an overflow to inf is a
    result (mixed precision's loss scaling looks for it), never a warning or, under the caller's
    `np.seterr(all="raise")`, an exception after the add. numpy (2.0 and later) keeps that state in a
    context variable; `Context.run` enters this context for one add in 35 ns, `np.errstate` costs 0.5-0.8
    µs a call. One per combiner: a context is entered by one thread at a time, and a group runs one op at
    a time."""
    with np.errstate(all="ignore"):
        return contextvars.copy_context()


def array_combiner(op: str, dtype: torch.dtype) -> "tuple[type, ArrayCombiner] | None":
    """numpy's dtype and kernel for `op` on `dtype` where they give torch's exact result, for the small ops'
    buffers (viewed as arrays once): numpy's add on 4 KB costs 0.4 µs, a torch kernel call 1 µs, most of
    a small all_reduce's arithmetic. None: combine with torch."""
    np_dtype = _ARRAY_SUMS.get(dtype) if op in ("sum", "avg", "premul_sum") else None
    if np_dtype is None:
        return None
    run, add = _quiet().run, np.add

    def combine(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        run(add, a, b, out=out)

    return np_dtype, combine
