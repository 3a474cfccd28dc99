"""Shared-memory segments for the shm transport: create, attach, unlink, and a janitor for crashed jobs.

A segment is a POSIX shared-memory object (`shm_open` + `mmap`; works on Linux and macOS, no reliance on
`/dev/shm` being a directory) or, where POSIX shm is missing or THUNDERBOLT_SHM_DIR is set, an mmap'd
file. Names are `tbt<pid>_<random>`: short enough for macOS's 31-character limit, and they carry the
creator's pid so a janitor can tell a dead job's leftovers from a live one's.

Lifetime: the creator unlinks its segment as soon as every peer has attached (the mappings stay valid),
so only a crash during setup can leave one behind. For that window a marker file per segment (name, pid,
process start time) lives in a per-user directory under the temp dir; `cleanup_stale_segments()` unlinks
the segments of creators that are gone. Python's multiprocessing.shared_memory is not used because its
resource tracker unlinks (and warns about) segments other processes still use.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..platform import Platform, current

try:
    import _posixshmem  # CPython's shm_open/shm_unlink binding (Linux, macOS)
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

PREFIX = "tbt"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)_[0-9a-f]+$")
_SOCK_RE = re.compile(rf"^{PREFIX}(\d+)_[0-9a-f]+\.sock$")  # doorbell listeners (shm_connect)


def marker_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"torch-thunderbolt-shm-{uid}"


def file_dir(configured: str = "") -> Path | None:
    """Directory for file-backed segments: THUNDERBOLT_SHM_DIR (Config.shm_dir, checked by config.py to exist
    and take files), else None to use POSIX shm, or our own directory where POSIX shm is missing."""
    if configured:
        return Path(configured)
    return None if _posixshmem is not None else marker_dir() / "files"


def new_name(pid: int | None = None) -> str:
    return f"{PREFIX}{os.getpid() if pid is None else pid}_{secrets.token_hex(4)}"


def creator_pid(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def _start_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - psutil missing or process gone: liveness falls back to the pid
        return None


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` exists (and, given its start time, is still the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if started is not None:
        now = _start_time(pid)
        if now is not None and abs(now - started) > 1.0:
            return False  # the pid was reused by another process
    return True


@dataclass
class Segment:
    name: str
    size: int
    mm: mmap.mmap
    owner: bool
    path: Path | None  # file-backed segments only
    unlinked: bool = False

    def unlink(self) -> None:
        """Remove the name (idempotent); mappings stay valid until closed."""
        if self.unlinked or not self.owner:
            return
        self.unlinked = True
        _unlink_name(self.name, self.path)
        try:
            (marker_dir() / self.name).unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. Fails quietly while views are still exported (process exit unmaps then)."""
        try:
            self.mm.close()
        except BufferError:
            pass


def _unlink_name(name: str, path: Path | None) -> None:
    try:
        if path is not None:
            path.unlink()
        elif _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _write_marker(name: str, path: Path | None) -> None:
    d = marker_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = {"pid": os.getpid(), "started": _start_time(os.getpid()), "path": str(path) if path else None}
    (d / name).write_text(json.dumps(info))


def create(size: int, shm_dir: str = "") -> Segment:
    """A new zero-filled segment of `size` bytes, owned (and later unlinked) by this process; file-backed
    in `shm_dir` (Config.shm_dir) when given."""
    name = new_name()
    fdir = file_dir(shm_dir)
    path = fdir / name if fdir is not None else None
    _write_marker(name, path)  # before the segment exists: a crash in between leaves nothing unaccounted
    try:
        if path is not None:
            if not shm_dir:  # our own fallback directory; a configured one must exist (a typo is an error)
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        else:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_name(name, path)
        try:
            (marker_dir() / name).unlink()
        except FileNotFoundError:
            pass
        raise
    return Segment(name, size, mm, True, path)


class SizeMismatch(OSError):
    """A peer's segment is smaller than this rank's settings say it should be."""


def attach(name: str, size: int, path: str | None = None) -> Segment:
    """Map a peer's segment (created by `create` in another process)."""
    if path:
        fd = os.open(path, os.O_RDWR)
    else:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        if os.fstat(fd).st_size < size:
            raise SizeMismatch(f"shared-memory segment {name} is smaller than expected ({size} bytes)")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return Segment(name, size, mm, False, Path(path) if path else None)


def cleanup_stale_segments(plat: Platform | None = None) -> list[str]:
    """Unlink segments whose creator process is gone; returns their names. Safe to run any time."""
    removed: list[str] = []
    d = marker_dir()
    seen: set[str] = set()
    if d.is_dir():
        for marker in d.iterdir():
            pid = creator_pid(marker.name)
            if pid is None or not marker.is_file():
                continue
            seen.add(marker.name)
            try:
                info = json.loads(marker.read_text() or "{}")
            except (OSError, ValueError):
                info = {}
            if process_alive(pid, info.get("started")):
                continue
            _unlink_name(marker.name, Path(info["path"]) if info.get("path") else None)
            try:
                marker.unlink()
            except FileNotFoundError:
                pass
            removed.append(marker.name)
        for sock in d.glob(f"{PREFIX}*.sock"):
            m = _SOCK_RE.match(sock.name)
            if m and not process_alive(int(m.group(1))):
                try:
                    sock.unlink()
                except FileNotFoundError:
                    pass
    removed += _sweep_dev_shm(seen, plat)
    return removed


def _sweep_dev_shm(seen: set[str], plat: Platform | None = None) -> list[str]:
    """Where shm objects are listable (Linux: /dev/shm), segments without a marker (marker dir wiped) too.
    macOS cannot list them: there the markers are all we know of."""
    listing = (plat or current()).shm_list_dir
    shm = Path(listing) if listing else None
    if _posixshmem is None or shm is None or not shm.is_dir():
        return []
    out = []
    for entry in shm.iterdir():
        pid = creator_pid(entry.name)
        if pid is None or entry.name in seen or process_alive(pid):
            continue
        _unlink_name(entry.name, None)
        out.append(entry.name)
    return out


def exists(name: str, path: str | None = None) -> bool:
    """Does segment `name` (file-backed: at `path`) still exist? A probe that works where shm objects
    cannot be listed (macOS): open it read-only."""
    if path:
        return Path(path).exists()
    if _posixshmem is None:
        return False
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not ours to open
    os.close(fd)
    return True


def live_segments(plat: Platform | None = None) -> list[str]:
    """Names of our segments that still exist (for tests: after a job, this should be empty of its pids):
    those with a marker that a probe finds, plus, where shm objects are listable (Linux), every listed one."""
    names = set()
    d = marker_dir()
    if d.is_dir():
        for m in d.iterdir():
            if creator_pid(m.name) is None or not m.is_file():
                continue
            try:
                info = json.loads(m.read_text() or "{}")
            except (OSError, ValueError):
                info = {}
            if exists(m.name, info.get("path")):
                names.add(m.name)
    listing = (plat or current()).shm_list_dir
    if listing and Path(listing).is_dir():
        names |= {e.name for e in Path(listing).iterdir() if creator_pid(e.name) is not None}
    return sorted(names)
