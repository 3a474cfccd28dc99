"""Operation signatures carried in every message (64 bits), so ranks that disagree about an op fail at once.

The high 32 bits say what the op is, readably: op | dtype | reduce op | root (low 8 bits). The low 32 bits
are a 32-bit BLAKE2 digest of everything that must agree and does not fit there: the full root, the element count, the
reduce op and a layout (uneven block sizes). Two ranks in different ops differ in the readable half or, for
the same kind of op, in a 32-bit checksum: an accidental collision is a one-in-four-billion event, where an
8-bit checksum collides among layouts of two blocks (tests/core/test_aliasing_and_signatures.py finds such
pairs). Not a CRC: CRCs are linear, so two different layouts mixed into two different op signatures can
cancel out exactly.
"""
from __future__ import annotations

import hashlib

OPS = [
    "none", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather", "scatter",
    "all_to_all", "barrier", "send", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single",
    "coalesced", "compressed_all_reduce",
]
DTYPES = [
    "none", "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
]
REDUCE_OPS = ["none", "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"]
# Bytes per element of each dtype above, to say how many elements a message of so many bytes holds.
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4, "uint64": 8,
            "float8_e4m3fn": 1, "float8_e5m2": 1}


def encode_sig(op: str, dtype: str = "none", root: int = 0, count: int = 0, reduce_op: str = "none",
               layout: object = None) -> int:
    o = OPS.index(op) if op in OPS else 0
    d = DTYPES.index(dtype) if dtype in DTYPES else 0
    r = REDUCE_OPS.index(reduce_op) if reduce_op in REDUCE_OPS else 0
    head = (o << 24) | (d << 16) | (r << 8) | (root & 0xFF)
    return (head << 32) | _digest(f"{op}:{dtype}:{reduce_op}:{root}:{count}:{layout!r}".encode())


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


def describe_sig(sig: int) -> str:
    if sig == 0:
        return "a message"
    head = (sig >> 32) & 0xFFFFFFFF
    o, d, r, root = head >> 24, (head >> 16) & 0xFF, (head >> 8) & 0xFF, head & 0xFF
    op = OPS[o] if o < len(OPS) else f"op#{o}"
    dt = DTYPES[d] if d < len(DTYPES) else f"dtype#{d}"
    red = f", {REDUCE_OPS[r].upper()}" if 0 < r < len(REDUCE_OPS) else ""
    root_txt = f", root {root}" if op in ("broadcast", "reduce", "gather", "scatter") else ""
    return f"{op}({dt}{red}{root_txt})"


def describe_message(sig: int, nbytes: int) -> str:
    """A message as errors name it: "send(float32) of 2 elements (8 bytes)" where the signature names a
    dtype, else "all_gather(uint8) of 16 bytes"."""
    what = describe_sig(sig)
    d = (sig >> 48) & 0xFF if sig else 0
    size = ITEMSIZE.get(DTYPES[d]) if 0 < d < len(DTYPES) else None
    if size and nbytes % size == 0 and DTYPES[d] != "uint8":
        return f"{what} of {nbytes // size} elements ({nbytes} bytes)"
    return f"{what} of {nbytes} bytes"


def sig_compatible(a: int, b: int) -> bool:
    return a == 0 or b == 0 or a == b
