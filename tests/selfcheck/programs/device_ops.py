"""Ranks of test_selfcheck_device.py: the selfcheck's op families and DDP checks on tensors of the fake
accelerator (testing.fake_device), which stands in for mps: what each found wrong, and DDP's figures."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.selfcheck import ddp, ops
from torch_thunderbolt.testing.fake_device import install
from torch_thunderbolt.testing.program import main, result

D = "tbfake"


def families() -> None:
    install()  # before the first backward pass: autograd counts devices then
    dist.init_process_group("thunderbolt", device_id=torch.device(D, 0), timeout=datetime.timedelta(seconds=60))
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    found = {f: ops.FAMILY_FUNCTIONS[f](group, rank, world, D, False) for f in ops.FAMILIES}
    spoiled = ops.FAMILY_FUNCTIONS["all_to_all"](group, rank, world, D, True)
    grads_dev, problems_dev = ddp.ddp_step(group, rank, world, D)
    grads_cpu, problems_cpu = ddp.ddp_step(group, rank, world, "cpu")
    figures = ddp.overlap(group, rank, D, iters=2, warmup=1)
    result({"families": found, "spoiled": spoiled, "ddp_problems": problems_dev + problems_cpu,
            "ddp_same_as_cpu": all(torch.equal(a, b) for a, b in zip(grads_dev, grads_cpu)), "overlap": figures})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"families": families})
