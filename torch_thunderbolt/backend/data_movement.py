"""The data-moving collectives of the torch ProcessGroup (broadcast, all_gather, gather, scatter,
all_to_all, barrier and their tensor forms): torch's arguments to flat buffers, then the Communicator on
the worker."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from ..algorithms.plan import tensor_bytes
from ..errors import CollectiveTimeout

from .tensors import Staged, byte_view, check_same_dtype, flat_cat, rows_to_elems, split_into
from .host import GroupHost
from .work import Work


MONITORED_BARRIER_TAG = -0x6D62  # a point-to-point tag of our own: user tags are not negative


class DataMovementOps(GroupHost):
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        root = opts.rootRank
        staged = [Staged(t, read=self._rank == root) for t in tensors]

        def run() -> None:
            comm = self._with_timeout(opts)
            for s in staged:
                comm.broadcast(s.flat, root)
                s.write_back()

        return self._submit("broadcast", run, tensors, sum(t.numel() * t.element_size() for t in tensors))

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

        return self._submit("all_gather", run, outputs, inputs=inputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Work:
        """`outputs[q][j]` receives rank q's `inputs[j]`: every input travels in one all_gather of their
        bytes (so dtypes may differ, complex and empty tensors included)."""
        self._check_list(outputs, "all_gather_coalesced output list")
        for q, outs in enumerate(outputs):
            if len(outs) != len(inputs) or any(o.numel() != x.numel() or o.dtype != x.dtype
                                               for o, x in zip(outs, inputs)):
                raise ValueError(f"rank {self._rank}: all_gather_coalesced: output list {q} must match the "
                                 f"inputs' sizes and dtypes {[(x.dtype, x.numel()) for x in inputs]}, got "
                                 f"{[(o.dtype, o.numel()) for o in outs]}")

        def run() -> None:
            mine = torch.cat([byte_view(x) for x in inputs]) if inputs else torch.empty(0, dtype=torch.uint8)
            n = mine.numel()
            flat = torch.empty(n * self._size, dtype=torch.uint8)
            self._with_timeout(opts).all_gather(flat, mine)
            for q, outs in enumerate(outputs):
                off = q * n
                for o in outs:
                    nb = o.numel() * o.element_size()
                    o.detach().copy_(flat[off : off + nb].view(o.dtype).view(o.shape))
                    off += nb

        return self._submit("all_gather_coalesced", run, outputs, inputs=inputs)

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

        return self._submit("all_gather_into_tensor", run, [output], output.numel() * output.element_size(),
                            inputs=x)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        def run() -> None:
            comm = self._with_timeout(opts)
            for o, x in zip(outputs, inputs):
                out = Staged(o, read=False)
                comm.all_gather(out.flat, flat_cat([x]))
                out.write_back()

        return self._submit("all_gather_into_tensor_coalesced", run, outputs, inputs=inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

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

        return self._submit("gather", run, outputs, inputs=inputs)

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

        return self._submit("scatter", run, outputs, inputs=inputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        def run() -> None:
            self._check_list(outputs, "all_to_all output list")
            self._check_list(inputs, "all_to_all input list")
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
            self._with_timeout(opts).all_to_all(flat_out, flat_cat(inputs), [t.numel() for t in inputs],
                                                [o.numel() for o in outputs])
            split_into(flat_out, outputs)

        return self._submit("all_to_all", run, outputs, inputs=inputs)

    def all_to_all_single(self, output: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], opts: Any = None) -> Work:
        def run() -> None:
            r, w = self._rank, self._size
            send = rows_to_elems(x, list(in_splits), w, "all_to_all_single input", r)
            recv = rows_to_elems(output, list(out_splits), w, "all_to_all_single output", r)
            out = Staged(output, read=False)
            self._with_timeout(opts).all_to_all(out.flat, flat_cat([x]), send, recv)
            out.write_back()

        return self._submit("all_to_all_single", run, [output], inputs=x)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Work:
        def run() -> None:
            self._with_timeout(opts).barrier()

        return self._submit("barrier", run, [], 0)

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
