"""The local stages of a compressed all-reduce (no communication), and the two exchanges between them.

Shared by the blocking call (`allreduce.py`), its pipelined form (`overlap.py`) and the DDP hooks
(`pipeline.py`).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from .codecs import Codec
from .scheme import ChunkLayout


class Exchange(Protocol):
    """Moves uint8 rows between the ranks of one group; both calls block until done."""

    world_size: int

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """inp, out: uint8 [W, C]; row j of inp goes to rank j, row i of out came from rank i."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """inp: uint8 [1, C], out: uint8 [W, C]; row i of out is rank i's inp."""


def encode_inputs(
    flat: torch.Tensor, layout: ChunkLayout, codec: Codec, residual: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 [numel] -> uint8 [W, C]. With `residual` (error feedback), encode flat + residual and
    leave in `residual` what this encoding lost, to be added next time."""
    rows = flat if residual is None else flat + residual
    if layout.padded != layout.numel:
        rows = torch.cat([rows, rows.new_zeros(layout.padded - layout.numel)])
    rows = rows.reshape(layout.world_size, layout.shard)  # a view unless `flat` is strided
    wire = codec.encode(rows)
    if residual is not None:
        lost = rows - codec.decode(wire, layout.shard)
        residual.copy_(lost.reshape(-1)[: layout.numel])
    return wire


def reduce_shard(
    received: torch.Tensor, layout: ChunkLayout, codec: Codec, residual: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """uint8 [W, C] (every rank's copy of my shard) -> uint8 [1, C] encoding of their fp32 sum.
    `residual` ([shard] fp32) is the same error feedback for the second encoding."""
    total = codec.decode(received[:1], layout.shard)
    for row in range(1, received.shape[0]):  # decode-and-add per row: no [W, shard] fp32 temporary
        codec.decode(received[row : row + 1], layout.shard, out=total, accumulate=True)
    if residual is not None:
        total += residual
    wire = codec.encode(total)
    if residual is not None:
        residual.copy_((total - codec.decode(wire, layout.shard)).view(-1))
    return wire


def decode_result(
    gathered: torch.Tensor, layout: ChunkLayout, codec: Codec, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """uint8 [W, C] (every rank's encoded sum) -> fp32 [numel], the reduced tensor.

    `out` (contiguous fp32 [numel]) receives it directly when no padding is involved, which saves a
    64 MB temporary and a copy for a 64 MB tensor."""
    if out is not None and layout.padded == layout.numel and out.is_contiguous() and out.dtype == torch.float32:
        codec.decode(gathered, layout.shard, out=out.view(layout.world_size, layout.shard))
        return out
    return codec.decode(gathered, layout.shard).reshape(-1)[: layout.numel]
