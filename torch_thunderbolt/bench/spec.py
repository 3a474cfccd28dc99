"""What each benchmarked op and dtype is: buffer layout, nccl-tests columns, bus-bandwidth factor.

Pure: no torch import, so argument parsing and table formatting stay cheap and testable.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str       # torch attribute name: torch.<name>
    itemsize: int
    nccl_name: str  # the "type" column as nccl-tests prints it
    exact_max: int  # largest integer the dtype holds exactly (bounds the check values)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, "float", 1 << 24),
        DType("float16", 2, "half", 1 << 11),
        DType("bfloat16", 2, "bfloat16", 1 << 8),
        DType("float64", 8, "double", 1 << 53),
        DType("int32", 4, "int32", (1 << 31) - 1),
        DType("int64", 8, "int64", (1 << 63) - 1),
        DType("int8", 1, "int8", 127),
        DType("uint8", 1, "uint8", 255),
    )
}
DTYPE_ALIASES = {
    "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16",
    "double": "float64", "fp64": "float64", "int": "int32", "long": "int64",
}

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
OP_ALIASES = {"allreduce": "all_reduce", "all_gather_into_tensor": "all_gather", "allgather": "all_gather",
              "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "send_recv": "sendrecv",
              "p2p": "sendrecv"}

REDUCING_OPS = ("all_reduce", "reduce_scatter")
# Ops whose size is split into one equal chunk per rank.
CHUNKED_OPS = ("all_gather", "reduce_scatter", "all_to_all")
BROADCAST_ROOT = 0
# The null backend of --floor (null.py): the torch.distributed name it is registered under, its label.
NULL_BACKEND = "tbnull"
FLOOR_LABEL = "floor"


def dtype(name: str) -> DType:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ConfigError(f"unknown --dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor, comparable to the link speed."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in CHUNKED_OPS:
        return (n - 1) / n
    if op in ("broadcast", "sendrecv", "reduce"):
        return 1.0
    raise ConfigError(f"unknown op {op!r}")


@dataclass(frozen=True)
class Layout:
    """Buffer sizes of one op at one requested size, as nccl-tests rounds them."""
    op: str
    nbytes: int     # the "size" column: the larger of input and output buffer, in bytes
    count: int      # the "count" column: elements per rank-chunk for chunked ops, else all elements
    in_numel: int
    out_numel: int


def layout(op: str, requested_bytes: int, itemsize: int, world_size: int) -> Layout:
    """Round `requested_bytes` down to whole elements (and whole chunks per rank); at least one each."""
    elements = max(1, requested_bytes // itemsize)
    if op in CHUNKED_OPS:
        per_rank = max(1, elements // world_size)
        total = per_rank * world_size
        in_numel = per_rank if op == "all_gather" else total
        out_numel = per_rank if op == "reduce_scatter" else total
        return Layout(op, total * itemsize, per_rank, in_numel, out_numel)
    if op in ("all_reduce", "broadcast", "sendrecv"):
        return Layout(op, elements * itemsize, elements, elements, elements)
    raise ConfigError(f"unknown op {op!r}")


def redop(op: str) -> str:
    return "sum" if op in REDUCING_OPS else "none"


def root(op: str) -> int:
    return BROADCAST_ROOT if op == "broadcast" else -1


def algbw_gbps(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second), as nccl-tests defines it."""
    return nbytes / (time_us * 1e3) if time_us > 0 else 0.0


def check_world_size(ops: list[str], world_size: int, dtype_: DType) -> None:
    """Reject combinations whose results could not be checked exactly, before any rank starts."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: expected at least 1 rank")
    if "sendrecv" in ops and world_size < 2:
        raise ConfigError("op sendrecv needs at least 2 ranks (ping-pong between rank 0 and 1)")
    # check.py fills values 1..8; a sum over all ranks must stay exact in the dtype.
    if any(op in REDUCING_OPS for op in ops) and 8 * world_size > dtype_.exact_max:
        raise ConfigError(
            f"--dtype {dtype_.name} cannot hold the exact sum over {world_size} ranks "
            f"(needs values up to {8 * world_size}, dtype is exact up to {dtype_.exact_max}); "
            "use a wider dtype")
