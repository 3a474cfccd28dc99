"""Keeping the Thunderbolt ports out of the bridge after a reboot (macOS), and noticing when they are back.

What `topo --apply` does with `networksetup` (a service per port, its address and MTU, the Thunderbolt
Bridge service off) is stored in the system's network preferences and survives a reboot. `ifconfig bridge0
deletem enX` is not: at boot macOS builds `bridge0` again with every Thunderbolt port as a member, and
three Macs in a ring loop again (other tools, EXO among them, re-apply it from a LaunchDaemon for this
reason). `topo --persist` installs a LaunchDaemon that takes this Mac's Thunderbolt ports out of the bridge
at boot and every RECHECK_SECONDS after (a port plugged in later joins the bridge too); `launch` and
`doctor` say when members are back (`bridge_back`).

The plist, the script and the commands are pure functions of their inputs; `install` writes under any root
directory, so tests install into a temporary one.
"""
from __future__ import annotations

import os
import plistlib
import shlex
import sys
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError
from .discover import RunCommand
from .macos import IFCONFIG, parse_ifconfig
from .model import Host

LABEL = "org.torch-thunderbolt.bridge-ports"
LAUNCH_DAEMONS = Path("Library/LaunchDaemons")
LAUNCHCTL = "/bin/launchctl"
RECHECK_SECONDS = 60


def plist_path(root: Path = Path("/")) -> Path:
    return root / LAUNCH_DAEMONS / f"{LABEL}.plist"


def boot_script(bridge: str, ports: Sequence[str]) -> str:
    """sh code taking `ports` out of `bridge`. deletem fails for a port that is not a member (the usual case
    once it ran), so each runs on its own, quietly, and the script succeeds."""
    steps = [f"{IFCONFIG} {shlex.quote(bridge)} deletem {shlex.quote(p)} 2>/dev/null" for p in ports]
    return "; ".join(steps + ["exit 0"])


def daemon_plist(bridge: str, ports: Sequence[str], interval: int = RECHECK_SECONDS) -> bytes:
    """The LaunchDaemon: runs `boot_script` as root when loaded (at every boot) and every `interval` s."""
    if not ports:
        raise ConfigError("no Thunderbolt port to keep out of the bridge")
    return plistlib.dumps({"Label": LABEL, "ProgramArguments": ["/bin/sh", "-c", boot_script(bridge, ports)],
                           "RunAtLoad": True, "StartInterval": interval})


def ports_to_keep_out(host: Host) -> tuple[str, list[str]]:
    """(bridge, ports): every Thunderbolt port of this Mac, which `topo`'s plan gives its own subnet."""
    if host.platform != "macos":
        raise ConfigError(f"--persist is for macOS (this is {host.platform}): on Linux make the bridge change "
                          "with your distribution's network configuration")
    if host.bridge is None:
        raise ConfigError(f"{host.name} has no Thunderbolt Bridge: nothing to keep out of it")
    ports = [p.ifname for p in host.ports if p.ifname]
    if not ports:
        raise ConfigError(f"no Thunderbolt port found on {host.name}")
    return host.bridge.ifname, ports


def install(plist: bytes, root: Path = Path("/")) -> Path:
    """Write the daemon's plist under `root`, replacing one there. launchd loads a LaunchDaemon only when
    its file is owned by root and writable by no one else: 0644, written as root."""
    path = plist_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(plist)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def load_commands(path: Path) -> list[list[str]]:
    """Unload a previous copy (fails harmlessly when none is loaded), then load this one: it runs at once."""
    return [[LAUNCHCTL, "bootout", f"system/{LABEL}"], [LAUNCHCTL, "bootstrap", "system", str(path)]]


def undo_text(path: Path) -> str:
    return f"sudo {LAUNCHCTL} bootout system/{LABEL}; sudo rm {shlex.quote(str(path))}"


def persist_command(python: str = sys.executable, ssh: str | None = None) -> str:
    """How to run `topo --persist` on a Mac: as root through a stock sudo (whose PATH has no venv, so the
    interpreter by absolute path), over `ssh -t` for another Mac (sudo asks for a password there)."""
    local = f"sudo {shlex.quote(python)} -m torch_thunderbolt topo --persist"
    return f"ssh -t {shlex.quote(ssh)} {shlex.quote(local)}" if ssh else local


def bridge_back(bridge: str, members: Sequence[str], in_use: Sequence[str] = (),
                python: str = sys.executable) -> str:
    """What to do when Thunderbolt ports are members of the bridge again ("" when none that matter is):
    `in_use` = the ports a job uses (empty: any member matters). The one text `doctor` and `launch` give."""
    back = [m for m in members if not in_use or m in in_use]
    if not back:
        return ""
    now = "; ".join(f"sudo {IFCONFIG} {bridge} deletem {m}" for m in back)
    return (f"{bridge} holds {', '.join(back)}: with 3+ Macs in a loop every broadcast circles forever, and "
            f"every reboot puts the Thunderbolt ports back after `topo --apply` took them out. Take them out now "
            f"(`{now}`, or `topo --apply`) and keep them out after reboots: `{persist_command(python)}` on each Mac")


def members_now(ifconfig_text: str) -> dict[str, list[str]]:
    """{bridge: member ports} from `ifconfig`'s output."""
    return {name: list(i.members) for name, i in parse_ifconfig(ifconfig_text).items()
            if name.startswith("bridge") and i.members}


def launch_bridge_check(run: RunCommand, in_use: Sequence[str], python: str = sys.executable) -> str:
    """`launch` on a Mac: the advice of `bridge_back` when a port the hostfile's hosts use is in a bridge of
    this Mac again ("" when none is, when the hostfile names no ports, or when ifconfig cannot be read)."""
    if not in_use:
        return ""
    res = run([IFCONFIG])
    if res.returncode != 0:
        return ""
    try:
        bridges = members_now(res.stdout)
    except ConfigError:
        return ""
    return " ".join(filter(None, (bridge_back(b, m, in_use, python) for b, m in sorted(bridges.items()))))
