"""Pure arithmetic of the compressed all-reduce: modes, chunk layout, bytes on the wire, error bounds.

Nothing here touches torch.distributed, so the backend (and the tests) can reason about a compressed
all-reduce without running one.

The scheme (see `allreduce.py`): the flat tensor of `numel` elements is padded with zeros to
`world_size * shard` elements and cut into `world_size` equal shards. Every rank encodes all shards,
sends shard j to rank j (all_to_all), rank j decodes the `world_size` copies of its shard, sums them in
fp32, encodes the sum once more and all ranks all-gather the encoded sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..config import COMPRESSIONS, DEFAULT_COMPRESSION_BLOCK, parse_compression
from ..errors import ConfigError

MODES = COMPRESSIONS
DEFAULT_BLOCK_SIZE = DEFAULT_COMPRESSION_BLOCK
SCALE_BYTES = 4  # int8 blocks carry one fp32 scale each
ENV_VAR = "THUNDERBOLT_COMPRESSION"
ENV_BLOCK_VAR = "THUNDERBOLT_COMPRESSION_BLOCK"

# Unit roundoff (half an ulp at 1.0) of the 16-bit float formats: relative error of one rounding.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# Smallest positive subnormal / 2: the absolute error floor of one rounding near zero.
ABS_ROUNDOFF = {"fp16": 2.0**-25, "bf16": 2.0**-134}


def check_mode(mode: str) -> str:
    """Return `mode` normalised to lower case, or raise ConfigError naming the valid modes."""
    norm = mode.strip().lower() if isinstance(mode, str) else None
    if norm not in MODES:
        raise ConfigError(f"compression mode must be one of {', '.join(MODES)}; got {mode!r}")
    return norm


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"compression block size must be a positive integer; got {block_size!r}")
    return block_size


def mode_from_env(environ: Mapping[str, str]) -> tuple[str, int]:
    """(mode, block_size) from THUNDERBOLT_COMPRESSION / THUNDERBOLT_COMPRESSION_BLOCK; unset means none/256.
    Parsed by config.py, like every setting (the block size is 1 to 1M, as for the backend's Config)."""
    return parse_compression(environ)


@dataclass(frozen=True)
class ChunkLayout:
    """How `numel` elements are split into `world_size` equal shards of `shard` elements."""

    numel: int
    world_size: int
    shard: int

    @property
    def padded(self) -> int:
        return self.world_size * self.shard


def chunk_layout(numel: int, world_size: int) -> ChunkLayout:
    """Shards of ceil(numel / world_size) elements; the last shards hold the zero padding."""
    if numel < 0:
        raise ConfigError(f"numel must be >= 0; got {numel}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1; got {world_size}")
    return ChunkLayout(numel, world_size, math.ceil(numel / world_size))


# Compressed all-reduces above two pieces of this many elements (8 MB of fp32) are pipelined
# (`overlap.py`): big enough that per-exchange overheads vanish, small enough for 4+ pieces at 64 MB.
PIECE_ELEMENTS = 1 << 21


def pipeline_pieces(numel: int, piece_elements: int = PIECE_ELEMENTS) -> list[tuple[int, int]]:
    """(start, stop) of the pieces a pipelined all-reduce of `numel` elements cuts: numel // piece_elements
    pieces (at least one) of near-equal size, so no piece is much smaller than `piece_elements`."""
    if piece_elements < 1:
        raise ConfigError(f"piece size must be >= 1 element; got {piece_elements}")
    count = max(1, numel // piece_elements)
    return [(k * numel // count, (k + 1) * numel // count) for k in range(count)]


def chunk_bytes(shard: int, mode: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one encoded shard: int8 = one byte per element + one fp32 scale per block."""
    mode = check_mode(mode)
    check_block_size(block_size)
    if mode == "int8":
        return shard + SCALE_BYTES * math.ceil(shard / block_size)
    if mode in ("fp16", "bf16"):
        return 2 * shard
    return 4 * shard


def wire_bytes(numel: int, mode: str, world_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Payload bytes ONE rank sends for an all-reduce of `numel` fp32 elements (headers not counted),
    summed over the pieces a large all-reduce is pipelined in.

    Compressed modes: (world_size - 1) encoded shards in the all_to_all plus the same again in the
    all-gather. "none" is the fp32 ring all-reduce figure, 2 * (world_size - 1) / world_size * 4 * numel,
    for comparison. A single rank sends nothing.
    """
    mode = check_mode(mode)
    if world_size == 1 or numel == 0:
        return 0
    if mode == "none":
        return math.ceil(2 * (world_size - 1) * 4 * numel / world_size)
    shards = [chunk_layout(b - a, world_size).shard for a, b in pipeline_pieces(numel)]
    return sum(2 * (world_size - 1) * chunk_bytes(shard, mode, block_size) for shard in shards)


def _fp32_slack(world_size: int, magnitude: float) -> float:
    # fp32 arithmetic (dequantise multiply, the sum of world_size terms, the scale division) adds a
    # few fp32 roundings of relative size 2**-24 on top of the compression error.
    return (world_size + 3) * 2.0**-24 * magnitude


def int8_error_bound(rank_absmax_sum: float, world_size: int) -> float:
    """Worst-case |result - exact sum| of one element under int8 block-absmax quantisation.

    `rank_absmax_sum` is sum over ranks r of a_r, where a_r is the absolute maximum of the block that
    holds the element on rank r. Each quantisation rounds to the nearest multiple of scale = absmax/127,
    so it errs by at most scale/2 = absmax/254. Phase 1 errs by at most sum_r a_r / 254. The fp32 sum s
    of the dequantised shards has |s| <= sum_r a_r, so phase 2 (quantising s) errs by at most
    sum_r a_r / 254 too. Total: sum_r a_r / 127 (+ fp32 rounding), so it grows linearly with the
    world size, and relative to the result it is unbounded where the ranks' values cancel.
    """
    return rank_absmax_sum / 127.0 + _fp32_slack(world_size, rank_absmax_sum)


def float16_error_bound(mode: str, rank_abs_sum: float, world_size: int) -> float:
    """Worst-case |result - exact sum| of one element in fp16/bf16 mode (no overflow).

    `rank_abs_sum` is sum over ranks of |x_r|. Each rank's value is rounded once (relative error u),
    the fp32 sum once more: u * (2 + u) * sum_r |x_r|, with u = 2**-11 (fp16) or 2**-8 (bf16), plus
    a subnormal floor per rounding. fp16 turns values or sums above 65504 into inf; bf16 has fp32's range.
    """
    u = UNIT_ROUNDOFF[check_mode(mode)]
    floor = (world_size + 1) * ABS_ROUNDOFF[mode]
    return u * (2.0 + u) * rank_abs_sum + floor + _fp32_slack(world_size, rank_abs_sum)
