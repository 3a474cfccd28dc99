"""Ranks of test_shm_p2p_failures.py: point-to-point and failure semantics of the shm transport, straight
on the transport and a Communicator over it (testing.program.shm_rank), no process group."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.config import Config
from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm
from torch_thunderbolt.testing.program import main, outcome, result, shm_rank
from torch_thunderbolt.transport.base import ANY_SOURCE


def _comm(t) -> Communicator:
    return Communicator(t, Config(), timeout=float(os.environ.get("TB_TIMEOUT", "30")))


def arr(v, n=1000, dt=torch.int64) -> torch.Tensor:
    return torch.full((n,), v, dtype=dt)


def mv(x: torch.Tensor) -> memoryview:
    return memoryview(x.numpy()).cast("B")  # keeps the tensor alive while the transport holds the view


def tags_order() -> None:
    """Tags out of order, a large message before its receive is posted, any-source receives."""
    me = shm_rank()
    t, r, w = me.transport, me.rank, me.world
    comm = _comm(t)
    out = {}
    if r != 0:
        # tag 7 before tag 3, and a large message (many slots) sent before rank 0 posts anything
        reqs = [t.isend_p2p(0, 7, mv(arr(100 + r))), t.isend_p2p(0, 3, mv(arr(10 + r, n=50000))),
                t.isend_p2p(0, 3, mv(arr(20 + r, n=5)))]
        t.wait(reqs, time.monotonic() + 30)
        back = arr(0)
        t.wait([t.irecv_p2p(0, 9, mv(back))], time.monotonic() + 30)
        out["back"] = int(back[0])
    else:
        time.sleep(0.5)  # everything above arrives early: buffered as unexpected p2p
        got3 = {}
        for p in range(1, w):
            a, b = arr(0, n=50000), arr(0, n=5)
            t.wait([t.irecv_p2p(p, 3, mv(a)), t.irecv_p2p(p, 3, mv(b))], time.monotonic() + 30)
            got3[p] = [int(a[0]), int(b[0]), bool((a == a[0]).all())]
        srcs = []
        for _ in range(1, w):
            x = arr(0)
            q = t.irecv_p2p(ANY_SOURCE, 7, mv(x))
            t.wait([q], time.monotonic() + 30)
            srcs.append([q.source, int(x[0])])
        t.wait([t.isend_p2p(p, 9, mv(arr(1000 + p))) for p in range(1, w)], time.monotonic() + 30)
        out = {"got3": got3, "srcs": sorted(srcs)}
    comm.barrier()
    t.close()
    result(out)


def any_source_early() -> None:
    """An any-source receive posted before the message arrives."""
    me = shm_rank()
    t, r = me.transport, me.rank
    _comm(t)  # as in every scenario: a Communicator on the transport (it attaches the shared window)
    if r == 0:
        x = arr(0)
        q = t.irecv_p2p(ANY_SOURCE, 5, mv(x))
        t.wait([q], time.monotonic() + 30)
        out = {"source": q.source, "value": int(x[0])}
    else:
        time.sleep(0.3)
        t.wait([t.isend_p2p(0, 5, mv(arr(42)))], time.monotonic() + 30)
        out = {}
    t.close()
    result(out)


def mismatch() -> None:
    """Calls that do not match (TEST_KIND); then every rank tries once more."""
    me = shm_rank()
    t, r = me.transport, me.rank
    comm = _comm(t)
    kind = os.environ["TEST_KIND"]

    def op():
        if kind == "size":
            comm.all_reduce(torch.ones(10 + r))
        elif kind == "dtype":
            comm.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64))
        elif kind == "op":
            x = torch.ones(10)
            comm.all_reduce(x) if r == 0 else comm.broadcast(x, 0)
        elif kind == "window_vs_ring":  # a shared-window op on one rank, a slot-ring op on the other
            x = torch.ones(1 << 16)
            comm.all_reduce(x) if r == 0 else comm.all_gather(torch.empty(2 << 16), x)
        elif kind == "window_vs_ring_receiver":  # the ring op only receives: the gather's root
            x = torch.ones(1000)
            comm.gather(torch.empty(2000), x, 0, [1000, 1000]) if r == 0 else comm.all_reduce(x)
        else:
            if r == 0:
                t.wait([t.isend_p2p(1, 0, mv(arr(1, n=8)))], time.monotonic() + 10)
                comm.barrier()
            else:
                t.wait([t.irecv_p2p(0, 0, mv(arr(0, n=9)))], time.monotonic() + 10)
    res = outcome(op)
    res["after"] = outcome(lambda: comm.all_reduce(torch.ones(3)))
    t.close()
    result(res)


def kill_9() -> None:
    """Rank 2 kills itself (SIGKILL) at its 20th all_reduce of TEST_SIZE bytes."""
    me = shm_rank()
    t, r = me.transport, me.rank
    comm = _comm(t)
    x = torch.ones(int(os.environ["TEST_SIZE"]) // 4)

    def loop():
        for i in range(100000):
            if r == 2 and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_reduce(x)
    res = outcome(loop)
    t.close()
    result(res)


def kill_9_in_p2p() -> None:
    """Rank 1 kills itself while rank 0 waits for its message."""
    me = shm_rank()
    t, r = me.transport, me.rank
    _comm(t)  # as in every scenario: a Communicator on the transport (it attaches the shared window)
    if r == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    res = outcome(lambda: t.wait([t.irecv_p2p(1, 0, mv(arr(0)))], time.monotonic() + 30))
    t.close()
    result(res)


def stalled() -> None:
    """Rank 2 arrives 4 s late; then every rank tries once more."""
    me = shm_rank()
    t, r = me.transport, me.rank
    comm = _comm(t)

    def op():
        if r == 2:
            time.sleep(4)
            comm.all_reduce(torch.ones(10))
            return
        comm.all_reduce(torch.ones(10))
    res = outcome(op)
    res["next"] = outcome(lambda: comm.all_reduce(torch.ones(10)))
    t.close()
    result(res)


def orderly_close() -> None:
    """Rank 1 closes its transport while rank 0 waits for its message."""
    me = shm_rank()
    t, r = me.transport, me.rank
    comm = _comm(t)
    comm.all_reduce(torch.ones(100))
    if r == 1:
        t.close()
        result({"closed": True})
    else:
        res = outcome(lambda: t.wait([t.irecv_p2p(1, 0, mv(arr(0)))], time.monotonic() + 10))
        t.close()
        result(res)


def window_settings() -> None:
    """Ranks whose shm windows differ (as if THUNDERBOLT_SHM_WINDOW did): connect_shm must refuse."""
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0, timeout=timedelta(seconds=30))
    opts = ShmOptions(window_bytes=(2 << 20) if r == 0 else 0)  # as if THUNDERBOLT_SHM_WINDOW differed
    result(outcome(lambda: connect_shm(store, r, w, Config(), 20, opts).close()))


if __name__ == "__main__":
    main({"tags_order": tags_order, "any_source_early": any_source_early, "mismatch": mismatch, "kill_9": kill_9,
          "kill_9_in_p2p": kill_9_in_p2p, "stalled": stalled, "orderly_close": orderly_close,
          "window_settings": window_settings})
