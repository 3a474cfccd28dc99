"""Local discovery: the thin I/O shell around the parsers, behind a `run` seam for commands."""
from __future__ import annotations

import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ThunderboltError
from .linux import IP_ADDR_COMMAND, build_linux_host, read_sysfs
from .macos import MACOS_COMMANDS, build_macos_host
from .model import Host

REQUIRED_MACOS = ("system_profiler", "hardware_ports", "ifconfig")


@dataclass
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""


RunCommand = Callable[[Sequence[str]], CommandResult]


def subprocess_runner(argv: Sequence[str], timeout: float = 60.0) -> CommandResult:
    """The real `run`: never raises for a failing or missing command, the caller decides."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{argv[0]}: timed out after {timeout:.0f} s")
    return CommandResult(proc.returncode, proc.stdout, proc.stderr)


def local_hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


def discover_local(run: RunCommand = subprocess_runner, *, system: str | None = None,
                   hostname: str | None = None, sysfs_root: Path | str = "/") -> Host:
    """This machine's Thunderbolt ports as a Host (no ports at all is a valid answer)."""
    system = system or platform.system()
    name = hostname or local_hostname()
    if system == "Darwin":
        return _discover_macos(run, name)
    if system == "Linux":
        ip = run(IP_ADDR_COMMAND)
        return build_linux_host(name, read_sysfs(sysfs_root), ip.stdout if ip.returncode == 0 else "[]")
    return Host(name=name, platform=system.lower(), checked=[f"nothing: {system} is not supported"])


def _discover_macos(run: RunCommand, name: str) -> Host:
    outputs: dict[str, str] = {}
    for key, argv in MACOS_COMMANDS.items():
        result = run(argv)
        if result.returncode == 0:
            outputs[key] = result.stdout
        elif key in REQUIRED_MACOS:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ThunderboltError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {detail[0]}")
    return build_macos_host(name, outputs)
