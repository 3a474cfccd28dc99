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
from .scheme import DEFAULT_BLOCK_SIZE, SCALE_BYTES, check_block_size, check_mode

INT8_LEVELS = 127  # symmetric: -127..127, so +absmax and -absmax are both exact


class Codec(Protocol):
    mode: str

    def chunk_bytes(self, shard: int) -> int: ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor: ...

    def decode(
        self, wire: torch.Tensor, shard: int, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        """fp32 [R, shard]; with `out`, written there (or added to it when `accumulate`)."""


# Rows are processed in slabs of whole blocks, about 1 MB of fp32 each: the scratch buffer stays in cache
# and is reused, whereas whole-tensor temporaries are fresh allocations whose page faults cost more than
# the arithmetic (measured: 16 ms of faults for a 32 MB temporary against 3 ms for a pass over it).
SLAB_ELEMENTS = 1 << 18


def _slabs(shard: int, block_size: int) -> list[tuple[int, int]]:
    """(start, stop) ranges covering [0, shard): whole blocks, the last slab may end in a short block."""
    step = max(1, SLAB_ELEMENTS // block_size) * block_size
    return [(a, min(a + step, shard)) for a in range(0, shard, step)]


def _block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute maximum of each block of 1-D `x` (the last block may be short); NaN propagates."""
    full = x.numel() // block_size * block_size
    parts = []
    if full:
        xb = x[:full].view(-1, block_size)
        # amax and amin are two cheap reductions; aminmax and abs() are several times slower here.
        parts.append(torch.maximum(xb.amax(dim=-1), xb.amin(dim=-1).neg_()))
    if x.numel() > full:
        tail = x[full:]
        parts.append(torch.maximum(tail.amax(), tail.amin().neg()).reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scale_blocks_(x: torch.Tensor, per_block: torch.Tensor, block_size: int) -> None:
    """x (1-D, in place) *= per_block[block of each element]."""
    full = x.numel() // block_size * block_size
    if full:
        x[:full].view(-1, block_size).mul_(per_block[: full // block_size].unsqueeze(-1))
    if x.numel() > full:
        x[full:].mul_(per_block[-1])


def quantize_int8(
    rows: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, out: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-absmax int8: returns (q int8 [R, S], scales fp32 [R, nb]) with x ~= q * scale.

    `out` (int8 [R, S], any strides) receives q, e.g. a slice of the wire buffer. A block whose
    absmax is 0 gets scale 0 (all q = 0). A block holding inf/nan gets a non-finite scale, so it
    decodes to non-finite values: overflow stays visible to loss scalers instead of being clipped.
    """
    rows = _as_rows(rows)
    block_size = check_block_size(block_size)
    n_rows, shard = rows.shape
    out = torch.empty(n_rows, shard, dtype=torch.int8) if out is None else out
    scales = rows.new_empty(n_rows, math.ceil(shard / block_size))
    scratch = rows.new_empty(min(shard, SLAB_ELEMENTS + block_size))
    for r in range(n_rows):
        for a, b in _slabs(shard, block_size):
            x, work = rows[r, a:b], scratch[: b - a]
            s = _block_absmax(x, block_size).div_(INT8_LEVELS)
            scales[r, a // block_size : a // block_size + s.numel()] = s
            # x * (1/scale) may land a hair above 127 (one fp32 rounding); round() and the int8
            # conversion keep it at 127, so no clamp pass is needed. Scale 0 or nan -> multiplier 0.
            inverse = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
            work.copy_(x)
            _scale_blocks_(work, inverse, block_size)
            out[r, a:b].copy_(work.round_())  # float -> int8 happens in this copy
    return out, scales


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Inverse of `quantize_int8`: fp32 [R, S] (written to, or with `accumulate` added to, `out`)."""
    n_rows, shard = q.shape
    block_size = check_block_size(block_size)
    expected = (n_rows, math.ceil(shard / block_size))
    if tuple(scales.shape) != expected:
        raise ConfigError(f"expected scales of shape {expected}; got {tuple(scales.shape)}")
    out = torch.empty(n_rows, shard) if out is None else out
    scratch = torch.empty(min(shard, SLAB_ELEMENTS + block_size)) if accumulate else None
    for r in range(n_rows):
        for a, b in _slabs(shard, block_size):
            # int8 -> fp32 copy then an fp32 multiply: a mixed-dtype multiply is 7x slower here.
            work = out[r, a:b] if scratch is None else scratch[: b - a]
            work.copy_(q[r, a:b])
            blocks = scales[r, a // block_size : math.ceil(b / block_size)]
            _scale_blocks_(work, blocks, block_size)
            if scratch is not None:
                out[r, a:b].add_(work)
    return out


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

    def decode(
        self, wire: torch.Tensor, shard: int, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        _check_wire(wire, self.chunk_bytes(shard))
        if shard == 0:
            return torch.zeros(wire.shape[0], 0) if out is None else out
        head = SCALE_BYTES * math.ceil(shard / self.block_size)
        scales = _reinterpret(wire[:, :head], torch.float32)
        return dequantize_int8(wire[:, head:].view(torch.int8), scales, self.block_size, out, accumulate)


@dataclass(frozen=True)
class CastCodec:
    """fp16 / bf16: every element rounded to nearest once; 2 bytes per element."""

    mode: str
    dtype: torch.dtype

    def chunk_bytes(self, shard: int) -> int:
        return 2 * shard

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return _as_rows(rows).to(self.dtype).contiguous().view(torch.uint8)

    def decode(
        self, wire: torch.Tensor, shard: int, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        _check_wire(wire, self.chunk_bytes(shard))
        if shard == 0:
            return torch.zeros(wire.shape[0], 0) if out is None else out
        values = _reinterpret(wire, self.dtype)
        if out is None:
            return values.to(torch.float32)
        return out.add_(values) if accumulate else out.copy_(values)


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
