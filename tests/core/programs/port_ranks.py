"""Ranks of test_ports.py: TCP ranks of one host with THUNDERBOLT_PORT set. Each reports the local ports of
its established connections (a rank accepts its higher peers on its listening port), then one exact
all_reduce proves the group works."""
from __future__ import annotations

import os

import psutil
import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, result


def listen() -> None:
    dist.init_process_group("thunderbolt")
    w = dist.get_world_size()
    ports = sorted({c.laddr.port for c in psutil.Process(os.getpid()).net_connections("tcp")
                    if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.ip == "127.0.0.1"})
    x = torch.arange(1000, dtype=torch.float32) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    result({"ports": ports, "ok": torch.equal(x, torch.arange(1000, dtype=torch.float32) * (w * (w + 1) // 2))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"listen": listen})
