"""A rank of the SIGSTOP trial (testing.reliability.pause): every rank prints READY after the barrier, then
its error (ERROR) with the ranks it blames and the seconds from the start of the call that raised it.

- `until_error`: every rank loops over the op until it fails; the trial runner freezes the victim.
- `frozen_first`: the victim (TB_VICTIM) freezes itself right after the barrier (STOPPED); the others run the
  op once, then a barrier (a broadcast's root is done with its op before the victim takes any of it).

Environment: TB_OP (all_reduce, broadcast, or send_recv: a ring of isend/recv), TB_SIZE (bytes), TB_ROOT (of
the broadcast), TB_TIMEOUT (the group's timeout), TB_VICTIM.
"""
from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Callable

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, emit, main


def _error(exc: Exception, started: float, ops: int) -> None:
    emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:1500], "t": time.time(),
                   "seconds": round(time.monotonic() - started, 3), "ranks": getattr(exc, "ranks", None),
                   "peer": getattr(exc, "peer", None), "ops": ops})


def _op() -> Callable[[], None]:
    """The op of TB_OP on TB_SIZE bytes, once per call (init_process_group done)."""
    r, w = dist.get_rank(), dist.get_world_size()
    op, root = os.environ["TB_OP"], int(os.environ.get("TB_ROOT", "0"))
    n = max(1, int(os.environ["TB_SIZE"]) // 4)
    x, y = torch.ones(n), torch.empty(n)

    def run() -> None:
        if op == "all_reduce":
            dist.all_reduce(x)
            x.fill_(1.0)  # keep values bounded
        elif op == "broadcast":
            dist.broadcast(x, root)
        else:  # send_recv: a ring of send/recv pairs
            req = dist.isend(x, (r + 1) % w)
            dist.recv(y, (r - 1) % w)
            req.wait()

    return run


def _init() -> None:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))


def until_error() -> Exit | None:
    _init()
    run = _op()
    dist.barrier()
    emit("READY", time.time())
    ops = 0
    started = time.monotonic()
    try:
        while True:
            started = time.monotonic()
            run()
            ops += 1
    except Exception as exc:
        _error(exc, started, ops)
        return Exit(3, hard=True)


def frozen_first() -> Exit | None:
    _init()
    run = _op()
    dist.barrier()
    emit("READY", time.time())
    if dist.get_rank() == int(os.environ["TB_VICTIM"]):
        emit("STOPPED", time.time())
        os.kill(os.getpid(), signal.SIGSTOP)
        return Exit(0, hard=True)
    time.sleep(0.5)  # the victim is stopped by now
    started = time.monotonic()
    try:
        run()
        started = time.monotonic()
        dist.barrier()
    except Exception as exc:
        _error(exc, started, 0)
        return Exit(3, hard=True)
    return Exit(0, hard=True)


if __name__ == "__main__":
    main({"until_error": until_error, "frozen_first": frozen_first})
