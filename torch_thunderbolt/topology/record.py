"""`topo --record DIR`: this machine's raw discovery outputs, saved as a test fixture for a bug report.

The topology tests read fixtures written by a script in the shape of macOS output (tests/fixtures/topology/
make_fixtures.py); none was recorded on a Mac. This writes what `topo` reads here, unparsed, into
DIR/<hostname>/ under the file names of those fixtures, so a recording can be attached to a bug report and
dropped into tests/fixtures/topology/<scenario>/ as it is. Beside the outputs, `record.json` says which
commands ran, how each ended, the system's version, and whether our parsers read the outputs (and if not,
their error: often the very bug).

A failing command is recorded, never fatal: a recording is most useful exactly when discovery fails.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .discover import RunCommand
from .linux import IP_ADDR_COMMAND, build_linux_host, read_sysfs
from .macos import MACOS_COMMANDS, build_macos_host

# The fixtures' file names, per discovery output (tests/topology/topo_fixtures.py reads these).
MACOS_FILES = {"system_profiler": "system_profiler.json", "hardware_ports": "hardware_ports.txt",
               "services": "services.txt", "ifconfig": "ifconfig.txt",
               "rdma_ctl": "rdma_ctl.txt", "ibv_devinfo": "ibv_devinfo.txt"}  # (the last two where RDMA exists)
LINUX_FILES = {"sysfs": "sysfs.json", "ip_addr": "ip_addr.json"}
RECORD_FILE = "record.json"
SW_VERS = ["/usr/bin/sw_vers"]  # macOS product version and build, for the report


def record(directory: str | Path, run: RunCommand, *, system: str | None = None, hostname: str,
           sysfs_root: str | Path = "/") -> Path:
    """Write this host's discovery outputs into `directory`/`hostname`/; returns that folder."""
    system = system or platform.system()
    folder = Path(directory) / hostname
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--record: cannot create {folder}: {exc.strerror or exc}") from None
    meta: dict[str, Any] = {"hostname": hostname, "system": system, "machine": platform.machine(),
                            "torch_thunderbolt": _version(), "commands": []}
    if system == "Darwin":
        outputs = _run_all(run, {key: argv for key, argv in MACOS_COMMANDS.items()}, meta)
        version = run(SW_VERS)
        meta["os_version"] = version.stdout.strip() if version.returncode == 0 else ""
        for key, text in outputs.items():
            _write(folder / MACOS_FILES[key], text)
        meta["parsed"] = _parse(lambda: build_macos_host(hostname, outputs))
    elif system == "Linux":
        outputs = _run_all(run, {"ip_addr": IP_ADDR_COMMAND}, meta)
        sysfs = read_sysfs(sysfs_root)
        _write(folder / LINUX_FILES["sysfs"], json.dumps(sysfs, indent=2, sort_keys=True) + "\n")
        if "ip_addr" in outputs:
            _write(folder / LINUX_FILES["ip_addr"], outputs["ip_addr"])
        meta["os_version"] = platform.release()
        meta["parsed"] = _parse(lambda: build_linux_host(hostname, sysfs, outputs.get("ip_addr", "[]")))
    else:
        meta["parsed"] = {"ok": False, "error": f"{system}: topo reads only macOS and Linux"}
    _write(folder / RECORD_FILE, json.dumps(meta, indent=2) + "\n")
    return folder


def _run_all(run: RunCommand, commands: dict[str, list[str]], meta: dict[str, Any]) -> dict[str, str]:
    outputs = {}
    for key, argv in commands.items():
        result = run(argv)
        meta["commands"].append({"output": key, "argv": list(argv), "exit": result.returncode,
                                 "stderr": result.stderr.strip()[-2000:]})
        if result.returncode == 0:
            outputs[key] = result.stdout
    return outputs


def _parse(build) -> dict[str, Any]:
    """What our parsers make of the recording: the host's view, or their error."""
    try:
        return {"ok": True, "host": build().to_json()}
    except Exception as exc:  # noqa: BLE001 - any parser failure is what the report is for
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _version() -> str:
    from ..version import __version__

    return __version__


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"--record: cannot write {path}: {exc.strerror or exc}") from None
