"""Ranks of test_shrink_groups.py: a rank of some group is SIGKILLed, the members that stay call
`dist.shrink_group(..., group=...)` on that group, and report torch's view of the group it returned, the
backend's, and what broadcast (from every src, named by global rank), all_reduce and all_gather gave on it.
World 4. Parameters from the environment:

- TEST_GROUP: which group loses the rank:
  `default` (the default group), `sub` (`new_group([1, 2, 3])`; rank 0 is in no group that loses a rank),
  `mesh` (`init_device_mesh("cpu", (2, 2))`: every dimension's group holding the lost rank),
  `twice` (`new_group([0, 1, 2, 3])`, shrunk after the loss of FIRST_LOST, then again after TEST_LOST's),
  `twice_default` (the default group, shrunk the same two times);
- TEST_LOST: the rank lost (as the rank this process was started with, `RANK`).

Nothing here asks torch who is who: a rank is known by the RANK it was started with, and the group's members
by that numbering (the test works out the global ranks torch must report). Each shrink a rank takes part in
is one SHRUNK line; then an UNTOUCHED line: one all_reduce on every group that lost no rank."""
from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, emit, main, pretend_hosts, rank, register_pid, world

FIRST_LOST = 1  # the rank lost before TEST_LOST where a group is shrunk twice
N = 1000  # elements of each op's tensors


def value(r: int) -> float:
    """What the rank started as RANK r puts in: distinct for every rank, exact in float64 sums."""
    return float(10 * r + 1)


def _pg() -> Any:
    return dist.distributed_c10d._get_default_group()


def _tried(fn: Callable[[], Any]) -> Any:
    """fn's result, or its error as a record (the test then says what went wrong, not a traceback)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the record is what the test checks
        return {"error": type(exc).__name__, "msg": str(exc)[:500]}


def _groups(kind: str) -> list[tuple[str, Any, list[int]]]:
    """Every group of the scenario this rank is in: (label, group, its members by RANK). Every rank calls
    this (new_group and init_device_mesh are called by every rank)."""
    me, w = rank(), world()
    if kind in ("default", "twice_default"):
        return [(kind, _pg(), list(range(w)))]
    if kind == "sub":
        members = [1, 2, 3]
        group = dist.new_group(members)
        return [(kind, group, members)] if me in members else []
    if kind == "twice":
        return [(kind, dist.new_group(list(range(w))), list(range(w)))]
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        # mesh [[0, 1], [2, 3]]: "replicate" joins ranks r and r ^ 2, "shard" r and r ^ 1
        return [("replicate", mesh.get_group("replicate"), sorted([me, me ^ 2])),
                ("shard", mesh.get_group("shard"), sorted([me, me ^ 1]))]
    raise ValueError(f"TEST_GROUP={kind!r}")


def _sum_on(group: Any, members: list[int]) -> dict[str, Any]:
    x = torch.full((N,), value(rank()), dtype=torch.float64)
    dist.all_reduce(x, group=group)
    return {"members": members, "sum": x.unique().tolist()}


def _until_lost(group: Any) -> dict[str, Any]:
    """all_reduces on `group` until one fails (the loss): how it failed, and the rank it names (`peer`)."""
    for _ in range(5000):
        try:
            dist.all_reduce(torch.ones(N), group=group)
        except Exception as exc:  # noqa: BLE001 - the loss is the record
            return {"type": type(exc).__name__, "msg": str(exc)[:500], "peer": getattr(exc, "peer", None)}
    return {"type": None, "msg": "no op failed", "peer": None}


def _view(new: Any) -> dict[str, Any]:
    """torch's view of `new` and the backend's."""
    ranks = dist.get_process_group_ranks(new)
    size = new.size()
    return {"torch": {"ranks": ranks, "rank": dist.get_rank(new), "size": size, "world": dist.get_world_size(new),
                      "global_of": [_tried(lambda r=r: dist.get_global_rank(new, r)) for r in range(size)],
                      "group_of": [_tried(lambda g=g: dist.get_group_rank(new, g)) for g in ranks]},
            "backend": {"global_ranks": _tried(lambda: new.global_ranks), "members": list(new.transport.members),
                        "rank": new.rank()},
            "default": new is _pg()}


def _data(new: Any) -> dict[str, Any]:
    """broadcast from every src torch lists (global ranks), all_reduce, all_gather: what each gave."""
    me = value(rank())

    def bcast(src: int) -> list[float]:
        x = torch.full((N,), me, dtype=torch.float64)
        dist.broadcast(x, src=src, group=new)
        return x.unique().tolist()

    def all_reduce() -> list[float]:
        x = torch.full((N,), me, dtype=torch.float64)
        dist.all_reduce(x, group=new)
        return x.unique().tolist()

    def all_gather() -> list[list[float]]:
        outs = [torch.zeros(N, dtype=torch.float64) for _ in range(new.size())]
        dist.all_gather(outs, torch.full((N,), me, dtype=torch.float64), group=new)
        return [o.unique().tolist() for o in outs]

    return {"bcast": [[src, _tried(lambda src=src: bcast(src))] for src in dist.get_process_group_ranks(new)],
            "sum": _tried(all_reduce), "gathered": _tried(all_gather)}


def any_group() -> Exit:
    register_pid()
    pretend_hosts()
    dist.init_process_group("thunderbolt", init_method="env://",
                            timeout=timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "60"))))
    me, kind = rank(), os.environ["TEST_GROUP"]
    losses = [FIRST_LOST, int(os.environ["TEST_LOST"])] if kind.startswith("twice") else [int(os.environ["TEST_LOST"])]
    groups = {label: (group, members) for label, group, members in _groups(kind)}
    for label, (group, members) in groups.items():  # (every link of every group is up)
        _sum_on(group, members)
    # Every rank is past new_group's store round before any goes (rank 0, in no group that loses a rank, ends
    # early, and with it the store it serves).
    dist.barrier()
    shrunk: set[str] = set()
    for step, victim in enumerate(losses):
        if me == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        for label, (group, members) in list(groups.items()):
            if victim not in members:
                continue
            loss = _until_lost(group)
            new = dist.shrink_group([members.index(victim)], group=group)
            stay = [m for m in members if m != victim]
            groups[label] = (new, stay)
            shrunk.add(label)
            emit("SHRUNK", {"label": label, "step": step, "lost": victim, "stay": stay, "loss": loss, **_view(new),
                            **_data(new)})
    emit("UNTOUCHED", [_sum_on(group, members) for label, (group, members) in groups.items() if label not in shrunk])
    dist.destroy_process_group()
    return Exit(0)


if __name__ == "__main__":
    main({"any_group": any_group})
