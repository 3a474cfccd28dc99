"""Pure planning of an emulated cluster: namespaces, cables, addresses, routes and the commands to build it.

`plan_lab` does no I/O; `executor` runs the commands it lists. Each cable gets its own /30 (as tools
that disable the Thunderbolt bridge do), so hosts are reachable on every cable address; non-neighbours
go through routes via the hosts in between.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from .cabling import forwarding_hosts, subnet_routes, topology_edges

DEFAULT_BASE = "10.213.0.0/16"
CONGESTION_CONTROLS = ("reno", "bbr", "cubic")
MAX_CABLES = 8
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)bit$")
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Cable:
    """One emulated Thunderbolt cable: a veth pair with its own /30."""

    index: int
    a: int  # host index of one end (the lower one)
    b: int
    k: int  # which of the cables between this pair (0, 1, ...)
    subnet: str
    addr_a: str
    addr_b: str
    ifname_a: str
    ifname_b: str


@dataclass(frozen=True)
class Route:
    host: int
    subnet: str
    via: str
    dev: str


@dataclass(frozen=True)
class LabPlan:
    name: str
    topology: str
    hosts: list[str]  # host names: mac0, mac1, ...
    namespaces: list[str]  # one per host, all starting with namespace_prefix(name)
    cables: list[Cable]
    routes: list[Route]
    forwarders: list[int]
    rate: str | None
    mtu: int | None
    cc: str | None
    commands: list[list[str]] = field(default_factory=list)


def namespace_prefix(name: str) -> str:
    """Every namespace of lab `name` is `<name>-mac<i>`; `down` matches exactly this shape."""
    return f"{name}-mac"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"lab name {name!r} is invalid: expected a lowercase letter then up to 23 of [a-z0-9-]")
    return name


def parse_rate(rate: str | None) -> tuple[str | None, int]:
    """Normalise a tc-style rate ('10gbit', '500mbit'); None/'none' means unshaped. -> (text, bit/s)."""
    if rate is None or str(rate).strip().lower() in ("", "none", "0"):
        return None, 0
    text = str(rate).strip().lower()
    match = _RATE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"rate {rate!r} is invalid: expected e.g. 10gbit, 500mbit, 100kbit or none")
    return text, int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


GSO_PACKET = 64 << 10  # the largest packet the kernel's TCP hands a qdisc at once (GSO/TSO)


def tbf_burst_bytes(bits_per_second: int) -> int:
    """Bucket depth: about 0.5 ms at the rate (625 KB at 10gbit holds the rate on this box), and never less
    than four GSO packets. tbf cannot pass a packet larger than its bucket whole: with the 62 KB bucket that
    0.5 ms gives at 1gbit, plain sockets sending on every cable of a 3-host ring at once carried 0.44 of the
    rate; with 125 KB 0.93, with 256 KB 0.95 (the most TCP carries over a 1500-byte MTU is ~0.96)."""
    return max(int(bits_per_second / 8 / 2000), 4 * GSO_PACKET)


def _check_args(cables: int, mtu: int | None, cc: str | None) -> None:
    if not isinstance(cables, int) or not 1 <= cables <= MAX_CABLES:
        raise ConfigError(f"--cables must be an integer from 1 to {MAX_CABLES}, got {cables!r}")
    if mtu is not None and (not isinstance(mtu, int) or not 68 <= mtu <= 65535):
        raise ConfigError(f"--mtu must be an integer from 68 to 65535, got {mtu!r}")
    if cc is not None and cc not in CONGESTION_CONTROLS:
        raise ConfigError(f"--cc {cc!r} is invalid: expected one of {', '.join(CONGESTION_CONTROLS)}")


def _subnets(base: str, count: int) -> list[ipaddress.IPv4Network]:
    try:
        net = ipaddress.IPv4Network(base, strict=True)
    except ValueError as exc:
        raise ConfigError(f"address base {base!r} is invalid: expected a network like {DEFAULT_BASE}") from exc
    if not net.is_private or net.prefixlen > 30:
        raise ConfigError(f"address base {base} must be a private IPv4 network of /30 or larger")
    available = 2 ** (30 - net.prefixlen)
    if count > available:
        raise ConfigError(f"address base {base} holds {available} cables, the lab needs {count}")
    first = int(net.network_address)
    return [ipaddress.IPv4Network((first + 4 * i, 30)) for i in range(count)]


def ifname(peer: int, k: int) -> str:
    """Interface name on a host for its k-th cable to `peer`: 'tb<peer>_<k>', at most 15 chars."""
    return f"tb{peer}_{k}"


def plan_cables(edges: list[tuple[int, int]], cables: int, base: str) -> list[Cable]:
    pairs = [(a, b, k) for a, b in edges for k in range(cables)]
    out = []
    for i, ((a, b, k), net) in enumerate(zip(pairs, _subnets(base, len(pairs)))):
        first = int(net.network_address)
        out.append(Cable(index=i, a=a, b=b, k=k, subnet=str(net),
                         addr_a=str(ipaddress.IPv4Address(first + 1)),
                         addr_b=str(ipaddress.IPv4Address(first + 2)),
                         ifname_a=ifname(b, k), ifname_b=ifname(a, k)))
    return out


def plan_routes(hosts: int, edges: list[tuple[int, int]], cables: list[Cable]) -> list[Route]:
    """Routes for every cable subnet a host is not on, via the first cable to the chosen neighbour."""
    first_cable = {(c.a, c.b): c for c in cables if c.k == 0}
    by_pair = {pair: [c for c in cables if (c.a, c.b) == pair] for pair in edges}
    routes = []
    for h, table in enumerate(subnet_routes(hosts, edges)):
        for e, hop in sorted(table.items()):
            link = first_cable[(min(h, hop), max(h, hop))]
            via, dev = (link.addr_b, link.ifname_a) if h == link.a else (link.addr_a, link.ifname_b)
            for target in by_pair[edges[e]]:
                routes.append(Route(host=h, subnet=target.subnet, via=via, dev=dev))
    return routes


def plan_lab(hosts: int, topology: str, cables: int = 1, rate: str | None = None, mtu: int | None = None,
             *, name: str = "tblab", cc: str | None = None, base: str = DEFAULT_BASE) -> LabPlan:
    """The whole lab as data, with `commands`: the `ip`/`tc`/`sysctl` argv lists that build it in order."""
    check_name(name)
    _check_args(cables, mtu, cc)
    rate_text, _ = parse_rate(rate)
    edges = topology_edges(hosts, topology)
    cable_list = plan_cables(edges, cables, base)
    names = [f"mac{i}" for i in range(hosts)]
    plan = LabPlan(name=name, topology=topology, hosts=names,
                   namespaces=[namespace_prefix(name) + str(i) for i in range(hosts)],
                   cables=cable_list, routes=plan_routes(hosts, edges, cable_list),
                   forwarders=forwarding_hosts(hosts, edges), rate=rate_text, mtu=mtu, cc=cc)
    return replace(plan, commands=build_commands(plan))


def build_commands(plan: LabPlan) -> list[list[str]]:
    ns = plan.namespaces
    cmds: list[list[str]] = []
    for n in ns:
        cmds.append(["ip", "netns", "add", n])
        cmds.append(["ip", "-n", n, "link", "set", "dev", "lo", "up"])
    for c in plan.cables:
        cmds.append(["ip", "link", "add", c.ifname_a, "netns", ns[c.a], "type", "veth",
                     "peer", "name", c.ifname_b, "netns", ns[c.b]])
        for host, dev, addr in ((c.a, c.ifname_a, c.addr_a), (c.b, c.ifname_b, c.addr_b)):
            cmds.extend(_end_commands(plan, ns[host], dev, addr))
    for r in plan.routes:
        cmds.append(["ip", "-n", ns[r.host], "route", "add", r.subnet, "via", r.via, "dev", r.dev])
    for h in plan.forwarders:
        cmds.append(["ip", "netns", "exec", ns[h], "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    if plan.cc:
        for n in ns:
            cmds.append(["ip", "netns", "exec", n, "sysctl", "-qw",
                         f"net.ipv4.tcp_congestion_control={plan.cc}"])
    return cmds


def _end_commands(plan: LabPlan, ns: str, dev: str, addr: str) -> list[list[str]]:
    cmds = [["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev]]
    link = ["ip", "-n", ns, "link", "set", "dev", dev]
    if plan.mtu:
        link += ["mtu", str(plan.mtu)]
    cmds.append(link + ["up"])
    if plan.rate:
        burst = tbf_burst_bytes(parse_rate(plan.rate)[1])
        cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", plan.rate,
                     "burst", str(burst), "latency", "1ms"])
    return cmds


def teardown_commands(namespaces: list[str]) -> list[list[str]]:
    """Deleting a namespace deletes its veth ends, and with them the peers: nothing else to undo."""
    return [["ip", "netns", "del", n] for n in namespaces]
