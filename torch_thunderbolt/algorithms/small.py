"""The direct all_reduce of small messages, run without a plan walk.

A small all_reduce is latency-bound: its data costs a few µs to move, and walking its plan (dependency
counts, per-peer queues, a byte view per buffer, a scratch slice per op) cost as much again. This runs the
same messages as `direct.direct_allreduce` (every rank sends its whole input to every other rank as message
0 of the op, and reduces what it received in rank order, so every rank ends with the same bits), on
receive buffers and byte views made once per message size and kept.

A rank running this and a rank running the plan exchange the same frames, so the two can meet in one op.
"""
from __future__ import annotations

import numpy as np
import torch

from ..transport.engine import Transport
from .direct import peer_order
from .plan import tensor_bytes
from .reduce_ops import ArrayCombiner, Combiner, array_combiner


class SmallOperands:
    """What a kept small all_reduce reduces, viewed once: its contributions (`slots[r]`: rank r's, by rank
    or window position) as torch tensors, or as numpy arrays where numpy's kernel gives torch's exact result
    (`reduce_ops.array_combiner`), with their byte views; and the byte view (and array) of the last input,
    kept while inputs come at the same address (the same tensor, most often: a DDP bucket, a loop's
    buffer), since making them costs a small op a few µs. `filled`: this rank's own slot holds its input
    by the time `reduce` runs (the window's one-shot copies it there); else only the peers' slots are
    filled."""

    __slots__ = ("rank", "slots", "slot_bytes", "combine", "filled", "_tensors", "_np", "_ptr", "own", "_x")

    def __init__(self, rank: int, slots: list[torch.Tensor], op: str, combine: Combiner, filled: bool) -> None:
        self.rank, self.filled = rank, filled
        self._tensors = slots  # the memory the byte views and arrays point into: kept alive with them
        self.slot_bytes = [tensor_bytes(s) for s in slots]
        fast = array_combiner(op, slots[0].dtype)
        self._np = None if fast is None else fast[0]
        self.slots: list = slots if fast is None else [np.frombuffer(b, fast[0]) for b in self.slot_bytes]
        self.combine: Combiner | ArrayCombiner = combine if fast is None else fast[1]
        self._ptr, self.own, self._x = -1, memoryview(b""), None

    def take(self, x: torch.Tensor) -> memoryview:
        """Make `x` (1-D, contiguous, of the slots' size and dtype) the input; returns its bytes."""
        ptr = x.data_ptr()
        if ptr != self._ptr:  # (a view of the same size at the same address is a view of `x`)
            self.own, self._ptr = tensor_bytes(x), ptr
            self._x = x if self._np is None else np.frombuffer(self.own, self._np)
        return self.own

    def reduce(self) -> None:
        """input := slots[0] ⊕ slots[1] ⊕ ... ⊕ slots[n-1], in rank order on every rank (the same bits
        everywhere). While its own slot is empty, rank 0 or 1 uses the input in its place; a later rank
        first copies its input there, since the input is overwritten before its turn."""
        xs, slots, combine, rank = self._x, self.slots, self.combine, self.rank
        if self.filled or rank > 1:
            if not self.filled:
                self.slot_bytes[rank][:] = self.own
            combine(xs, slots[0], slots[1])
        elif rank == 0:
            combine(xs, xs, slots[1])
        else:
            combine(xs, slots[0], xs)
        for r in range(2, len(slots)):
            combine(xs, xs, slots[r])


class DirectAllReduce:
    """A small all_reduce of one element count, dtype and reduce op, made once: `operands.slots[r]` holds rank
    r's contribution once it arrived. `what` names the op in errors (the Communicator numbers it)."""

    __slots__ = ("t", "to", "frm", "recvs", "operands", "sig", "what")
    engine = True  # its messages go through the engine, under the op's tag (which `exchange` retires)

    def __init__(self, t: Transport, count: int, dtype: torch.dtype, op: str, combine: Combiner, sig: int,
                 what: object) -> None:
        self.t = t
        self.to, self.frm = peer_order(t.rank, t.world)  # the plan's order
        scratch = torch.empty(t.world * count, dtype=dtype)
        self.operands = SmallOperands(t.rank, [scratch[r * count : (r + 1) * count] for r in range(t.world)], op,
                                      combine, filled=False)
        self.recvs = [(p, self.operands.slot_bytes[p]) for p in self.frm]
        self.sig, self.what = sig, what

    def run(self, x: torch.Tensor, tag: int, deadline: float) -> None:
        """x := x_0 ⊕ x_1 ⊕ ... ⊕ x_{world-1} (rank order) on every rank, `x` being this rank's x_rank."""
        # Sends first, as the plan posts them: a rank that finds a mismatch in what arrived (and stops)
        # has still sent its own part, so its peers find the mismatch too instead of waiting for it. The
        # exchange also waits for the sends: they read `x`, which the reduction overwrites.
        own, key = self.operands.take(x), (self.t.coll, tag, 0)
        self.t.exchange([(p, key, own) for p in self.to], [(p, key, view) for p, view in self.recvs], self.sig,
                        deadline, self.what, retire=tag)
        self.operands.reduce()
