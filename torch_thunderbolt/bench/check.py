"""Result checking: rank-dependent inputs whose exact outputs are known, and a count of wrong elements.

Rank r's input element i is value(r, i) = 1 + (r + i) mod 8: small integers, exact in every dtype,
different per rank (so a chunk from the wrong rank is caught) and per position (so a shifted chunk is
caught). Every expected output is periodic with period 8 within a chunk, so it is described by eight
numbers per chunk and compared without building a full-size expected tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .spec import Layout

if TYPE_CHECKING:  # torch is imported lazily so the pure half of this module stays light
    import torch

PERIOD = 8


def value(rank: int, index: int) -> int:
    return 1 + (rank + index) % PERIOD


@dataclass(frozen=True)
class Chunk:
    """out[offset + k] must equal values[k % PERIOD] for 0 <= k < length."""
    offset: int
    length: int
    values: tuple[int, ...]


def _pattern(rank: int, start: int) -> tuple[int, ...]:
    return tuple(value(rank, start + k) for k in range(PERIOD))


def _summed(world_size: int, start: int) -> tuple[int, ...]:
    return tuple(sum(value(r, start + k) for r in range(world_size)) for k in range(PERIOD))


def expected_chunks(op: str, rank: int, world_size: int, lay: Layout) -> list[Chunk]:
    """The exact output of `op` on `rank` when every rank's input was filled by `fill_input`."""
    n, per = world_size, lay.count
    if op == "all_reduce":
        return [Chunk(0, lay.out_numel, _summed(n, 0))]
    if op == "broadcast":
        return [Chunk(0, lay.out_numel, _pattern(0, 0))]
    if op == "all_gather":
        return [Chunk(j * per, per, _pattern(j, 0)) for j in range(n)]
    if op == "reduce_scatter":
        return [Chunk(0, per, _summed(n, rank * per))]
    if op == "all_to_all":
        return [Chunk(j * per, per, _pattern(j, rank * per)) for j in range(n)]
    if op == "sendrecv":
        if rank > 1:
            return []  # only ranks 0 and 1 take part in the ping-pong
        return [Chunk(0, lay.out_numel, _pattern(1 - rank, 0))]
    raise ValueError(f"unknown op {op!r}")


def _periodic_view(tensor: "torch.Tensor", offset: int, length: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Split tensor[offset:offset+length] into whole periods (rows of PERIOD) and a remainder."""
    flat = tensor.reshape(-1)[offset:offset + length]
    whole = (length // PERIOD) * PERIOD
    return flat[:whole].view(-1, PERIOD), flat[whole:]


def fill_input(tensor: "torch.Tensor", rank: int) -> None:
    """Write value(rank, i) into every element i of `tensor` (in place)."""
    import torch

    base = torch.tensor(_pattern(rank, 0), dtype=tensor.dtype)
    rows, rest = _periodic_view(tensor, 0, tensor.numel())
    rows.copy_(base.expand_as(rows))
    rest.copy_(base[: rest.numel()])


def count_wrong(output: "torch.Tensor", chunks: list[Chunk]) -> int:
    """How many elements of `output` differ from the expected chunks (nccl-tests' #wrong)."""
    import torch

    covered = sum(chunk.length for chunk in chunks)
    if chunks and output.numel() != covered:
        return max(output.numel(), covered)  # a buffer of the wrong size is wrong throughout
    wrong = 0
    for chunk in chunks:
        base = torch.tensor(chunk.values, dtype=output.dtype)
        rows, rest = _periodic_view(output, chunk.offset, chunk.length)
        wrong += int((rows != base).sum()) + int((rest != base[: rest.numel()]).sum())
    return wrong
