"""Ranks of test_compression_ranks.py: every compression experiment (cmp_workers.suite) in one process group
of TEST_BACKEND (gloo or thunderbolt); the results, tensors among them, go back with testing.program.save.

Environment: TEST_BACKEND, TEST_CASES (JSON list of [mode, numel, block]), TEST_HOOK_STEPS, TEST_EF_STEPS.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from tests.compression import cmp_workers
from torch_thunderbolt.testing.program import main, rank, save, world
from torch_thunderbolt.transport.netif import loopback_ifname


def suite() -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname()  # keep gloo's traffic on loopback (lo0 on macOS)
    torch.set_num_threads(1)
    backend = os.environ["TEST_BACKEND"]
    if backend == "thunderbolt":
        import torch_thunderbolt  # noqa: F401 - registers the backend
    dist.init_process_group(backend, init_method="env://", rank=rank(), world_size=world())
    try:
        save(cmp_workers.suite(rank(), world(), json.loads(os.environ["TEST_CASES"]),
                               int(os.environ["TEST_HOOK_STEPS"]), int(os.environ["TEST_EF_STEPS"])))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main({"suite": suite})
