"""What a test run may leave behind: child processes, listening sockets, lab namespaces, shared-memory
segments."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import psutil

from torch_thunderbolt.platform import Platform, current
from torch_thunderbolt.transport import shm_segment

LAB_NAMESPACE = re.compile(r"^(tb[a-z0-9-]*)-mac\d+$")  # lab namespaces: <name>-mac<i>, names start with tb
SHM_PREFIXES = ("tb", "torch_thunderbolt")


@dataclass(frozen=True)
class Snapshot:
    namespaces: frozenset
    shm: frozenset


def lab_namespaces() -> set[str]:
    if shutil.which("ip") is None:
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if LAB_NAMESPACE.match(n)}


def shm_entries(plat: Platform | None = None) -> set[str]:
    """Our shared-memory segments that exist now. macOS cannot list shm objects (no /dev/shm): there the
    segments' markers, each probed, are what we see; where the platform lists them, every listed one too."""
    plat = plat or current()
    names = set(shm_segment.live_segments(plat))
    if plat.shm_list_dir:
        try:
            names |= {n for n in os.listdir(plat.shm_list_dir) if n.startswith(SHM_PREFIXES)}
        except FileNotFoundError:
            pass
    return names


def take_snapshot() -> Snapshot:
    return Snapshot(frozenset(lab_namespaces()), frozenset(shm_entries()))


# Python's own helper, started once per process by multiprocessing (shared_memory, spawn); it exits with
# pytest and unlinks what a crashed user left. Not something a test leaked.
_ALLOWED_CHILDREN = ("multiprocessing.resource_tracker",)


def child_processes() -> list[str]:
    found = []
    for p in psutil.Process().children(recursive=True):
        cmd = " ".join(_cmdline(p))
        if not any(a in cmd for a in _ALLOWED_CHILDREN):
            found.append(f"{p.pid} {cmd[:200]}")
    return found


def processes_mentioning(path: str) -> list[str]:
    """Processes anywhere (orphans included) whose command line mentions `path` (our rank scripts)."""
    found = []
    for p in psutil.process_iter():
        if p.pid != os.getpid() and any(path in a for a in _cmdline(p)):
            found.append(f"{p.pid} {' '.join(_cmdline(p))[:200]}")
    return found


def listening_sockets() -> list[str]:
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append(f"pid {p.pid} listens on {c.laddr.ip}:{c.laddr.port}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []
