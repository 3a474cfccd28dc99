"""Collectives on flat tensors over a transport: picks a plan, runs it, applies the op's final touches.

`Communicator` knows nothing about torch.distributed: the backend layer flattens torch's arguments into
contiguous 1-D tensors and calls these methods, one at a time, in the same order on every rank.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..config import Config
from ..errors import CollectiveTimeout, MismatchError
from ..protocol.signature import describe_sig, encode_sig
from ..transport.engine import Transport
from ..transport.window import Window
from . import direct, select, windowed
from .layout import offsets
from .plan import Plan, run_plan
from .reduce_ops import make_combiner, make_reducer
from .shape import Shape


log = logging.getLogger("torch_thunderbolt.ops")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _noop(d: torch.Tensor, s: torch.Tensor) -> None:
    raise AssertionError("this plan has no reductions")


class Communicator:
    def __init__(self, transport: Transport, cfg: Config, timeout: float = 1800.0,
                 shape: Shape | None = None) -> None:
        self.t = transport
        self.cfg = cfg
        self.rank, self.world = transport.rank, transport.world
        self.timeout = timeout
        self.shape = shape or Shape.full(transport.world)
        self.seq = 0
        self._plans: dict[tuple, Plan] = {}
        self._scratch: torch.Tensor | None = None
        self._full: torch.Tensor | None = None  # reduce-scatter's working copy, reused like _scratch
        self._checked: set[tuple[str, torch.dtype]] = set()
        self._sigs: dict[tuple, int] = {}  # (reduce op, dtype) pairs this rank can compute

    # -- machinery -----------------------------------------------------------------------------------------
    def _plan(self, key: tuple, build: Callable[[], Plan]) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 512:
                self._plans.clear()
            plan = self._plans[key] = build()
        return plan

    def _tmp(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """Scratch reused across ops (allocating fresh pages for every 64 MB op costs page faults)."""
        nbytes = n * like.element_size()
        self._scratch = _at_least(self._scratch, nbytes)
        return self._scratch[:nbytes].view(like.dtype) if nbytes else like.new_empty(0)

    def _run(self, plan: Plan, what: str, bufs: dict[str, torch.Tensor], op: str | None, like: torch.Tensor,
             root: int = 0, count: int = 0, layout: object = None) -> None:
        self.seq += 1
        bufs["tmp"] = self._tmp(plan.tmp, like)
        reducer = make_reducer(op, like.dtype) if op else _noop
        sig = self._sig(what, like, root, count, op or "none", layout)
        deadline = time.monotonic() + self.timeout
        if self.cfg.debug:
            log.debug("rank %d: op #%d %s, %s plan of %d steps, signature %016x", self.rank, self.seq,
                      describe_sig(sig), plan.algo, len(plan.steps), sig)
        try:
            run_plan(plan, self.t, bufs, reducer, tag=self.seq, sig=sig, deadline=deadline,
                     what=f"{what} (op #{self.seq}, {_dtype_name(like)}, {count} elements)")
        except BaseException as exc:
            # Peers may still send for this op, or wait for this rank's next step: the group cannot be
            # trusted any more. BROKEN, and everyone is told why (nothing stays posted to be written late).
            self.t.abort(exc)
            raise
        self.t.retire(self.seq)

    def _window(self) -> Window | None:
        """The transport's shared window, when it spans the whole group and no algorithm is forced."""
        win = self.t.window
        return win if win is not None and win.world == self.world and self.cfg.algo == "auto" else None

    def _run_window(self, body: Callable[[int, float, str], None], what: str, like: torch.Tensor,
                    root: int = 0, count: int = 0, op: str = "none", layout: object = None) -> None:
        self.seq += 1
        sig = self._sig(what, like, root, count, op, layout)
        if self.cfg.debug:
            log.debug("rank %d: op #%d %s on the shared window, signature %016x", self.rank, self.seq,
                      describe_sig(sig), sig)
        try:
            body(sig, time.monotonic() + self.timeout,
                 f"{what} (op #{self.seq}, {_dtype_name(like)}, {count} elements)")
        except BaseException as exc:
            self.t.abort(exc)  # peers may be waiting on this rank's next step: tell them why it won't come
            raise

    def _sig(self, what: str, like: torch.Tensor, root: int, count: int, op: str, layout: object) -> int:
        """The op's signature, cached: hashing it costs a few µs, as much as a small message's Python steps."""
        key = (what, like.dtype, root, count, op, layout)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) > 1024:
                self._sigs.clear()
            sig = self._sigs[key] = encode_sig(what, _dtype_name(like), root, count, op, layout)
        return sig

    def check_op(self, what: str, op: str, dtype: torch.dtype) -> None:
        """Raise (before any traffic, so the group stays usable) if this rank cannot compute `op` on `dtype`:
        torch lacks some kernels (e.g. add for uint16 on the CPU), and finding out mid-op would leave peers
        waiting on a step that never comes."""
        key = (op, dtype)
        if key in self._checked:
            return
        try:
            combine = make_combiner(op, dtype)
            one = torch.zeros(1, dtype=dtype)
            combine(one, one, one)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            raise ValueError(f"rank {self.rank}: {what} with ReduceOp.{op.upper()} is not supported for "
                             f"{dtype} ({exc})") from None
        self._checked.add(key)

    # -- collectives ----------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum", premul: object = None) -> None:
        self.check_op("all_reduce", op, x.dtype)
        if op == "premul_sum" and premul is not None:
            x.mul_(premul)
        n, es = x.numel(), x.element_size()
        win = self._window()
        if win is not None:
            self._run_window(lambda sig, deadline, what: windowed.all_reduce(
                win, x, op, sig, deadline, what, self.cfg.small_bytes), "all_reduce", x, count=n, op=op)
        else:
            plan = self._plan(("ar", n, es), lambda: select.allreduce_plan(
                self.cfg, self.rank, self.world, n, es, self.shape))
            self._run(plan, "all_reduce", {"in": x, "out": x}, op, x, count=n)
        if op == "avg":
            x.div_(self.world)

    def broadcast(self, x: torch.Tensor, root: int) -> None:
        n, es = x.numel(), x.element_size()
        win = self._window()
        if win is not None:
            raw = x.view(torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            self._run_window(lambda sig, deadline, what: windowed.broadcast(win, raw, root, sig, deadline, what),
                             "broadcast", x, root=root, count=n)
            return
        plan = self._plan(("bc", n, es, root), lambda: select.broadcast_plan(
            self.cfg, self.rank, self.world, root, n, es, self.shape))
        self._run(plan, "broadcast", {"out": x}, None, x, root=root, count=n)

    def reduce(self, x: torch.Tensor, root: int, op: str = "sum") -> None:
        self.check_op("reduce", op, x.dtype)
        n, es = x.numel(), x.element_size()
        plan = self._plan(("rd", n, es, root), lambda: select.reduce_plan(
            self.cfg, self.rank, self.world, root, n, es, self.shape))
        self._run(plan, "reduce", {"in": x, "out": x}, op, x, root=root, count=n)
        if op == "avg" and self.rank == root:
            x.div_(self.world)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, counts: list[int] | None = None) -> None:
        """`out` holds every rank's block in rank order; `counts` gives uneven block sizes."""
        counts = counts or [x.numel()] * self.world
        offs = offsets(counts)
        mine = out[offs[self.rank] : offs[self.rank] + counts[self.rank]]
        if mine.data_ptr() != x.data_ptr() or mine.numel() != x.numel():
            mine.copy_(x)
        es = x.element_size()
        plan = self._plan(("ag", tuple(counts), es), lambda: select.all_gather_plan(
            self.cfg, self.rank, self.world, counts, es, self.shape))
        self._run(plan, "all_gather", {"out": out}, None, out, count=sum(counts), layout=tuple(counts))

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, counts: list[int], op: str = "sum") -> None:
        """Reduce `x` (all ranks' blocks, `counts` long) and keep this rank's block in `out`."""
        self.check_op("reduce_scatter", op, x.dtype)
        if _overlap(out, x):  # the in-place form: out is this rank's slice of x, which peers still need
            x = x.clone()
        win = self._window()
        if win is not None:
            self._run_window(lambda sig, deadline, what: windowed.reduce_scatter(
                win, out, x, counts, op, sig, deadline, what), "reduce_scatter", x, count=sum(counts), op=op,
                layout=tuple(counts))
        else:
            self._reduce_scatter_plan(out, x, counts, op)
        if op == "avg":
            out.div_(self.world)

    def _reduce_scatter_plan(self, out: torch.Tensor, x: torch.Tensor, counts: list[int], op: str) -> None:
        es = x.element_size()
        plan, in_place = self._plan(("rs", tuple(counts), es), lambda: select.reduce_scatter_plan(
            self.cfg, self.rank, self.world, counts, es, self.shape))
        if in_place:  # ring, hierarchy: reduce a full working copy ("in" and "out"), then keep our block
            work = self._tmp_full(x)
            self._run(plan, "reduce_scatter", {"in": work, "out": work}, op, x, count=sum(counts),
                      layout=tuple(counts))
            start = offsets(counts)[self.rank]
            out.copy_(work[start : start + counts[self.rank]])
        else:
            self._run(plan, "reduce_scatter", {"in": x, "out": out}, op, x, count=sum(counts),
                      layout=tuple(counts))

    def _tmp_full(self, x: torch.Tensor) -> torch.Tensor:
        """A copy of `x` to reduce in place, in a buffer kept across ops (a fresh 64 MB clone per call costs
        more in page faults than the reduction: 48 ms against 19 ms for a whole 64 MB all_reduce)."""
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return x.clone()
        self._full = _at_least(self._full, nbytes)
        return self._full[:nbytes].view(x.dtype).copy_(x.reshape(-1)).view(x.shape)

    def gather(self, out: torch.Tensor | None, x: torch.Tensor, root: int, counts: list[int]) -> None:
        segs = list(zip(offsets(counts), counts))
        if out is not None and _overlap(out, x):
            x = x.clone()
        plan = self._plan(("ga", tuple(counts), root), lambda: direct.gather(self.rank, self.world, root, segs))
        bufs = {"in": x, "out": out if out is not None else x}
        self._run(plan, "gather", bufs, None, x, root=root, count=sum(counts), layout=tuple(counts))

    def scatter(self, out: torch.Tensor, x: torch.Tensor | None, root: int, counts: list[int]) -> None:
        segs = list(zip(offsets(counts), counts))
        if x is not None and _overlap(out, x):
            x = x.clone()
        plan = self._plan(("sc", tuple(counts), root), lambda: direct.scatter(self.rank, self.world, root, segs))
        bufs = {"in": x if x is not None else out, "out": out}
        self._run(plan, "scatter", bufs, None, out, root=root, count=sum(counts), layout=tuple(counts))

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> None:
        ss = list(zip(offsets(send_counts), send_counts))
        rs = list(zip(offsets(recv_counts), recv_counts))
        if _overlap(out, x):
            x = x.clone()
        plan = self._plan(("a2a", tuple(send_counts), tuple(recv_counts)),
                          lambda: direct.all_to_all(self.rank, self.world, ss, rs))
        self._run(plan, "all_to_all", {"in": x, "out": out}, None, x)  # counts differ by rank: not in the sig

    def barrier(self) -> None:
        plan = self._plan(("barrier",), lambda: direct.barrier(self.rank, self.world))
        empty = torch.empty(0, dtype=torch.uint8)
        self._run(plan, "barrier", {"out": empty}, None, empty)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous buffers share any byte (an output that aliases an input must not be written
    while peers still read the input)."""
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    if not na or not nb:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + nb and pb < pa + na


def _at_least(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """`buf` if it holds `nbytes`, else a new byte buffer that does (kept by the caller for later ops)."""
    if buf is None or buf.numel() < nbytes:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf
