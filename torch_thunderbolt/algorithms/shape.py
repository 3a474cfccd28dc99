"""The shape of the cluster as the algorithms see it: which ranks are directly cabled, in what order.

Built from the networks each rank's chosen addresses sit in: two ranks sharing a network reach each other
without a router (one Thunderbolt cable with its own /30, or the Thunderbolt Bridge, or loopback). Pure.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ..topology.graph import chain_order_adjacency, classify_adjacency, ring_order_adjacency


@dataclass(frozen=True)
class Shape:
    kind: str  # single, pair, ring, chain, mesh, other
    order: list[int] = field(default_factory=list)  # ring order (ring/mesh/pair/other) or line (chain)
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    groups: list[list[int]] = field(default_factory=list)  # ranks per host (hosts in order) when mixed

    @property
    def is_line(self) -> bool:
        return self.kind == "chain"

    @classmethod
    def full(cls, world: int) -> "Shape":
        adj = {r: {q for q in range(world) if q != r} for r in range(world)}
        kind = "single" if world == 1 else "pair" if world == 2 else "mesh"
        return cls(kind, list(range(world)), adj)


def shape_from_networks(nets: list[list[str]]) -> Shape:
    """`nets[r]`: CIDR networks of rank r's addresses ("10.77.0.1/30"). Ranks on one host share
    127.0.0.0/8-style networks, so a single-host job is a full mesh."""
    world = len(nets)
    parsed = [{ipaddress.ip_network(n, strict=False) for n in ns} for ns in nets]
    adj = {r: {q for q in range(world) if q != r and parsed[r] & parsed[q]} for r in range(world)}
    names = list(range(world))
    kind = classify_adjacency(adj, names)
    if kind == "chain":
        return Shape(kind, chain_order_adjacency(adj, names) or names, adj)
    if kind in ("ring", "mesh", "pair"):
        return Shape(kind, ring_order_adjacency(adj, names) or names, adj)
    return Shape(kind, names, adj)
