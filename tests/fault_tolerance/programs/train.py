"""Ranks of test_train_shrink.py: DDP training that survives losing a rank in the process.

A small float64 model, a fixed seed and a fixed global batch of BATCH samples per step, re-sharded by the
world size (rank r of w takes its w-th of each step's batch in rank order). Rank TEST_VICTIM kills itself
(SIGKILL) at step KILL_STEP, after its forward pass: the others are in that step's gradient all_reduce. They
catch the error, put the model and optimizer back as they were before the step (a snapshot each step), call
`dist.shrink_group` with the lost rank, agree on the steps every one of them finished (the smallest, in case
one finished the step the loss broke), rebuild DDP on the shrunk group and go on from there with the batch
re-sharded over 2 ranks. `reference()` is the same schedule in one process (see there). Each rank that stays
reports its final parameters and when the loss, the shrink and the first step after it happened."""
from __future__ import annotations

import copy
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.testing.program import emit, main, rank, register_pid, result

STEPS, KILL_STEP, BATCH, FEATURES, LR = 12, 5, 12, 8, 0.05


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True))


def shard(step: int, r: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    per = BATCH // w
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def flat(net: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def reference(skip: int | None = None) -> list[float]:
    """The same schedule in one process: every step once, on its whole global batch. DDP averages the
    gradients of equal shards of the mean loss, which is the whole batch's gradient, so where the world size
    switches changes nothing but the rounding of the sum (float64: ~1e-16 relative). `skip`: a step left out,
    to show what a schedule that loses a step gives."""
    net = model()
    opt = optimizer(net)
    for step in range(STEPS):
        if step == skip:
            continue
        x, y = batch(step)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat(net)


def _fresh(state: tuple[dict, dict]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A new module and optimizer from a snapshot: DDP's hooks on the old module's parameters stay behind."""
    net = model()
    net.load_state_dict(state[0])
    opt = optimizer(net)
    opt.load_state_dict(state[1])
    return net, opt


def train() -> None:
    register_pid()
    dist.init_process_group("thunderbolt", init_method="env://", timeout=timedelta(seconds=60))
    me, victim = rank(), int(os.environ["TEST_VICTIM"])
    net = model()
    opt = optimizer(net)
    ddp = DDP(net)
    step, snapshots = 0, {}
    out: dict[str, Any] = {"loss": None}
    while step < STEPS:
        snapshots[step] = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
        snapshots.pop(step - 2, None)
        x, y = shard(step, dist.get_rank(), dist.get_world_size())
        try:
            loss = nn.functional.mse_loss(ddp(x), y)
            if me == victim and step == KILL_STEP:
                emit("KILLED", {"at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if os.environ.get("TEST_TRACE"):
                emit("PARAMS", {"step": step, "p": flat(net)})
            if out["loss"] is not None and "first_step_at" not in out:
                out["first_step_at"] = time.time()
            continue
        except Exception as exc:  # noqa: BLE001 - a lost rank: shrink and go on
            # DDP hands the backend's error on as a RuntimeError with its text; the group keeps the
            # PeerLostError itself, which names the lost rank
            why = exc if isinstance(exc, PeerLostError) else dist.group.WORLD.transport.broken
            out["loss"] = {"type": type(exc).__name__, "msg": str(exc)[:500], "at": time.time(), "step": step,
                           "group_error": type(why).__name__, "peer": getattr(why, "peer", None)}
        if not isinstance(out["loss"]["peer"], int):
            raise RuntimeError(f"rank {me}: no rank named lost: {out['loss']}")
        dist.shrink_group([out["loss"]["peer"]])
        out["shrunk_at"] = time.time()
        done = torch.tensor([step])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the steps every rank that stays finished
        step = int(done.item())
        net, opt = _fresh(snapshots[step])
        ddp = DDP(net)
    result({**out, "params": flat(net), "world": dist.get_world_size()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"train": train})
