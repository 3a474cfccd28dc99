"""What a test run may leave behind, and how to see it: child processes, rank processes, listening sockets,
lab namespaces, shared-memory segments and doorbell sockets; and what one process holds (`holdings`: file
descriptors, threads, shared memory, fake-fabric objects), for tests that re-create groups in one process.

Two users: the runner in `testing.ranks`, which checks after each shared-memory run that its ranks left no
segment behind, and the test suite's end-of-session check (tests/conftest.py), which compares what exists
at the end with a `Snapshot` taken before the first test (other people's labs and jobs are not ours).
"""
from __future__ import annotations

import functools
import gc
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from torch_thunderbolt.platform import Platform, current
from torch_thunderbolt.transport import shm_segment

LAB_NAMESPACE = re.compile(r"^(tb[a-z0-9-]*)-mac\d+$")  # lab namespaces: <name>-mac<i>, names start with tb
SHM_PREFIXES = ("tb", "torch_thunderbolt")

# Python's own helper, started once per process by multiprocessing (shared_memory, spawn); it exits with
# pytest and unlinks what a crashed user left. Not something a test leaked.
_ALLOWED_CHILDREN = ("multiprocessing.resource_tracker",)


@dataclass(frozen=True)
class Snapshot:
    """What already existed before the tests started: not theirs to clean up."""
    namespaces: frozenset[str]
    shm: frozenset[str]


def take_snapshot() -> Snapshot:
    return Snapshot(frozenset(lab_namespaces()), frozenset(shm_entries()))


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


def segments_and_doorbells(pids: set[int] | None = None) -> set[str]:
    """Our segments and doorbell sockets that currently exist on this host: of any job, or only those
    created by `pids` (names carry the creator's pid; other jobs may be running on this host meanwhile)."""
    names = set(shm_segment.live_segments())
    d = shm_segment.marker_dir()
    if d.is_dir():
        names |= {p.name for p in d.glob(f"{shm_segment.PREFIX}*.sock")}
    if pids is None:
        return names
    return {n for n in names if shm_segment.creator_pid(n.removesuffix(".sock")) in pids}


def new_with_dead_creator(before: set[str]) -> list[str]:
    """Segments and doorbell sockets that appeared since `before` and whose creator is dead: a finished run's
    (every rank has exited by then). Those of live processes belong to other jobs setting up concurrently."""
    left = []
    for name in segments_and_doorbells() - before:
        pid = shm_segment.creator_pid(name.removesuffix(".sock"))
        if pid is None or not shm_segment.process_alive(pid):
            left.append(name)
    return sorted(left)


def holdings(fabric: Any = None, plat: Platform | None = None) -> dict[str, Any]:
    """What this process holds now: open file descriptors (`fds`, and `fd_kinds`: how many of each kind,
    for telling a leak apart), OS threads (`threads`, and the Python ones' names in `py_threads`), shared
    memory (`shm`: segments and doorbell sockets it created that still exist; `shm_maps`: shared-memory
    objects it still maps, its peers' included), the package's objects still alive (`objects`: instances of
    its classes, and partials of its functions such as exit hooks), its RSS in MB, and with a fake verbs fabric (a
    testing.fake_verbs.Fabric) what it holds there (`fabric`: queue pairs, memory regions, PDs ...)."""
    plat = plat or current()
    proc = psutil.Process()
    kinds = _fd_kinds(proc, plat)
    shm_dir = plat.shm_list_dir
    maps = {m.path.removesuffix(" (deleted)") for m in proc.memory_maps(grouped=True)
            if shm_dir and m.path.startswith(shm_dir + "/")} if plat.has_proc else set()
    return {"fds": sum(kinds.values()), "fd_kinds": dict(sorted(kinds.items())), "threads": proc.num_threads(),
            "py_threads": sorted(t.name for t in threading.enumerate()),
            "shm": len(segments_and_doorbells({os.getpid()})), "shm_maps": len(maps),
            "objects": package_objects(),
            "rss_mb": round(proc.memory_info().rss / 2**20, 1),
            "fabric": fabric.held_by(os.getpid()) if fabric is not None else {}}


def package_objects(package: str = "torch_thunderbolt") -> int:
    """How many objects the garbage collector tracks that are instances of `package`'s classes or partials
    of its functions (an exit hook registered per group is one): a count that grows with each group made
    and ended means something keeps what should have gone."""
    prefix = package + "."
    n = 0
    for o in gc.get_objects():
        module = getattr(type(o), "__module__", "")
        if isinstance(o, functools.partial):
            module = getattr(o.func, "__module__", "")
        # (some extension types answer __module__ with a descriptor, not a string)
        if isinstance(module, str) and (module == package or module.startswith(prefix)):
            n += 1
    return n


def _fd_kinds(proc: psutil.Process, plat: Platform) -> Counter[str]:
    """How many descriptors this process has open, by kind. Linux names each one in /proc/self/fd (a
    symlink to "socket:[123]", "pipe:[45]", a path). macOS's /dev/fd holds fdesc nodes, not symlinks, so
    readlink fails for every one: there the count is psutil's (`num_fds`, from proc_pidinfo), files and
    sockets are named by psutil, and the rest (pipes, kqueues) counted as "other"."""
    kinds: Counter[str] = Counter()
    if plat.has_proc:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # the listing's own descriptor, closed by now
            kinds[re.sub(r"[:\[]?\d+\]?$", "", target) if not target.startswith("/") else _path_kind(target, plat)] += 1
        return kinds
    total = proc.num_fds()
    for f in proc.open_files():
        kinds[_path_kind(f.path, plat)] += 1
    connections = getattr(proc, "net_connections", None) or proc.connections  # (psutil < 6)
    for c in connections(kind="all"):
        if c.fd >= 0:
            kinds["socket:"] += 1
    named = sum(kinds.values())
    if total > named:
        kinds["other"] += total - named
    return kinds


def _path_kind(path: str, plat: Platform) -> str:
    """A file descriptor's path as a kind: shared memory and our doorbell sockets by kind, others as is."""
    if plat.shm_list_dir and path.startswith(plat.shm_list_dir + "/"):
        return "shm"
    return path


def child_processes() -> list[str]:
    found = []
    for p in psutil.Process().children(recursive=True):
        cmd = " ".join(_cmdline(p))
        if not any(a in cmd for a in _ALLOWED_CHILDREN):
            found.append(f"{p.pid} {cmd[:200]}")
    return found


def processes_mentioning(path: str) -> list[str]:
    """Processes anywhere (orphans included) whose command line mentions `path`, or whose working directory
    is inside it: the runner starts every rank in its run's directory, so this finds a rank of any of this
    session's runs even when its program lives elsewhere."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        argv = _cmdline(p)
        cwd = _cwd(p)
        if any(path in a for a in argv) or cwd == path or cwd.startswith(path.rstrip(os.sep) + os.sep):
            found.append(f"{p.pid} {' '.join(argv)[:200]}")
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


def settled(check: Callable[[], list[str]], seconds: float = 5.0) -> list[str]:
    """`check()` until it finds nothing (processes being reaped, sockets being closed) or time runs out."""
    end = time.monotonic() + seconds
    while True:
        gc.collect()  # stores and transports closed only when collected
        found = check()
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.2)


def session_leftovers(before: Snapshot, run_dir: Path) -> dict[str, list[str]]:
    """Every check of the end of a test session, by name; an empty list is a pass. `run_dir` is the
    session's base temporary directory (every rank of the session ran inside it)."""
    base = str(run_dir)
    return {
        "child processes": settled(child_processes),
        "rank processes of this run": settled(lambda: processes_mentioning(base)),
        "listening sockets": settled(listening_sockets),
        "lab namespaces": settled(lambda: sorted(lab_namespaces() - before.namespaces)),
        "shared-memory segments": settled(lambda: sorted(shm_entries() - before.shm)),
    }


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _cwd(p: psutil.Process) -> str:
    try:
        return p.cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return ""
