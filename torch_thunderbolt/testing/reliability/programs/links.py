"""Ranks of the link-fault scenarios (testing.reliability.links). Both print READY after the barrier, then:

- `until_error`: all_reduce in a loop until it fails (ERROR, exit 3); with TB_IDLE > 0, sleep that long
  first (the fault comes while nobody is in a collective), then one all_reduce (CALL, PASSED).
- `checked_run`: checked all_reduces for TB_RUN seconds, stopping after the same op on every rank (OP after
  each); DONE with how many ran, how many were wrong and what the TCP links lost and sent again.

Environment: TB_TIMEOUT (the group's timeout), TB_SIZE (bytes), TB_IDLE, TB_RUN.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, emit, main


def _init() -> None:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))


def _error(exc: Exception, ops: int) -> None:
    emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:400], "t": time.time(),
                   "peer": getattr(exc, "peer", None), "ops": ops})


def until_error() -> Exit | None:
    _init()
    x = torch.ones(int(os.environ["TB_SIZE"]) // 4)
    idle = float(os.environ.get("TB_IDLE", "0"))
    dist.barrier()
    emit("READY", time.time())
    done = 0
    try:
        if idle:  # the fault is injected while nobody is in a collective
            time.sleep(idle)
            emit("CALL", time.time())
        while True:
            dist.all_reduce(x)
            x.fill_(1.0)
            done += 1
            if done == 1 and idle:
                emit("PASSED", time.time())
                break
    except Exception as exc:
        _error(exc, done)
        return Exit(3)
    return None


def checked_run() -> Exit | None:
    _init()
    r, w = dist.get_rank(), dist.get_world_size()
    n = int(os.environ["TB_SIZE"]) // 4
    pg = dist.new_group(backend="thunderbolt")  # returns our ProcessGroup object, with its transport
    dist.barrier()
    emit("READY", time.time())
    end = time.time() + float(os.environ["TB_RUN"])
    ops = wrong = 0
    try:
        while True:
            go = torch.tensor([int(time.time() < end)])
            dist.all_reduce(go, op=dist.ReduceOp.MIN, group=pg)  # every rank stops after the same op
            if not go.item():
                break
            x = torch.arange(n, dtype=torch.float32) + r  # every op checked: sum over ranks of (i + r)
            dist.all_reduce(x, group=pg)
            wrong += int(not torch.equal(x, torch.arange(n, dtype=torch.float32) * w + w * (w - 1) / 2))
            ops += 1
            emit("OP", time.time())
    except Exception as exc:
        _error(exc, ops)
        return Exit(3)
    tcp = pg.transport.link_kind("tcp")
    emit("DONE", {"ops": ops, "wrong": wrong, "lost_streams": tcp.lost_streams, "resent": tcp.resent_bytes})
    return None


if __name__ == "__main__":
    main({"until_error": until_error, "checked_run": checked_run})
