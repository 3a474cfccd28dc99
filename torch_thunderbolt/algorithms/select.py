"""Which algorithm for which collective, by message size and world size (overridable)."""
from __future__ import annotations

from ..config import Config
from . import chain, direct, ring
from .layout import offsets, split_even
from .plan import Plan


def ring_order_from(order: list[int] | None, world: int) -> list[int]:
    return list(order) if order else list(range(world))


def _chunk_elems(cfg: Config, elem: int) -> int:
    return max(1, cfg.chunk_bytes // max(1, elem))


def _small(cfg: Config, nbytes: int) -> bool:
    if cfg.algo == "direct":
        return True
    if cfg.algo in ("ring", "chain"):
        return False
    return nbytes <= cfg.small_bytes


def allreduce_plan(cfg: Config, rank: int, world: int, count: int, elem: int, order: list[int] | None) -> Plan:
    if world == 1 or _small(cfg, count * elem) or count < world:
        return direct.direct_allreduce(rank, world, count)
    order = ring_order_from(order, world)
    return ring.ring_allreduce(rank, order, split_even(count, world), _chunk_elems(cfg, elem))


def reduce_scatter_plan(cfg: Config, rank: int, world: int, counts: list[int], elem: int,
                        order: list[int] | None) -> tuple[Plan, bool]:
    """Returns (plan, in_place): ring plans reduce a full copy in "out"; direct ones read "in"."""
    segs = list(zip(offsets(counts), counts))
    if world == 1 or _small(cfg, sum(counts) * elem):
        return direct.direct_reduce_scatter(rank, world, segs), False
    order = ring_order_from(order, world)
    return ring.ring_reduce_scatter(rank, order, segs, _chunk_elems(cfg, elem)), True


def all_gather_plan(cfg: Config, rank: int, world: int, counts: list[int], elem: int,
                    order: list[int] | None) -> Plan:
    segs = list(zip(offsets(counts), counts))
    if world == 1 or _small(cfg, sum(counts) * elem):
        return direct.direct_all_gather(rank, world, segs)
    return ring.ring_all_gather(rank, ring_order_from(order, world), segs, _chunk_elems(cfg, elem))


def broadcast_plan(cfg: Config, rank: int, world: int, root: int, count: int, elem: int) -> Plan:
    if world <= 2 or _small(cfg, count * elem):
        if cfg.algo != "chain":
            return direct.flat_broadcast(rank, world, root, count)
    order = [(root + k) % world for k in range(world)]
    return chain.chain_broadcast(rank, order, count, _chunk_elems(cfg, elem))


def reduce_plan(cfg: Config, rank: int, world: int, root: int, count: int, elem: int) -> Plan:
    if _small(cfg, count * elem) and cfg.algo != "chain":
        return direct.direct_reduce(rank, world, root, count)
    order = [(root + k) % world for k in range(world)]
    return chain.chain_reduce(rank, order, count, _chunk_elems(cfg, elem))

