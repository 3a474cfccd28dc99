"""The torch ProcessGroup: identity, the worker thread and lifecycle. The calls themselves are in
reductions.py and data_movement.py (collectives, run on the worker thread) and p2p_ops.py."""
from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algorithms.collectives import Communicator
from ..algorithms.shape import Shape
from ..config import Config
from ..transport.engine import Transport
from .data_movement import DataMovementOps
from .p2p_ops import PointToPointOps
from .reductions import ReductionOps
from .tensors import on_device
from .work import Work
from .worker import Worker

log = logging.getLogger("torch_thunderbolt")
DEVICE_TYPES = ("cpu", "mps", "cuda")  # cpu first: torch runs object collectives on the first listed
_live_groups: "weakref.WeakSet[ThunderboltProcessGroup]" = weakref.WeakSet()


def _timeout_s(opts: Any, default: float) -> float:
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default


class ThunderboltProcessGroup(ReductionOps, DataMovementOps, PointToPointOps, dist.ProcessGroup):
    def __init__(self, transport: Transport, cfg: Config, timeout: float, description: str = "",
                 shape: Shape | None = None) -> None:
        super().__init__(transport.rank, transport.world)
        self._rank, self._size = transport.rank, transport.world  # rank() is a C++ call, ~1 µs each
        self._transport = transport
        self._cfg = cfg
        self._timeout = timeout
        self._comm = Communicator(transport, cfg, timeout, shape)
        self._worker = Worker(f"tb-worker-r{transport.rank}")
        self._group_name = ""
        self._group_desc = description
        self._closed = False
        self._close_lock = threading.Lock()
        _live_groups.add(self)
        if cfg.debug:
            enable_debug_logging()
            log.debug("rank %d: group %r of %d ranks on %s (shape %s); %s", self._rank, description, self._size,
                      transport.kind, self._comm.shape.kind, cfg)

    # -- identity --------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "thunderbolt"

    def name(self) -> str:
        return "thunderbolt"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def transport(self) -> Transport:
        return self._transport

    # -- torch's device -> backend map ------------------------------------------------------------------
    # torch wraps a C++ `Backend` in its own ProcessGroup and registers it per device type; a Backend cannot
    # be constructed from Python in this torch (pybind: "No constructor defined"), so this ProcessGroup is
    # the whole group and answers the lookups torch's Python side makes itself: every device type is served
    # by this group (tensors off the CPU are staged through host memory), and `init_process_group(...,
    # device_id=torch.device("mps", 0))` finds it.
    supports_splitting = False

    def _get_backend(self, device: Any) -> "ThunderboltProcessGroup":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICE_TYPES]

    # -- plumbing ------------------------------------------------------------------------------------------
    def _submit(self, what: str, fn: Callable[[], None], result: Any, nbytes: int = 0, inputs: Any = None) -> Work:
        """Run `fn` (the op on flat CPU buffers) in issue order. Ops that touch a tensor on another device
        (`result` holds the outputs, `inputs` the inputs) run entirely in the caller's thread; see worker."""
        work = Work(f"{what} on rank {self._rank}", result)
        if on_device(result) or (inputs is not None and on_device(inputs)):
            work.device = True
            return self._worker.run_in_caller(work, fn)
        return self._worker.submit(work, fn, inline_ok=nbytes <= self._cfg.small_bytes)

    def _with_timeout(self, opts: Any) -> Communicator:
        self._comm.timeout = _timeout_s(opts, self._timeout)
        return self._comm

    def _check_list(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != self._size:
            raise ValueError(f"rank {self._rank}: {what} has {len(tensors)} tensors, expected one per rank "
                             f"({self._size})")

    # -- lifecycle ---------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._worker.stop()
        self._transport.close()

    def abort(self) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def enable_debug_logging() -> None:
    """THUNDERBOLT_DEBUG=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL): the package's loggers at DEBUG, to stderr
    unless the application configured a handler for them."""
    pkg = logging.getLogger("torch_thunderbolt")
    pkg.setLevel(logging.DEBUG)
    if not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        pkg.addHandler(handler)


def shutdown_all() -> None:
    """Close every live group (at interpreter exit): joins worker threads before Python tears down."""
    for pg in list(_live_groups):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001
            pass
