"""Helpers that turn the fixtures into Hosts (through the real parsers). The fixtures are written by
make_fixtures.py in the shape of macOS output, not recorded on a Mac; an owner's `topo --record` output has
the same layout."""
from __future__ import annotations

import json
from pathlib import Path

from torch_thunderbolt.topology.linux import build_linux_host
from torch_thunderbolt.topology.macos import build_macos_host
from torch_thunderbolt.topology.model import Host
from torch_thunderbolt.topology.record import MACOS_FILES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
FILES = MACOS_FILES  # the names `topo --record` writes: a recording drops in as a scenario's host folder


def mac_outputs(scenario: str, host: str) -> dict[str, str]:
    """What each of MACOS_COMMANDS printed on this Mac (a command left out: it failed or does not exist)."""
    folder = FIXTURES / scenario / host
    return {key: (folder / name).read_text() for key, name in FILES.items() if (folder / name).exists()}


def mac_host(scenario: str, host: str) -> Host:
    return build_macos_host(host, mac_outputs(scenario, host))


def scenario_hosts(scenario: str) -> list[Host]:
    folders = sorted(p for p in (FIXTURES / scenario).iterdir() if p.is_dir())
    if (folders[0] / "sysfs.json").exists():
        return [build_linux_host(p.name, json.loads((p / "sysfs.json").read_text()),
                                 (p / "ip_addr.json").read_text()) for p in folders]
    return [mac_host(scenario, p.name) for p in folders]


def write_dumps(hosts: list[Host], folder: Path) -> list[str]:
    paths = []
    for h in hosts:
        path = folder / f"{h.name}.json"
        path.write_text(json.dumps(h.to_json()))
        paths.append(str(path))
    return paths
