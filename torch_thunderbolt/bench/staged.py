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

STAGED_BACKEND = "gloo_staged"
DEVICES = ["cpu"]

__all__ = ["STAGED_BACKEND", "StagedWork", "StagedGlooProcessGroup", "create_process_group", "register",
           "new_staged_group"]


class StagedWork(dist._Work):
    """Done when handed out: the staged copies and gloo's own work were waited for before it was made."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._result

    def source_rank(self) -> int:
        return -1

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.to("cpu")


class StagedGlooProcessGroup(dist.ProcessGroup):
    """all_reduce and all_gather of `inner` (a gloo group of the same ranks) on tensors of any device."""

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        if inner is None or dist.get_backend(inner) != "gloo":
            raise ValueError(f"rank {rank}: a {STAGED_BACKEND} group needs the gloo group it stages through as "
                             f"its pg_options, got {inner!r}")
        if inner.size() != size:
            raise ValueError(f"rank {rank}: the {STAGED_BACKEND} group has {size} ranks but its gloo group has "
                             f"{inner.size()}: expected the same ranks")
        self.inner = inner
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:
        return STAGED_BACKEND

    def name(self) -> str:
        return STAGED_BACKEND

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    supports_splitting = False

    def _get_backend(self, device: Any) -> "StagedGlooProcessGroup":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICES]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> StagedWork:
        hosts = [_host(t) for t in tensors]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for h in hosts:
            dist.all_reduce(h, op=op, group=self.inner)
        for t, h in zip(tensors, hosts):
            if h is not t:
                t.copy_(h)
        return StagedWork(tensors)

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> StagedWork:
        out = _host(output) if output.device.type == "cpu" else torch.empty(output.shape, dtype=output.dtype)
        dist.all_gather_into_tensor(out, _host(x).contiguous(), group=self.inner)
        if out is not output:
            output.copy_(out)
        return StagedWork([output])


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
