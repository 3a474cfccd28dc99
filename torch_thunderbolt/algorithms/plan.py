"""Collectives as plans: a list of steps with dependencies, built by pure functions, run by one executor.

A plan names buffers ("in", "out", "tmp"), offsets and counts in elements. Unit tests inspect plans
directly (who talks to whom, how many bytes, in which order) and run them over the in-memory transport.

Ordering rule the executor guarantees and the plan checker verifies: for every pair of ranks, the sender
posts its messages in plan order and the receiver posts its receives in the same order, so a transport may
stall a stream on a message whose receive is not posted yet without ever deadlocking.
"""
from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..transport.base import Key, Request
from ..transport.engine import Transport
from .reduce_ops import Reducer

SEND, RECV, REDUCE, COPY = 0, 1, 2, 3
ONE_PHASE_LOCAL_BYTES = 256 << 10  # see run_plan


class Step(NamedTuple):
    kind: int
    peer: int  # SEND/RECV: the peer; else -1
    buf: str  # SEND: source; RECV: destination; REDUCE/COPY: destination
    off: int
    n: int
    msg: int  # message id within the op, unique per (sender, receiver) pair
    src: str  # REDUCE/COPY source buffer
    src_off: int
    deps: tuple[int, ...]


@dataclass
class Plan:
    rank: int
    world: int
    algo: str
    steps: list[Step] = field(default_factory=list)
    tmp: int = 0  # scratch elements needed

    def send(self, peer: int, buf: str, off: int, n: int, msg: int, deps: tuple[int, ...] = ()) -> int:
        return self._add(Step(SEND, peer, buf, off, n, msg, "", 0, deps))

    def recv(self, peer: int, buf: str, off: int, n: int, msg: int, deps: tuple[int, ...] = ()) -> int:
        return self._add(Step(RECV, peer, buf, off, n, msg, "", 0, deps))

    def reduce(self, dst: str, off: int, src: str, src_off: int, n: int, deps: tuple[int, ...] = ()) -> int:
        return self._add(Step(REDUCE, -1, dst, off, n, -1, src, src_off, deps))

    def copy(self, dst: str, off: int, src: str, src_off: int, n: int, deps: tuple[int, ...] = ()) -> int:
        return self._add(Step(COPY, -1, dst, off, n, -1, src, src_off, deps))

    def _add(self, step: Step) -> int:
        self.steps.append(step)
        return len(self.steps) - 1

    def graph(self) -> "_Graph":
        """The dependency structure, computed once per plan (plans are cached and reused per op)."""
        g = self.__dict__.get("_graph")
        if g is None or g.n != len(self.steps):
            g = self.__dict__["_graph"] = _Graph(self.steps)
        return g


class _Graph:
    """Children, initial dependency counts, roots and per-peer message order of a plan's steps."""

    def __init__(self, steps: list[Step]) -> None:
        self.n = len(steps)
        self.waiting = [len(s.deps) for s in steps]
        self.children: list[list[int]] = [[] for _ in steps]
        self.queues: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(steps):
            for d in s.deps:
                self.children[d].append(i)
            if s.kind in (SEND, RECV):  # per-peer FIFO, so posting order follows plan order
                self.queues.setdefault((s.kind, s.peer), []).append(i)
        self.roots = [i for i, s in enumerate(steps) if not s.deps]
        # One phase: every send and receive can be posted at once (none waits on another step). Such a plan
        # runs as one post of every message, one wait and its local steps in plan order (a step's
        # dependencies come before it); `_Run`'s bookkeeping would cost a small op as much as its data.
        self.comm = [i for i, s in enumerate(steps) if s.kind in (SEND, RECV)]
        self.local = [i for i, s in enumerate(steps) if s.kind not in (SEND, RECV)]
        self.one_phase = all(not steps[i].deps for i in self.comm) and all(
            d < i for i, s in enumerate(steps) for d in s.deps)
        self.local_elems = sum(steps[i].n for i in self.local)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's storage (the tensor must outlive the view)."""
    nbytes = t.nbytes
    if nbytes == 0:
        return memoryview(bytearray(0))
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


class _Run:
    """Executes one plan: posts sends/receives as their dependencies complete, in per-peer order."""

    def __init__(self, plan: Plan, transport: Transport, bufs: dict[str, torch.Tensor], reducer: Reducer,
                 tag: int, sig: int) -> None:
        self.plan, self.t, self.bufs, self.reducer, self.tag, self.sig = plan, transport, bufs, reducer, tag, sig
        es = next(iter(bufs.values())).element_size()
        self.es = es
        self.views = {name: tensor_bytes(b) for name, b in bufs.items()}
        steps = plan.steps
        graph = plan.graph()
        self.waiting = list(graph.waiting)
        self.children = graph.children
        self.queues = {k: deque(v) for k, v in graph.queues.items()}
        self.roots = graph.roots
        self.ready = [False] * len(steps)
        self.inflight: dict[int, Request] = {}
        self.remaining = len(steps)
        self.heard: set[int] = set()  # peers that sent us something for this op (they arrived)

    def run(self, deadline: float | None, what: object) -> None:
        todo = deque(self.roots)
        while self.remaining:
            while todo:
                self._start(todo.popleft(), todo)
            if not self.remaining:
                break
            reqs = list(self.inflight.values())
            self.t.wait_any(reqs, deadline, what, arrived=self.heard)
            for i, r in list(self.inflight.items()):
                if r.done:
                    if not r.is_send:
                        self.heard.add(r.source)
                    del self.inflight[i]
                    self._complete(i, todo)

    def _start(self, i: int, todo: deque[int]) -> None:
        s = self.plan.steps[i]
        if s.kind == REDUCE or s.kind == COPY:
            _local(s, self.bufs, self.reducer)
            self._complete(i, todo)
            return
        self.ready[i] = True
        q = self.queues[(s.kind, s.peer)]
        while q and self.ready[q[0]]:  # post in plan order per peer
            j = q.popleft()
            self._post(j)

    def _post(self, j: int) -> None:
        s = self.plan.steps[j]
        self.inflight[j] = _message(self.t, s, self.views[s.buf], self.es, self.tag, self.sig)

    def _complete(self, i: int, todo: deque[int]) -> None:
        self.remaining -= 1
        for c in self.children[i]:
            self.waiting[c] -= 1
            if self.waiting[c] == 0:
                todo.append(c)


def _run_one_phase(plan: Plan, graph: _Graph, t: Transport, bufs: dict[str, torch.Tensor], reducer: Reducer,
                   tag: int, sig: int, deadline: float | None, what: object) -> None:
    """A one-phase plan: its sends, then its receives, each in plan order (so per peer too), through one
    `Transport.exchange`, then the local steps in plan order (they wait for every message: run_plan sends
    here only plans with little local work)."""
    steps = plan.steps
    es = next(iter(bufs.values())).element_size()
    views: dict[str, memoryview] = {}
    sends, recvs = [], []
    for i in graph.comm:
        s = steps[i]
        view = views.get(s.buf)
        if view is None:
            view = views[s.buf] = tensor_bytes(bufs[s.buf])
        (sends if s.kind == SEND else recvs).append(_part(s, view, es, t.coll, tag))
    t.exchange(sends, recvs, sig, deadline, what)
    for i in graph.local:
        _local(steps[i], bufs, reducer)


def _part(s: Step, view: memoryview, es: int, space: int, tag: int) -> tuple[int, Key, memoryview]:
    """(peer, key, bytes) of the SEND or RECV step `s` of op `tag` in collective `space` (the group's: see
    Transport.coll; `view`: the bytes of its buffer, `es` bytes per element)."""
    return s.peer, (space, tag, s.msg), view[s.off * es : (s.off + s.n) * es]


def _message(t: Transport, s: Step, view: memoryview, es: int, tag: int, sig: int) -> Request:
    """Post the SEND or RECV step `s` of op `tag`."""
    peer, key, part = _part(s, view, es, t.coll, tag)
    return t.isend(peer, key, part, sig) if s.kind == SEND else t.irecv(peer, key, part, sig)


def _local(s: Step, bufs: dict[str, torch.Tensor], reducer: Reducer) -> None:
    """A REDUCE (dst ⊕= src) or COPY step."""
    dst = bufs[s.buf][s.off : s.off + s.n]
    src = bufs[s.src][s.src_off : s.src_off + s.n]
    if s.kind == REDUCE:
        reducer(dst, src)
    else:
        dst.copy_(src)


def run_plan(plan: Plan, transport: Transport, bufs: dict[str, torch.Tensor], reducer: Reducer, *,
             tag: int, sig: int = 0, deadline: float | None = None, what: object = "") -> None:
    """Run `plan` on this rank. `bufs` maps buffer names to flat tensors of one dtype."""
    if not plan.steps:
        return
    graph = plan.graph()
    # Local steps of more than a few pieces' worth of data: `_Run` overlaps them with what is still arriving.
    if graph.one_phase and graph.local_elems * next(iter(bufs.values())).element_size() <= ONE_PHASE_LOCAL_BYTES:
        _run_one_phase(plan, graph, transport, bufs, reducer, tag, sig, deadline, what)
    else:
        _Run(plan, transport, bufs, reducer, tag, sig).run(deadline, what)
