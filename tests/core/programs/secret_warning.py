"""Ranks of test_secret.py: one exact all_reduce through torch's API, so that the test can count the
warnings about THUNDERBOLT_SECRET each rank printed. Under TEST_FAKE_HOSTS=1 two ranks share each pretend
host, so `auto` picks shm + TCP (the hybrid)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, pretend_hosts, result


def warn() -> None:
    pretend_hosts()
    dist.init_process_group("thunderbolt")
    w = dist.get_world_size()
    x = torch.arange(1000, dtype=torch.float32) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    result({"ok": torch.equal(x, torch.arange(1000, dtype=torch.float32) * (w * (w + 1) // 2))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"warn": warn})
