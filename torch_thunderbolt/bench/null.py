"""The "null" backend behind `bench --floor`: a Python ProcessGroup whose every call does nothing.

Its per-op time is the floor of any Python process group: what torch spends dispatching one call into
Python (argument checks, options objects, the pybind trampoline, building and waiting on a Work). It is
registered exactly the way the thunderbolt backend registers itself (extended API, a creator taking
torch's backend options), so both pay the same dispatch path. A tool of the benchmark, never of the
runtime: nothing in the package imports it.

It moves no data and computes nothing, so the bench never checks its outputs and never counts it as a
backend to compare against unless asked (`--baseline floor`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .spec import FLOOR_LABEL, NULL_BACKEND

__all__ = ["FLOOR_LABEL", "NULL_BACKEND", "BenchGroup", "NullProcessGroup", "NullWork", "create_process_group",
           "register"]
DEVICES = ["cpu"]


class NullWork(dist._Work):
    """Already complete when handed out: waiting on it returns at once."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result if result is not None else []

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
        # Made only on request (a Future costs tens of µs), already holding its result.
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class BenchGroup(dist.ProcessGroup):
    """What every Python ProcessGroup of the benchmark answers torch with (as ThunderboltProcessGroup does):
    its name (`BACKEND`), the group name and description torch gives it, and itself for every device's
    backend. Collectives are its subclasses' (torch's ProcessGroup raises for the others)."""

    BACKEND = ""
    supports_splitting = False

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:
        return self.BACKEND

    def name(self) -> str:
        return self.BACKEND

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _get_backend(self, device: Any) -> "BenchGroup":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICES]


class NullProcessGroup(BenchGroup):
    """Every collective and send/recv returns a completed NullWork without touching a tensor."""

    BACKEND = NULL_BACKEND

    # -- collectives: nothing moved, nothing computed -------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> NullWork:
        return NullWork(tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> NullWork:
        return NullWork(tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> NullWork:
        return NullWork(tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> NullWork:
        return NullWork(tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def all_gather_single(self, output: Any, x: Any, opts: Any = None) -> NullWork:
        return NullWork([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def reduce_scatter_single(self, output: Any, x: Any, opts: Any = None) -> NullWork:
        return NullWork([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> NullWork:
        return NullWork(outputs)

    def all_to_all_single(self, output: Any, x: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> NullWork:
        return NullWork([output])

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> NullWork:
        return NullWork()

    # -- point-to-point ---------------------------------------------------------------------------------------
    def send(self, tensors: Any, dst: int, tag: int = 0) -> NullWork:
        return NullWork(tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> NullWork:
        return NullWork(tensors)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> NullWork:
        return NullWork(tensors)


def create_process_group(dist_opts: Any, backend_opts: Any = None) -> NullProcessGroup:
    """The creator torch calls for a group of the null backend (extended API, like ours): no rendezvous,
    no connections; the store is left alone."""
    return NullProcessGroup(dist_opts.group_rank, dist_opts.group_size)


def register() -> None:
    """Idempotent; called by the bench only when --floor asks for the null backend."""
    if NULL_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(NULL_BACKEND, create_process_group, extended_api=True, devices=DEVICES)
