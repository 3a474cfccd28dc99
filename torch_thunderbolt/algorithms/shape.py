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


def hosts_shape(nets: list[list[str]] | None, hosts: list[str]) -> Shape | None:
    """The cluster shape when hosts run several ranks: derived from the hosts' networks (a 3-Mac chain
    stays a chain, however many ranks each Mac runs), each host's ranks next to each other in the
    ring/line order, so a ring crosses each cable once rather than once per rank."""
    if not nets:
        return None
    names = list(dict.fromkeys(hosts))  # hosts in the order of their lowest rank
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in names}
    host_nets = [sorted({n for r in members[h] for n in nets[r]}) for h in names]
    by_host = shape_from_networks(host_nets)
    order = [r for i in by_host.order for r in members[names[i]]]
    kind = "mesh" if by_host.kind in ("single", "pair") else by_host.kind  # 2 hosts: everyone reaches everyone
    groups = [members[names[i]] for i in by_host.order]
    return Shape(kind, order, shape_from_networks(nets).neighbours, groups)


def cluster_shape(nets: list[list[str]] | None, hosts: list[str] | None) -> Shape | None:
    """What the algorithms plan for, from every rank's networks (`nets`, None when the set-up had no reason to
    look: one host) and host identity (`hosts`, None when links were not chosen by host): hosts in
    hierarchy where some run several ranks, else the ranks' own networks. None: derive it from the group
    size alone (`Shape.full`)."""
    if hosts is not None and 1 < len(set(hosts)) < len(hosts):  # several hosts, some with several ranks
        return hosts_shape(nets, hosts)
    return shape_from_networks(nets) if nets else None
