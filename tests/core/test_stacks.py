"""DDP, FSDP2 and pipelining running unchanged on the thunderbolt backend, compared with one process."""
from __future__ import annotations

import pytest

from .mp import PRELUDE, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

COMMON = PRELUDE + """
import copy, datetime
import torch.nn as nn
dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=60))
r, w = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
def make_model(unused=False):
    torch.manual_seed(0)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 32); self.b = nn.Linear(32, 32); self.c = nn.Linear(32, 4)
            self.unused = nn.Linear(32, 4) if unused else None
        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))
    return M()
def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8 * w, 8, generator=g), torch.randn(8 * w, 4, generator=g)
def max_diff(m1, m2):
    return max((p1.detach() - p2.detach()).abs().max().item() for p1, p2 in zip(m1.parameters(), m2.parameters()))
"""


def test_ddp_matches_single_process(tmp_path) -> None:
    script = COMMON + """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
out = {}
def train(ddp_kwargs, steps=4, accumulate=1, hook=None, unused=False):
    ref = make_model(unused); model = DDP(make_model(unused), **ddp_kwargs)
    if hook: model.register_comm_hook(None, hook)
    o1 = torch.optim.SGD(ref.parameters(), lr=0.1); o2 = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(step)
        # single process: the whole global batch
        o1.zero_grad(); nn.functional.mse_loss(ref(x), y).backward(); o1.step()
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
"""
    for res in run_ranks(script, 2, tmp_path, timeout=150):
        out = res.json()
        for k in ("plain", "small_buckets", "no_sync", "unused_params"):
            assert out[k] < 1e-5, (k, out)
        assert out["fp16_hook"] < 1e-2, out


def test_fsdp2_matches_single_process(tmp_path) -> None:
    script = COMMON + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (w,))
ref = make_model(); model = make_model()
for layer in (model.a, model.b, model.c):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
o1 = torch.optim.SGD(ref.parameters(), lr=0.1); o2 = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y = data(step)
    o1.zero_grad(); nn.functional.mse_loss(ref(x), y).backward(); o1.step()
    o2.zero_grad(); nn.functional.mse_loss(model(x[8 * r : 8 * r + 8]), y[8 * r : 8 * r + 8]).backward(); o2.step()
diff = max((p1.detach() - p2.full_tensor().detach()).abs().max().item() for p1, p2 in zip(ref.parameters(), model.parameters()))
dist.destroy_process_group()
result({"diff": diff})
"""
    for res in run_ranks(script, 2, tmp_path, timeout=150):
        assert res.json()["diff"] < 1e-5


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipelining_matches_single_process(schedule: str, tmp_path) -> None:
    script = COMMON + f"""
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, Schedule1F1B
full = make_model()
stages = [nn.Sequential(full.a, nn.ReLU()), nn.Sequential(full.b, nn.ReLU(), full.c)]
ref = copy.deepcopy(full)
part = copy.deepcopy(stages[r])
stage = PipelineStage(part, r, w, torch.device("cpu"))
loss_fn = lambda out, tgt: nn.functional.mse_loss(out, tgt)
sched = (ScheduleGPipe if "{schedule}" == "GPipe" else Schedule1F1B)(stage, n_microbatches=4, loss_fn=loss_fn)
x, y = data(0)
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
result({{"diff": diff}})
"""
    for res in run_ranks(script, 2, tmp_path, timeout=150):
        assert res.json()["diff"] < 1e-5
