"""Independent reference for the documented error bounds (element by element, plain loops)."""
from __future__ import annotations

import math

import torch

from torch_thunderbolt.compression import float16_error_bound, int8_error_bound


def int8_bound(inputs: torch.Tensor, block: int) -> torch.Tensor:
    """inputs [W, n] -> per-element bound: sum over ranks of the absmax of the element's block / 127."""
    world, n = inputs.shape
    shard = math.ceil(n / world) if n else 0
    absmax_sum = torch.zeros(n, dtype=torch.float64)
    for start in range(0, n, shard or 1):  # shard by shard, then block by block inside the shard
        stop_shard = min(start + shard, n)
        for b in range(start, stop_shard, block):
            part = slice(b, min(b + block, stop_shard))
            absmax_sum[part] = inputs[:, part].abs().amax(dim=1).double().sum()
    return torch.tensor([int8_error_bound(v, world) for v in absmax_sum.tolist()], dtype=torch.float64)


def float16_bound(inputs: torch.Tensor, mode: str) -> torch.Tensor:
    world = inputs.shape[0]
    abs_sum = inputs.abs().double().sum(dim=0)
    if mode == "none":  # plain fp32 all_reduce: only fp32 summation rounding
        return (world + 3) * 2.0**-24 * abs_sum
    return torch.tensor([float16_error_bound(mode, v, world) for v in abs_sum.tolist()], dtype=torch.float64)


def bound(inputs: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    return int8_bound(inputs, block) if mode == "int8" else float16_bound(inputs, mode)


def check_within_bound(result: torch.Tensor, inputs: torch.Tensor, mode: str, block: int) -> float:
    """Assert |result - exact| <= bound for every element; return the largest error / bound ratio."""
    exact = inputs.double().sum(dim=0)
    err = (result.double().reshape(-1) - exact).abs()
    limit = bound(inputs, mode, block)
    worst = torch.nonzero(err > limit).flatten()
    assert worst.numel() == 0, (
        f"{mode}: {worst.numel()} elements out of bound, first at {worst[0].item()}: "
        f"err {err[worst[0]].item():.3g} > bound {limit[worst[0]].item():.3g}"
    )
    ratio = err / limit.clamp_min(1e-300)
    return ratio.max().item() if ratio.numel() else 0.0
