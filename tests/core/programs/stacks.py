"""Ranks of test_stacks.py: DDP, FSDP2 and pipelining on the thunderbolt backend, each rank comparing its
parameters (or gradients) with the same training run in this one process."""
from __future__ import annotations

import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, result


class Model(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def make_model(unused: bool = False) -> Model:
    torch.manual_seed(0)  # every rank and the reference start from the same parameters
    return Model(unused)


def data(step: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (8 rows per rank)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8 * w, 8, generator=g), torch.randn(8 * w, 4, generator=g)


def max_diff(m1: nn.Module, m2: nn.Module) -> float:
    return max((p1.detach() - p2.detach()).abs().max().item() for p1, p2 in zip(m1.parameters(), m2.parameters()))


def _init() -> tuple[int, int]:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def ddp() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, w = _init()
    out = {}

    def train(ddp_kwargs, steps=4, accumulate=1, hook=None, unused=False):
        ref = make_model(unused)
        model = DDP(make_model(unused), **ddp_kwargs)
        if hook:
            model.register_comm_hook(None, hook)
        o1 = torch.optim.SGD(ref.parameters(), lr=0.1)
        o2 = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x, y = data(step, w)
            # single process: the whole global batch
            o1.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            o1.step()
            # this rank's shard, in `accumulate` micro-batches (no_sync on all but the last)
            o2.zero_grad()
            xs, ys = x[8 * r : 8 * r + 8].chunk(accumulate), y[8 * r : 8 * r + 8].chunk(accumulate)
            for i, (xm, ym) in enumerate(zip(xs, ys)):
                ctx = model.no_sync() if i < accumulate - 1 else torch.enable_grad()
                with ctx:
                    (nn.functional.mse_loss(model(xm), ym) / accumulate).backward()
            o2.step()
        return max_diff(ref, model.module)

    out["plain"] = train({})
    out["small_buckets"] = train({"bucket_cap_mb": 0.001})
    out["no_sync"] = train({}, accumulate=2)
    out["unused_params"] = train({"find_unused_parameters": True}, unused=True)
    out["fp16_hook"] = train({}, hook=default_hooks.fp16_compress_hook)
    dist.destroy_process_group()
    result(out)


def fsdp2() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, w = _init()
    mesh = init_device_mesh("cpu", (w,))
    ref = make_model()
    model = make_model()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    o1 = torch.optim.SGD(ref.parameters(), lr=0.1)
    o2 = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = data(step, w)
        o1.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        o1.step()
        o2.zero_grad()
        nn.functional.mse_loss(model(x[8 * r : 8 * r + 8]), y[8 * r : 8 * r + 8]).backward()
        o2.step()
    diff = max((p1.detach() - p2.full_tensor().detach()).abs().max().item()
               for p1, p2 in zip(ref.parameters(), model.parameters()))
    dist.destroy_process_group()
    result({"diff": diff})


def pipelining() -> None:
    """Two stages under the schedule TEST_SCHEDULE (GPipe or 1F1B)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    r, w = _init()
    full = make_model()
    stages = [nn.Sequential(full.a, nn.ReLU()), nn.Sequential(full.b, nn.ReLU(), full.c)]
    ref = copy.deepcopy(full)
    part = copy.deepcopy(stages[r])
    stage = PipelineStage(part, r, w, torch.device("cpu"))

    def loss_fn(out, tgt):
        return nn.functional.mse_loss(out, tgt)
    schedule = ScheduleGPipe if os.environ["TEST_SCHEDULE"] == "GPipe" else Schedule1F1B
    sched = schedule(stage, n_microbatches=4, loss_fn=loss_fn)
    x, y = data(0, w)
    if r == 0:
        sched.step(x)
    else:
        losses = []
        sched.step(target=y, losses=losses)
    # reference: the mean of the micro-batch losses (the schedule scales gradients by 1/n_microbatches)
    refx = ref(x)
    (sum(nn.functional.mse_loss(o, t) for o, t in zip(refx.chunk(4), y.chunk(4))) / 4).backward()
    ref_stage = [nn.Sequential(ref.a), nn.Sequential(ref.b, ref.c)][r]
    diff = max((p1.grad - p2.grad).abs().max().item() for p1, p2 in zip(ref_stage.parameters(), part.parameters()))
    dist.destroy_process_group()
    result({"diff": diff})


if __name__ == "__main__":
    main({"ddp": ddp, "fsdp2": fsdp2, "pipelining": pipelining})
