"""Turning torch's tensor arguments into flat contiguous CPU buffers, and writing results back.

Tensors on other devices (mps, cuda) or non-contiguous ones are staged through a host copy; results are
copied back in place when the op finishes.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor", dist.ReduceOp.PREMUL_SUM: "premul_sum",
}


# By the enum's integer value: looking a pybind enum up in a dict compares it through a Python-level
# __eq__, which would cost a small all_reduce more than a µs per conversion.
_OPS_BY_VALUE = {int(kind): name for kind, name in _OPS.items()}


def reduce_op(op: object) -> tuple[str, object]:
    """(name, premul factor) of a torch ReduceOp (or RedOpType)."""
    kind = getattr(op, "op", op)
    try:
        name = _OPS_BY_VALUE.get(int(kind))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        name = None
    if name is None:
        raise ValueError(f"unsupported reduce op {op!r}")
    if name != "premul_sum":
        return name, None
    factor = getattr(op, "factor", None)
    if factor is None:  # a plain sum would be silently wrong
        raise ValueError(f"ReduceOp.PREMUL_SUM: this torch ({torch.__version__}) does not show the op's factor to "
                         "a Python backend (torch 2.13 does); multiply the tensor first and use ReduceOp.SUM")
    return name, factor


def on_device(tensors: object) -> bool:
    """Whether any tensor in `tensors` (a tensor, or lists of them, nested) lives off the CPU."""
    if type(tensors) is list:  # the common case first: torch hands a flat list of tensors
        for t in tensors:
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                if on_device(t):
                    return True
            elif not t.is_cpu:
                return True
        return False
    if isinstance(tensors, torch.Tensor):
        return not tensors.is_cpu
    if isinstance(tensors, tuple):
        return any(on_device(t) for t in tensors)
    return False


def total_bytes(tensors: object) -> int:
    """Bytes of every tensor in `tensors` (a tensor, or lists and tuples of them, nested)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(total_bytes(t) for t in tensors)
    return 0


def flat_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as a 1-D, stride-1 CPU tensor sharing its memory and detached from autograd, or None when it
    cannot be one (another device, not contiguous). Detached because the backend's arithmetic must never
    be recorded by autograd: a gradient that requires grad (double backward) would make every `out=` call
    fail. A tensor with one element may be contiguous with any stride (`torch.zeros(2)[::2]`): such a view
    is re-strided, since byte views (`.view(torch.uint8)`) need stride 1."""
    if not (t.is_cpu and t.is_contiguous()):
        return None
    v = t.detach() if t.requires_grad else t  # detach() costs ~1 µs, as much as a small send's other steps
    if v.dim() != 1:
        v = v.view(-1)
    if v.numel() <= 1 and v.stride(0) != 1:
        v = v.as_strided((v.numel(),), (1,))
    return v


class Staged:
    """A flat CPU view of `t`, plus what it takes to put results back."""

    __slots__ = ("orig", "flat", "copied")

    def __init__(self, t: torch.Tensor, read: bool = True) -> None:
        self.orig = t
        flat = flat_view(t)
        if flat is not None:
            self.flat = flat
            self.copied = False
        else:
            src = t.detach().to("cpu") if read else torch.empty(t.shape, dtype=t.dtype)
            self.flat = src.contiguous().view(-1)
            self.copied = True

    def write_back(self) -> None:
        if self.copied:
            self.orig.detach().copy_(self.flat.view(self.orig.shape))


def flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        flat = flat_view(tensors[0])  # each torch call costs ~1 µs, as much as a small send: no copy here
        if flat is not None:
            return flat
    return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors]) if tensors else torch.empty(0)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 CPU tensor (a view when `t` is a contiguous CPU tensor)."""
    flat = flat_view(t)
    if flat is None:
        flat = t.detach().to("cpu").contiguous().view(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    off = 0
    for o in outs:
        n = o.numel()
        o.detach().copy_(flat[off : off + n].view(o.shape))
        off += n


def check_same_dtype(tensors: list[torch.Tensor], what: str, rank: int) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"rank {rank}: {what} got tensors of different dtypes {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def rows_to_elems(t: torch.Tensor, splits: list[int] | None, world: int, what: str, rank: int) -> list[int]:
    """all_to_all_single split sizes (in rows of dim 0) to element counts."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if rows % world:
            raise ValueError(f"rank {rank}: {what}: dim 0 ({rows}) is not divisible by world size {world}")
        return [rows // world * per_row] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"rank {rank}: {what}: split sizes {list(splits)} do not cover dim 0 ({rows}) "
                         f"for world size {world}")
    return [s * per_row for s in splits]


