"""The direct all_reduce of small messages, run without a plan walk.

A small all_reduce is latency-bound: its data costs a few µs to move, and walking its plan (dependency
counts, per-peer queues, a byte view per buffer, a scratch slice per op) cost as much again. This runs the
same messages as `direct.direct_allreduce` (every rank sends its whole input to every other rank as message
0 of the op, and reduces what it received in rank order, so every rank ends with the same bits), on
receive buffers and byte views made once per message size and kept.

A rank running this and a rank running the plan exchange the same frames, so the two can meet in one op.
"""
from __future__ import annotations

import torch

from ..transport.engine import Transport
from .direct import peer_order
from .plan import tensor_bytes
from .reduce_ops import Combiner


class DirectAllReduce:
    """A small all_reduce of one element count, dtype and reduce op, made once: `slots[r]` holds rank r's
    contribution once it arrived. `what` names the op in errors (the Communicator numbers it)."""

    __slots__ = ("t", "rank", "world", "to", "frm", "slots", "recvs", "combine", "sig", "what", "_ptr", "_own")
    engine = True  # its messages go through the engine, under the op's tag (which `exchange` retires)

    def __init__(self, t: Transport, count: int, dtype: torch.dtype, combine: Combiner, sig: int,
                 what: object) -> None:
        self.t, self.rank, self.world = t, t.rank, t.world
        self.to, self.frm = peer_order(t.rank, t.world)  # the plan's order
        scratch = torch.empty(t.world * count, dtype=dtype)
        self.slots = [scratch[r * count : (r + 1) * count] for r in range(t.world)]
        self.recvs = [(p, tensor_bytes(self.slots[p])) for p in self.frm]
        self.combine, self.sig, self.what = combine, sig, what
        # The byte view of the last input, kept while inputs come at the same address (the same tensor, most
        # often: a DDP bucket, a loop's buffer): making one costs a small op a few µs.
        self._ptr, self._own = 0, memoryview(b"")

    def run(self, x: torch.Tensor, tag: int, deadline: float) -> None:
        """x := x_0 ⊕ x_1 ⊕ ... ⊕ x_{world-1} (rank order) on every rank, `x` being this rank's x_rank."""
        # Sends first, as the plan posts them: a rank that finds a mismatch in what arrived (and stops)
        # has still sent its own part, so its peers find the mismatch too instead of waiting for it. The
        # exchange also waits for the sends: they read `x`, which the reduction overwrites.
        ptr = x.data_ptr()
        if ptr != self._ptr:  # (a view of the same size at the same address is a view of `x`)
            self._own, self._ptr = tensor_bytes(x), ptr
        own, key = self._own, (self.t.coll, tag, 0)
        self.t.exchange([(p, key, own) for p in self.to], [(p, key, view) for p, view in self.recvs], self.sig,
                        deadline, self.what, retire=tag)
        slots, combine, rank = self.slots, self.combine, self.rank
        # x_0 ⊕ x_1 first, with the operands in that order on every rank: in place of the own one on ranks
        # 0 and 1; a later rank keeps its own part aside for its turn.
        if rank == 0:
            combine(x, x, slots[1])
        elif rank == 1:
            combine(x, slots[0], x)
        else:
            slots[rank].copy_(x)
            combine(x, slots[0], slots[1])
        for r in range(2, self.world):
            combine(x, x, slots[r])
