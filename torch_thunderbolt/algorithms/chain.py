"""Pipelined chains: broadcast and reduce along a line of ranks, chunk by chunk.

A chain matches daisy-chained Macs (A–B–C with no A–C cable): every byte crosses each cable once, and the
pipeline keeps all cables busy at once.
"""
from __future__ import annotations

from .layout import chunks
from .plan import Plan


def chain_broadcast(rank: int, order: list[int], count: int, chunk: int) -> Plan:
    """`order[0]` is the root; data flows order[0] -> order[1] -> ... into "out"."""
    plan = Plan(rank, len(order), "chain")
    pos = order.index(rank)
    prev = order[pos - 1] if pos > 0 else None
    nxt = order[pos + 1] if pos + 1 < len(order) else None
    for j, (off, n) in enumerate(chunks(0, count, chunk)):
        deps: tuple[int, ...] = ()
        if prev is not None:
            deps = (plan.recv(prev, "out", off, n, j),)
        if nxt is not None:
            plan.send(nxt, "out", off, n, j, deps)
    return plan


def chain_reduce(rank: int, order: list[int], count: int, chunk: int) -> Plan:
    """`order[0]` is the root; partial results flow from the far end towards it. "in" is not modified
    except on the root, whose "out" is its "in"."""
    plan = Plan(rank, len(order), "chain")
    if len(order) == 1:
        return plan
    pos = order.index(rank)
    prev = order[pos + 1] if pos + 1 < len(order) else None  # farther from root: sends to us
    nxt = order[pos - 1] if pos > 0 else None  # towards the root
    plan.tmp = count if prev is not None else 0
    for j, (off, n) in enumerate(chunks(0, count, chunk)):
        if prev is None:
            plan.send(nxt, "in", off, n, j)
            continue
        r = plan.recv(prev, "tmp", off, n, j)
        if nxt is None:
            plan.reduce("out", off, "tmp", off, n, (r,))
        else:
            red = plan.reduce("tmp", off, "in", off, n, (r,))
            plan.send(nxt, "tmp", off, n, j, (red,))
    return plan
