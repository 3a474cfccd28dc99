"""Reading the launcher's hostfile: JSON describing the Macs a job runs on.

Accepted shapes (the reader is tolerant, the topology tool writes the full form):

    ["mac-a.local", "user@mac-b.local"]                       # plain ssh hosts
    [{"name": "a", "ssh": "user@10.0.0.1", "addresses": ["169.254.1.1"], "ifname": "en2,en3"}, ...]
    {"hosts": [ ...as above... ], "cables": [...]}            # extra top-level keys are ignored

Per host: `name` (default: the ssh host), `ssh` (user@host for ssh), `addresses` (Thunderbolt
addresses, first one used for MASTER_ADDR when this is host 0), `ifname` (string "en2,en3" or a list;
becomes THUNDERBOLT_IFNAME), `exec` ("ssh", "lab" or "local"; default ssh when `ssh` is given, else
local), `lab` (lab name for exec "lab"), `env` (extra environment for ranks on this host), `python`
(absolute path of the interpreter with torch on this ssh host, when it differs from the launcher's), and
optionally `cables` as `topo` writes them ([{"address": my end, "peer": host name, ...}]), which lets
the launcher tell whether host 0's Thunderbolt address is on a cable to every other host.
"""
from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

EXEC_MODES = ("ssh", "lab", "local")


@dataclass(frozen=True)
class Host:
    name: str
    exec: str = "local"
    ssh: str | None = None
    addresses: tuple[str, ...] = ()
    ifname: str | None = None
    lab: str | None = None
    namespace: str | None = None  # exec "lab": the host's network namespace (default <lab>-<name>)
    links: tuple[tuple[str, str], ...] = ()  # (my address, peer name) per cable, when the hostfile says
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None  # ssh hosts: interpreter by absolute path (default: the launcher's --python)

    @property
    def ssh_address(self) -> str | None:
        """The host part of `ssh` (no user@, no [brackets])."""
        if not self.ssh:
            return None
        return self.ssh.rsplit("@", 1)[-1].strip("[]")


def _ifname(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    elif isinstance(value, list) and all(isinstance(p, str) for p in value):
        parts = [p.strip() for p in value]
    else:
        raise ConfigError(f"{where}: 'ifname' must be a string like \"en2,en3\" or a list of names")
    if not all(parts) or any(len(p) > 15 or " " in p for p in parts):
        raise ConfigError(f"{where}: 'ifname' {value!r} is not a comma list of interface names")
    return ",".join(parts)


def _addresses(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: 'addresses' must be a list of IP addresses")
    out = []
    for addr in value:
        text = str(addr).split("/")[0]  # tolerate "169.254.1.1/30" from the address plan
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise ConfigError(f"{where}: {addr!r} in 'addresses' is not an IP address") from None
        out.append(text)
    return tuple(out)


def _python(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"{where}: 'python' must be an absolute path like \"/opt/homebrew/bin/python3.12\" "
                          f"(over ssh a Mac's PATH is only /usr/bin:/bin:/usr/sbin:/sbin), got {value!r}")
    return value


def _links(value: Any) -> tuple[tuple[str, str], ...]:
    """(address, peer) from topo's per-host "cables" list; anything malformed is ignored (optional info)."""
    if not isinstance(value, list):
        return ()
    return tuple((str(c["address"]).split("/")[0], str(c["peer"])) for c in value
                 if isinstance(c, dict) and c.get("address") and c.get("peer"))


def parse_host(entry: Any, index: int, default_exec: str | None = None) -> Host:
    """One hostfile entry; `default_exec` (from --via) overrides what the entry says."""
    where = f"hostfile host #{index}"
    if isinstance(entry, str):
        if not entry.strip():
            raise ConfigError(f"{where}: empty host name")
        entry = {"ssh": entry.strip()}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a string (ssh host) or an object, got {type(entry).__name__}")
    ssh = entry.get("ssh") or entry.get("host")
    mode = default_exec or entry.get("exec") or ("ssh" if ssh else "local")
    if mode not in EXEC_MODES:
        raise ConfigError(f"{where}: 'exec' {mode!r} is invalid: expected one of {', '.join(EXEC_MODES)}")
    if mode == "lab" and not (entry.get("lab") or entry.get("namespace")):
        raise ConfigError(f"{where}: exec 'lab' needs a 'lab' (lab name) or 'namespace' field")
    if mode == "ssh" and not ssh:
        raise ConfigError(f"{where}: exec 'ssh' needs an 'ssh' field like \"user@mac-b.local\"")
    env = entry.get("env") or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{where}: 'env' must be an object of NAME: value")
    name = str(entry.get("name") or ssh or f"host{index}")
    return Host(name=name, exec=mode, ssh=ssh, addresses=_addresses(entry.get("addresses"), where),
                ifname=_ifname(entry.get("ifname", entry.get("ifnames")), where),
                lab=entry.get("lab"), namespace=entry.get("namespace"), links=_links(entry.get("cables")),
                env={str(k): str(v) for k, v in env.items()}, python=_python(entry.get("python"), where))


def parse_hostfile(data: Any, default_exec: str | None = None) -> list[Host]:
    if isinstance(data, dict):
        if "hosts" not in data:
            raise ConfigError("hostfile: expected a JSON list of hosts or an object with a 'hosts' list")
        data = data["hosts"]
    if not isinstance(data, list) or not data:
        raise ConfigError("hostfile: expected a non-empty JSON list of hosts")
    hosts = [parse_host(entry, i, default_exec) for i, entry in enumerate(data)]
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ConfigError(f"hostfile: host names must be unique, got {names}")
    return hosts


def read_hostfile(path: str | os.PathLike, default_exec: str | None = None) -> list[Host]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"hostfile {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"hostfile {path} is not valid JSON: {exc}") from None
    return parse_hostfile(data, default_exec)


def local_hosts() -> list[Host]:
    """No hostfile: one host, this machine."""
    return [Host(name="localhost", exec="local", addresses=("127.0.0.1",))]
