"""The cluster graph: which cable joins which two hosts, its shape, and rank orders that follow it.

Two hosts are cabled when a port of one lists the other's bus UUID as the computer at its far end.
Orders are found by brute force (backtracking), fine for the handful of Macs one can cable together.
"""
from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError
from .model import Cable, ClusterGraph, Host, Port

SHAPES = ("single", "pair", "chain", "ring", "mesh", "other")


def build_graph(hosts: Iterable[Host]) -> ClusterGraph:
    hosts = list(hosts)
    _check_unique_names(hosts)
    index: dict[str, list[tuple[Host, Port]]] = {}
    for host in hosts:
        for port in host.ports:
            if port.uuid:
                index.setdefault(port.uuid, []).append((host, port))
    cables: dict[frozenset, Cable] = {}
    warnings: list[str] = []
    order = {h.name: i for i, h in enumerate(hosts)}
    for host in hosts:
        for port in host.ports:
            if port.peer_uuid:
                _link(host, port, index, order, cables, warnings)
    ordered = sorted(cables.values(), key=lambda c: (order[c.a_host], c.a_port, order[c.b_host], c.b_port))
    return ClusterGraph(hosts=hosts, cables=ordered, warnings=warnings)


def _check_unique_names(hosts: list[Host]) -> None:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise ConfigError(f"two dumps are both named {h.name!r}: give each host its own dump")
        seen.add(h.name)


def _port_id(port: Port) -> str:
    return port.ifname or port.name


def _link(host: Host, port: Port, index: dict, order: dict, cables: dict, warnings: list[str]) -> None:
    candidates = [(h, p) for h, p in index.get(port.peer_uuid, []) if h.name != host.name]
    if not candidates:
        own = any(h.name == host.name for h, _ in index.get(port.peer_uuid, []))
        where = "another port of the same host" if own else "a computer that is not in this cluster"
        peer = f" ({port.peer_name})" if port.peer_name else ""
        warnings.append(f"{host.name}:{_port_id(port)} is cabled to {where}{peer}, UUID {port.peer_uuid}")
        return
    # A Linux domain shares one UUID across ports: prefer the port that points back at us.
    far_host, far_port = next(((h, p) for h, p in candidates if p.peer_uuid == port.uuid), candidates[0])
    ends = sorted([(host, port), (far_host, far_port)], key=lambda e: (order[e[0].name], _port_id(e[1])))
    key = frozenset((h.name, _port_id(p)) for h, p in ends)
    if key in cables:
        return
    speeds = [s for s in (port.speed_gbps, far_port.speed_gbps) if s > 0]
    (ha, pa), (hb, pb) = ends
    cables[key] = Cable(ha.name, _port_id(pa), hb.name, _port_id(pb), min(speeds) if speeds else 0.0)


def _adjacency(graph: ClusterGraph) -> dict[str, set[str]]:
    return {name: graph.neighbours(name) for name in graph.names}


def is_connected(graph: ClusterGraph) -> bool:
    adj = _adjacency(graph)
    if not adj:
        return True
    seen, todo = set(), [graph.names[0]]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(adj[node] - seen)
    return len(seen) == len(adj)


def classify(graph: ClusterGraph) -> str:
    """One of SHAPES. A 3-host cycle is a "ring" (it is also a full mesh; ring is the useful name)."""
    if len(graph.hosts) >= 2 and not is_connected(graph):
        return "other"
    return classify_adjacency(_adjacency(graph), graph.names)


def classify_adjacency(adj: dict, names: list) -> str:
    """`classify` over a plain adjacency map (the backend builds one from which ranks share a subnet)."""
    n = len(names)
    if n < 2:
        return "single"
    if n == 2:
        return "pair" if names[1] in adj[names[0]] else "other"
    edges = sum(len(v) for v in adj.values()) // 2
    degrees = [len(adj[x]) for x in names]
    if edges == n and all(d == 2 for d in degrees) and ring_order_adjacency(adj, names) is not None:
        return "ring"
    if edges == n - 1 and max(degrees) <= 2 and chain_order_adjacency(adj, names) is not None:
        return "chain"
    if edges == n * (n - 1) // 2:
        return "mesh"
    return "other"


def ring_order(graph: ClusterGraph) -> list[str] | None:
    """Host names in an order where each is cabled to the next and the last to the first, or None."""
    return ring_order_adjacency(_adjacency(graph), graph.names)


def ring_order_adjacency(adj: dict, names: list) -> list | None:
    if len(names) <= 1:
        return list(names)
    if len(names) == 2:
        return list(names) if names[1] in adj[names[0]] else None
    path = _hamiltonian(adj, names, [names[0]], closed=True)
    if path is None:
        return None
    # Of the two directions round the ring, prefer the one that visits earlier hosts first.
    index = {n: i for i, n in enumerate(names)}
    return path if index[path[1]] < index[path[-1]] else [path[0]] + path[1:][::-1]


def chain_order(graph: ClusterGraph) -> list[str] | None:
    """Host names in an order where each is cabled to the next (a Hamiltonian path), or None."""
    return chain_order_adjacency(_adjacency(graph), graph.names)


def chain_order_adjacency(adj: dict, names: list) -> list | None:
    if len(names) <= 1:
        return list(names)
    for start in names:
        path = _hamiltonian(adj, names, [start], closed=False)
        if path is not None:
            return path
    return None


def best_order(graph: ClusterGraph) -> tuple[str, list[str]] | None:
    """("ring", order) if the cabling closes a ring, else ("chain", order), else None."""
    ring = ring_order(graph)
    if ring is not None:
        return "ring", ring
    chain = chain_order(graph)
    return ("chain", chain) if chain is not None else None


def order_cables(graph: ClusterGraph, order: list[str], closed: bool) -> list[list[Cable]]:
    """For each consecutive pair in `order` (and last->first if closed) the cables joining them."""
    pairs = list(zip(order, order[1:] + order[:1] if closed else order[1:]))
    if closed and len(order) == 2:
        pairs = pairs[:1]
    return [graph.cables_between(a, b) for a, b in pairs]


def _hamiltonian(adj: dict[str, set[str]], names: list[str], path: list[str], closed: bool) -> list[str] | None:
    if len(path) == len(names):
        return path if not closed or path[0] in adj[path[-1]] else None
    visited = set(path)
    for nxt in names:  # in host order, so the answer is deterministic
        if nxt not in visited and nxt in adj[path[-1]]:
            found = _hamiltonian(adj, names, path + [nxt], closed)
            if found is not None:
                return found
    return None
