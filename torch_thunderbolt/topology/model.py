"""Data model of a Thunderbolt cluster: hosts, their ports, the cables between them.

Everything here round-trips through plain JSON (`to_json` / `from_json`) because a host's discovery
result travels as a file (`topo --dump`) or over ssh before the cluster graph is built elsewhere.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

DUMP_FORMAT = "torch-thunderbolt-topo/1"


@dataclass
class Port:
    """One Thunderbolt port of a host and what its cable reaches."""

    name: str  # hardware port name: "Thunderbolt 1" on macOS, "thunderbolt0" on Linux
    ifname: str = ""  # network interface carrying IP over this port ("en2"), "" if none
    receptacle: str = ""  # physical port number as the OS reports it ("1", "2", ...)
    uuid: str = ""  # this end's bus/domain UUID; the far end lists it in its own items
    status: str = "unknown"  # "connected" | "empty" | "unknown"
    speed_gbps: float = 0.0
    speed_text: str = ""
    peer_uuid: str = ""  # bus UUID of the computer at the other end, "" if not a computer
    peer_name: str = ""  # what the far end calls itself (a Mac model, a display, a drive)
    devices: list[str] = field(default_factory=list)  # non-computer devices on this port
    addresses: list[str] = field(default_factory=list)  # IPv4 "10.77.0.1/30"
    mtu: int = 0
    link_up: bool = False
    # RDMA over this port: "yes", "no: <why>" or "" where not known (not a Mac, or older dumps)
    rdma: str = ""

    @property
    def has_computer(self) -> bool:
        return bool(self.peer_uuid)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: Any) -> "Port":
        return _build(Port, data, "port")


@dataclass
class Bridge:
    """The Thunderbolt Bridge (`bridge0`): joining ports at layer 2 is what makes loops dangerous."""

    ifname: str = "bridge0"
    members: list[str] = field(default_factory=list)
    active: bool = False
    service_enabled: bool | None = None  # None: not known (e.g. Linux, or services not listed)
    addresses: list[str] = field(default_factory=list)
    service: str = ""  # macOS network service name, localized ("Thunderbolt-Brücke"); "" on Linux


@dataclass
class Host:
    name: str
    platform: str = "macos"  # "macos" | "linux"
    model: str = ""
    ports: list[Port] = field(default_factory=list)
    bridge: Bridge | None = None
    # network service name -> enabled; None when not known. Needed to make commands idempotent.
    services: dict[str, bool] | None = None
    # addresses on non-Thunderbolt interfaces, to keep the address plan clear of them
    other_addresses: list[str] = field(default_factory=list)
    ssh: str = ""  # how to reach it ("user@host"); filled in by the gatherer, not by discovery
    checked: list[str] = field(default_factory=list)  # what discovery looked at, for messages

    def port(self, ifname_or_name: str) -> Port:
        for p in self.ports:
            if ifname_or_name in (p.ifname, p.name):
                return p
        raise ConfigError(f"host {self.name!r} has no Thunderbolt port {ifname_or_name!r}")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["format"] = DUMP_FORMAT
        return data

    @staticmethod
    def from_json(data: Any) -> "Host":
        return _host_from_json(data)


@dataclass
class Cable:
    """One cable between two hosts, identified by the port (interface) at each end."""

    a_host: str
    a_port: str  # ifname if known, else port name
    b_host: str
    b_port: str
    speed_gbps: float = 0.0

    @property
    def hosts(self) -> tuple[str, str]:
        return (self.a_host, self.b_host)

    def other(self, host: str) -> str:
        return self.b_host if host == self.a_host else self.a_host

    def end(self, host: str) -> str:
        """The port this cable uses on `host`."""
        return self.a_port if host == self.a_host else self.b_port

    def label(self) -> str:
        return f"{self.a_host}:{self.a_port} <-> {self.b_host}:{self.b_port}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: Any) -> "Cable":
        return _build(Cable, data, "cable")


@dataclass
class ClusterGraph:
    hosts: list[Host]
    cables: list[Cable]
    warnings: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(f"no host named {name!r} in the cluster (have: {', '.join(self.names)})")

    def neighbours(self, name: str) -> set[str]:
        return {c.other(name) for c in self.cables if name in c.hosts and c.a_host != c.b_host}

    def cables_between(self, a: str, b: str) -> list[Cable]:
        return [c for c in self.cables if {a, b} == set(c.hosts)]

    def to_json(self) -> dict[str, Any]:
        return {
            "hosts": [h.to_json() for h in self.hosts],
            "cables": [c.to_json() for c in self.cables],
            "warnings": list(self.warnings),
        }

    @staticmethod
    def from_json(data: Any) -> "ClusterGraph":
        if not isinstance(data, dict) or "hosts" not in data or "cables" not in data:
            raise ConfigError("a cluster graph must be a JSON object with 'hosts' and 'cables'")
        return ClusterGraph(
            hosts=[Host.from_json(h) for h in _as_list(data["hosts"], "hosts")],
            cables=[Cable.from_json(c) for c in _as_list(data["cables"], "cables")],
            warnings=[str(w) for w in data.get("warnings", [])],
        )


def load_host_dump(text: str, source: str) -> Host:
    """Parse a `topo --dump` file; `source` names it in error messages."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not a topology dump (invalid JSON: {exc.msg} at line {exc.lineno})") from None
    try:
        return Host.from_json(data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _as_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"expected a list for {what!r}, got {type(value).__name__}")
    return value


def _build(cls: type, data: Any, what: str) -> Any:
    """Construct a flat dataclass from a dict, naming unknown/missing fields in the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object for a {what}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in data.items() if k in fields}
    for key, value in values.items():
        expected = _expected_type(fields[key])
        if expected is not None and not isinstance(value, expected):
            raise ConfigError(f"bad {what}: {key!r} should be {expected[0].__name__}, got {value!r}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"bad {what}: {exc}") from None


def _expected_type(f: dataclasses.Field) -> tuple[type, ...] | None:
    """The JSON type a plain field must have, judged from its default (None: not checked here)."""
    if f.type == "str":  # required fields have no default to judge by
        return (str,)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool):
        return (bool,)
    if isinstance(default, float):
        return (float, int)
    for kind in (int, str, list):
        if isinstance(default, kind):
            return (kind,)
    return None


def _host_from_json(data: Any) -> Host:
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object describing a host, got {type(data).__name__}")
    fmt = data.get("format", DUMP_FORMAT)
    if fmt != DUMP_FORMAT:
        raise ConfigError(f"unsupported dump format {fmt!r} (expected {DUMP_FORMAT!r})")
    if not isinstance(data.get("name"), str) or not data["name"]:
        raise ConfigError("a host needs a non-empty 'name'")
    fields = dict(data)
    fields.pop("format", None)
    fields["ports"] = [Port.from_json(p) for p in _as_list(data.get("ports", []), "ports")]
    if data.get("bridge") is not None:
        fields["bridge"] = _build(Bridge, data["bridge"], "bridge")
    services = data.get("services")
    if services is not None and not isinstance(services, dict):
        raise ConfigError("'services' must be an object mapping service name to enabled")
    return _build(Host, fields, "host")
