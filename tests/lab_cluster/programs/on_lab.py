"""Ranks of the lab cluster tests, one per emulated Mac (testing.lab.lab_setup)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from tests.core.collective_checks import ExactChecks
from torch_thunderbolt.testing.program import main, rank, result, world


def collectives() -> None:
    """Every collective exact; the shape the group found."""
    dist.init_process_group("thunderbolt", init_method="env://")
    pg = dist.group.WORLD
    checks = ExactChecks(rank(), world())
    checks.every_collective()
    checks.check_barrier(0.5)
    result({"shape": pg._comm.shape.kind, "order": pg._comm.shape.order, "bad": checks.bad})
    dist.destroy_process_group()


def all_reduce() -> None:
    """One all_reduce of TEST_PAYLOAD bytes per rank; whether it was exact and what this rank sent."""
    dist.init_process_group("thunderbolt", init_method="env://")
    t = torch.full((int(os.environ["TEST_PAYLOAD"]) // 4,), float(rank() + 1))
    dist.all_reduce(t)
    ok = bool((t == world() * (world() + 1) / 2).all())
    result({"ok": ok, "sent": dist.group.WORLD.transport.bytes_sent})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"collectives": collectives, "all_reduce": all_reduce})
