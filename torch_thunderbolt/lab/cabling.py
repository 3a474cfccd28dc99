"""Cable graphs for the emulated cluster: which hosts are cabled, and how non-neighbours reach each other.

Pure functions over host indices; no I/O. A Thunderbolt cable joins exactly two Macs, so a chain or ring
leaves most pairs without a direct link. Like a Thunderbolt bridge would, the lab forwards their
traffic through the hosts in between; `next_hops` says through which neighbour.
"""
from __future__ import annotations

from collections import deque

from ..errors import ConfigError

TOPOLOGIES = ("pair", "chain", "ring", "mesh")
MAX_HOSTS = 64


def topology_edges(hosts: int, topology: str) -> list[tuple[int, int]]:
    """The pairs (a, b), a < b, that get cables, in a stable order."""
    if topology not in TOPOLOGIES:
        raise ConfigError(f"unknown topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}")
    if not isinstance(hosts, int) or hosts < 2 or hosts > MAX_HOSTS:
        raise ConfigError(f"--hosts must be an integer from 2 to {MAX_HOSTS}, got {hosts!r}")
    if topology == "pair":
        if hosts != 2:
            raise ConfigError(f"topology 'pair' needs exactly 2 hosts, got {hosts}")
        return [(0, 1)]
    if topology == "chain":
        return [(i, i + 1) for i in range(hosts - 1)]
    if topology == "ring":
        if hosts < 3:
            raise ConfigError(f"topology 'ring' needs at least 3 hosts, got {hosts} (use 'pair')")
        return [(i, i + 1) for i in range(hosts - 1)] + [(0, hosts - 1)]
    return [(a, b) for a in range(hosts) for b in range(a + 1, hosts)]


def neighbours(hosts: int, edges: list[tuple[int, int]]) -> list[list[int]]:
    """Adjacency lists, each sorted so that route choices are deterministic."""
    adj: list[set[int]] = [set() for _ in range(hosts)]
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    return [sorted(s) for s in adj]


def next_hops(hosts: int, edges: list[tuple[int, int]], src: int) -> tuple[list[int], list[int]]:
    """Breadth-first search from `src`: (distance, first hop) per destination host.

    The first hop is the neighbour of `src` that starts a shortest path (the lowest-numbered one on
    ties); it is -1 for `src` itself and for unreachable hosts, whose distance is -1 too.
    """
    adj = neighbours(hosts, edges)
    dist = [-1] * hosts
    first = [-1] * hosts
    dist[src] = 0
    queue = deque([src])
    while queue:
        node = queue.popleft()
        for nxt in adj[node]:
            if dist[nxt] != -1:
                continue
            dist[nxt] = dist[node] + 1
            first[nxt] = nxt if node == src else first[node]
            queue.append(nxt)
    return dist, first


def subnet_routes(hosts: int, edges: list[tuple[int, int]]) -> list[dict[int, int]]:
    """Per host: {edge index: neighbour to send through} for every cable subnet it is not on.

    Each cable has its own subnet, so a host needs a route for every cable it is not an end of. It
    heads for the nearer end of that cable; every hop strictly shortens the distance, so no loops.
    """
    tables = [next_hops(hosts, edges, h) for h in range(hosts)]
    routes: list[dict[int, int]] = []
    for h in range(hosts):
        dist, first = tables[h]
        mine: dict[int, int] = {}
        for e, (a, b) in enumerate(edges):
            if h in (a, b) or dist[a] == -1:
                continue
            end = a if (dist[a], a) <= (dist[b], b) else b
            mine[e] = first[end]
        routes.append(mine)
    return routes


def forwarding_hosts(hosts: int, edges: list[tuple[int, int]]) -> list[int]:
    """Hosts that pass on packets between other hosts under `subnet_routes` (they need ip_forward=1).

    Found by walking every (source, destination address) pair hop by hop, so it matches the routes
    exactly instead of guessing from the shape.
    """
    routes = subnet_routes(hosts, edges)
    inner: set[int] = set()
    for src in range(hosts):
        for e, (a, b) in enumerate(edges):
            for dst in (a, b):
                node = src
                while node != dst:
                    # A host on the cable delivers on-link; any other host follows its route.
                    node = dst if node in (a, b) else routes[node].get(e, dst)
                    if node != dst:
                        inner.add(node)
    return sorted(inner)
