"""Which algorithm for which collective, by message size, world size and cluster shape (overridable
with THUNDERBOLT_ALGO)."""
from __future__ import annotations

from ..config import Config
from . import chain, direct, hierarchy, ring
from .segments import offsets, split_even
from .plan import Plan
from .shape import Shape


MIN_PIPELINE_PIECES = 8
MIN_CHUNK_BYTES = 64 << 10
# Pieces per block of the mesh all_reduce and reduce_scatter, at most: every piece costs Python steps on every rank. 1 MB pieces
# of a 64 MB all_reduce took 1.11-1.17x the whole blocks' time on the CPU-bound 10 Gbit/s lab mesh; four
# per block 0.98-1.00 there and 0.91-0.94 at 1 Gbit/s, where the reduction then overlaps the exchanges.
MESH_PIECES = 4


def chunk_elems(cfg: Config, elem: int, count: int | None = None) -> int:
    """Pipeline piece size; with `count`, small enough for MIN_PIPELINE_PIECES pieces (down to 64 KB), so a
    1 MB message on a line of hosts is pipelined too instead of crossing each cable in one piece."""
    chunk = max(1, cfg.chunk_bytes // max(1, elem))
    if count is not None:
        floor = max(1, MIN_CHUNK_BYTES // max(1, elem))
        chunk = min(chunk, max(floor, -(-count // MIN_PIPELINE_PIECES)))
    return chunk


def _mesh_piece(chunk: int, count: int, world: int) -> int:
    """Piece size on a mesh: `chunk`, or larger where a block of count/world would get more than MESH_PIECES
    (the same on every rank, since it depends on the whole count only)."""
    return max(chunk, -(-count // (world * MESH_PIECES)))


def _small(cfg: Config, nbytes: int) -> bool:
    if cfg.algo == "direct":
        return True
    if cfg.algo != "auto":
        return False
    return nbytes <= cfg.small_bytes


def _line_from(shape: Shape, root: int) -> list[int]:
    """A line through every rank along the cables: the chain itself, or the ring cut open at the root."""
    if shape.is_line:
        return shape.order
    p = shape.order.index(root)
    return shape.order[p:] + shape.order[:p]


def _hierarchical(cfg: Config, world: int, shape: Shape) -> bool:
    """Several ranks on some host, each host's ranks consecutive: its blocks form one range per host."""
    return cfg.algo == "auto" and 1 < len(shape.groups) < world and hierarchy.contiguous_hosts(shape.groups)


def allreduce_plan(cfg: Config, rank: int, world: int, count: int, elem: int, shape: Shape) -> Plan:
    if world == 1 or _small(cfg, count * elem) or count < world:
        return direct.direct_allreduce(rank, world, count)
    chunk = chunk_elems(cfg, elem)
    if cfg.algo == "auto" and len(shape.groups) > 1 and len(shape.groups) < world:
        return hierarchy.hierarchical_allreduce(rank, shape.groups, count, chunk, line=shape.is_line)
    if cfg.algo == "chain" or (cfg.algo == "auto" and shape.is_line):
        return chain.chain_allreduce(rank, shape.order, count, chunk_elems(cfg, elem, count))
    if cfg.algo == "auto" and shape.kind == "mesh" and world >= 4:  # one hop over every cable
        return direct.mesh_allreduce(rank, world, count, _mesh_piece(chunk, count, world))
    if cfg.algo == "biring" or (cfg.algo == "auto" and world > 2 and count >= 2 * world):
        return ring.bidirectional_ring_allreduce(rank, shape.order, count, chunk)
    return ring.ring_allreduce(rank, shape.order, split_even(count, world), chunk)


def _block_algo(cfg: Config, world: int, counts: list[int], shape: Shape) -> str:
    """How a large all_gather or reduce_scatter moves its blocks over the cables: "line" along a chain
    (each block out from, or in to, its owner along both branches), "direct" on a full mesh of four or
    more (one hop over each pair's own cable), "biring" round a ring (half of each block each way), "ring"
    otherwise. Each keeps every cable of the least cabled rank busy in both directions."""
    if cfg.algo != "auto":
        return {"chain": "line"}.get(cfg.algo, cfg.algo)
    if shape.is_line:
        return "line"
    if shape.kind == "mesh" and world >= 4:
        return "direct"
    return "biring" if world >= 3 and min(counts) >= 2 else "ring"


def reduce_scatter_plan(cfg: Config, rank: int, world: int, counts: list[int], elem: int,
                        shape: Shape) -> tuple[Plan, bool]:
    """Returns (plan, in_place): in place, the plan reduces a full working copy of the input ("in" and
    "out" both) and the caller keeps its block (the hierarchy); else it reads "in" and writes the
    rank's block to "out"."""
    segs = list(zip(offsets(counts), counts))
    if world == 1 or _small(cfg, sum(counts) * elem):
        return direct.direct_reduce_scatter(rank, world, segs), False
    chunk = chunk_elems(cfg, elem)
    if _hierarchical(cfg, world, shape):
        return hierarchy.hierarchical_reduce_scatter(rank, shape.groups, counts, chunk), True
    algo = _block_algo(cfg, world, counts, shape)
    if algo == "direct":
        return direct.direct_reduce_scatter(rank, world, segs, _mesh_piece(chunk, sum(counts), world)), False
    if algo == "line":
        return chain.line_reduce_scatter(rank, _line_from(shape, shape.order[0]), segs, chunk), False
    if algo == "biring":
        return ring.bidirectional_ring_reduce_scatter(rank, shape.order, segs, chunk), False
    return ring.ring_reduce_scatter_into(rank, shape.order, segs, chunk), False


def all_gather_plan(cfg: Config, rank: int, world: int, counts: list[int], elem: int, shape: Shape) -> Plan:
    segs = list(zip(offsets(counts), counts))
    if world == 1 or _small(cfg, sum(counts) * elem):
        return direct.direct_all_gather(rank, world, segs)
    chunk = chunk_elems(cfg, elem)
    if _hierarchical(cfg, world, shape):
        return hierarchy.hierarchical_all_gather(rank, shape.groups, counts, chunk)
    algo = _block_algo(cfg, world, counts, shape)
    if algo == "direct":
        return direct.direct_all_gather(rank, world, segs)
    if algo == "line":
        return chain.line_all_gather(rank, _line_from(shape, shape.order[0]), segs, chunk)
    if algo == "biring":
        return ring.bidirectional_ring_all_gather(rank, shape.order, segs, chunk)
    return ring.ring_all_gather(rank, shape.order, segs, chunk)


def broadcast_plan(cfg: Config, rank: int, world: int, root: int, count: int, elem: int, shape: Shape) -> Plan:
    if cfg.algo != "chain" and (world <= 2 or _small(cfg, count * elem)):
        return direct.flat_broadcast(rank, world, root, count)
    chunk = chunk_elems(cfg, elem, count)
    # Up to a few pipeline pieces, the cables first, then each host on its own (its window, where it has
    # one): a larger message is better pipelined through every rank, each cable crossed once, below.
    if (cfg.algo == "auto" and 1 < len(shape.groups) < world
            and count * elem <= cfg.chunk_bytes * MIN_PIPELINE_PIECES):
        return hierarchy.hierarchical_broadcast(rank, shape.groups, root, count, chunk, line=shape.is_line)
    if cfg.algo == "auto" and shape.kind == "mesh" and world >= 4 and count >= world:
        # every cable of the root at once (a ring would use two of them)
        return direct.scatter_forward_broadcast(rank, world, root, count, chunk)
    if cfg.algo != "chain" and not shape.is_line and world >= 3 and count >= 2:
        return chain.two_way_ring_broadcast(rank, shape.order, root, count, chunk)
    return chain.chain_broadcast(rank, _line_from(shape, root), root, count, chunk)


def reduce_plan(cfg: Config, rank: int, world: int, root: int, count: int, elem: int, shape: Shape) -> Plan:
    if _small(cfg, count * elem) and cfg.algo != "chain":
        return direct.direct_reduce(rank, world, root, count)
    return chain.chain_reduce(rank, _line_from(shape, root), root, count, chunk_elems(cfg, elem, count))
