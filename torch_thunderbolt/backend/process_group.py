"""The torch ProcessGroup: one class for one group, whatever torch calls on it.

Collectives turn torch's arguments into flat CPU buffers (tensors.py) and run the Communicator in issue order
on the group's worker thread (worker.py); a collective on device tensors is that CPU op on host copies, its
device part done on a thread allowed to touch the device (device.py). Point-to-point calls post their
message at once and are driven by the thread that waits on the work (work.py). Registration with torch is
in registration.py."""
from __future__ import annotations

import atexit
import functools
import logging
import math
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algorithms.collectives import Communicator
from ..algorithms.plan import tensor_bytes
from ..algorithms.shape import Shape, cluster_shape
from ..compression.allreduce import compressed_all_reduce
from ..config import Config
from ..errors import CollectiveTimeout
from ..transport.base import ANY_SOURCE
from ..transport.engine import Transport
from ..transport.names import RankNames
from .device import DeviceCompletions, DeviceGate
from .keep_awake import Hold
from .tensors import (Staged, byte_view, check_same_dtype, flat_cat, flat_view, on_device, reduce_op,
                      rows_to_elems, split_into, total_bytes)
from .work import WaitedWork, Work
from .worker import Worker

log = logging.getLogger("torch_thunderbolt")
DEVICE_TYPES = ("cpu", "mps", "cuda")  # cpu first: torch runs object collectives on the first listed
# The ops works are named after (`_submit`'s `what`), whose names are formatted once per group.
_COLLECTIVES = ("all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "broadcast",
                "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                "scatter", "sparse_all_reduce")
MONITORED_BARRIER_TAG = -0x6D62  # a point-to-point tag of our own: user tags are not negative
_SUM = dist.ReduceOp.SUM
_NO_TIME = timedelta(0)
SHRINK_ABORT = 0x01  # torch's flag of shrink_group (distributed_c10d.SHRINK_ABORT; SHRINK_DEFAULT is 0)


def _blocking(opts: Any) -> bool:
    """Whether the caller waits for this op at once: torch's Python API says so (`async_op=False`) in
    `opts.asyncOp`; C++ callers (DDP) leave it True, and an older torch has no asyncOp (never blocking)."""
    return getattr(opts, "asyncOp", True) is False


def _timeout_s(opts: Any, default: float) -> float:
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default


class ThunderboltProcessGroup(dist.ProcessGroup):
    """`nets` and `hosts`: every rank's networks and host, as the set-up found them (None where it had no
    reason to look), for the shape of this group and of the groups split from it; `global_ranks`: each
    rank's global rank (None: the ranks are the global ones); `awake`: this group's share of the process's
    power assertion (keep_awake.py), released at shutdown."""

    def __init__(self, transport: Transport, cfg: Config, timeout: float, description: str = "",
                 shape: Shape | None = None, *, nets: "list[list[str]] | None" = None,
                 hosts: "list[str] | None" = None, global_ranks: "list[int] | None" = None,
                 awake: Hold | None = None) -> None:
        super().__init__(transport.rank, transport.world)
        self._rank, self._size = transport.rank, transport.world  # rank() is a C++ call, ~1 µs each
        self._transport = transport
        self._cfg = cfg
        self._timeout = timeout
        self._nets, self._hosts = nets, hosts
        self._global_ranks = list(global_ranks) if global_ranks is not None else list(range(transport.world))
        self._comm = Communicator(transport, cfg, timeout, shape if shape is not None else cluster_shape(nets, hosts))
        self._worker = Worker(f"tb-worker-r{transport.rank}")
        self._awake = awake
        self._devices = DeviceCompletions()  # ops on device tensors not yet complete (device.py)
        self._group_name = ""
        self._group_desc = description
        # How works name their op ("all_reduce on rank 3"), formatted once: a small op pays for every string.
        self._whats = {op: f"{op} on rank {self._rank}" for op in _COLLECTIVES}
        self._what_all_reduce = self._whats["all_reduce"]
        self._waited = WaitedWork(self._what_all_reduce)  # every blocking all_reduce that ran inline and succeeded
        self._small_bytes = cfg.small_bytes
        self._compressing = cfg.compression != "none"
        self._closed = False
        self._close_lock = threading.Lock()
        # monitored_barrier's receive buffers, kept past the call (see there)
        self._monitored_tokens: list[torch.Tensor] = []
        # Closed at interpreter exit if still open: joins the worker thread before Python tears down.
        # Through a weak reference, so the exit hook keeps no group alive; a hook of its own (a partial
        # compares by identity), so that shutdown removes this group's hook and no other.
        self._exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
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

    @property
    def global_ranks(self) -> list[int]:
        """The global rank of each of this group's ranks, in group rank order: what torch registers for it
        (`dist.get_process_group_ranks`)."""
        return list(self._global_ranks)

    def _become_default(self) -> None:
        """torch made this group its default group (a shrunk default group replaces the old one): torch numbers
        global ranks by the default group (`dist.get_rank()` is its rank), so this group's ranks are now the
        global ones, and its errors name them so."""
        self._global_ranks = list(range(self._size))
        self._transport.names = None

    # -- torch's device -> backend map ------------------------------------------------------------------
    # torch wraps a C++ `Backend` in its own ProcessGroup and registers it per device type; a Backend cannot
    # be constructed from Python in this torch (pybind: "No constructor defined"), so this ProcessGroup is
    # the whole group and answers the lookups torch's Python side makes itself: every device type is served
    # by this group (tensors off the CPU are staged through host memory), and `init_process_group(...,
    # device_id=torch.device("mps", 0))` finds it.
    supports_splitting = True
    supports_shrinking = True
    # torch's split_group (taken where an accelerator is present: a Mac's MPS device bound to the default
    # group) copies the parent backend's `options` for the child and sets its sequence number: a thunderbolt
    # group has no options of torch's kind (a Config comes as pg_options) and no sequence numbers to set.
    options = None

    def _set_sequence_number_for_group(self) -> None:
        pass

    def _get_backend(self, device: Any) -> "ThunderboltProcessGroup":
        return self

    def eager_connect_single_device(self, device: Any) -> None:
        """torch asks a backend that splits to connect now (init_process_group with device_id): this group's
        links were connected when it was made."""

    def perform_nocolor_split(self, device: Any) -> None:
        """torch's call on a rank outside a new group that is split off this one: nothing to do here (the
        members split among themselves, over their own links)."""

    # -- more groups over the same links (split, shrink) ------------------------------------------------
    def split_group(self, ranks: list[int], timeout: Any = None, opts: Any = None, group_name: str | None = None,
                    group_desc: str | None = None, device_types: Any = None) -> "ThunderboltProcessGroup | None":
        """torch's `split_group` (and DeviceMesh where it splits): the group of this group's `ranks`, over
        this group's links (no new connection or rendezvous). Every rank of this group calls it with its own
        split (torch's rule); a rank in none gets None."""
        if self._rank not in ranks:
            return None
        child = self.split(sorted(ranks), timeout, group_desc or group_name or "split_group")
        if group_name:
            child._set_group_name(group_name)
        if group_desc:
            child._set_group_desc(group_desc)
        return child

    def split(self, ranks: list[int], timeout: Any = None, what: str = "split_group") -> "ThunderboltProcessGroup":
        """The group of this group's `ranks` (this rank among them) over the same links: its ranks call this
        together (`new_group`'s creator, `split_group`)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 \
            else self._timeout
        names = RankNames.for_group([self._global_ranks[r] for r in ranks], len(ranks), what)
        view = self._transport.split(ranks, time.monotonic() + seconds, what, names)
        return self._child(view, ranks, seconds, what)

    def shrink(self, ranks_to_exclude: list[int], shrink_flags: int = 0,
               pg_options: Any = None) -> "ThunderboltProcessGroup":
        """torch's `shrink_group`, called by the ranks that stay: the group of this group's ranks but
        `ranks_to_exclude`, over the live links (no rendezvous, no new connection; a lost rank's rendezvous
        store is not needed). This group is over: its ops in flight fail (with the loss's error, or if
        none broke it, naming the shrink), never with a wrong result; an excluded rank that is alive hears why
        in an ABORT. `shrink_flags`: SHRINK_ABORT ends this group on every member at once; with
        SHRINK_DEFAULT it is over once the ranks that stay agree (every one has called this), so an op over
        on a rank before then is not affected and one still pending then fails. The new group's global ranks
        are this group's less the excluded. `pg_options`: a Config for the new group, else this group's
        settings."""
        excluded = sorted(set(ranks_to_exclude))
        stay = [r for r in range(self._size) if r not in excluded]
        names = RankNames.for_group([self._global_ranks[r] for r in stay], len(stay), "shrink_group")
        view = self._transport.shrink(excluded, time.monotonic() + self._timeout, "shrink_group", names,
                                      abort=bool(shrink_flags & SHRINK_ABORT))
        cfg = pg_options if isinstance(pg_options, Config) else self._cfg
        return self._child(view, stay, self._timeout, "shrink_group", cfg)

    def _child(self, view: Transport, ranks: list[int], timeout: float, what: str,
               cfg: Config | None = None) -> "ThunderboltProcessGroup":
        pick = (lambda xs: None if xs is None else [xs[r] for r in ranks])  # noqa: E731
        return ThunderboltProcessGroup(view, cfg or self._cfg, timeout, description=what, nets=pick(self._nets),
                                       hosts=pick(self._hosts), global_ranks=pick(self._global_ranks),
                                       awake=self.awake_hold())

    def awake_hold(self) -> Hold | None:
        """Another share of the power assertion this group holds, for a group made from it (None: it holds
        none, or no longer)."""
        owner = self._awake.owner if self._awake is not None else None
        return owner.hold() if owner is not None else None

    @property
    def usable(self) -> bool:
        """Whether this group can take more ops (and groups can be split from it): not broken, not closed."""
        t = self._transport
        return not self._closed and t.broken is None and not t.closed

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICE_TYPES]

    # -- plumbing ------------------------------------------------------------------------------------------
    def _submit(self, what: str, fn: Callable[[], None], result: Any, nbytes: int | None = None,
                inputs: Any = None, opts: Any = None, gate: DeviceGate | None = None) -> Work:
        """Run `fn` (the op on flat CPU buffers; `result` holds its outputs, `inputs` its inputs) in issue order.
        `nbytes`: the op's size, for `_inline_ok` (None: the bytes of `result` and `inputs`). `gate`: the
        device point `fn` waits for (the caller took it already; else it is taken here)."""
        if gate is None and (not self._devices.idle or self._devices.issuing):
            # this thread's device ops whose bytes are in, and the gate of the one it issues (device.py)
            gate = self._devices.gate()
        work = Work(self._whats.get(what) or f"{what} on rank {self._rank}", result)
        inline_ok = self._inline_ok(total_bytes(result) + total_bytes(inputs) if nbytes is None else nbytes, opts)
        if gate is not None:
            fn = self._gated(gate, fn, work.what, opts)
            # Inline only where the issuing thread would not wait for the device, or waits anyway.
            inline_ok = inline_ok and (_blocking(opts) or gate.ready())
        return self._worker.submit(work, fn, inline_ok=inline_ok)

    def _gated(self, gate: DeviceGate, fn: Callable[[], None], what: str, opts: Any) -> Callable[[], None]:
        """`fn`, run once the device has copied the op's inputs to host memory (device.py)."""
        def run() -> None:
            try:
                gate.wait(_timeout_s(opts, self._timeout), what)
            except CollectiveTimeout as exc:
                # The peers are in this op already: the group cannot go on in step without it.
                self._transport.abort(exc)
                raise
            fn()

        return run

    def _inline_ok(self, nbytes: int, opts: Any) -> bool:
        """Whether an op may run in the caller's thread when the worker is idle: a small one (two thread
        hand-offs cost more than it does), or one the caller waits for at once (`_blocking`): DDP's ops
        still overlap the caller's compute on the worker."""
        return nbytes <= self._cfg.small_bytes or _blocking(opts)

    def _with_timeout(self, opts: Any) -> Communicator:
        self._comm.timeout = _timeout_s(opts, self._timeout)
        return self._comm

    def _check_list(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != self._size:
            raise ValueError(f"rank {self._rank}: {what} has {len(tensors)} tensors, expected one per rank "
                             f"({self._size})")

    # -- reducing collectives (through the worker, in issue order) -------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if len(tensors) == 1:
            x = tensors[0]
            # One contiguous CPU tensor (a DDP bucket, most direct calls): reduced in place, with no staging to
            # copy back and no device check, the steps that dominate a small op. (is_sparse first: a sparse
            # tensor has no is_contiguous.)
            if not x.is_sparse and x.is_cpu and x.is_contiguous():
                op, factor = "sum", None
                if opts is not None:
                    rop = opts.reduceOp
                    if not rop == _SUM:  # (`==` is the cheaper of the two in pybind)
                        op, factor = reduce_op(rop)
                # (1-D and contiguous is stride 1 but for one element, which flat_view re-strides)
                flat = x if x.dim() == 1 and not x.requires_grad and x.numel() > 1 else flat_view(x)
                if flat is not None and not (self._compressing and self._compress(flat, op)):
                    return self._all_reduce_one(tensors, flat, op, factor, opts)
        if on_device(tensors):
            return self._devices.run(tensors, lambda s: self.allreduce(s.read_write(tensors), opts))
        op, factor = reduce_op(opts.reduceOp if opts is not None else _SUM)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op, opts)
        staged = [Staged(t) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                if self._compress(s.flat, op):
                    # What the compressed bytes stand for goes into their signatures: a float64 tensor
                    # beside a float32 one of as many elements puts the same bytes on the wire.
                    what = ("compressed", str(s.flat.dtype).removeprefix("torch."), s.flat.numel(), op)
                    compressed_all_reduce(s.flat, self._cfg.compression, block_size=self._cfg.compression_block,
                                          average=op == "avg", exchange=_CommExchange(comm, what))
                else:
                    comm.all_reduce(s.flat, op, factor)
                s.write_back()

        return self._submit("all_reduce", run, tensors, sum(t.numel() * t.element_size() for t in tensors),
                            opts=opts)

    def _all_reduce_one(self, tensors: list[torch.Tensor], flat: torch.Tensor, op: str, factor: object,
                        opts: Any) -> Work:
        """The all_reduce of one flat CPU tensor, in the caller's thread when it may run inline (the group's
        turn taken once, and the finished Work made after the op), else on the worker. Written out, as the
        one path every small all_reduce takes: each call and attribute here costs it measurably."""
        if self._devices.pending or self._devices.issuing:
            # this thread's device ops whose bytes are in, and the gate of the one it issues (device.py)
            gate = self._devices.gate()
            if gate is not None:
                return self._submit("all_reduce", functools.partial(self._all_reduce_flat, opts, flat, op, factor),
                                    tensors, flat.numel() * flat.element_size(), opts=opts, gate=gate)
        what = self._what_all_reduce
        worker = self._worker
        blocking = _blocking(opts)
        if (blocking or flat.numel() * flat.element_size() <= self._small_bytes) and worker.try_inline():
            comm = self._comm
            t = opts.timeout if opts is not None else None
            comm.timeout = t.total_seconds() if type(t) is timedelta and t > _NO_TIME else self._timeout
            try:
                comm.all_reduce(flat, op, factor)
            except BaseException as exc:  # noqa: BLE001 - delivered through the work
                return Work.completed(what, tensors, exc)
            finally:
                worker.end_inline()
            if blocking:
                waited = self._waited
                waited._result = tensors
                return waited
            return Work.completed(what, tensors)
        return worker.submit(Work(what, tensors), functools.partial(self._all_reduce_flat, opts, flat, op, factor))

    def _all_reduce_flat(self, opts: Any, flat: torch.Tensor, op: str, factor: object) -> None:
        # The op's timeout is set by the thread that runs it, just before it: the caller may not touch it
        # while the worker runs an earlier op.
        self._with_timeout(opts).all_reduce(flat, op, factor)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str, opts: Any) -> Work:
        """Sparse COO tensors (e.g. nn.Embedding(sparse=True) gradients under DDP), summed like gloo does:
        every rank's indices and values are gathered, the sum is coalesced and copied into each tensor."""
        if op not in ("sum", "avg") or not all(t.is_sparse for t in tensors):
            raise ValueError(f"rank {self._rank}: sparse all_reduce supports ReduceOp.SUM and AVG on sparse "
                             f"COO tensors only (got {op.upper()}, layouts {[str(t.layout) for t in tensors]})")

        def run() -> None:
            comm = self._with_timeout(opts)
            for t in tensors:
                s = t.detach().to("cpu").coalesce()
                idx, val = s.indices().contiguous(), s.values().contiguous()
                nnz = torch.tensor([idx.shape[1]], dtype=torch.int64)
                every = torch.empty(self._size, dtype=torch.int64)
                # The sparse tensor's shape and dtype in the signature: ranks whose tensors differ there would
                # otherwise add up indices of different shapes (or values of another dtype's bytes).
                comm.all_gather(every, nnz, layout=("sparse", tuple(s.shape), s.sparse_dim(),
                                                    str(val.dtype).removeprefix("torch.")))
                counts = [int(c) for c in every]
                per_value = math.prod(val.shape[1:])  # elements per entry (dense dimensions)
                all_idx = torch.empty(idx.shape[0] * sum(counts), dtype=idx.dtype)
                comm.all_gather(all_idx, _rows_first(idx), [idx.shape[0] * c for c in counts])
                all_val = torch.empty(per_value * sum(counts), dtype=val.dtype)
                comm.all_gather(all_val, val.reshape(-1), [per_value * c for c in counts])
                indices = torch.cat([blk.view(-1, idx.shape[0]).t() for blk in
                                     all_idx.split([idx.shape[0] * c for c in counts])], dim=1)
                total = torch.sparse_coo_tensor(indices, all_val.view(sum(counts), *val.shape[1:]), s.shape)
                total = total.coalesce()
                if op == "avg":
                    total = total / self._size
                with torch.no_grad():  # a sparse tensor's detached alias would take the new indices, not `t`
                    t.copy_(total.to(t.device))

        return self._submit("sparse_all_reduce", run, tensors, opts=opts)

    def _compress(self, flat: torch.Tensor, op: str) -> bool:
        """THUNDERBOLT_COMPRESSION applies to float SUM/AVG all_reduce above the small-message size."""
        return (self._cfg.compression != "none" and op in ("sum", "avg") and flat.is_floating_point()
                and flat.numel() * flat.element_size() > self._cfg.small_bytes and self._size > 1)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if on_device(tensors):
            return self._devices.run(tensors, lambda s: self.allreduce_coalesced(s.read_write(tensors), opts))
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
                # Several tensors packed into one: their sizes go into the signature, so [2, 2] never pairs
                # with another rank's [4] (or [1, 3]).
                layout = tuple(t.numel() for t in group) if len(group) > 1 else None
                comm.all_reduce(flat, op, factor, layout=layout)
                split_into(flat, group)

        return self._submit("all_reduce_coalesced", run, tensors, opts=opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        if on_device(tensors):
            return self._devices.run(tensors, lambda s: self.reduce(s.read_write(tensors), opts))
        op, factor = reduce_op(opts.reduceOp)
        root = opts.rootRank
        staged = [Staged(t) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                if factor is not None:
                    comm.check_op("reduce", op, s.flat.dtype)  # before scaling: refused with the tensor untouched
                    s.flat.mul_(factor)
                comm.reduce(s.flat, root, op)  # premul_sum stays itself: a rank summing plainly is a mismatch
                s.write_back()

        return self._submit("reduce", run, tensors, sum(t.numel() * t.element_size() for t in tensors),
                            opts=opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.reduce_scatter(s.write(outputs), s.read(inputs), opts))
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            for o, ins in zip(outputs, inputs):
                self._check_list(ins, "reduce_scatter input list")
                flat_in = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
                if factor is not None:
                    comm.check_op("reduce_scatter", op, flat_in.dtype)
                    flat_in.mul_(factor)
                out = Staged(o, read=False)
                comm.reduce_scatter(out.flat, flat_in, [t.numel() for t in ins], op)
                out.write_back()

        return self._submit("reduce_scatter", run, outputs, inputs=inputs, opts=opts)

    def _reduce_scatter_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        return self.reduce_scatter_single(output, x, opts)

    def reduce_scatter_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        if on_device(output) or on_device(x):
            return self._devices.run([output], lambda s: self.reduce_scatter_single(s.write(output), s.read(x), opts))
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            if x.numel() != output.numel() * self._size:
                raise ValueError(f"rank {self._rank}: reduce_scatter_tensor: input has {x.numel()} elements, "
                                 f"expected {self._size} x {output.numel()}")
            flat_in = x.detach().reshape(-1).cpu().clone() if factor is not None else flat_cat([x])
            if factor is not None:
                self._with_timeout(opts).check_op("reduce_scatter", op, flat_in.dtype)
                flat_in.mul_(factor)
            out = Staged(output, read=False)
            self._with_timeout(opts).reduce_scatter(out.flat, flat_in, [output.numel()] * self._size, op)
            out.write_back()

        return self._submit("reduce_scatter_tensor", run, [output], x.numel() * x.element_size(), inputs=x,
                            opts=opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.reduce_scatter_single_coalesced(
                s.write(outputs), s.read(inputs), opts))
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            for o, x in zip(outputs, inputs):
                flat_in = x.detach().reshape(-1).cpu().clone()
                if factor is not None:
                    comm.check_op("reduce_scatter", op, flat_in.dtype)
                    flat_in.mul_(factor)
                out = Staged(o, read=False)
                comm.reduce_scatter(out.flat, flat_in, [o.numel()] * self._size, op)
                out.write_back()

        return self._submit("reduce_scatter_tensor_coalesced", run, outputs, inputs=inputs, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data-moving collectives (through the worker, in issue order) ----------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        root = opts.rootRank
        if on_device(tensors):  # only the root's tensors are read
            return self._devices.run(tensors, lambda s: self.broadcast(
                s.read_write(tensors) if self._rank == root else s.write(tensors), opts))
        staged = [Staged(t, read=self._rank == root) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                comm.broadcast(s.flat, root)
                s.write_back()

        return self._submit("broadcast", run, tensors, sum(t.numel() * t.element_size() for t in tensors),
                            opts=opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.allgather(s.write(outputs), s.read(inputs), opts))

        def run() -> None:
            comm = self._with_timeout(opts)
            for outs, x in zip(outputs, inputs):
                self._check_list(outs, "all_gather output list")
                check_same_dtype(outs + [x], "all_gather", self._rank)
                counts = [o.numel() for o in outs]
                flat = torch.empty(sum(counts), dtype=x.dtype)
                comm.all_gather(flat, flat_cat([x]), counts)
                split_into(flat, outs)

        return self._submit("all_gather", run, outputs, inputs=inputs, opts=opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Work:
        """`outputs[q][j]` receives rank q's `inputs[j]`: every input travels in one all_gather of their
        bytes (so dtypes may differ, complex and empty tensors included)."""
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.allgather_coalesced(s.write(outputs), s.read(inputs),
                                                                                 opts))
        self._check_list(outputs, "all_gather_coalesced output list")
        for q, outs in enumerate(outputs):
            if len(outs) != len(inputs) or any(o.numel() != x.numel() or o.dtype != x.dtype
                                               for o, x in zip(outs, inputs)):
                raise ValueError(f"rank {self._rank}: all_gather_coalesced: output list {q} must match the "
                                 f"inputs' sizes and dtypes {[(x.dtype, x.numel()) for x in inputs]}, got "
                                 f"{[(o.dtype, o.numel()) for o in outs]}")

        layout = ("coalesced", tuple((str(x.dtype).removeprefix("torch."), x.numel()) for x in inputs))

        def run() -> None:
            mine = torch.cat([byte_view(x) for x in inputs]) if inputs else torch.empty(0, dtype=torch.uint8)
            n = mine.numel()
            flat = torch.empty(n * self._size, dtype=torch.uint8)
            # The bytes' dtypes and element counts go into the signature: a rank gathering float32[4] beside
            # one gathering int32[4] (16 bytes each) must not read the other's bytes as its own dtype.
            self._with_timeout(opts).all_gather(flat, mine, layout=layout)
            for q, outs in enumerate(outputs):
                off = q * n
                for o in outs:
                    nb = o.numel() * o.element_size()
                    o.detach().copy_(flat[off : off + nb].view(o.dtype).view(o.shape))
                    off += nb

        return self._submit("all_gather_coalesced", run, outputs, inputs=inputs, opts=opts)

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        return self.all_gather_single(output, x, opts)

    def all_gather_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        if on_device(output) or on_device(x):
            return self._devices.run([output], lambda s: self.all_gather_single(s.write(output), s.read(x), opts))
        out = Staged(output, read=False)

        def run() -> None:
            if output.numel() != x.numel() * self._size:
                raise ValueError(f"rank {self._rank}: all_gather_into_tensor: output has {output.numel()} "
                                 f"elements, expected {self._size} x {x.numel()}")
            self._with_timeout(opts).all_gather(out.flat, flat_cat([x]))
            out.write_back()

        return self._submit("all_gather_into_tensor", run, [output], output.numel() * output.element_size(),
                            inputs=x, opts=opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.all_gather_single_coalesced(
                s.write(outputs), s.read(inputs), opts))

        def run() -> None:
            comm = self._with_timeout(opts)
            for o, x in zip(outputs, inputs):
                out = Staged(o, read=False)
                comm.all_gather(out.flat, flat_cat([x]))
                out.write_back()

        return self._submit("all_gather_into_tensor_coalesced", run, outputs, inputs=inputs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.gather(s.write(outputs), s.read(inputs), opts))
        root = opts.rootRank

        def run() -> None:
            x = inputs[0]
            n = x.numel()
            if self._rank == root:
                outs = outputs[0]
                self._check_list(outs, "gather_list")
                flat = torch.empty(n * self._size, dtype=x.dtype)
                self._with_timeout(opts).gather(flat, flat_cat([x]), root, [n] * self._size)
                split_into(flat, outs)
            else:
                self._with_timeout(opts).gather(None, flat_cat([x]), root, [n] * self._size)

        return self._submit("gather", run, outputs, inputs=inputs, opts=opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.scatter(s.write(outputs), s.read(inputs), opts))
        root = opts.rootRank

        def run() -> None:
            out = Staged(outputs[0], read=False)
            n = out.flat.numel()
            src = None
            if self._rank == root:
                self._check_list(inputs[0], "scatter_list")
                src = flat_cat(inputs[0])
            self._with_timeout(opts).scatter(out.flat, src, root, [n] * self._size)
            out.write_back()

        return self._submit("scatter", run, outputs, inputs=inputs, opts=opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        if on_device(outputs) or on_device(inputs):
            return self._devices.run(outputs, lambda s: self.alltoall(s.write(outputs), s.read(inputs), opts))

        def run() -> None:
            self._check_list(outputs, "all_to_all output list")
            self._check_list(inputs, "all_to_all input list")
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
            self._with_timeout(opts).all_to_all(flat_out, flat_cat(inputs), [t.numel() for t in inputs],
                                                [o.numel() for o in outputs])
            split_into(flat_out, outputs)

        return self._submit("all_to_all", run, outputs, inputs=inputs, opts=opts)

    def all_to_all_single(self, output: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], opts: Any = None) -> Work:
        if on_device(output) or on_device(x):
            return self._devices.run([output], lambda s: self.all_to_all_single(
                s.write(output), s.read(x), out_splits, in_splits, opts))

        def run() -> None:
            r, w = self._rank, self._size
            send = rows_to_elems(x, list(in_splits), w, "all_to_all_single input", r)
            recv = rows_to_elems(output, list(out_splits), w, "all_to_all_single output", r)
            out = Staged(output, read=False)
            self._with_timeout(opts).all_to_all(out.flat, flat_cat([x]), send, recv)
            out.write_back()

        return self._submit("all_to_all_single", run, [output], inputs=x, opts=opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Work:
        def run() -> None:
            self._with_timeout(opts).barrier()

        return self._submit("barrier", run, [], 0, opts=opts)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, called on the group object (torch's `dist.monitored_barrier` refuses any
        backend but gloo): every rank reports to rank 0 within the timeout and waits for its release; rank 0
        names the ranks that did not report (the first, or all with `wait_all_ranks`). A failure leaves the
        group BROKEN, like any failed point-to-point wait."""
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout
        deadline = time.monotonic() + max(0.0, seconds)
        ms = int(seconds * 1000)
        # One buffer per peer, kept with the group: a receive left posted by a timeout must never write into a
        # freed tensor (tensor_bytes is a view that does not own its memory).
        tokens = [torch.zeros(1, dtype=torch.uint8) for _ in range(self._size)]
        self._monitored_tokens = tokens
        token = tokens[self._rank]
        t = self._transport
        if self._rank != 0:
            t.wait([t.isend_p2p(0, MONITORED_BARRIER_TAG, tensor_bytes(token))], deadline,
                   f"monitored_barrier on rank {self._rank}")
            try:
                t.wait([t.irecv_p2p(0, MONITORED_BARRIER_TAG, tensor_bytes(token))], deadline,
                       f"monitored_barrier on rank {self._rank}")
            except BaseException as exc:
                t.abort(exc)
                raise RuntimeError(f"Rank {self._rank} successfully reached monitoredBarrier, but received errors "
                                   f"while waiting for send/recv from rank 0: {exc}") from exc
            return
        missing: list[int] = []
        for peer in range(1, self._size):
            if time.monotonic() >= deadline and not missing:
                err: BaseException = RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
                t.abort(err)
                raise err
            req = t.irecv_p2p(peer, MONITORED_BARRIER_TAG, tensor_bytes(tokens[peer]))
            try:
                t.wait([req], deadline, f"monitored_barrier on rank 0, waiting for rank {peer}")
            except CollectiveTimeout:
                missing.append(peer)
                if not wait_all_ranks:
                    break
        if missing:
            err = RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms" if not wait_all_ranks
                               else f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms")
            t.abort(err)
            raise err
        t.wait([t.isend_p2p(p, MONITORED_BARRIER_TAG, tensor_bytes(token)) for p in range(1, self._size)],
               time.monotonic() + self._timeout, "monitored_barrier on rank 0, releasing the others")

    # -- point-to-point: posted at once, driven by the thread that waits on the work --------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        flat = flat_cat(tensors)
        req = self._transport.isend_p2p(dst, tag, tensor_bytes(flat), self._p2p_sig(flat))
        return self._p2p_work("send to", dst, tag, req, tensors, keep=flat)

    def _p2p_sig(self, flat: torch.Tensor) -> int:
        """What a point-to-point message is (dtype and element count): the receive checks it against its own
        before any byte lands, so a float32 send never fills an int32 receive of the same size."""
        return self._comm.message_sig(flat)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        return self._recv(tensors, ANY_SOURCE, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        if len(tensors) == 1:
            staged = Staged(tensors[0], read=False)
            flat, done = staged.flat, (staged.write_back if staged.copied else None)
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
            done = functools.partial(split_into, flat, tensors)
        req = self._transport.irecv_p2p(src, tag, tensor_bytes(flat), self._p2p_sig(flat))
        return self._p2p_work("recv from", src, tag, req, tensors, keep=flat, on_done=done)

    def _p2p_work(self, verb: str, peer: int, tag: int, req: Any, result: Any, keep: Any,
                  on_done: Callable[[], None] | None = None) -> Work:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        what = f"{verb} {who} (tag {tag}) on rank {self._rank}"

        def wait_fn(work: Work, seconds: float | None) -> None:
            budget = seconds if seconds is not None else self._timeout
            try:
                self._transport.wait([req], time.monotonic() + budget, what)
                # (a send that went at once, or a message already here: the group may be over for its peers)
                self._comm.confirm(time.monotonic())
            except BaseException as exc:
                # The receive is still posted (a timeout) or the stream is out of step (a size mismatch): a
                # later message would be written into this buffer after the caller gave up on it. BROKEN
                # instead, as for a collective, and peers are told why.
                self._transport.abort(exc)
                raise
            _ = keep  # the buffer must stay alive until the transfer is done
            if on_done is not None:
                on_done()
            work._source = req.source
            work.finish()

        work = Work(what, result, wait_fn)
        work.device = on_device(result)
        if req.done and req.error is None:
            try:
                wait_fn(work, None)
            except BaseException as exc:  # noqa: BLE001 - the group's error (confirm), through the work
                work.finish(exc)
        return work

    # -- lifecycle ---------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._exit_hook)  # a process that makes group after group must not collect hooks
        try:
            self._worker.stop()
            self._transport.close()
        finally:
            if self._awake is not None:
                self._awake.release()

    def abort(self) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class _CommExchange:
    """The compression layer's two byte-moving calls, served by our own Communicator (no re-entry)."""

    def __init__(self, comm: Communicator, layout: object = None) -> None:
        self.comm = comm
        self.world_size = comm.world
        self.layout = layout  # what the bytes stand for (the compressed tensor's dtype and size), signed

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        c = inp.shape[1]
        self.comm.all_to_all(out.view(-1), inp.reshape(-1), [c] * self.world_size, [c] * self.world_size,
                             layout=self.layout)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.all_gather(out.view(-1), inp.reshape(-1), layout=self.layout)


def _rows_first(idx: torch.Tensor) -> torch.Tensor:
    """A (sparse_dim, nnz) index matrix as nnz rows of sparse_dim indices, flat: one entry per element,
    so each rank's block is whole entries."""
    return idx.t().contiguous().view(-1)


def enable_debug_logging() -> None:
    """THUNDERBOLT_DEBUG=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL): the package's loggers at DEBUG, to stderr
    unless the application configured a handler for them."""
    pkg = logging.getLogger("torch_thunderbolt")
    pkg.setLevel(logging.DEBUG)
    if not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        pkg.addHandler(handler)


def _shutdown_at_exit(ref: "weakref.ref[ThunderboltProcessGroup]") -> None:
    pg = ref()
    if pg is None:
        return
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - at exit there is no one left to tell
        pass
