"""Code that runs inside the ranks of test_compression_ranks.py (programs/suite.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

from torch_thunderbolt.compression import Int8Codec, compressed_all_reduce
from torch_thunderbolt.compression.pipeline import (
    AsyncGroups,
    all_reduce_future,
    make_phase2_group,
)
from torch_thunderbolt.hooks import CompressionState, bf16_hook, fp16_hook, int8_hook

from .cmp_reference import check_within_bound


def inputs_for(world: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(world, numel, generator=g) * torch.rand(world, numel, generator=g).pow(3) * 10


def allreduce_cases(rank: int, world: int, cases: list) -> list:
    """Run every (mode, numel, block) case; check the bound here; return results for cross-rank checks."""
    out = []
    for i, (mode, numel, block) in enumerate(cases):
        inputs = inputs_for(world, numel, seed=i)
        t = inputs[rank].clone()
        compressed_all_reduce(t, mode, group=None, block_size=block)
        check_within_bound(t, inputs, mode, block)
        out.append(t)
    return out


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(rank: int, hook, state, steps: int) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # ~1 KB buckets: the 3-layer model becomes several buckets whose all-reduces overlap.
    model = DDP(_tiny_model(), bucket_cap_mb=0.001)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        y = torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def ddp_hooks(rank: int, world: int, steps: int) -> dict:
    """Parameters after `steps` of DDP training: uncompressed, and with each hook."""
    start = [p.detach().clone() for p in _tiny_model().parameters()]
    runs = {"start": start, "reference": _train(rank, None, None, steps)}
    for name, hook, ef in [("int8", int8_hook, True), ("int8-noef", int8_hook, False),
                           ("fp16", fp16_hook, False), ("bf16", bf16_hook, False)]:
        runs[name] = _train(rank, hook, CompressionState(error_feedback=ef), steps)
    return runs


def error_feedback_drift(rank: int, world: int, steps: int) -> dict:
    """|w_T - exact w_T| of a linear model whose gradient is a constant that int8 rounds badly.

    Loss = sum(w . x_r) so the gradient of rank r is x_r every step and SGD(lr=1) gives exactly
    w_T = w_0 - T * mean_r(x_r). x_r has one 1.0 per 256-block and 0.003 elsewhere: after division by
    the world size, 0.003/2 is below half an int8 step (0.5/127/2), so without error feedback those
    entries are rounded to 0 every step and the drift grows linearly with T.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.full((1, 512), 0.003)
    x[0, ::256] = 1.0
    drift = {}
    for ef in (True, False):
        lin = nn.Linear(512, 1, bias=False)
        nn.init.zeros_(lin.weight)
        model = DDP(lin)
        state = CompressionState(error_feedback=ef)
        model.register_comm_hook(state, int8_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        exact = -steps * x[0]
        drift[ef] = (lin.weight.detach()[0] - exact).abs().max().item()
        drift[f"residuals-{ef}"] = len(state.residuals)
    return drift


class _BrokenCodec(Int8Codec):
    def decode(self, wire, shard):
        raise ValueError("broken codec")


def async_error_then_recovery(rank: int, world: int) -> dict:
    """A failure between the two phases reaches the future's waiter, and the next call still works."""
    groups = AsyncGroups(None, make_phase2_group(None))
    try:
        all_reduce_future(torch.ones(10), _BrokenCodec(), groups).wait()
        error = ""
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        error = str(exc)
    after = all_reduce_future(torch.ones(600), Int8Codec(), groups).wait()
    return {"error": error, "after": after}


def suite(rank: int, world: int, cases: list, hook_steps: int, ef_steps: int) -> dict:
    """Every experiment in one set of processes: starting ranks is the slow part of these tests."""
    return {
        "allreduce": allreduce_cases(rank, world, cases),
        "hooks": ddp_hooks(rank, world, hook_steps),
        "drift": error_feedback_drift(rank, world, ef_steps),
        "async": async_error_then_recovery(rank, world),
    }
