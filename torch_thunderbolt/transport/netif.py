"""Which local addresses to use: from THUNDERBOLT_IFNAME, else the interface that reaches the store host.

Pure functions over an interface table ({name: [ipv4, ...]}) so the choice is testable; `local_interfaces`
is the only I/O.
"""
from __future__ import annotations

import ipaddress
import socket

from ..errors import ConfigError
from ..platform import Platform, current

Interfaces = dict[str, list[str]]


def local_interfaces() -> Interfaces:
    import psutil

    out: Interfaces = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            out[name] = v4
    return out


def loopback_ifname(platform: "str | Platform | None" = None) -> str:
    """The loopback interface's name, for GLOO_SOCKET_IFNAME / THUNDERBOLT_IFNAME in local runs.

    Linux calls it `lo`; macOS and the BSDs `lo0`, and gloo fails to start when given a name that does not
    exist. `platform` is a Platform or a system name ("linux", "darwin") (default: this machine's), so both cases are
    testable.
    """
    if platform is None:
        platform = current()
    elif isinstance(platform, str):
        platform = Platform.for_system(platform)
    return platform.loopback


def _is_ip(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def resolve_ifnames(entries: tuple[str, ...], table: Interfaces) -> list[str]:
    """Map THUNDERBOLT_IFNAME entries (interface names or IPv4 addresses) to addresses, in order."""
    out: list[str] = []
    known = {a for addrs in table.values() for a in addrs}
    for e in entries:
        if _is_ip(e):
            if e not in known:
                raise ConfigError(f"THUNDERBOLT_IFNAME: address {e} is not assigned to any interface here "
                                  f"(have: {_describe(table)})")
            out.append(e)
        elif e in table:
            out.append(table[e][0])
        else:
            raise ConfigError(f"THUNDERBOLT_IFNAME: no interface named {e!r} with an IPv4 address here "
                              f"(have: {_describe(table)})")
    return list(dict.fromkeys(out))


def _describe(table: Interfaces) -> str:
    return ", ".join(f"{n}={'/'.join(a)}" for n, a in sorted(table.items())) or "none"


def address_towards(host: str) -> str:
    """The local address the kernel would use to reach `host` (no packet is sent: UDP connect only)."""
    try:
        target = socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"cannot resolve the rendezvous host {host!r}: {exc}") from exc
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"no route to the rendezvous host {host} ({target}): {exc}; "
                              "set THUNDERBOLT_IFNAME") from exc


def choose_addresses(ifnames: tuple[str, ...], store_host: str | None, table: Interfaces | None = None) -> list[str]:
    if ifnames:
        return resolve_ifnames(ifnames, table if table is not None else local_interfaces())
    if store_host:
        return [address_towards(store_host)]
    return ["127.0.0.1"]


def network_of(address: str, masks: dict[str, str] | None = None) -> str:
    """CIDR of the network `address` sits in (its interface's netmask), e.g. "10.77.0.1/30"."""
    if masks is None:
        masks = local_netmasks()
    mask = masks.get(address) or ("255.0.0.0" if address.startswith("127.") else "255.255.255.255")
    return str(ipaddress.IPv4Interface(f"{address}/{mask}").network)


def local_netmasks() -> dict[str, str]:
    import psutil

    return {a.address: a.netmask for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and a.netmask}
