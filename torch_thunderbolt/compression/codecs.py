"""Pure encoders: fp32 rows <-> byte rows that travel on the wire.

Every codec turns a 2-D fp32 tensor [rows, shard] into a uint8 tensor [rows, chunk_bytes(shard)] and
back. Bytes (not int8/fp16 tensors) go on the wire so that any backend that can move uint8 can carry
any mode, and bf16 needs no bf16 support in the transport.

int8 row layout: [fp32 scale per block (4 * blocks bytes) | one int8 per element (shard bytes)].
Blocks are `block_size` consecutive elements of a row; the last block of a row may be short.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..errors import ConfigError
from .layout import DEFAULT_BLOCK_SIZE, SCALE_BYTES, check_block_size, check_mode

INT8_LEVELS = 127  # symmetric: -127..127, so +absmax and -absmax are both exact


class Codec(Protocol):
    mode: str

    def chunk_bytes(self, shard: int) -> int: ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor: ...

    def decode(self, wire: torch.Tensor, shard: int) -> torch.Tensor: ...


def _blocked(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, S] -> [R, nb, block_size], zero-padding each row's last block (no copy when S divides)."""
    n_rows, shard = rows.shape
    nb = math.ceil(shard / block_size)
    if nb * block_size == shard:
        return rows.reshape(n_rows, nb, block_size)
    padded = rows.new_zeros(n_rows, nb * block_size)
    padded[:, :shard] = rows
    return padded.view(n_rows, nb, block_size)


def quantize_int8(
    rows: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, out: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-absmax int8: returns (q int8 [R, S], scales fp32 [R, nb]) with x ~= q * scale.

    `out` (int8 [R, S], any strides) receives q, e.g. a slice of the wire buffer. A block whose
    absmax is 0 gets scale 0 (all q = 0). A block holding inf/nan gets a non-finite scale, so it
    decodes to non-finite values: overflow stays visible to loss scalers instead of being clipped.
    """
    rows = _as_rows(rows)
    n_rows, shard = rows.shape
    out = torch.empty(n_rows, shard, dtype=torch.int8) if out is None else out
    if shard == 0:
        return out, rows.new_zeros(n_rows, 0)
    blocks = _blocked(rows, check_block_size(block_size))
    low, high = torch.aminmax(blocks, dim=-1)  # one pass; abs().amax() would allocate |x| first
    scales = torch.maximum(high, low.neg_()).div_(INT8_LEVELS)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    # |x| / (absmax/127) <= 127 up to one fp32 rounding, which round() absorbs: no clamp pass needed.
    scaled = torch.div(blocks, safe.unsqueeze(-1)).round_()
    out.copy_(scaled.view(n_rows, -1)[:, :shard])  # the float -> int8 conversion happens in this copy
    return out, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Inverse of `quantize_int8`: fp32 [R, S]."""
    n_rows, shard = q.shape
    blocks = _blocked(q, check_block_size(block_size))
    if scales.shape != blocks.shape[:2]:
        raise ConfigError(f"expected scales of shape {tuple(blocks.shape[:2])}; got {tuple(scales.shape)}")
    # int8 * fp32 promotes inside the kernel: one pass, no fp32 copy of q.
    return torch.mul(blocks, scales.unsqueeze(-1)).view(n_rows, -1)[:, :shard]


def _as_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dim() != 2:
        raise ConfigError(f"expected a 2-D [rows, shard] tensor; got shape {tuple(rows.shape)}")
    return rows.to(torch.float32)


@dataclass(frozen=True)
class Int8Codec:
    block_size: int = DEFAULT_BLOCK_SIZE
    mode: str = "int8"

    def chunk_bytes(self, shard: int) -> int:
        return SCALE_BYTES * math.ceil(shard / self.block_size) + shard

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        n_rows, shard = rows.shape
        head = SCALE_BYTES * math.ceil(shard / self.block_size)
        wire = torch.empty(n_rows, head + shard, dtype=torch.uint8)
        _, scales = quantize_int8(rows, self.block_size, out=wire[:, head:].view(torch.int8))
        wire[:, :head] = scales.contiguous().view(torch.uint8)
        return wire

    def decode(self, wire: torch.Tensor, shard: int) -> torch.Tensor:
        _check_wire(wire, self.chunk_bytes(shard))
        if shard == 0:
            return torch.zeros(wire.shape[0], 0)
        head = SCALE_BYTES * math.ceil(shard / self.block_size)
        scales = _reinterpret(wire[:, :head], torch.float32)
        return dequantize_int8(wire[:, head:].view(torch.int8), scales, self.block_size)


@dataclass(frozen=True)
class CastCodec:
    """fp16 / bf16: every element rounded to nearest once; 2 bytes per element."""

    mode: str
    dtype: torch.dtype

    def chunk_bytes(self, shard: int) -> int:
        return 2 * shard

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return _as_rows(rows).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, wire: torch.Tensor, shard: int) -> torch.Tensor:
        _check_wire(wire, self.chunk_bytes(shard))
        if shard == 0:
            return torch.zeros(wire.shape[0], 0)
        return _reinterpret(wire, self.dtype).to(torch.float32)


def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [R, k * itemsize] -> dtype [R, k], copying only when strides or alignment forbid a view."""
    size = torch.empty((), dtype=dtype).element_size()
    viewable = raw.stride(1) == 1 and raw.stride(0) % size == 0 and raw.storage_offset() % size == 0
    if not viewable:
        raw = torch.empty(raw.shape, dtype=torch.uint8).copy_(raw)
    return raw.view(dtype)


def _check_wire(wire: torch.Tensor, expected: int) -> None:
    if wire.dtype != torch.uint8 or wire.dim() != 2 or wire.shape[1] != expected:
        raise ConfigError(
            f"expected a uint8 [rows, {expected}] wire tensor; got {wire.dtype} {tuple(wire.shape)}"
        )


def codec_for(mode: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec of a compressed mode; "none" has no codec (it is a plain all_reduce)."""
    mode = check_mode(mode)
    if mode == "int8":
        return Int8Codec(check_block_size(block_size))
    if mode == "fp16":
        return CastCodec("fp16", torch.float16)
    if mode == "bf16":
        return CastCodec("bf16", torch.bfloat16)
    raise ConfigError("compression mode 'none' has no codec: use a plain all_reduce")
