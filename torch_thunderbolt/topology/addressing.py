"""Address plan (one /30 per cable) and the exact commands that apply it, each marked satisfied or not.

Addresses already in place are kept when they fit the plan, so re-running after adding a cable does not
renumber the others, and re-running after `--apply` finds every command already satisfied.
"""
from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

from ..errors import ConfigError
from .macos import BRIDGE_SERVICE, IFCONFIG, NETWORKSETUP
from .model import Cable, ClusterGraph, Host, Port

# 10.77.0.0/16: private, and away from the ranges home routers (192.168.x), Docker (172.17+), VPNs
# (10.0-10.10, 10.8) and CGNAT/Tailscale (100.64/10) hand out. --base overrides; overlaps are refused.
DEFAULT_BASE = "10.77.0.0/16"
PREFIX = 30
NETMASK = "255.255.255.252"


@dataclass
class Assignment:
    cable: Cable
    network: str  # "10.77.0.0/30"
    a_address: str  # on cable.a_host / a_port
    b_address: str
    kept: bool = False  # already configured like this before planning

    def address(self, host: str) -> str:
        return self.a_address if host == self.cable.a_host else self.b_address


@dataclass
class AddressPlan:
    base: str
    assignments: list[Assignment] = field(default_factory=list)

    def for_host(self, host: str) -> list[tuple[str, str]]:
        """[(ifname, address)] this host must carry."""
        return [(a.cable.end(host), a.address(host)) for a in self.assignments if host in a.cable.hosts]


@dataclass
class Command:
    host: str
    argv: list[str]
    why: str
    satisfied: bool = False

    def shell(self) -> str:
        return "sudo " + shlex.join(self.argv)


def parse_base(base: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(base, strict=True)
    except ValueError as exc:
        raise ConfigError(f"--base {base!r} is not a network like {DEFAULT_BASE} ({exc})") from None
    if net.version != 4 or net.prefixlen > PREFIX:
        raise ConfigError(f"--base must be an IPv4 network of /{PREFIX} or larger, like {DEFAULT_BASE}")
    return net


def plan_addresses(graph: ClusterGraph, base: str = DEFAULT_BASE) -> AddressPlan:
    net = parse_base(base)
    _check_overlap(graph, net)
    taken: set[ipaddress.IPv4Network] = set()
    plan = AddressPlan(base=str(net))
    todo = []
    for cable in graph.cables:
        kept = _existing(graph, cable, net, taken)
        if kept is None:
            todo.append(cable)
        else:
            taken.add(ipaddress.ip_network(kept.network))
            plan.assignments.append(kept)
    free = (s for s in net.subnets(new_prefix=PREFIX) if s not in taken)
    for cable in todo:
        subnet = next(free, None)
        if subnet is None:
            raise ConfigError(f"--base {base} has room for {len(taken)} cables' subnets, "
                              f"{len(graph.cables)} needed: choose a larger network")
        hosts = list(subnet.hosts())
        plan.assignments.append(Assignment(cable, str(subnet), str(hosts[0]), str(hosts[1])))
    order = {id(c): i for i, c in enumerate(graph.cables)}
    plan.assignments.sort(key=lambda a: order[id(a.cable)])
    return plan


def _check_overlap(graph: ClusterGraph, net: ipaddress.IPv4Network) -> None:
    for host in graph.hosts:
        for addr in host.other_addresses:
            iface = _interface(addr, host)
            if iface.version == 4 and iface.network.overlaps(net):
                raise ConfigError(f"--base {net} overlaps {addr} already used on {host.name} "
                                  f"(not a Thunderbolt port): choose another --base")


def _existing(graph: ClusterGraph, cable: Cable, net, taken) -> Assignment | None:
    """The cable's current /30 if both ends already sit in the same free /30 inside the base."""
    a = _port_addrs(graph.host(cable.a_host), cable.a_port)
    b = _port_addrs(graph.host(cable.b_host), cable.b_port)
    for ia in a:
        for ib in b:
            if (ia.network == ib.network and ia.network.prefixlen == PREFIX and ia.ip != ib.ip
                    and ia.network.subnet_of(net) and ia.network not in taken
                    and ia.ip in ia.network.hosts() and ib.ip in ib.network.hosts()):
                return Assignment(cable, str(ia.network), str(ia.ip), str(ib.ip), kept=True)
    return None


def _port_addrs(host: Host, port: str) -> list[ipaddress.IPv4Interface]:
    return [_interface(a, host) for a in host.port(port).addresses]


def _interface(addr: str, host: Host) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    try:
        return ipaddress.ip_interface(addr)
    except ValueError:
        raise ConfigError(f"host {host.name!r} lists {addr!r}, expected an address like 10.77.0.1/30") from None


def plan_commands(graph: ClusterGraph, plan: AddressPlan, mtu: int | None = None) -> list[Command]:
    """Every command needed on every host, in the order to run them; `satisfied` ones can be skipped."""
    if mtu is not None and not 576 <= mtu <= 16384:
        raise ConfigError(f"--mtu {mtu} is out of range: expected 576..16384 (9000 is the usual jumbo MTU)")
    commands: list[Command] = []
    for host in graph.hosts:
        wanted = plan.for_host(host.name)
        if not wanted:
            continue
        builder = _macos_commands if host.platform == "macos" else _linux_commands
        commands.extend(builder(host, wanted, mtu))
    return commands


def _macos_commands(host: Host, wanted: list[tuple[str, str]], mtu: int | None) -> list[Command]:
    out: list[Command] = []
    add = lambda argv, why, ok: out.append(Command(host.name, argv, why, ok))  # noqa: E731
    bridge = host.bridge
    if bridge is not None:
        off = bridge.service_enabled is False or (bridge.service_enabled is None and not bridge.members)
        add([NETWORKSETUP, "-setnetworkserviceenabled", bridge.service or BRIDGE_SERVICE, "off"],
            "stop bridging the Thunderbolt ports together (loops cause broadcast storms)", off)
        for ifname, _ in wanted:
            if ifname in bridge.members:  # deletem on a non-member fails, so only list real members
                add([IFCONFIG, bridge.ifname, "deletem", ifname], f"take {ifname} out of {bridge.ifname} now",
                    False)
    services = host.services
    for ifname, address in wanted:
        port = host.port(ifname)
        if services is not None:
            add([NETWORKSETUP, "-createnetworkservice", port.name, port.name],
                f"a network service of its own for {port.name} ({ifname})", port.name in services)
            if services.get(port.name) is False:
                add([NETWORKSETUP, "-setnetworkserviceenabled", port.name, "on"], f"enable {port.name}", False)
        add([NETWORKSETUP, "-setmanual", port.name, address, NETMASK],
            f"{ifname} gets {address}/{PREFIX}", _has(port, address))
        if mtu:
            add([NETWORKSETUP, "-setMTU", ifname, str(mtu)], f"MTU {mtu} on {ifname}", port.mtu == mtu)
    return out


def _linux_commands(host: Host, wanted: list[tuple[str, str]], mtu: int | None) -> list[Command]:
    out: list[Command] = []
    bridge = host.bridge
    for ifname, address in wanted:
        port = host.port(ifname)
        if bridge is not None and ifname in bridge.members:
            out.append(Command(host.name, ["ip", "link", "set", ifname, "nomaster"],
                               f"take {ifname} out of {bridge.ifname}"))
        out.append(Command(host.name, ["ip", "addr", "replace", f"{address}/{PREFIX}", "dev", ifname],
                           f"{ifname} gets {address}/{PREFIX}", _has(port, address)))
        if mtu:
            out.append(Command(host.name, ["ip", "link", "set", ifname, "mtu", str(mtu)],
                               f"MTU {mtu} on {ifname}", port.mtu == mtu))
        out.append(Command(host.name, ["ip", "link", "set", ifname, "up"], f"bring {ifname} up", port.link_up))
    return out


def _has(port: Port, address: str) -> bool:
    return f"{address}/{PREFIX}" in port.addresses
