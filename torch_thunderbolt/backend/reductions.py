"""The reducing collectives of the torch ProcessGroup (all_reduce, reduce, reduce_scatter and their
coalesced and tensor forms): torch's arguments to flat buffers, then the Communicator on the worker."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms.collectives import Communicator
from ..compression.allreduce import compressed_all_reduce
from .tensors import Staged, flat_cat, reduce_op, split_into
from .host import GroupHost
from .work import Work


class ReductionOps(GroupHost):
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op, opts)
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
                comm.all_gather(every, nnz)
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

        return self._submit("sparse_all_reduce", run, tensors)

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

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
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

        return self._submit("reduce", run, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Work:
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

        return self._submit("reduce_scatter", run, outputs, inputs=inputs)

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
                self._with_timeout(opts).check_op("reduce_scatter", op, flat_in.dtype)
                flat_in.mul_(factor)
            out = Staged(output, read=False)
            self._with_timeout(opts).reduce_scatter(out.flat, flat_in, [output.numel()] * self._size, op)
            out.write_back()

        return self._submit("reduce_scatter_tensor", run, [output], x.numel() * x.element_size(), inputs=x)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
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

        return self._submit("reduce_scatter_tensor_coalesced", run, outputs, inputs=inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


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


def _rows_first(idx: torch.Tensor) -> torch.Tensor:
    """A (sparse_dim, nnz) index matrix as nnz rows of sparse_dim indices, flat: one entry per element,
    so each rank's block is whole entries."""
    return idx.t().contiguous().view(-1)


