"""Linux thunderbolt-net discovery: sysfs (read into a plain dict) plus `ip -j addr`.

The kernel names a host-to-host link an XDomain, `/sys/bus/thunderbolt/devices/<domain>-<route>`, whose
`unique_id` is the remote host's UUID and `device_name` its name; the local host router `<domain>-0`
carries this host's UUID. `/sys/class/net/thunderboltN/device` points at the XDomain's service
(`0-1.0`), which is how an interface is tied to the peer behind it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .model import Bridge, Host, Port
from .speed import link_speed_gbps

DEVICES_DIR = "sys/bus/thunderbolt/devices"
NET_DIR = "sys/class/net"
_ATTRS = ("unique_id", "device_name", "vendor_name", "rx_speed", "rx_lanes", "tx_speed", "tx_lanes")
IP_ADDR_COMMAND = ["ip", "-j", "addr"]


def read_sysfs(root: Path | str = "/") -> dict[str, Any]:
    """Snapshot of the sysfs parts we use: {"devices": {name: {attr: text}}, "net": {ifname: service}}.

    `root` is a parameter so tests can point it at a fake tree.
    """
    root = Path(root)
    devices: dict[str, dict[str, str]] = {}
    devdir = root / DEVICES_DIR
    if devdir.is_dir():
        for entry in sorted(devdir.iterdir()):
            attrs = {a: _read(entry / a) for a in _ATTRS if (entry / a).is_file()}
            if attrs:
                devices[entry.name] = attrs
    net: dict[str, str] = {}
    netdir = root / NET_DIR
    if netdir.is_dir():
        for entry in sorted(netdir.glob("thunderbolt*")):
            target = entry / "device"
            net[entry.name] = os.path.basename(os.path.realpath(target)) if target.exists() else ""
    return {"devices": devices, "net": net}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def parse_ip_addr(text: str) -> dict[str, dict[str, Any]]:
    """{ifname: {"addresses": [...], "mtu": int, "up": bool, "master": str}} from `ip -j addr`."""
    try:
        data = json.loads(text or "[]")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"`ip -j addr` output is not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise ConfigError("`ip -j addr` output must be a JSON list of interfaces")
    result = {}
    for link in data:
        if not isinstance(link, dict) or "ifname" not in link:
            raise ConfigError("`ip -j addr`: every entry needs an 'ifname'")
        addrs = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                 if a.get("family") == "inet" and "local" in a and "prefixlen" in a]
        result[link["ifname"]] = {
            "addresses": addrs,
            "mtu": int(link.get("mtu", 0)),
            "up": link.get("operstate") == "UP" or "LOWER_UP" in link.get("flags", []),
            "master": link.get("master", ""),
        }
    return result


def build_linux_host(name: str, sysfs: dict[str, Any], ip_addr_json: str) -> Host:
    devices = sysfs.get("devices", {})
    links = parse_ip_addr(ip_addr_json)
    ports = [_port(ifname, service, devices, links.get(ifname, {}))
             for ifname, service in sorted(sysfs.get("net", {}).items())]
    tb = {p.ifname for p in ports}
    masters = sorted({links[i]["master"] for i in tb if i in links and links[i]["master"]})
    bridge = None
    if masters:
        br = masters[0]
        bridge = Bridge(ifname=br, members=sorted(i for i in tb if links.get(i, {}).get("master") == br),
                        active=links.get(br, {}).get("up", False),
                        addresses=links.get(br, {}).get("addresses", []))
    other = [a for i, info in links.items() if i not in tb and i not in masters and i != "lo"
             for a in info["addresses"]]
    model = next((d.get("device_name", "") for k, d in devices.items() if k.endswith("-0")), "")
    return Host(name=name, platform="linux", model=model, ports=ports, bridge=bridge,
                other_addresses=other, checked=[f"/{DEVICES_DIR}/*/{{unique_id,device_name,vendor_name}}",
                                                f"/{NET_DIR}/thunderbolt*", " ".join(IP_ADDR_COMMAND)])


def _port(ifname: str, service: str, devices: dict[str, dict[str, str]], link: dict[str, Any]) -> Port:
    xdomain = service.rsplit(".", 1)[0] if "." in service else service  # "0-1.0" -> "0-1"
    domain, _, route = xdomain.partition("-")
    remote = devices.get(xdomain, {})
    local = devices.get(f"{domain}-0", {})
    return Port(
        name=ifname, ifname=ifname, receptacle=route,
        uuid=local.get("unique_id", ""),
        status="connected" if remote else "unknown",
        speed_text=remote.get("rx_speed", ""),
        speed_gbps=_xdomain_speed(remote),
        peer_uuid=remote.get("unique_id", ""),
        peer_name=" ".join(x for x in (remote.get("vendor_name"), remote.get("device_name")) if x),
        addresses=list(link.get("addresses", [])), mtu=link.get("mtu", 0), link_up=link.get("up", False),
    )


def _xdomain_speed(remote: dict[str, str]) -> float:
    """sysfs gives the speed per lane ("20.0 Gb/s") and the lane count separately."""
    per_lane = link_speed_gbps(remote.get("rx_speed", ""))
    lanes = remote.get("rx_lanes", "1") or "1"
    if not lanes.isdigit():
        raise ConfigError(f"sysfs rx_lanes is {lanes!r}, expected a number")
    return per_lane * int(lanes)
