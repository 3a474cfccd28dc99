"""The timed loop: every backend runs each op at each size, interleaved iteration by iteration.

Fairness: iteration i runs backend A then B, iteration i+1 B then A, ... so a machine that drifts
(other load, CPU placement, thermal) slows both alike, and neither always follows the other. Each
iteration is a block of back-to-back calls (several for small messages, as nccl-tests times a loop),
started after a barrier on the control group so no backend inherits the other's finishing skew, and, for
blocks of several calls, after one untimed call that lines the ranks up on the backend being timed; each
rank times its own block and the per-iteration maximum over ranks is taken once at the end of the size.
Inputs are refilled and outputs checked only on the check iterations (the first and last timed one, single
calls), outside the timed region.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import ThunderboltError
from . import check, spec

# op(group, buffers, rank): one blocking call of the collective on `group`.
OpFn = Callable[[Any, "Buffers", int], None]


@dataclass
class Buffers:
    inp: torch.Tensor
    out: torch.Tensor  # the same tensor as inp for in-place ops (all_reduce, broadcast)


def make_buffers(op: str, lay: spec.Layout, dtype: torch.dtype) -> Buffers:
    inp = torch.empty(lay.in_numel, dtype=dtype)
    if op in ("all_reduce", "broadcast"):
        return Buffers(inp, inp)
    return Buffers(inp, torch.empty(lay.out_numel, dtype=dtype))


def _all_reduce(group: Any, b: Buffers, rank: int) -> None:
    dist.all_reduce(b.out, group=group)


def _broadcast(group: Any, b: Buffers, rank: int) -> None:
    dist.broadcast(b.out, src=spec.BROADCAST_ROOT, group=group)


def _all_gather(group: Any, b: Buffers, rank: int) -> None:
    # all_gather_single is the current name; all_gather_into_tensor the deprecated one of older torch.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(b.out, b.inp, group=group)


def _reduce_scatter(group: Any, b: Buffers, rank: int) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(b.out, b.inp, group=group)


def _all_to_all(group: Any, b: Buffers, rank: int) -> None:
    dist.all_to_all_single(b.out, b.inp, group=group)


def _sendrecv(group: Any, b: Buffers, rank: int) -> None:
    # Ping-pong: rank 0 sends and waits for the answer; ranks above 1 sit this one out.
    if rank == 0:
        dist.send(b.inp, dst=1, group=group)
        dist.recv(b.out, src=1, group=group)
    elif rank == 1:
        dist.recv(b.out, src=0, group=group)
        dist.send(b.inp, dst=0, group=group)


OP_FUNCTIONS: dict[str, OpFn] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "sendrecv": _sendrecv,
}


def prepare(op: str, b: Buffers, rank: int) -> None:
    """Known inputs; outputs poisoned with 0 (never a valid value), so a call that did nothing is caught."""
    if b.out is not b.inp:
        b.out.zero_()
    if op == "broadcast" and rank != spec.BROADCAST_ROOT:
        b.inp.zero_()
    else:
        check.fill_input(b.inp, rank)


def check_iterations(warmup: int, iters: int) -> set[int]:
    return {warmup, warmup + iters - 1}


def own_time_us(op: str, rank: int, elapsed_ns: int) -> float:
    """What this rank contributes to the iteration's time (the maximum over ranks is taken later)."""
    if op == "sendrecv":
        return elapsed_ns / 2e3 if rank == 0 else 0.0  # one-way = round trip / 2, timed by rank 0
    return elapsed_ns / 1e3


class OpFailedError(ThunderboltError):
    """A backend raised inside a benchmarked op; `group_index` says which of the measured groups."""

    def __init__(self, message: str, group_index: int) -> None:
        super().__init__(message)
        self.group_index = group_index


@dataclass
class SizeTimes:
    times_us: list[list[float]]  # [backend][iteration], this rank's own view until reduced
    wrong: list[int]             # [backend]


def block_size(nbytes: int) -> int:
    """Back-to-back calls per timed block (as nccl-tests times a loop): small ops are dominated by the
    start-up skew between ranks, which a block amortises; large ones need no repeats."""
    return 1 if nbytes >= (1 << 20) else 10 if nbytes >= (64 << 10) else 20


def time_size(op: str, lay: spec.Layout, groups: Sequence[Any], rank: int, world_size: int,
              dtype: torch.dtype, warmup: int, iters: int, fn: OpFn,
              step: Callable[[], None] = lambda: None, control: Any = None,
              checked: Sequence[bool] | None = None) -> SizeTimes:
    """Run warmup + iters interleaved iterations of `fn` over all groups at one size on this rank.
    `checked[g]` False: group g's outputs are not checked (the floor's null group computes nothing); its
    check iterations are still single calls, timed like everyone else's."""
    b = make_buffers(op, lay, dtype)
    chunks = check.expected_chunks(op, rank, world_size, lay)
    checks = check_iterations(warmup, iters)
    result = SizeTimes([[0.0] * iters for _ in groups], [0] * len(groups))
    prepare(op, b, rank)
    clock = time.perf_counter_ns
    for it in range(warmup + iters):
        # A B, B A, A B, ...: neither backend always runs right after the other one.
        order = list(enumerate(groups)) if it % 2 == 0 else list(enumerate(groups))[::-1]
        for g, group in order:
            checking = it in checks
            if checking:
                prepare(op, b, rank)
            reps = 1 if checking else block_size(lay.nbytes)
            # Start every backend's block from the same line: without this, the skew with which the
            # previous backend's op finished on each rank is charged to whichever op runs next.
            dist.barrier(group=control)
            try:
                if reps > 1:
                    # One untimed call first, as nccl-tests' warm-up calls precede its timed loop: the
                    # control group's barrier releases the ranks up to a wake-up or two apart (~0.1-0.2 ms
                    # here), which a block of 20 small ops would pay as if each op took 5-10 µs longer.
                    fn(group, b, rank)
                start = clock()
                for _ in range(reps):
                    fn(group, b, rank)
            except Exception as exc:  # noqa: BLE001 - re-raised with the op, size and backend named
                raise OpFailedError(f"{op} of {lay.nbytes} B failed: {exc}", g) from exc
            elapsed = (clock() - start) // reps
            if checking and (checked is None or checked[g]):
                result.wrong[g] += check.count_wrong(b.out, chunks)
            if it >= warmup:
                result.times_us[g][it - warmup] = own_time_us(op, rank, elapsed)
        step()
    return result


def reduce_over_ranks(local: SizeTimes, control: Any) -> SizeTimes:
    """Once per size: per-iteration maximum of the times and total of the wrong counts over all ranks."""
    times = torch.tensor(local.times_us, dtype=torch.float64)
    wrong = torch.tensor(local.wrong, dtype=torch.int64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=control)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM, group=control)
    return SizeTimes(times.tolist(), [int(w) for w in wrong.tolist()])


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def op_function(op: str, table: Mapping[str, OpFn] | None = None) -> OpFn:
    return (table or OP_FUNCTIONS)[op]
