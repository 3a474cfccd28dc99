"""A rank of the kill -9 trial (testing.reliability.kill): every rank loops over one collective until it
fails; the victim kills itself with SIGKILL `TB_DELAY` seconds after the barrier and prints when (KILLAT).
A survivor prints its error (ERROR) and lets it end the program, which must still exit cleanly (code 1).

Environment: TB_TIMEOUT (the group's timeout), TB_OP, TB_SIZE (bytes), TB_VICTIM, TB_ROOT, TB_DELAY.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import emit, main


def kill_trial() -> None:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))
    r, w = dist.get_rank(), dist.get_world_size()
    op, n = os.environ["TB_OP"], max(1, int(os.environ["TB_SIZE"]) // 4)
    victim, root, delay = int(os.environ["TB_VICTIM"]), int(os.environ["TB_ROOT"]), float(os.environ["TB_DELAY"])
    n -= n % w  # reduce_scatter and all_to_all split the tensor into w equal parts
    x, y, out = torch.full((n,), float(r + 1)), torch.empty(n), torch.empty(n * w)
    parts = [torch.empty(n) for _ in range(w)] if op == "gather" and r == root else None

    def killer() -> None:
        time.sleep(delay)
        emit("KILLAT", time.time())
        os.kill(os.getpid(), signal.SIGKILL)

    def step() -> None:
        if op == "all_reduce":
            dist.all_reduce(x)
            x.fill_(float(r + 1))  # keep values bounded
        elif op == "broadcast":
            dist.broadcast(x, root)
        elif op == "all_gather":
            dist.all_gather_into_tensor(out, x)
        elif op == "gather":
            dist.gather(x, parts, dst=root)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(y[: n // w], x)
            x.fill_(float(r + 1))
        elif op == "all_to_all":
            dist.all_to_all_single(y, x)
        else:  # a ring of send/recv pairs
            req = dist.isend(x, (r + 1) % w)
            dist.recv(y, (r - 1) % w)
            req.wait()

    done = 0
    try:  # the barrier too: a survivor may still be in it when the victim (already out of it) is killed
        dist.barrier()
        if r == victim:
            threading.Thread(target=killer, daemon=True).start()
        while True:
            step()
            done += 1
    except Exception as exc:
        emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:500], "t": time.time(),
                       "peer": getattr(exc, "peer", None), "ops": done})
        raise  # the program lets the exception end it: the process must still exit cleanly


if __name__ == "__main__":
    main({"kill_trial": kill_trial})
