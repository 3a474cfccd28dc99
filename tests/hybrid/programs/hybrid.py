"""Ranks of the hybrid transport tests (shm within a host, TCP across), on one machine with two emulated hosts
of two ranks each (TEST_FAKE_HOSTS=1: testing.program.pretend_hosts, the HYBRID setup) or on a lab, where
network namespaces make the hosts."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from tests.core.collective_checks import ExactChecks
from torch_thunderbolt.testing.program import Exit, main, outcome, pretend_hosts, rank, result, world


def collectives() -> None:
    """Every collective exact; same-host send/recv on shm only; any-source receives; which plans were
    hierarchical."""
    pretend_hosts()
    RANK, W = rank(), world()
    dist.init_process_group("thunderbolt", init_method="env://")
    pg = dist.group.WORLD
    t = pg._comm.t
    checks = ExactChecks(RANK, W)
    data, check, bad = checks.data, checks.check, checks.bad
    # Same-host pairs only: shm moves the bytes, TCP moves none.
    tcp0 = (t.link_kind("tcp").bytes_sent, t.link_kind("tcp").bytes_received)
    shm0 = (t.link_kind("shm").bytes_sent, t.link_kind("shm").bytes_received)
    mate = RANK ^ 1
    for n in (1000, (1 << 18) + 3):
        for first in (0, 1):
            if RANK % 2 == first:
                dist.send(data(n, RANK), dst=mate, tag=3)
            else:
                got = torch.zeros(n)
                dist.recv(got, src=mate, tag=3)
                check(f"same-host send/recv {mate}->{RANK} {n}", got, data(n, mate))
    same_host = {"tcp": [t.link_kind("tcp").bytes_sent - tcp0[0], t.link_kind("tcp").bytes_received - tcp0[1]],
                 "shm": [t.link_kind("shm").bytes_sent - shm0[0], t.link_kind("shm").bytes_received - shm0[1]]}

    checks.every_collective()

    # Receive from any source: one message from a same-host and one from another-host rank.
    if RANK == 0:
        seen = []
        for _ in range(2):
            x = torch.zeros(10)
            src = dist.recv(x, tag=9)
            check(f"any-source from {src}", x, data(10, src))
            seen.append(src)
        if sorted(seen) != [1, 2]:
            bad.append(f"any-source senders {seen}")
    elif RANK in (1, 2):
        dist.send(data(10, RANK), dst=0, tag=9)

    checks.check_barrier(0.3)
    plans = [(key[0], p[0] if isinstance(p, tuple) else p) for key, p in pg._comm._plans.items()]
    hier = sorted({op for op, p in plans if p.algo == "hier"})
    result({"kind": t.kind, "order": pg._comm.shape.order, "bad": bad, "same_host": same_host,
            "tcp": [t.link_kind("tcp").bytes_sent, t.link_kind("tcp").bytes_received],
            "shm": [t.link_kind("shm").bytes_sent, t.link_kind("shm").bytes_received], "hier": hier})
    dist.destroy_process_group()


def kill() -> Exit:
    """Rank TEST_VICTIM kills itself (SIGKILL) at its 20th all_reduce of TEST_SIZE elements."""
    pretend_hosts()
    RANK = rank()
    size, victim = int(os.environ["TEST_SIZE"]), int(os.environ["TEST_VICTIM"])
    dist.init_process_group("thunderbolt", init_method="env://")
    x = torch.ones(size)

    def loop() -> None:
        for i in range(100000):
            if RANK == victim and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(x)
    result(outcome(loop))
    return Exit(0, hard=True)  # the group is broken; skip the orderly shutdown


def forced() -> None:
    """One all_reduce; which transport the group got."""
    pretend_hosts()
    dist.init_process_group("thunderbolt", init_method="env://")
    x = torch.full((5,), float(rank()))
    dist.all_reduce(x)
    result({"kind": dist.group.WORLD._comm.t.kind, "sum": x.tolist()})
    dist.destroy_process_group()


def stall() -> Exit:
    """Rank 3 arrives 5 s late (the group's timeout is 2 s); then every rank tries once more."""
    pretend_hosts()
    RANK = rank()
    dist.init_process_group("thunderbolt", init_method="env://", timeout=timedelta(seconds=2))

    def op() -> None:
        if RANK == 3:
            time.sleep(5)
        dist.all_reduce(torch.ones(10))
    res = outcome(op)
    res["next"] = outcome(lambda: dist.all_reduce(torch.ones(10)))
    result(res)
    return Exit(0, hard=True)


if __name__ == "__main__":
    main({"collectives": collectives, "kill": kill, "forced": forced, "stall": stall})
