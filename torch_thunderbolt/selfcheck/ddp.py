"""One DistributedDataParallel step on a small model, checked against the average of every rank's gradient
computed here without any exchange."""
from __future__ import annotations

from typing import Any

import torch


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
