"""Thunderbolt Bridge loop check.

macOS puts every Thunderbolt port into `bridge0` ("Thunderbolt Bridge") by default. When bridged cables
close a cycle (three Macs in a ring, or two cables between one pair) a broadcast frame goes round forever:
a broadcast storm that saturates the links and the CPUs. The fix is to take the ports out of the bridge
and give each cable its own small subnet, which is what the address plan does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import Cable, ClusterGraph, Host


@dataclass
class BridgeLoop:
    hosts: list[str]
    cables: list[Cable]
    advice: str = ""
    fix: list[str] = field(default_factory=list)  # one line per host: what to turn off there


def bridged(host: Host, port: str) -> bool:
    """Whether `port` (an ifname) is a member of an active bridge on `host`."""
    bridge = host.bridge
    return bool(bridge and bridge.active and port in bridge.members)


def bridged_cables(graph: ClusterGraph) -> list[Cable]:
    return [c for c in graph.cables
            if bridged(graph.host(c.a_host), c.a_port) and bridged(graph.host(c.b_host), c.b_port)]


def find_bridge_loops(graph: ClusterGraph) -> list[BridgeLoop]:
    """One BridgeLoop per group of hosts whose bridged cables contain a cycle.

    A connected group of bridged cables is loop-free exactly when it is a tree: edges == hosts - 1.
    Counting cables (not host pairs) makes two bridged cables between one pair a loop too, which it is.
    """
    loops = []
    for hosts, cables in _components(bridged_cables(graph)):
        if len(cables) >= len(hosts):
            loops.append(_describe(graph, hosts, cables))
    return loops


def _components(cables: list[Cable]) -> list[tuple[list[str], list[Cable]]]:
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for c in cables:
        parent[root(c.a_host)] = root(c.b_host)
    groups: dict[str, tuple[list[str], list[Cable]]] = {}
    for c in cables:
        hosts, members = groups.setdefault(root(c.a_host), ([], []))
        members.append(c)
        for h in c.hosts:
            if h not in hosts:
                hosts.append(h)
    return list(groups.values())


def _describe(graph: ClusterGraph, hosts: list[str], cables: list[Cable]) -> BridgeLoop:
    ordered = [h for h in graph.names if h in hosts]
    kind = f"{len(ordered)} hosts" if len(ordered) > 2 else f"{len(cables)} cables between {' and '.join(ordered)}"
    advice = (f"Thunderbolt Bridge loop over {kind}: "
              f"{'; '.join(c.label() for c in cables)}. Every broadcast circles this loop forever "
              f"(a broadcast storm). Take these ports out of the bridge and give each cable its own /30 "
              f"subnet: run the commands of the address plan below (or `topo ... --apply`).")
    fix = []
    for name in ordered:
        ports = sorted({c.end(name) for c in cables if name in c.hosts})
        bridge = graph.host(name).bridge
        fix.append(f"{name}: remove {', '.join(ports)} from {bridge.ifname if bridge else 'the bridge'}"
                   " and turn the Thunderbolt Bridge service off")
    return BridgeLoop(hosts=ordered, cables=cables, advice=advice, fix=fix)
