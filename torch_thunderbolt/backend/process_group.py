"""The torch ProcessGroup: maps each torch.distributed call onto the Communicator, on the worker thread."""
from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algorithms.collectives import Communicator
from ..algorithms.plan import tensor_bytes
from ..algorithms.shape import Shape
from ..compression.allreduce import compressed_all_reduce
from ..config import Config
from ..transport.base import ANY_SOURCE, Transport
from .tensors import Staged, check_same_dtype, flat_cat, reduce_op, rows_to_elems, split_into
from .work import Work
from .worker import Worker

log = logging.getLogger("torch_thunderbolt")
_live_groups: "weakref.WeakSet[ThunderboltProcessGroup]" = weakref.WeakSet()


def _timeout_s(opts: Any, default: float) -> float:
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default


class ThunderboltProcessGroup(dist.ProcessGroup):
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

    # -- plumbing ------------------------------------------------------------------------------------------
    def _submit(self, what: str, fn: Callable[[], None], result: Any, nbytes: int = 0) -> Work:
        work = Work(f"{what} on rank {self._rank}", result)
        return self._worker.submit(work, fn, inline_ok=nbytes <= self._cfg.small_bytes)

    def _with_timeout(self, opts: Any) -> Communicator:
        self._comm.timeout = _timeout_s(opts, self._timeout)
        return self._comm

    # -- collectives -----------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        staged = [Staged(t) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                if self._compress(s.flat, op):
                    compressed_all_reduce(s.flat, self._cfg.compression, block_size=self._cfg.compression_block,
                                          average=op == "avg", exchange=_CommExchange(comm))
                else:
                    comm.all_reduce(s.flat, op, factor)
                s.write_back()

        return self._submit("all_reduce", run, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def _compress(self, flat: torch.Tensor, op: str) -> bool:
        """THUNDERBOLT_COMPRESSION applies to float SUM/AVG all_reduce above the small-message size."""
        return (self._cfg.compression != "none" and op in ("sum", "avg") and flat.is_floating_point()
                and flat.numel() * flat.element_size() > self._cfg.small_bytes and self._size > 1)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
                comm.all_reduce(flat, op, factor)
                split_into(flat, group)

        return self._submit("all_reduce_coalesced", run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        root = opts.rootRank
        staged = [Staged(t, read=self._rank == root) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                comm.broadcast(s.flat, root)
                s.write_back()

        return self._submit("broadcast", run, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        op, factor = reduce_op(opts.reduceOp)
        root = opts.rootRank
        staged = [Staged(t) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                if factor is not None:
                    s.flat.mul_(factor)
                comm.reduce(s.flat, root, "sum" if op == "premul_sum" else op)
                s.write_back()

        return self._submit("reduce", run, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        def run() -> None:
            comm = self._with_timeout(opts)
            for outs, x in zip(outputs, inputs):
                self._check_list(outs, "all_gather output list")
                check_same_dtype(outs + [x], "all_gather", self._rank)
                counts = [o.numel() for o in outs]
                flat = torch.empty(sum(counts), dtype=x.dtype)
                comm.all_gather(flat, flat_cat([x]), counts)
                split_into(flat, outs)

        return self._submit("all_gather", run, outputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Work:
        return self.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        return self.all_gather_single(output, x, opts)

    def all_gather_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        out = Staged(output, read=False)

        def run() -> None:
            if output.numel() != x.numel() * self._size:
                raise ValueError(f"rank {self._rank}: all_gather_into_tensor: output has {output.numel()} "
                                 f"elements, expected {self._size} x {x.numel()}")
            self._with_timeout(opts).all_gather(out.flat, flat_cat([x]))
            out.write_back()

        return self._submit("all_gather_into_tensor", run, [output], output.numel() * output.element_size())

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        def run() -> None:
            comm = self._with_timeout(opts)
            for o, x in zip(outputs, inputs):
                out = Staged(o, read=False)
                comm.all_gather(out.flat, flat_cat([x]))
                out.write_back()

        return self._submit("all_gather_into_tensor_coalesced", run, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            for o, ins in zip(outputs, inputs):
                self._check_list(ins, "reduce_scatter input list")
                flat_in = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
                if factor is not None:
                    flat_in.mul_(factor)
                out = Staged(o, read=False)
                comm.reduce_scatter(out.flat, flat_in, [t.numel() for t in ins], _plain(op))
                out.write_back()

        return self._submit("reduce_scatter", run, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        return self.reduce_scatter_single(output, x, opts)

    def reduce_scatter_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            if x.numel() != output.numel() * self._size:
                raise ValueError(f"rank {self._rank}: reduce_scatter_tensor: input has {x.numel()} elements, "
                                 f"expected {self._size} x {output.numel()}")
            flat_in = x.detach().reshape(-1).cpu().clone() if factor is not None else flat_cat([x])
            if factor is not None:
                flat_in.mul_(factor)
            out = Staged(output, read=False)
            self._with_timeout(opts).reduce_scatter(out.flat, flat_in, [output.numel()] * self._size, _plain(op))
            out.write_back()

        return self._submit("reduce_scatter_tensor", run, [output], x.numel() * x.element_size())

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run() -> None:
            comm = self._with_timeout(opts)
            for o, x in zip(outputs, inputs):
                flat_in = x.detach().reshape(-1).cpu().clone()
                if factor is not None:
                    flat_in.mul_(factor)
                out = Staged(o, read=False)
                comm.reduce_scatter(out.flat, flat_in, [o.numel()] * self._size, _plain(op))
                out.write_back()

        return self._submit("reduce_scatter_tensor_coalesced", run, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:
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

        return self._submit("gather", run, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:
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

        return self._submit("scatter", run, outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        def run() -> None:
            self._check_list(outputs, "all_to_all output list")
            self._check_list(inputs, "all_to_all input list")
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
            self._with_timeout(opts).all_to_all(flat_out, flat_cat(inputs), [t.numel() for t in inputs],
                                                [o.numel() for o in outputs])
            split_into(flat_out, outputs)

        return self._submit("all_to_all", run, outputs)

    def all_to_all_single(self, output: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], opts: Any = None) -> Work:
        def run() -> None:
            r, w = self._rank, self._size
            send = rows_to_elems(x, list(in_splits), w, "all_to_all_single input", r)
            recv = rows_to_elems(output, list(out_splits), w, "all_to_all_single output", r)
            out = Staged(output, read=False)
            self._with_timeout(opts).all_to_all(out.flat, flat_cat([x]), send, recv)
            out.write_back()

        return self._submit("all_to_all_single", run, [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Work:
        def run() -> None:
            self._with_timeout(opts).barrier()

        return self._submit("barrier", run, [], 0)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier(opts).wait()

    # -- point to point --------------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        flat = flat_cat(tensors)
        req = self._transport.isend_p2p(dst, tag, tensor_bytes(flat))
        return self._p2p_work("send to", dst, tag, req, tensors, keep=flat)

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
        req = self._transport.irecv_p2p(src, tag, tensor_bytes(flat))
        return self._p2p_work("recv from", src, tag, req, tensors, keep=flat, on_done=done)

    def _p2p_work(self, verb: str, peer: int, tag: int, req: Any, result: Any, keep: Any,
                  on_done: Callable[[], None] | None = None) -> Work:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        what = f"{verb} {who} (tag {tag}) on rank {self._rank}"

        def wait_fn(seconds: float | None) -> None:
            budget = seconds if seconds is not None else self._timeout
            self._transport.wait([req], time.monotonic() + budget, what)
            _ = keep  # the buffer must stay alive until the transfer is done
            if on_done is not None:
                on_done()
            work._source = req.source
            work.finish()

        work = Work(what, result, wait_fn)
        if req.done and req.error is None:
            wait_fn(None)
        return work

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _check_list(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != self._size:
            raise ValueError(f"rank {self._rank}: {what} has {len(tensors)} tensors, expected one per rank "
                             f"({self._size})")

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


class _CommExchange:
    """The compression layer's two byte-moving calls, served by our own Communicator (no re-entry)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.world_size = comm.world

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        c = inp.shape[1]
        self.comm.all_to_all(out.view(-1), inp.reshape(-1), [c] * self.world_size, [c] * self.world_size)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.all_gather(out.view(-1), inp.reshape(-1))


def _plain(op: str) -> str:
    return "sum" if op == "premul_sum" else op


def shutdown_all() -> None:
    """Close every live group (at interpreter exit): joins worker threads before Python tears down."""
    for pg in list(_live_groups):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001
            pass
