"""Ranks of test_split.py: groups split off the default group over its links (DeviceMesh dimensions,
new_group, the backend's split_group hook), a subgroup destroyed while the parent goes on, and subgroups of a
broken default group, which are set up afresh. Each scenario reports one RESULT."""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, main, outcome, pretend_hosts, rank, register_pid, result

from ..op_checks import LARGE, GroupChecks


def _init() -> Any:
    register_pid()
    pretend_hosts()
    dist.init_process_group("thunderbolt", init_method="env://",
                            timeout=timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "60"))))
    x = torch.ones(10)
    dist.all_reduce(x)  # (every link is up)
    return dist.distributed_c10d._get_default_group()


def mesh() -> None:
    """A 2x2 DeviceMesh ("replicate" x "shard": under pretended hosts, replicate across hosts and shard within
    one, as HSDP lays it out): every op family exact on each dimension's group, over the default group's
    engine."""
    from torch.distributed.device_mesh import init_device_mesh

    default = _init()
    t0 = time.perf_counter()
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    took = time.perf_counter() - t0
    dims = {}
    for dim in ("replicate", "shard"):
        group = grid.get_group(dim)
        dims[dim] = {"ranks": dist.get_process_group_ranks(group), "same_engine":
                     group.transport.engine is default.transport.engine, "shape": group._comm.shape.kind,
                     "hosts": group._hosts, "bad": GroupChecks(group).every_op()}
    result({"ms": took * 1000, "dims": dims})
    dist.destroy_process_group()


def split_group() -> None:
    """The backend's split_group called as torch's split_group calls it (torch's own needs an accelerator):
    each rank passes the split it is in, or the first split when it is in none (it gets None). The members
    check their group through its methods (torch has not registered it)."""
    default = _init()
    splits = [[2, 0]]
    mine = next((sorted(s) for s in splits if rank() in s), sorted(splits[0]))
    child = default.split_group(mine, timeout=timedelta(seconds=60), opts=None, group_name="split-0-2",
                                group_desc="split test", device_types=None)
    if child is None:
        result({"member": False})
        return
    r = child.rank()
    x = torch.full((LARGE,), float(rank() + 1))
    child.allreduce([x]).wait()
    y = torch.full((100,), float(rank()))
    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    child.broadcast([y], opts).wait()
    outs = [[torch.zeros(3) for _ in range(child.size())]]
    child.allgather(outs, [torch.full((3,), float(r))]).wait()
    result({"member": True, "rank": r, "size": child.size(), "name": child.group_name,
            "desc": child.group_desc, "same_engine": child.transport.engine is default.transport.engine,
            "sum": x.unique().tolist(), "bcast": y.unique().tolist(), "gathered": [t[0].item() for t in outs[0]]})
    dist.destroy_process_group()


def torch_split_group() -> None:
    """torch's own dist.split_group, as it runs on a Mac whose default group is bound to its MPS device
    (an accelerator: torch then splits through the backend): here the accelerator is pretended, bound to
    the CPU. Ranks 0 and 2 get a group torch knows (its functions take it, with global ranks); rank 1 None."""
    default = _init()
    default.bound_device_id = torch.device("cpu", 0)
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu", 0)
    child = dist.split_group(split_ranks=[[0, 2]], group_desc="split test")
    if child is None:
        result({"member": False})
    else:
        x = torch.full((LARGE,), float(rank() + 1))
        dist.all_reduce(x, group=child)
        y = torch.full((100,), float(rank()))
        dist.broadcast(y, src=2, group=child)
        result({"member": True, "rank": dist.get_rank(child), "ranks": dist.get_process_group_ranks(child),
                "same_engine": child.transport.engine is default.transport.engine, "sum": x.unique().tolist(),
                "bcast": y.unique().tolist()})
    dist.barrier()
    dist.destroy_process_group()


def destroy_sub() -> None:
    """3 ranks: a new_group of ranks 0 and 1 runs large ops, then its members destroy it at once (no
    barrier: the other member may still be taking the last op's data); the default group goes on exact, and
    one more new_group (ranks 1 and 2) works over the same links."""
    default = _init()
    engine = default.transport.engine
    sub = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    if rank() in (0, 1):
        checks = GroupChecks(sub)
        for _ in range(5):
            t = checks.data(LARGE, checks.rank)
            dist.all_reduce(t, group=sub)
            checks.check("sub all_reduce", t, checks.total(LARGE))
        out["sub_bad"] = checks.bad
        out["sub_same_engine"] = sub.transport.engine is engine
        gid = sub.transport.gid
        dist.destroy_process_group(sub)
        out["sub_gone"] = gid not in engine.groups and not engine.closed
    out["bad"] = GroupChecks().every_op()
    other = dist.new_group([1, 2])
    if rank() in (1, 2):
        checks = GroupChecks(other)
        t = checks.data(1000, checks.rank)
        dist.all_reduce(t, group=other)
        checks.check("second sub all_reduce", t, checks.total(1000))
        out["other_bad"] = checks.bad
        out["other_same_engine"] = other.transport.engine is engine
    result(out)
    dist.barrier()  # (rank 0 serves the store: it stays until ranks 1 and 2 have made their group)
    dist.destroy_process_group()


def broken_default() -> Exit:
    """3 ranks: rank 2 exits hard; the others see the loss, then make a new_group of themselves: their
    default group is broken, so it is set up afresh (its own links), and works."""
    default = _init()
    if rank() == 2:
        return Exit(0, hard=True)
    loss = outcome(lambda: [dist.all_reduce(torch.ones(LARGE)) for _ in range(100)])
    sub = dist.new_group([0, 1])
    result({"loss": loss, **_fresh(default, sub)})
    dist.destroy_process_group()
    return Exit(0)


def half_broken() -> Exit:
    """2 ranks: rank 1 makes a new_group at once, its default group still usable; rank 0 a second later
    breaks its default group (an abort, which rank 1 hears only later) and makes the new_group: the members
    disagree on whether they can split, so both set the group up afresh."""
    default = _init()
    usable = default.usable
    if rank() == 0:
        time.sleep(1.0)
        default.transport.abort(RuntimeError("rank 0 broke its default group on purpose"))
        usable = default.usable
    sub = dist.new_group([0, 1])
    result({"usable": usable, **_fresh(default, sub)})
    dist.destroy_process_group()
    return Exit(0)


def _fresh(default: Any, sub: Any) -> dict[str, Any]:
    checks = GroupChecks(sub)
    t = checks.data(LARGE, checks.rank)
    dist.all_reduce(t, group=sub)
    checks.check("all_reduce", t, checks.total(LARGE))
    outs = [torch.zeros(100) for _ in range(checks.world)]
    dist.all_gather(outs, checks.data(100, checks.rank), group=sub)
    for q in range(checks.world):
        checks.check(f"all_gather from {q}", outs[q], checks.data(100, q))
    return {"fresh": sub.transport.engine is not default.transport.engine, "bad": checks.bad}


if __name__ == "__main__":
    main({"mesh": mesh, "split_group": split_group, "torch_split_group": torch_split_group, "destroy_sub": destroy_sub, "broken_default": broken_default,
          "half_broken": half_broken})
