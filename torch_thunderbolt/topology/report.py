"""Everything `topo` prints or writes except pictures: the cluster analysis, tables, JSON, the hostfile."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .graph import best_order, build_graph, classify
from .loops import BridgeLoop, find_bridge_loops
from ..errors import ConfigError
from .model import Cable, ClusterGraph, Host
from .addressing import DEFAULT_BASE, AddressPlan, Command, plan_addresses, plan_commands
from .speed import generation


@dataclass
class Analysis:
    graph: ClusterGraph
    shape: str
    order: tuple[str, list[str]] | None
    loops: list[BridgeLoop]
    plan: AddressPlan
    commands: list[Command] = field(default_factory=list)


def analyse(hosts: list[Host], base: str = DEFAULT_BASE, mtu: int | None = None) -> Analysis:
    graph = build_graph(hosts)
    plan = plan_addresses(graph, base)
    return Analysis(graph=graph, shape=classify(graph), order=best_order(graph),
                    loops=find_bridge_loops(graph), plan=plan, commands=plan_commands(graph, plan, mtu))


def _speed(gbps: float) -> str:
    return f"{gbps:g} Gb/s {generation(gbps)}" if gbps else "-"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def host_summary(host: Host) -> str:
    if not host.ports:
        checked = "\n".join(f"  - {c}" for c in host.checked) or "  - nothing"
        return f"No Thunderbolt interfaces found on {host.name} ({host.platform}). Checked:\n{checked}"
    lines = [f"Host {host.name}" + (f" ({host.model}, {host.platform})" if host.model else f" ({host.platform})")]
    rdma = any(p.rdma for p in host.ports)
    rows = [["PORT", "IF", "STATUS", "SPEED", "FAR END", "ADDRESSES"] + (["RDMA"] if rdma else [])]
    for p in host.ports:
        far = []
        if p.peer_uuid:
            far.append(f"computer {p.peer_name or '?'} (bus {p.peer_uuid[:8]})")
        far += [f"device: {d}" for d in p.devices]
        rows.append([p.name, p.ifname or "-", p.status, _speed(p.speed_gbps), "; ".join(far) or "-",
                     " ".join(p.addresses) or "-"] + ([p.rdma or "?"] if rdma else []))
    lines += _table(rows)
    if host.bridge:
        b = host.bridge
        service = {True: "service on", False: "service off", None: "service ?"}[b.service_enabled]
        lines.append(f"Bridge {b.ifname}: {'active' if b.active else 'inactive'}, {service}, "
                     f"members: {' '.join(b.members) or 'none'}")
    return "\n".join(lines)


def cluster_report(a: Analysis) -> str:
    g = a.graph
    order = ""
    if a.order and len(g.hosts) > 1:
        kind, names = a.order
        order = f"; {kind} order: " + " -> ".join(names + (names[:1] if kind == "ring" and len(names) > 2 else []))
    lines = [f"Cluster: {_count(len(g.hosts), 'host')}, {_count(len(g.cables), 'cable')}, shape: {a.shape}{order}",
             "", "Cables:"]
    rdma = any(p.rdma for h in g.hosts for p in h.ports)
    rows = [["#", "FROM", "TO", "SPEED"] + (["RDMA"] if rdma else [])] + [
        [str(i), f"{c.a_host}:{c.a_port}", f"{c.b_host}:{c.b_port}", _speed(c.speed_gbps)]
        + ([cable_rdma(g, c)] if rdma else []) for i, c in enumerate(g.cables)]
    lines += ["  " + r for r in _table(rows)] if g.cables else ["  none: no two hosts are cabled together"]
    lines += [f"Warning: {w}" for w in g.warnings]
    lines += ["", "Thunderbolt Bridge loops: " + ("none" if not a.loops else f"{len(a.loops)} FOUND")]
    for loop in a.loops:
        lines += [f"  {loop.advice}"] + [f"    - {f}" for f in loop.fix]
    lines += ["", f"Address plan (base {a.plan.base}, one /30 per cable):"
              + ("" if a.plan.assignments else " nothing to plan")]
    for asg in a.plan.assignments:
        c = asg.cable
        lines.append(f"  {asg.network:<18} {c.a_host} {c.a_port} {asg.a_address}  <->  "
                     f"{c.b_host} {c.b_port} {asg.b_address}" + ("  (already set)" if asg.kept else ""))
    lines += ["", commands_text(a.commands)]
    return "\n".join(lines)


def cable_rdma(g: ClusterGraph, c: Cable) -> str:
    """Whether a cable carries RDMA: "yes" when both ends' ports do, else why not (the first end that
    does not), "?" when an end's state is not known."""
    for host, port in ((c.a_host, c.a_port), (c.b_host, c.b_port)):
        try:
            state = g.host(host).port(port).rdma
        except ConfigError:
            state = ""
        if state != "yes":
            return f"{state} ({host}:{port})" if state else f"? ({host}:{port})"
    return "yes"


def commands_text(commands: list[Command]) -> str:
    if not commands:
        return "Commands: none needed."
    todo = sum(not c.satisfied for c in commands)
    lines = [f"Commands ({todo} to run, {len(commands) - todo} already satisfied; run them with --apply):"]
    host = None
    for c in commands:
        if c.host != host:
            host = c.host
            lines.append(f"  on {host}:")
        lines.append(f"    {'# done: ' if c.satisfied else ''}{c.shell()}    # {c.why}")
    return "\n".join(lines)


def analysis_json(a: Analysis) -> dict[str, Any]:
    return {
        **a.graph.to_json(),
        "shape": a.shape,
        "order": {"kind": a.order[0], "hosts": a.order[1]} if a.order else None,
        "bridge_loops": [asdict(loop) for loop in a.loops],
        "plan": {"base": a.plan.base, "assignments": [asdict(x) for x in a.plan.assignments]},
        "commands": [{**asdict(c), "shell": c.shell()} for c in a.commands],
    }


def hostfile(a: Analysis, python: str | None = None) -> list[dict[str, Any]]:
    """Launcher hostfile: hosts in ring/chain order (rank neighbours are cable neighbours).

    Each host: name, ssh, addresses (its planned Thunderbolt addresses), ifname (the value for its
    THUNDERBOLT_IFNAME) and cables (this host's end of each cable, with the far end's address). Hosts
    reached over ssh also get `python`, the interpreter their dump just ran with, for `launch` to use.
    """
    names = a.order[1] if a.order else a.graph.names
    result = []
    for name in names:
        host = a.graph.host(name)
        cables = []
        for asg in a.plan.assignments:
            c = asg.cable
            if name in c.hosts:
                peer = c.other(name)
                cables.append({"ifname": c.end(name), "address": asg.address(name), "peer": peer,
                               "peer_ifname": c.end(peer), "peer_address": asg.address(peer),
                               "network": asg.network, "speed_gbps": c.speed_gbps})
        result.append({
            "name": name,
            "ssh": host.ssh or (f"{name}.local" if host.platform == "macos" else name),
            "addresses": [x["address"] for x in cables],
            "ifname": ",".join(dict.fromkeys(x["ifname"] for x in cables)),
            "cables": cables,
        })
        if python and host.ssh:
            result[-1]["python"] = python
    return result
