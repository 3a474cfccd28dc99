"""Gradient compression: int8 (block-absmax), fp16 and bf16 all-reduce summed in fp32.

`compressed_all_reduce(tensor, mode, group, block_size)` is the blocking collective, `wire_bytes(...)`
what it puts on the wire; `torch_thunderbolt.hooks` has the DDP communication hooks.
"""
from .allreduce import Exchange, TorchExchange, compressed_all_reduce
from .codecs import CastCodec, Int8Codec, codec_for, dequantize_int8, quantize_int8
from .scheme import (
    DEFAULT_BLOCK_SIZE,
    ENV_BLOCK_VAR,
    ENV_VAR,
    MODES,
    ChunkLayout,
    check_mode,
    chunk_bytes,
    chunk_layout,
    float16_error_bound,
    int8_error_bound,
    mode_from_env,
    wire_bytes,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "ENV_BLOCK_VAR", "ENV_VAR", "MODES", "CastCodec", "ChunkLayout", "Exchange",
    "Int8Codec", "TorchExchange", "check_mode", "chunk_bytes", "chunk_layout", "codec_for",
    "compressed_all_reduce", "dequantize_int8", "float16_error_bound", "int8_error_bound",
    "mode_from_env", "quantize_int8", "wire_bytes",
]
