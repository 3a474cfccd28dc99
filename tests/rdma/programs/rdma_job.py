"""Ranks of whole jobs over a fake verbs fabric (THUNDERBOLT_TRANSPORT=rdma, THUNDERBOLT_VERBS=fake:DIR set by
the test): every collective exact, DDP against one process, injected faults seen from the ranks, and a
job under auto whose RDMA set-up fails."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from tests.core.collective_checks import ExactChecks
from torch_thunderbolt.config import Config
from torch_thunderbolt.testing.program import main, outcome, pretend_hosts, rank, result, world
from torch_thunderbolt.testing.fake_verbs import Fabric


def _init() -> None:
    pretend_hosts()  # (TEST_FAKE_HOSTS=1: two ranks per pretended host, so auto picks shm within, rdma across)
    dist.init_process_group("thunderbolt", init_method="env://")


def _transport():
    return dist.group.WORLD._comm.t


def collectives() -> None:
    """Every collective and send/recv exact against the reference values; which kind carried them."""
    _init()
    RANK, W = rank(), world()
    checks = ExactChecks(RANK, W)
    checks.every_collective()
    # receive from any source, and many messages in flight between every pair
    if RANK == 0:
        seen = []
        for _ in range(W - 1):
            x = torch.zeros(10)
            src = dist.recv(x, tag=1000)
            checks.check(f"any-source from {src}", x, checks.data(10, src))
            seen.append(src)
        if sorted(seen) != list(range(1, W)):
            checks.bad.append(f"any-source senders {seen}")
    else:
        dist.send(checks.data(10, RANK), dst=0, tag=1000)
    reqs, outs = [], []
    for k in range(40):
        for p in range(W):
            if p != RANK:
                reqs.append(dist.isend(checks.data(100 + k, RANK) + k, dst=p, tag=k))
                outs.append((p, k, torch.zeros(100 + k)))
                reqs.append(dist.irecv(outs[-1][2], src=p, tag=k))
    for r in reqs:
        r.wait()
    for p, k, got in outs:
        checks.check(f"isend/irecv {p}->{RANK} #{k}", got, checks.data(100 + k, p) + k)
    checks.check_barrier(0.2)
    t = _transport()
    kind = t.link_kind("rdma")
    fabric = Fabric(Config.from_env().verbs_fabric)
    dropped = [fabric.dropped(d.name) for d in fabric.devices]  # before any rank closes: none may be lost
    fabric.close()
    result({"bad": checks.bad, "kind": t.kind, "sent": kind.bytes_sent, "received": kind.bytes_received,
            "peers": sorted(kind.links), "lanes": sorted({len(link.lanes) for link in kind.links.values()}),
            "dropped": dropped})
    dist.destroy_process_group()


def fallback() -> None:
    """A job whose RDMA set-up fails (a fault the test set): how starting the group went; when it worked,
    the kind it got, every collective exact, and what of RDMA is left on the fabric while the job runs (every
    rank is past its set-up once a collective ran: nothing of a failed attempt may remain)."""
    got = outcome(_init)
    if not got["ok"]:
        result({"init": got})
        return
    checks = ExactChecks(rank(), world())
    checks.every_collective()
    checks.check_barrier(0.2)
    fabric = Fabric(Config.from_env().verbs_fabric)
    qps = [len(fabric.live_qps(i)) for i in range(len(fabric.devices))]
    mrs = [fabric.live_mrs(i) for i in range(len(fabric.devices))]
    fabric.close()
    dist.barrier()  # (no rank closes before every rank has counted)
    result({"init": got, "bad": checks.bad, "kind": _transport().kind, "qps": qps, "mrs": mrs})
    dist.destroy_process_group()


def profile() -> None:
    """A 4 KB all_reduce loop under cProfile on rank 0 (for looking, not for a test)."""
    import cProfile
    import pstats

    _init()
    x = torch.ones(1024)
    for _ in range(50):
        dist.all_reduce(x)
    n = int(os.environ.get("TEST_ITERS", "2000"))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if rank() == 0:
        prof.enable()
    for _ in range(n):
        dist.all_reduce(x)
    if rank() == 0:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    result({"us": (time.perf_counter() - t0) / n * 1e6})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"collectives": collectives, "fallback": fallback, "profile": profile})
