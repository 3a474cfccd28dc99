"""Operation signatures carried in every frame header (32 bits): op | dtype | root | size hash.

Cheap enough to check on every message, informative enough to say what a mismatched peer was doing.
"""
from __future__ import annotations

import zlib

OPS = [
    "none", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather", "scatter",
    "all_to_all", "barrier", "send", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single",
    "coalesced", "compressed_all_reduce",
]
DTYPES = [
    "none", "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
]


def encode_sig(op: str, dtype: str = "none", root: int = 0, count: int = 0) -> int:
    o = OPS.index(op) if op in OPS else 0
    d = DTYPES.index(dtype) if dtype in DTYPES else 0
    h = zlib.crc32(f"{root}:{count}".encode()) & 0xFF
    return (o << 24) | (d << 16) | ((root & 0xFF) << 8) | h


def describe_sig(sig: int) -> str:
    if sig == 0:
        return "a message"
    o, d, root = sig >> 24, (sig >> 16) & 0xFF, (sig >> 8) & 0xFF
    op = OPS[o] if o < len(OPS) else f"op#{o}"
    dt = DTYPES[d] if d < len(DTYPES) else f"dtype#{d}"
    root_txt = f", root {root}" if op in ("broadcast", "reduce", "gather", "scatter") else ""
    return f"{op}({dt}{root_txt})"


def sig_compatible(a: int, b: int) -> bool:
    return a == 0 or b == 0 or a == b
