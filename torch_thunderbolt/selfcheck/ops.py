"""Every op family once, on small tensors, compared with algorithms/reference.py's exact answer.

Each rank can compute every rank's input (a function of the rank), so each rank checks its own output
against the reference alone; the caller gathers what each rank found. `corrupt` (a test-only injected
fault) makes this rank spoil its own output before checking, as a faulty rank would.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algorithms import reference
from ..algorithms.reduce_ops import make_combiner
from .model import FAMILIES

NUMEL = 37  # not a multiple of the world size or of a page: uneven splits, odd tails
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
_TORCH_OPS = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
              "bor": "BOR", "bxor": "BXOR"}

# (group, rank, world, device, corrupt) -> (combinations checked, problems found on this rank)
Family = Callable[[Any, int, int, str, bool], "tuple[int, list[str]]"]


def dtypes_on(device: str) -> tuple[str, ...]:
    """The dtypes checked on `device`: MPS has no float64 (torch refuses to make such a tensor there)."""
    return tuple(d for d in DTYPES if not (device == "mps" and d == "float64"))


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values (1..3, or alternating bools) so that products of a few ranks stay exact in every dtype."""
    i = torch.arange(numel)
    if dtype == torch.bool:
        return (i + rank) % 2 == 0
    return ((i * 7 + rank * 3) % 3 + 1).to(dtype)


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, close: bool = False) -> list[str]:
    got = got.cpu()
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    same = torch.isclose(got.double(), want.double(), rtol=1e-2, atol=0) if close else got == want
    if bool(same.all()):
        return []
    bad = int((~same).nonzero()[0])
    return [f"{what}: element {bad} is {got[bad].item()}, expected {want[bad].item()} "
            f"({int((~same).sum())} of {got.numel()} wrong)"]


def _spoil(t: torch.Tensor) -> None:
    flat = t.view(-1)
    flat[0] = ~flat[0] if t.dtype == torch.bool else flat[0] + 1


def _valid(op: str, dtype: torch.dtype) -> bool:
    try:
        make_combiner(op, dtype)
    except ValueError:
        return False
    return True


def all_reduce(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    problems, count = [], 0
    for name in dtypes_on(device):
        dtype = getattr(torch, name)
        for op in REDUCE_OPS:
            if not _valid(op, dtype):
                continue
            count += 1
            want = reference.all_reduce([rank_input(r, NUMEL, dtype) for r in range(world)], op)[rank]
            t = rank_input(rank, NUMEL, dtype).to(device)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _TORCH_OPS[op]), group=group)
            if corrupt:
                _spoil(t)
            problems += _compare(f"all_reduce {op} {name}", t, want, close=op == "avg")
    return count, problems


def broadcast(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    problems = []
    for root in range(world):
        want = rank_input(root, NUMEL, torch.float32)
        t = (want.clone() if rank == root else torch.zeros(NUMEL)).to(device)
        dist.broadcast(t, src=dist.get_global_rank(group, root), group=group)
        if corrupt:
            _spoil(t)
        problems += _compare(f"broadcast from group rank {root}", t, want)
    return world, problems


def all_gather(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    inputs = [rank_input(r, NUMEL, torch.int32) for r in range(world)]
    outs = [torch.zeros(NUMEL, dtype=torch.int32, device=device) for _ in range(world)]
    dist.all_gather(outs, inputs[rank].to(device), group=group)
    flat = torch.zeros(NUMEL * world, dtype=torch.int32, device=device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(flat, inputs[rank].to(device),
                                                                              group=group)
    if corrupt:
        _spoil(flat)
    want = reference.all_gather(inputs)[rank]
    return 2, _compare("all_gather (list)", torch.cat([o.cpu() for o in outs]), want) + \
        _compare("all_gather into one tensor", flat, want)


def reduce_scatter(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    problems = []
    for op in ("sum", "max"):
        inputs = [rank_input(r, NUMEL * world, torch.float32) for r in range(world)]
        out = torch.zeros(NUMEL, device=device)
        # reduce_scatter_single is the current name; reduce_scatter_tensor the deprecated one of older torch.
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, inputs[rank].to(device), op=getattr(dist.ReduceOp, _TORCH_OPS[op]), group=group)
        if corrupt:
            _spoil(out)
        problems += _compare(f"reduce_scatter into one tensor {op}", out,
                             reference.reduce_scatter(inputs, op, [NUMEL] * world)[rank])
    return 2, problems


def all_to_all(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    # Uneven splits: rank r sends r + p + 1 elements to rank p.
    splits = [[r + p + 1 for p in range(world)] for r in range(world)]
    inputs = [rank_input(r, sum(splits[r]), torch.float32) for r in range(world)]
    want = reference.all_to_all(inputs, splits)[rank]
    out = torch.zeros(want.numel(), device=device)
    dist.all_to_all_single(out, inputs[rank].to(device), output_split_sizes=[splits[r][rank] for r in range(world)],
                           input_split_sizes=splits[rank], group=group)
    if corrupt:
        _spoil(out)
    return 1, _compare("all_to_all_single (uneven splits)", out, want)


def gather(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    inputs = [rank_input(r, NUMEL, torch.float32) for r in range(world)]
    dst = world - 1
    outs = [torch.zeros(NUMEL, device=device) for _ in range(world)] if rank == dst else None
    dist.gather(inputs[rank].to(device), outs, dst=dist.get_global_rank(group, dst), group=group)
    if rank != dst:
        return 1, []
    got = torch.cat([o.cpu() for o in outs])
    if corrupt:
        _spoil(got)
    return 1, _compare(f"gather to group rank {dst}", got, torch.cat(inputs))


def scatter(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    inputs = [rank_input(r, NUMEL, torch.float32) for r in range(world)]
    out = torch.zeros(NUMEL, device=device)
    dist.scatter(out, [t.to(device) for t in inputs] if rank == 0 else None, src=dist.get_global_rank(group, 0),
                 group=group)
    if corrupt:
        _spoil(out)
    return 1, _compare("scatter from group rank 0", out, inputs[rank])


def send_recv(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    """A ring: each rank sends to the next and receives from the previous (even ranks send first)."""
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    dtype = torch.float64 if "float64" in dtypes_on(device) else torch.float32
    mine = rank_input(rank, NUMEL, dtype).to(device)
    got = torch.zeros(NUMEL, dtype=dtype, device=device)
    to, frm = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    if rank % 2 == 0:
        dist.send(mine, dst=to, group=group)
        dist.recv(got, src=frm, group=group)
    else:
        dist.recv(got, src=frm, group=group)
        dist.send(mine, dst=to, group=group)
    if corrupt:
        _spoil(got)
    return 1, _compare(f"recv from group rank {prev}", got, rank_input(prev, NUMEL, dtype))


def barrier(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    for _ in range(3):
        dist.barrier(group=group)
    return 3, ["barrier: (injected) wrong result"] if corrupt else []


def objects(group: Any, rank: int, world: int, device: str, corrupt: bool) -> tuple[int, list[str]]:
    mine = {"rank": rank, "text": "é" * (rank + 1), "list": list(range(rank))}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if corrupt:
        every[0] = None
    want = [{"rank": r, "text": "é" * (r + 1), "list": list(range(r))} for r in range(world)]
    problems = [] if every == want else [f"all_gather_object: got {every!r}, expected {want!r}"]
    if box[0] != want[0]:
        problems.append(f"broadcast_object_list: got {box[0]!r}, expected {want[0]!r}")
    return 2, problems


FAMILY_FUNCTIONS: dict[str, Family] = {
    "all_reduce": all_reduce, "broadcast": broadcast, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all, "gather": gather, "scatter": scatter, "send_recv": send_recv, "barrier": barrier,
    "objects": objects,
}
