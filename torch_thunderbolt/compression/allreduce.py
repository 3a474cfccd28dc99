"""Compressed all-reduce: reduce-scatter of encoded shards, fp32 sum, all-gather of encoded sums.

    rank r:  x_r --pad/cut into W shards--> encode --all_to_all--> W encoded copies of shard r
             --decode, sum in fp32--> s_r --encode--> --all_gather--> decode --> result (all ranks)

Each element is encoded twice whatever the world size (once per rank's input, once for the sum), and
each rank sends 2 * (W - 1) encoded shards: the bytes of a ring all-reduce, at 1/4 (int8) or 1/2
(fp16/bf16) of fp32. Every rank decodes the same gathered bytes, so all ranks get identical results.

The collectives are reached through an `Exchange` (two byte-moving calls), so this runs on gloo, on the
thunderbolt backend, or on the backend's own transport without re-entering its all_reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .codecs import Codec, codec_for
from .layout import DEFAULT_BLOCK_SIZE, ChunkLayout, check_mode, chunk_layout


class Exchange(Protocol):
    """Moves uint8 rows between the ranks of one group; both calls block until done."""

    world_size: int

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """inp, out: uint8 [W, C]; row j of inp goes to rank j, row i of out came from rank i."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """inp: uint8 [1, C], out: uint8 [W, C]; row i of out is rank i's inp."""


def all_gather_fn():
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older torch lacks it.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TorchExchange:
    """Exchange over torch.distributed collectives on `group` (None = the default group)."""

    group: Optional[dist.ProcessGroup] = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_to_all_single(out, inp, group=self.group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        all_gather_fn()(out, inp, group=self.group)


# --- the three local stages (no communication), shared by the blocking call and the DDP hooks ------


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
    total = codec.decode(received, layout.shard).sum(dim=0, keepdim=True)
    if residual is not None:
        total += residual
    wire = codec.encode(total)
    if residual is not None:
        residual.copy_((total - codec.decode(wire, layout.shard)).view(-1))
    return wire


def decode_result(gathered: torch.Tensor, layout: ChunkLayout, codec: Codec) -> torch.Tensor:
    """uint8 [W, C] (every rank's encoded sum) -> fp32 [numel], the reduced tensor."""
    return codec.decode(gathered, layout.shard).reshape(-1)[: layout.numel]


# --- blocking call ---------------------------------------------------------------------------------


def check_float(tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point() or tensor.is_complex():
        raise ConfigError(f"compressed all_reduce needs a floating-point tensor; got {tensor.dtype}")


def compressed_all_reduce(
    tensor: torch.Tensor,
    mode: str = "int8",
    group: Optional[dist.ProcessGroup] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    average: bool = False,
    exchange: Optional[Exchange] = None,
) -> torch.Tensor:
    """Sum (or average) `tensor` across the group in place, through `mode` compression; returns it.

    Every rank must call it with the same numel, mode and block size. "none" is a plain all_reduce.
    `exchange` replaces the torch.distributed collectives on `group` (the backend passes its transport).
    With `average`, values are divided by the world size before encoding (fp16 then overflows only if
    the mean does).
    """
    mode = check_mode(mode)
    check_float(tensor)
    if mode == "none":
        dist.all_reduce(tensor, group=group)
        return tensor.div_(dist.get_world_size(group)) if average else tensor
    codec = codec_for(mode, block_size)
    exchange = exchange if exchange is not None else TorchExchange(group)
    world = exchange.world_size
    if world == 1 or tensor.numel() == 0:
        return tensor
    layout = chunk_layout(tensor.numel(), world)
    flat = tensor.detach().reshape(-1).to(torch.float32)
    if average:
        flat = flat / world
    sent = encode_inputs(flat, layout, codec)
    received = torch.empty_like(sent)
    exchange.all_to_all(received, sent)
    mine = reduce_shard(received, layout, codec)
    gathered = torch.empty(world, mine.shape[1], dtype=torch.uint8)
    exchange.all_gather(gathered, mine)
    result = decode_result(gathered, layout, codec)
    with torch.no_grad():
        tensor.copy_(result.view(tensor.shape))
    return tensor
