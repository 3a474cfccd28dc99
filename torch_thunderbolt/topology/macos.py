"""Parsers for the macOS command outputs that describe Thunderbolt links, and a Host built from them.

Pure functions over text so they run (and are tested) on Linux against recorded-style fixtures.
Commands read (see `MACOS_COMMANDS`): `system_profiler SPThunderboltDataType -json` (ports, speeds,
the bus UUID of the Mac at the other end), `networksetup -listallhardwareports` (port -> enX),
`networksetup -listallnetworkservices` (which services exist / are disabled) and `ifconfig`; where macOS
has RDMA over Thunderbolt (26.2+), `rdma_ctl status` and `ibv_devinfo -v` say which ports carry it.

Hardware port and service names are localized ("Thunderbolt-Brücke" on a German Mac, "Pont Thunderbolt"
on a French one), so the bridge is found by its device (`bridgeN`) and the Thunderbolt ports by their
number and `ifconfig` bridge membership, never by an English name; the names found are what the
commands of the address plan use. Commands are run by absolute path: over ssh a Mac's PATH is only
/usr/bin:/bin:/usr/sbin:/sbin, and a user's PATH may put other tools of the same name first.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..platform import RDMA_CTL
from .model import Bridge, Host, Port
from .speed import link_speed_gbps

SYSTEM_PROFILER = "/usr/sbin/system_profiler"
NETWORKSETUP = "/usr/sbin/networksetup"
IFCONFIG = "/sbin/ifconfig"
# Apple's RDMA tools (macOS 26.2+), assumed in /usr/bin beside the system's others (exo runs them by name);
# missing or failing, a port's RDMA state is simply not known.
IBV_DEVINFO = "/usr/bin/ibv_devinfo"
MACOS_COMMANDS: dict[str, list[str]] = {
    "system_profiler": [SYSTEM_PROFILER, "SPThunderboltDataType", "-json"],
    "hardware_ports": [NETWORKSETUP, "-listallhardwareports"],
    "services": [NETWORKSETUP, "-listallnetworkservices"],
    "ifconfig": [IFCONFIG],
    "rdma_ctl": [RDMA_CTL, "status"],
    "ibv_devinfo": [IBV_DEVINFO, "-v"],
}
BRIDGE_SERVICE = "Thunderbolt Bridge"  # the English default name; only a fallback for old dumps
_BRIDGE_DEVICE = re.compile(r"^bridge\d+$")
_EN_DEVICE = re.compile(r"^en\d+$")
_TRAILING_NUMBER = re.compile(r"(\d+)\s*$")
_THUNDERBOLT_N = re.compile(r"^thunderbolt\W*(\d+)$", re.IGNORECASE)  # not "Thunderbolt Ethernet Slot 1"
_RECEPTACLE = re.compile(r"^receptacle_\d+_tag$")
_STATUS = {"receptacle_connected": "connected", "receptacle_no_devices_connected": "empty"}


@dataclass
class Interface:
    """What `ifconfig` says about one interface."""

    name: str
    up: bool = False
    mtu: int = 0
    active: bool = False  # "status: active"
    addresses: list[str] = field(default_factory=list)  # "10.77.0.1/30"
    members: list[str] = field(default_factory=list)  # bridges only


def parse_system_profiler(text: str) -> tuple[str, list[Port]]:
    """(this Mac's model, its Thunderbolt ports) from `system_profiler SPThunderboltDataType -json`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"system_profiler output is not JSON ({exc.msg} at line {exc.lineno})") from None
    buses = data.get("SPThunderboltDataType") if isinstance(data, dict) else None
    if not isinstance(buses, list):
        raise ConfigError("system_profiler output has no 'SPThunderboltDataType' list")
    model, ports = "", []
    for bus in buses:
        if not isinstance(bus, dict):
            raise ConfigError("system_profiler: each SPThunderboltDataType entry must be an object")
        model = model or str(bus.get("device_name_key", ""))
        port = _bus_port(bus)
        if port is not None:
            ports.append(port)
    return model, ports


def _bus_port(bus: dict[str, Any]) -> Port | None:
    tags = [v for k, v in bus.items() if _RECEPTACLE.match(k) and isinstance(v, dict)]
    if not tags:
        return None  # a bus without a receptacle is not a port we can cable
    tag = tags[0]
    receptacle = str(tag.get("receptacle_id_key", "")).strip()
    if not receptacle:
        raise ConfigError(f"system_profiler: bus {bus.get('_name', '?')!r} has no receptacle_id_key")
    items = bus.get("_items") or []
    if not isinstance(items, list):
        raise ConfigError(f"system_profiler: '_items' of bus {bus.get('_name', '?')!r} is not a list")
    speed_text = str(tag.get("current_speed_key") or _item_speed(items))
    port = Port(
        name=f"Thunderbolt {receptacle}",
        receptacle=receptacle,
        uuid=str(bus.get("domain_uuid_key", "")),
        status=_STATUS.get(str(tag.get("receptacle_status_key", "")), "unknown"),
        speed_text=speed_text,
        speed_gbps=link_speed_gbps(speed_text),
    )
    for item in items:
        _add_item(port, item)
    if port.peer_uuid or port.devices:
        port.status = "connected"
    return port


def _item_speed(items: list) -> str:
    for item in items:
        for key, value in item.items() if isinstance(item, dict) else ():
            if key.startswith("receptacle_") and isinstance(value, dict) and value.get("current_speed_key"):
                return str(value["current_speed_key"])
    return ""


def _add_item(port: Port, item: Any) -> None:
    """A computer at the far end shows its bus UUID; displays, docks and drives do not."""
    if not isinstance(item, dict):
        raise ConfigError("system_profiler: a device under '_items' is not an object")
    name = str(item.get("device_name_key") or item.get("_name") or "unknown device")
    if item.get("domain_uuid_key") and not port.peer_uuid:
        port.peer_uuid = str(item["domain_uuid_key"])
        port.peer_name = name
    else:
        port.devices.append(name)
    for child in item.get("_items") or []:  # daisy-chained devices behind this one
        _add_item_as_device(port, child)


def _add_item_as_device(port: Port, item: Any) -> None:
    if isinstance(item, dict):
        port.devices.append(str(item.get("device_name_key") or item.get("_name") or "unknown device"))
        for child in item.get("_items") or []:
            _add_item_as_device(port, child)


def parse_hardware_ports(text: str) -> dict[str, str]:
    """{"Thunderbolt 1": "en2", "Thunderbolt Bridge": "bridge0", ...} from -listallhardwareports."""
    ports: dict[str, str] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Hardware Port:"):
            current = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and current is not None:
            ports[current] = line.split(":", 1)[1].strip()
            current = None
    if not ports and text.strip():
        raise ConfigError("networksetup -listallhardwareports: no 'Hardware Port:'/'Device:' lines found")
    return ports


def parse_network_services(text: str) -> dict[str, bool]:
    """{service: enabled} from -listallnetworkservices; a leading '*' marks a disabled service."""
    services: dict[str, bool] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("An asterisk"):
            continue
        services[line.lstrip("*").strip()] = not line.startswith("*")
    return services


_IF_HEADER = re.compile(r"^([A-Za-z0-9_.]+): flags=[0-9a-fA-F]+<([^>]*)>(?:.*\bmtu (\d+))?")
_INET = re.compile(r"^\s+inet (\d+\.\d+\.\d+\.\d+) netmask (0x[0-9a-fA-F]{8}|\d+\.\d+\.\d+\.\d+)")


def parse_ifconfig(text: str) -> dict[str, Interface]:
    """Interfaces, their IPv4 addresses, MTU, status and (for bridges) member ports."""
    interfaces: dict[str, Interface] = {}
    current: Interface | None = None
    for line in text.splitlines():
        header = _IF_HEADER.match(line)
        if header:
            current = Interface(header.group(1), up="UP" in header.group(2).split(","),
                                mtu=int(header.group(3) or 0))
            interfaces[current.name] = current
            continue
        if current is None or not line.strip():
            continue
        _ifconfig_detail(current, line)
    if not interfaces and text.strip():
        raise ConfigError("ifconfig output has no 'NAME: flags=...' interface lines")
    return interfaces


def _ifconfig_detail(iface: Interface, line: str) -> None:
    inet = _INET.match(line)
    stripped = line.strip()
    if inet:
        iface.addresses.append(f"{inet.group(1)}/{_prefix_len(inet.group(2))}")
    elif stripped.startswith("member:"):
        iface.members.append(stripped.split()[1])
    elif stripped.startswith("status:"):
        iface.active = stripped.split(":", 1)[1].strip() == "active"


def _prefix_len(mask: str) -> int:
    value = int(mask, 16) if mask.startswith("0x") else int.from_bytes(bytes(int(p) for p in mask.split(".")), "big")
    return bin(value).count("1")


def thunderbolt_bridge(hw: dict[str, str], ifaces: dict[str, Interface]) -> tuple[str, str] | None:
    """(hardware port name, device) of the Thunderbolt Bridge, found by its `bridgeN` device.

    A Mac normally lists one bridge; with several, the one whose members are `enN` ports wins, then the
    one whose name says Thunderbolt, then the lowest number.
    """
    bridges = [(name, dev) for name, dev in hw.items() if _BRIDGE_DEVICE.match(dev)]
    if not bridges:
        return None

    def rank(item: tuple[str, str]) -> tuple[bool, bool, int]:
        name, dev = item
        members = ifaces.get(dev, Interface(dev)).members
        return (not any(_EN_DEVICE.match(m) for m in members), "thunderbolt" not in name.lower(),
                int(dev[len("bridge"):]))

    return min(bridges, key=rank)


def thunderbolt_port_devices(hw: dict[str, str], ifaces: dict[str, Interface]) -> dict[str, tuple[str, str]]:
    """{receptacle number: (hardware port name, enN)} for the Thunderbolt ports of `hw`.

    A Thunderbolt port is an `enN` hardware port named "Thunderbolt N" (the brand is not translated),
    or one whose name ends in a number and that is a member of the Thunderbolt Bridge.
    """
    bridge = thunderbolt_bridge(hw, ifaces)
    members = set(ifaces.get(bridge[1], Interface(bridge[1])).members) if bridge else set()
    out: dict[str, tuple[str, str]] = {}
    for name, dev in hw.items():
        if not _EN_DEVICE.match(dev):
            continue
        number = _THUNDERBOLT_N.match(name.strip()) or (_TRAILING_NUMBER.search(name) if dev in members else None)
        if number is not None:
            out.setdefault(str(int(number.group(1))), (name, dev))
    return out


def build_macos_host(name: str, outputs: dict[str, str]) -> Host:
    """A Host from the raw outputs of `MACOS_COMMANDS` (keyed the same way)."""
    missing = [key for key in ("system_profiler", "hardware_ports", "ifconfig") if key not in outputs]
    if missing:
        raise ConfigError(f"macOS discovery needs the output of: {', '.join(missing)}")
    model, ports = parse_system_profiler(outputs["system_profiler"])
    hw = parse_hardware_ports(outputs["hardware_ports"])
    ifaces = parse_ifconfig(outputs["ifconfig"])
    services = parse_network_services(outputs["services"]) if "services" in outputs else None
    by_receptacle = thunderbolt_port_devices(hw, ifaces)
    for port in ports:
        # The localized hardware port name is what networksetup's service commands take.
        port.name, port.ifname = by_receptacle.get(port.receptacle, (port.name, ""))
        info = ifaces.get(port.ifname)
        if info is not None:
            port.addresses, port.mtu, port.link_up = list(info.addresses), info.mtu, info.up and info.active
    enabled = parse_rdma_ctl(outputs["rdma_ctl"]) if "rdma_ctl" in outputs else None
    devices = parse_ibv_devinfo(outputs["ibv_devinfo"]) if "ibv_devinfo" in outputs else None
    for port in ports:
        port.rdma = rdma_state(port, enabled, devices)
    bridge = _bridge(thunderbolt_bridge(hw, ifaces), ifaces, services)
    used = {p.ifname for p in ports} | ({bridge.ifname} if bridge else set())
    other = [a for i in ifaces.values() if i.name not in used and not i.name.startswith("lo")
             for a in i.addresses]
    return Host(name=name, platform="macos", model=model, ports=ports, bridge=bridge,
                services=services, other_addresses=other,
                checked=[" ".join(cmd) for cmd in MACOS_COMMANDS.values()])


def _bridge(found: tuple[str, str] | None, ifaces: dict[str, Interface],
            services: dict[str, bool] | None) -> Bridge | None:
    if found is None:
        return None
    service, ifname = found
    info = ifaces.get(ifname, Interface(ifname))
    enabled = None if services is None else services.get(service, False)
    return Bridge(ifname=ifname, members=list(info.members), active=info.up and info.active,
                  service_enabled=enabled, addresses=list(info.addresses), service=service)


# --- RDMA over Thunderbolt (macOS 26.2+) ------------------------------------------------------------------

def parse_rdma_ctl(text: str) -> bool | None:
    """`rdma_ctl status`: True for "enabled", False for "disabled", None for anything else."""
    words = text.strip().lower().split()
    if "disabled" in words:
        return False
    return True if "enabled" in words else None


_HCA = re.compile(r"^\s*hca_id:\s*(\S+)")
_PORT = re.compile(r"^\s*port:\s*(\d+)")
_STATE = re.compile(r"^\s*state:\s*(\S+)")
_GID = re.compile(r"^\s*GID\[\s*\d+\]:\s*([0-9a-fA-F:.]+)")


def parse_ibv_devinfo(text: str) -> dict[str, tuple[str, list[str]]]:
    """`ibv_devinfo -v` (rdma-core's format): device -> (state of port 1, the IPv4 addresses of its
    IPv4-mapped GIDs)."""
    out: dict[str, tuple[str, list[str]]] = {}
    device, port = "", 0
    for line in text.splitlines():
        if m := _HCA.match(line):
            device, port = m.group(1), 0
            out[device] = ("", [])
        elif not device:
            continue
        elif m := _PORT.match(line):
            port = int(m.group(1))
        elif port == 1 and (m := _STATE.match(line)):
            out[device] = (m.group(1), out[device][1])
        elif port == 1 and (m := _GID.match(line)):
            try:
                mapped = ipaddress.IPv6Address(m.group(1)).ipv4_mapped
            except ValueError:
                continue
            if mapped is not None:
                out[device][1].append(str(mapped))
    return out


def rdma_state(port: Port, enabled: bool | None, devices: "dict[str, tuple[str, list[str]]] | None") -> str:
    """Whether `port` carries RDMA ("yes"), why not ("no: ..."), or "" when the tools said nothing. The
    device of interface enX is rdma_enX; RDMA needs Thunderbolt 5 (rdma devices also appear on Thunderbolt
    4 ports, where they do not work: exo #1813)."""
    if enabled is None and devices is None:
        return ""
    if 0 < port.speed_gbps <= 40:
        return "no: Thunderbolt 4 or slower (RDMA needs Thunderbolt 5 at both ends)"
    if enabled is False:
        return "no: not enabled (`rdma_ctl enable` in Recovery, then reboot)"
    if devices is None:
        return "no: `ibv_devinfo` failed (a wedged port hangs it: reboot)"
    state, ipv4 = devices.get(f"rdma_{port.ifname}", ("", []))
    if not port.ifname or f"rdma_{port.ifname}" not in devices:
        return f"no: no RDMA device for {port.ifname or 'this port'}"
    if state != "PORT_ACTIVE":
        return f"no: port {state or 'state unknown'}"
    if not ipv4:
        return f"no: no IPv4-mapped GID (give {port.ifname} an IPv4 address)"
    return "yes"
