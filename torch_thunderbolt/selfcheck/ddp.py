"""DistributedDataParallel on the checked backend: one step checked against the average of every rank's
gradient computed here without any exchange, and how much of the exchange a step hides behind its
backward pass (the measure of scripts/ddp_overlap.py, on a smaller model)."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..bench.metrics import hidden_share

# The overlap model: ~2.4 M parameters (9.5 MB of float32 gradients) in 1 MB buckets, so that the exchange
# of the first buckets can run while the backward pass computes the others.
OVERLAP_WIDTH, OVERLAP_DEPTH, OVERLAP_BATCH, OVERLAP_BUCKET_MB = 768, 4, 64, 1.0


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and device
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _grads(model: torch.nn.Module, rank: int, device: str) -> list[torch.Tensor]:
    x, y = _batch(rank)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


def ddp_step(group: Any, rank: int, world: int, device: str) -> tuple[list[torch.Tensor], list[str]]:
    """(this rank's gradients after the step's exchange, problems against the reference average)."""
    from torch.nn.parallel import DistributedDataParallel

    local = _model(device)
    reference = [torch.stack(gs).mean(0) for gs in zip(*(_grads(local, r, device) for r in range(world)))]
    ddp = DistributedDataParallel(_model(device), process_group=group, device_ids=None)
    grads = _grads(ddp, rank, device)
    problems = [f"{device} gradient {i} differs from the average by {(g - want).abs().max().item():g}"
                for i, (g, want) in enumerate(zip(grads, reference)) if not torch.allclose(g, want, atol=1e-5)]
    return grads, problems


def overlap(group: Any, rank: int, device: str, iters: int, warmup: int) -> dict[str, float]:
    """Medians (seconds, and the share hidden) over `iters` iterations after `warmup`, each phase the slowest
    rank's: compute (forward + backward under no_sync), step (with DDP's exchange), exchange (every bucket's
    all_reduce alone). Every rank of the default group calls it (the slowest rank is found over it)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(OVERLAP_DEPTH):
        layers += [torch.nn.Linear(OVERLAP_WIDTH, OVERLAP_WIDTH), torch.nn.Tanh()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), process_group=group,
                                    bucket_cap_mb=OVERLAP_BUCKET_MB)
    g = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(OVERLAP_BATCH, OVERLAP_WIDTH, generator=g).to(device)
    sync = getattr(getattr(torch, device, None), "synchronize", None) if device != "cpu" else None

    def fwd_bwd() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        if sync is not None:  # the device's queued work (mps runs asynchronously) belongs to the phase
            sync()
        return time.perf_counter() - t0

    def exchange() -> float:
        buckets = model.reducer._get_zeros_like_grad_buckets()  # buckets of DDP's own sizes
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for work in [dist.all_reduce(b.buffer(), group=group, async_op=True) for b in buckets]:
            work.wait()
        return time.perf_counter() - t0

    phases: list[list[float]] = []
    for it in range(warmup + iters):
        dist.barrier(group=group)
        with model.no_sync():
            compute = fwd_bwd()
        dist.barrier(group=group)
        step = fwd_bwd()
        times = torch.tensor([compute, step, exchange()], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # over the default (control) group
        if it >= warmup:
            phases.append(times.tolist())
    compute, step, ex = ([p[i] for p in phases] for i in range(3))
    return {"compute_s": statistics.median(compute), "step_s": statistics.median(step),
            "exchange_s": statistics.median(ex),
            "hidden": statistics.median(hidden_share(c, s, e) for c, s, e in phases),
            "parameters": sum(p.numel() for p in model.parameters()), "iters": iters}
