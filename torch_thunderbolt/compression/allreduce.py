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
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .codecs import Codec, codec_for
from .overlap import pipelined_all_reduce
from .stages import Exchange, decode_result, encode_inputs, reduce_shard
from .scheme import DEFAULT_BLOCK_SIZE, PIECE_ELEMENTS, check_mode, chunk_layout, pipeline_pieces


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
    piece_elements: int = PIECE_ELEMENTS,
) -> torch.Tensor:
    """Sum (or average) `tensor` across the group in place, through `mode` compression; returns it.

    Every rank must call it with the same numel, mode and block size. "none" is a plain all_reduce.
    `exchange` replaces the torch.distributed collectives on `group` (the backend passes its transport).
    With `average`, values are divided by the world size before encoding (fp16 then overflows only if
    the mean does). Tensors of two or more `piece_elements` are pipelined in pieces (`overlap.py`).
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
    flat = tensor.detach().reshape(-1).to(torch.float32)
    if average:
        flat = flat / world
    in_place = tensor.is_contiguous() and tensor.dtype == torch.float32 and not average  # flat is tensor's view
    out = flat if in_place else torch.empty_like(flat)
    with torch.no_grad():
        if len(pipeline_pieces(flat.numel(), piece_elements)) > 1:
            pipelined_all_reduce(flat, out, codec, exchange, piece_elements)
        else:
            _one_piece(flat, out, codec, exchange)
        if not in_place:
            tensor.copy_(out.view(tensor.shape))
    return tensor


def _one_piece(flat: torch.Tensor, out: torch.Tensor, codec: Codec, exchange: Exchange) -> None:
    """encode, all_to_all, reduce, all_gather, decode into `out` (may be `flat`: decoding comes last)."""
    layout = chunk_layout(flat.numel(), exchange.world_size)
    sent = encode_inputs(flat, layout, codec)
    received = torch.empty_like(sent)
    exchange.all_to_all(received, sent)
    mine = reduce_shard(received, layout, codec)
    gathered = torch.empty(layout.world_size, mine.shape[1], dtype=torch.uint8)
    exchange.all_gather(gathered, mine)
    result = decode_result(gathered, layout, codec, out=out)
    if result is not out:
        out.copy_(result)
