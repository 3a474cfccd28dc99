"""The "gloo_staged" backend behind `bench --workload llama-tp --tp-impl dtensor`'s gloo rows: a Python
ProcessGroup that runs a gloo group's collectives on device tensors by copying them to host memory and
back, as a Mac user of gloo must (gloo has no kernels for a GPU).

DTensor sends its collectives to the process group of its DeviceMesh, with the model's device tensors; a
gloo group refuses those (torch finds no gloo backend for the device), so the gloo side of a DTensor run
needs a group that stages them. It is registered like the thunderbolt backend (extended API, a creator taking
torch's backend options) and created with the gloo group it stages through as its options: every byte moves
over that gloo group. A tool of the benchmark, never of the runtime.

Only what DTensor's tensor-parallel plan and the workload call is implemented: all_reduce and all_gather
into one tensor (torch's ProcessGroup raises for the others).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .null import DEVICES, BenchGroup, NullWork  # (a NullWork is one done when handed out)

STAGED_BACKEND = "gloo_staged"

__all__ = ["STAGED_BACKEND", "StagedGlooProcessGroup", "create_process_group", "register", "new_staged_group"]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.to("cpu")


class StagedGlooProcessGroup(BenchGroup):
    """all_reduce and all_gather of `inner` (a gloo group of the same ranks) on tensors of any device."""

    BACKEND = STAGED_BACKEND

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        if inner is None or dist.get_backend(inner) != "gloo":
            raise ValueError(f"rank {rank}: a {STAGED_BACKEND} group needs the gloo group it stages through as "
                             f"its pg_options, got {inner!r}")
        if inner.size() != size:
            raise ValueError(f"rank {rank}: the {STAGED_BACKEND} group has {size} ranks but its gloo group has "
                             f"{inner.size()}: expected the same ranks")
        self.inner = inner

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> NullWork:
        hosts = [_host(t) for t in tensors]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for h in hosts:
            dist.all_reduce(h, op=op, group=self.inner)
        for t, h in zip(tensors, hosts):
            if h is not t:
                t.copy_(h)
        return NullWork(tensors)

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> NullWork:
        out = _host(output) if output.device.type == "cpu" else torch.empty(output.shape, dtype=output.dtype)
        dist.all_gather_into_tensor(out, _host(x).contiguous(), group=self.inner)
        if out is not output:
            output.copy_(out)
        return NullWork([output])


def create_process_group(dist_opts: Any, backend_opts: Any = None) -> StagedGlooProcessGroup:
    """The creator torch calls (extended API): `backend_opts` is the gloo group to stage through."""
    return StagedGlooProcessGroup(backend_opts, dist_opts.group_rank, dist_opts.group_size)


def register() -> None:
    """Idempotent; called by the workload only when a DTensor run measures gloo on a device."""
    if STAGED_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(STAGED_BACKEND, create_process_group, extended_api=True, devices=DEVICES)


def new_staged_group(gloo_group: Any) -> Any:
    """A group of the same ranks as `gloo_group` whose collectives stage device tensors through it. Every
    rank of the default group calls it, in the same order (as `dist.new_group`)."""
    register()
    ranks = dist.get_process_group_ranks(gloo_group)
    return dist.new_group(ranks=ranks, backend=STAGED_BACKEND, pg_options=gloo_group)
