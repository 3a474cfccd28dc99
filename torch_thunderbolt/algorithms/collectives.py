"""Collectives on flat tensors over a transport: picks how each op runs, runs it, applies its final touches.

`Communicator` knows nothing about torch.distributed: the backend layer flattens torch's arguments into
contiguous 1-D tensors and calls these methods, one at a time, in the same order on every rank.

Which way an op runs (its path) is chosen in one place, `paths.choose`: on the shared window when the whole
group shares one host's memory (all_reduce one-shot when small); as a plan of sends and receives over the
engine (`select`), a small all_reduce's direct plan as straight code; or, where that plan is hierarchical
(a multi-host job whose hosts run several ranks each) and this host's ranks share a window, with the
per-host phases on the window and only the plan's cable phase over the engine (`hierarchy.cable_*`: the
same messages as the full plan, so hosts may differ in how they run their own phases).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..config import Config
from ..protocol.signature import describe_sig, encode_sig
from ..transport.engine import Transport
from . import direct, hierarchy, paths, select, windowed
from .small import DirectAllReduce
from .segments import offsets
from .plan import Plan, run_plan
from .reduce_ops import Combiner, Reducer, make_combiner, make_reducer
from .shape import Shape
from .window import Window


log = logging.getLogger("torch_thunderbolt.ops")

# An op that succeeded reads what its peers said before it reports success (`Communicator.confirm`) unless
# it began within this many seconds of this group's last look: a look (a poll and a pump) costs about what
# a small op does (7 us over tcp, 2.5 us over shm against 20 and 9 us on a 2-core VM), and over tcp the op
# after it may find a peer's next message read ahead (the general path, not `take`). Looking once in 1 ms
# cost a 4-byte all_reduce 2.5-3% over tcp; once in 10 ms, within the noise (under 1%).
LOOK_AFTER = 0.01


class OpLabel:
    """How errors name an op ("all_reduce (op #3, float32, 1000 elements)"), formatted only when one needs
    it: building the string costs a small op about a microsecond, and almost every op succeeds."""

    __slots__ = ("name", "seq", "dtype", "count")

    def __init__(self, name: str, seq: int, dtype: torch.dtype, count: int) -> None:
        self.name, self.seq, self.dtype, self.count = name, seq, dtype, count

    def __str__(self) -> str:
        return f"{self.name} (op #{self.seq}, {str(self.dtype).removeprefix('torch.')}, {self.count} elements)"


# How `Communicator._run_body` runs an op, as the debug log says it.
_HOW = {"window": "on the shared window", "hier": "in hierarchy (per-host phases on the shared window)",
        "direct": "as a direct exchange (no plan walk)"}


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
        self._sigs: dict[tuple, int] = {}  # signatures by op shape (see _sig)
        # Element-wise kernels by (reduce op, dtype), made and tried once (check_op): building one per op
        # costs a small op as much time as its sends.
        self._combiners: dict[tuple[str, torch.dtype], Combiner] = {}
        self._reducers: dict[tuple[str, torch.dtype], Reducer] = {}
        # Small all_reduces by element count, dtype and reduce op, each made once with its buffers, kernel
        # and signature: one-shot on the window, or a direct exchange over the engine. `all_reduce` runs
        # one it finds before any other step (its op was checked when it was made).
        self._small_ops: dict[tuple[int, torch.dtype, str], "windowed.OneShotAllReduce | DirectAllReduce"] = {}
        # The shared window of this host's ranks, if the transport has window memory for them. The windowed
        # collectives replace plans only when no algorithm is forced: over the whole group (`_flat`), or
        # for the per-host phases of hierarchical plans (`_per_host`: the window spans this host's ranks).
        memory = transport.window_memory
        self.window = Window(transport, memory) if memory is not None else None
        auto = self.window is not None and cfg.algo == "auto"
        self._flat = auto and self.window.world == self.world
        host = next((g for g in self.shape.groups if self.rank in g), None)
        self._per_host = auto and not self._flat and host is not None and self.window.spans(host)
        # The window position of this host's leader (the first rank of its group), which the cables reach.
        self._leader = self.window.members.index(host[0]) if self._per_host else 0
        # All_reduces up to this size run one-shot on the window (when the group runs on it at all).
        self._one_shot_bytes = min(cfg.small_bytes, self.window.nbytes) if self._flat else -1
        self.group = paths.Group(self.world, self._flat, self._per_host, self._one_shot_bytes)
        self._looked = 0.0  # when `confirm` last read the links

    def confirm(self, began: float) -> None:
        """Before an op that began at `began` (time.monotonic()) reports success: the group's error if its
        peers gave up on it. A rank that comes to an op after the others timed out can find every byte it
        needs already there (a window's published steps, messages sent before the others gave up) or need
        none (it only sends), and finish without reading the ABORT behind them. So the links are read once,
        without waiting (`Transport.check_usable`), unless the op began within LOOK_AFTER seconds of the last
        such look: an op that begins that long after the ABORT reached this rank raises the group's error,
        not the next one. (`_small_all_reduce` makes the same test inline.)"""
        if began - self._looked > LOOK_AFTER or self.t.broken is not None:
            self._look()

    def _look(self) -> None:
        self._looked = time.monotonic()
        self.t.check_usable(look=True)

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
        reducer = self._reducer(op, like.dtype) if op else _noop
        sig = self._sig(what, like, root, count, op or "none", layout)
        began = time.monotonic()
        deadline = began + self.timeout
        if self.cfg.debug:
            log.debug("rank %d: op #%d %s, %s plan of %d steps, signature %016x", self.rank, self.seq,
                      describe_sig(sig), plan.algo, len(plan.steps), sig)
        try:
            run_plan(plan, self.t, bufs, reducer, tag=self.seq, sig=sig, deadline=deadline,
                     what=OpLabel(what, self.seq, like.dtype, count))
        except BaseException as exc:
            # Peers may still send for this op, or wait for this rank's next step: the group cannot be
            # trusted any more. BROKEN, and everyone is told why (nothing stays posted to be written late).
            self.t.abort(exc)
            raise
        self.t.retire(self.seq)
        self.confirm(began)

    def _run_body(self, body: Callable[[int, float, OpLabel], None], what: str, like: torch.Tensor,
                  root: int = 0, count: int = 0, op: str = "none", layout: object = None,
                  how: str = "window", sig: int | None = None) -> None:
        """Run `body(sig, deadline, what)` as op number `self.seq`: a windowed op, or one whose messages go
        under this op's tag (`how` = "hier": the cable phase of a hierarchical op; "direct": small.py).
        `sig`: the op's signature, when the caller keeps it already."""
        self.seq += 1
        if sig is None:
            sig = self._sig(what, like, root, count, op, layout)
        if self.cfg.debug:
            log.debug("rank %d: op #%d %s %s, signature %016x", self.rank, self.seq, describe_sig(sig),
                      _HOW[how], sig)
        began = time.monotonic()
        try:
            body(sig, began + self.timeout, OpLabel(what, self.seq, like.dtype, count))
        except BaseException as exc:
            self.t.abort(exc)  # peers may be waiting on this rank's next step: tell them why it won't come
            raise
        if how != "window":
            self.t.retire(self.seq)
        self.confirm(began)

    def _cables(self, plan: Plan, bufs: dict[str, torch.Tensor], op: str | None, like: torch.Tensor, sig: int,
                deadline: float, what: OpLabel) -> None:
        """The cable phase of a hierarchical op: `plan` among one rank per host, under this op's tag."""
        if not plan.steps:
            return
        bufs["tmp"] = self._tmp(plan.tmp, like)
        run_plan(plan, self.t, bufs, self._reducer(op, like.dtype) if op else _noop, tag=self.seq, sig=sig,
                 deadline=deadline, what=what)

    def _sig(self, what: str, like: torch.Tensor, root: int, count: int, op: str, layout: object) -> int:
        """The op's signature, cached: hashing it costs a few µs, as much as a small message's Python steps."""
        key = (what, like.dtype, root, count, op, layout)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) > 1024:
                self._sigs.clear()
            sig = self._sigs[key] = encode_sig(what, str(like.dtype).removeprefix("torch."), root, count, op, layout)
        return sig

    def message_sig(self, x: torch.Tensor) -> int:
        """The signature of a point-to-point message of the flat tensor `x`: its dtype and element count."""
        return self._sig("send", x, 0, x.numel(), "none", None)

    def _combiner(self, op: str, dtype: torch.dtype) -> Combiner:
        """The kernel of `op` on `dtype`, which `check_op` tried before this op's first traffic."""
        return self._combiners[(op, dtype)]

    def _reducer(self, op: str, dtype: torch.dtype) -> Reducer:
        reduce = self._reducers.get((op, dtype))
        if reduce is None:
            reduce = self._reducers[(op, dtype)] = make_reducer(op, dtype)
        return reduce

    def check_op(self, what: str, op: str, dtype: torch.dtype) -> None:
        """Raise (before any traffic, so the group stays usable) if this rank cannot compute `op` on `dtype`:
        torch lacks some kernels (e.g. add for uint16 on the CPU), and finding out mid-op would leave peers
        waiting on a step that never comes."""
        key = (op, dtype)
        if key in self._combiners:
            return
        try:
            combine = make_combiner(op, dtype)
            one = torch.zeros(1, dtype=dtype)
            combine(one, one, one)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            raise ValueError(f"rank {self.rank}: {what} with ReduceOp.{op.upper()} is not supported for "
                             f"{dtype} ({exc})") from None
        self._combiners[key] = combine

    # -- collectives ----------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum", premul: object = None, layout: object = None) -> None:
        """Reduce `x` in place. `layout`: how `x` was packed from several tensors (a coalesced call), for the
        signature; such an op takes the general paths, not the small ones kept per element count."""
        small = self._small_ops.get((x.numel(), x.dtype, op))
        if small is not None and layout is None:
            self._small_all_reduce(small, x, op, premul)
            return
        self.check_op("all_reduce", op, x.dtype)
        if op == "premul_sum" and premul is not None:
            x.mul_(premul)
        n, es = x.numel(), x.element_size()
        plan = None if self._flat else self._plan(("ar", n, es), lambda: select.allreduce_plan(
            self.cfg, self.rank, self.world, n, es, self.shape))
        path = paths.choose("all_reduce", n * es, self.group, plan.algo if plan else "", layout is not None)
        if path == "one_shot":
            self._one_shot_all_reduce(x, op)
        elif path == "window":
            combine = self._combiner(op, x.dtype)
            self._run_body(lambda sig, deadline, what: windowed.all_reduce(
                self.window, x, combine, sig, deadline, what), "all_reduce", x, count=n, op=op, layout=layout)
        elif path == "hier":
            self._run_body(lambda sig, deadline, what: self._hier_all_reduce(x, op, sig, deadline, what),
                           "all_reduce", x, count=n, op=op, how="hier", layout=layout)
        elif path == "direct":
            self._direct_all_reduce(x, op)
        else:
            self._run(plan, "all_reduce", {"in": x, "out": x}, op, x, count=n, layout=layout)
        if op == "avg":
            x.div_(self.world)

    def _one_shot_all_reduce(self, x: torch.Tensor, op: str) -> None:
        """A small all_reduce on the window: one copy in, one wait, one reduction (see windowed.py)."""
        n = x.numel()
        what = OpLabel("all_reduce", 0, x.dtype, n)
        small = windowed.OneShotAllReduce(self.window, n, x.dtype, op, self._combiner(op, x.dtype),
                                          self._sig("all_reduce", x, 0, n, op, None), what)
        self._keep_small(x, op, small)

    def _direct_all_reduce(self, x: torch.Tensor, op: str) -> None:
        """The direct plan's messages without its plan walk (see small.py)."""
        n = x.numel()
        what = OpLabel("all_reduce", 0, x.dtype, n)
        self._keep_small(x, op, DirectAllReduce(self.t, n, x.dtype, op, self._combiner(op, x.dtype),
                                                self._sig("all_reduce", x, 0, n, op, None), what))

    def _keep_small(self, x: torch.Tensor, op: str,
                    small: "windowed.OneShotAllReduce | DirectAllReduce") -> None:
        """Run this op's first small all_reduce (`all_reduce` has already applied premul to `x`), and keep
        `small` for the next ones of its size, dtype and reduce op."""
        if len(self._small_ops) > 64:
            self._small_ops.clear()
        self._small_ops[(x.numel(), x.dtype, op)] = small
        self._small_all_reduce(small, x, "sum")  # no premul or avg here: the caller applies them

    def _small_all_reduce(self, small: "windowed.OneShotAllReduce | DirectAllReduce", x: torch.Tensor,
                          op: str, premul: object = None) -> None:
        """Run a kept small all_reduce as op number `self.seq`, with `all_reduce`'s first and final touches:
        the few steps of `_run_body` and `all_reduce` a latency-bound op cannot spare, inline."""
        if premul is not None and op == "premul_sum":
            x.mul_(premul)
        self.seq += 1
        what = small.what
        what.seq = self.seq
        if self.cfg.debug:
            log.debug("rank %d: op #%d %s %s, signature %016x", self.rank, self.seq, describe_sig(small.sig),
                      _HOW["direct"] if small.engine else "on the shared window (one-shot)", small.sig)
        began = time.monotonic()
        try:
            small.run(x, self.seq, began + self.timeout)
        except BaseException as exc:
            self.t.abort(exc)  # peers may be waiting on this rank's next step: tell them why it won't come
            raise
        if began - self._looked > LOOK_AFTER or self.t.broken is not None:  # (`confirm`, inline)
            self._look()
        if op == "avg":
            x.div_(self.world)

    def _hier_all_reduce(self, x: torch.Tensor, op: str, sig: int, deadline: float, what: OpLabel) -> None:
        """Reduce within the host to its leader on its window, all-reduce among the hosts' leaders over the
        cables, then the leader's result to its host's ranks on the window."""
        win, n, es = self.window, x.numel(), x.element_size()
        windowed.reduce(win, x, self._leader, self._combiner(op, x.dtype), sig, deadline, what)
        plan = self._plan(("ar-cables", n, es), lambda: hierarchy.cable_allreduce(
            self.rank, self.shape.groups, n, select.chunk_elems(self.cfg, es), self.shape.is_line))
        self._cables(plan, {"in": x, "out": x}, op, x, sig, deadline, what)
        windowed.broadcast(win, _bytes(x), self._leader, sig, deadline, what)

    def broadcast(self, x: torch.Tensor, root: int) -> None:
        n, es = x.numel(), x.element_size()
        plan = None if self._flat else self._plan(("bc", n, es, root), lambda: select.broadcast_plan(
            self.cfg, self.rank, self.world, root, n, es, self.shape))
        path = paths.choose("broadcast", n * es, self.group, plan.algo if plan else "")
        if path == "window":
            self._run_body(lambda sig, deadline, what: windowed.broadcast(
                self.window, _bytes(x), root, sig, deadline, what), "broadcast", x, root=root, count=n)
        elif path == "hier":
            self._run_body(lambda sig, deadline, what: self._hier_broadcast(x, root, sig, deadline, what),
                           "broadcast", x, root=root, count=n, how="hier")
        else:
            self._run(plan, "broadcast", {"out": x}, None, x, root=root, count=n)

    def _hier_broadcast(self, x: torch.Tensor, root: int, sig: int, deadline: float, what: OpLabel) -> None:
        """The root to one rank per host over the cables (itself for its own host, the leader for the
        others), then that rank to its host's ranks on the window."""
        n, es = x.numel(), x.element_size()
        plan = self._plan(("bc-cables", n, es, root), lambda: hierarchy.cable_broadcast(
            self.rank, self.shape.groups, root, n, select.chunk_elems(self.cfg, es, n), self.shape.is_line))
        self._cables(plan, {"out": x}, None, x, sig, deadline, what)
        entry = next(e for e in hierarchy.broadcast_entries(self.shape.groups, root) if e in self.window.members)
        windowed.broadcast(self.window, _bytes(x), self.window.members.index(entry), sig, deadline, what)

    def reduce(self, x: torch.Tensor, root: int, op: str = "sum") -> None:
        self.check_op("reduce", op, x.dtype)
        n, es = x.numel(), x.element_size()
        plan = self._plan(("rd", n, es, root), lambda: select.reduce_plan(
            self.cfg, self.rank, self.world, root, n, es, self.shape))
        self._run(plan, "reduce", {"in": x, "out": x}, op, x, root=root, count=n)
        if op == "avg" and self.rank == root:
            x.div_(self.world)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, counts: list[int] | None = None,
                   layout: object = None) -> None:
        """`out` holds every rank's block in rank order; `counts` gives uneven block sizes. `layout`: what the
        bytes are when `out` is only bytes (the dtypes and sizes a coalesced call packed), for the signature."""
        counts = counts or [x.numel()] * self.world
        blocks = tuple(counts) if layout is None else (tuple(counts), layout)
        offs = offsets(counts)
        mine = out[offs[self.rank] : offs[self.rank] + counts[self.rank]]
        if mine.data_ptr() != x.data_ptr() or mine.numel() != x.numel():
            mine.copy_(x)
        es = x.element_size()
        plan = None if self._flat else self._plan(("ag", tuple(counts), es), lambda: select.all_gather_plan(
            self.cfg, self.rank, self.world, counts, es, self.shape))
        path = paths.choose("all_gather", sum(counts) * es, self.group, plan.algo if plan else "")
        if path == "window":
            spans = [(start * es, c * es) for start, c in zip(offs, counts)]
            self._run_body(lambda sig, deadline, what: windowed.all_gather(
                self.window, _bytes(out), spans, sig, deadline, what), "all_gather", out, count=sum(counts),
                layout=blocks)
        elif path == "hier":
            self._run_body(lambda sig, deadline, what: self._hier_all_gather(out, counts, sig, deadline, what),
                           "all_gather", out, count=sum(counts), layout=blocks, how="hier")
        else:
            self._run(plan, "all_gather", {"out": out}, None, out, count=sum(counts), layout=blocks)

    def _hier_all_gather(self, out: torch.Tensor, counts: list[int], sig: int, deadline: float, what: OpLabel) -> None:
        """The host's blocks to its leader on the window, whole host blocks among the leaders over the
        cables, then the leader's full result to its host's ranks on the window."""
        win, es = self.window, out.element_size()
        starts = offsets(counts)
        raw = _bytes(out)
        windowed.gather(win, raw, [(starts[p] * es, counts[p] * es) for p in win.members], self._leader, sig,
                        deadline, what)
        plan = self._plan(("ag-cables", tuple(counts), es), lambda: hierarchy.cable_all_gather(
            self.rank, self.shape.groups, counts, select.chunk_elems(self.cfg, es)))
        self._cables(plan, {"out": out}, None, out, sig, deadline, what)
        windowed.broadcast(win, raw, self._leader, sig, deadline, what)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, counts: list[int], op: str = "sum") -> None:
        """Reduce `x` (all ranks' blocks, `counts` long) and keep this rank's block in `out`."""
        self.check_op("reduce_scatter", op, x.dtype)
        if _overlap(out, x):  # the in-place form: out is this rank's slice of x, which peers still need
            x = x.clone()
        es = x.element_size()
        plan = None if self._flat else self._plan(("rs", tuple(counts), es), lambda: select.reduce_scatter_plan(
            self.cfg, self.rank, self.world, counts, es, self.shape))
        path = paths.choose("reduce_scatter", sum(counts) * es, self.group, plan[0].algo if plan else "")
        if path == "window":
            combine = self._combiner(op, x.dtype)
            self._run_body(lambda sig, deadline, what: windowed.reduce_scatter(
                self.window, out, x, counts, combine, sig, deadline, what), "reduce_scatter", x, count=sum(counts),
                op=op, layout=tuple(counts))
        elif path == "hier":
            self._run_body(lambda sig, deadline, what: self._hier_reduce_scatter(
                out, x, counts, op, sig, deadline, what), "reduce_scatter", x, count=sum(counts), op=op,
                layout=tuple(counts), how="hier")
        else:
            self._reduce_scatter_plan(out, x, counts, op, *plan)
        if op == "avg":
            out.div_(self.world)

    def _hier_reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, counts: list[int], op: str, sig: int,
                             deadline: float, what: OpLabel) -> None:
        """Reduce a working copy within the host to its leader on its window, reduce-scatter whole host blocks
        among the leaders over the cables, then the leader's host blocks to its host's ranks on the window."""
        win, es = self.window, x.element_size()
        starts = offsets(counts)
        work = self._tmp_full(x)
        windowed.reduce(win, work, self._leader, self._combiner(op, x.dtype), sig, deadline, what)
        plan = self._plan(("rs-cables", tuple(counts), es), lambda: hierarchy.cable_reduce_scatter(
            self.rank, self.shape.groups, counts, select.chunk_elems(self.cfg, es)))
        self._cables(plan, {"in": work, "out": work}, op, x, sig, deadline, what)
        lo, hi = starts[win.members[0]], starts[win.members[-1]] + counts[win.members[-1]]
        windowed.broadcast(win, _bytes(work[lo:hi]), self._leader, sig, deadline, what)
        out.copy_(work[starts[self.rank] : starts[self.rank] + counts[self.rank]])

    def _reduce_scatter_plan(self, out: torch.Tensor, x: torch.Tensor, counts: list[int], op: str, plan: Plan,
                             in_place: bool) -> None:
        if in_place:  # the hierarchy: reduce a full working copy ("in" and "out"), then keep our block
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

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   layout: object = None) -> None:
        """`layout`: what the bytes are when they are only bytes (a compressed all_reduce's), for the
        signature. The counts differ by rank, so they are not in it: each message's size is checked."""
        ss = list(zip(offsets(send_counts), send_counts))
        rs = list(zip(offsets(recv_counts), recv_counts))
        if _overlap(out, x):
            x = x.clone()
        plan = self._plan(("a2a", tuple(send_counts), tuple(recv_counts)),
                          lambda: direct.all_to_all(self.rank, self.world, ss, rs))
        self._run(plan, "all_to_all", {"in": x, "out": out}, None, x, layout=layout)

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


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of the 1-D contiguous `x`, for the byte-wise window collectives."""
    return x.view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)


def _at_least(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """`buf` if it holds `nbytes`, else a new byte buffer that does (kept by the caller for later ops)."""
    if buf is None or buf.numel() < nbytes:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf
