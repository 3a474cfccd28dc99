"""Reference semantics: a few lines computing the exact answer of each collective, for tests.

Inputs are lists indexed by rank. Every real algorithm is checked against these.
"""
from __future__ import annotations

import functools

import torch

REDUCE_FNS = {
    "sum": lambda a, b: a + b if a.dtype != torch.bool else a | b,
    "product": lambda a, b: a * b if a.dtype != torch.bool else a & b,
    "min": torch.minimum,
    "max": torch.maximum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def reduce_all(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduction in rank order (the order our one-shot algorithms use)."""
    if op == "avg":
        return reduce_all(inputs, "sum") / len(inputs)
    return functools.reduce(REDUCE_FNS[op], inputs)


def all_reduce(inputs: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    out = reduce_all(inputs, op)
    return [out.clone() for _ in inputs]


def broadcast(inputs: list[torch.Tensor], root: int) -> list[torch.Tensor]:
    return [inputs[root].clone() for _ in inputs]


def all_gather(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(inputs) for _ in inputs]


def reduce_scatter(inputs: list[torch.Tensor], op: str, counts: list[int]) -> list[torch.Tensor]:
    full = reduce_all(inputs, op)
    return list(torch.split(full, counts))


def all_to_all(inputs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """splits[r][p]: elements rank r sends to rank p."""
    parts = [torch.split(x, s) for x, s in zip(inputs, splits)]
    return [torch.cat([parts[r][p] for r in range(len(inputs))]) for p in range(len(inputs))]
