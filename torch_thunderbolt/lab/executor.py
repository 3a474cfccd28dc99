"""The I/O shell of the lab: runs a plan's commands through a runner seam, and undoes them.

Everything here goes through `runner(argv) -> CommandResult`, so unit tests pass a recording fake and
only the root-only integration tests touch real namespaces.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ConfigError, ThunderboltError
from .blueprint import LabPlan, check_name, namespace_prefix, teardown_commands
from .state import load_state, remove_state, save_state


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""


Runner = Callable[[Sequence[str]], CommandResult]


class LabCommandError(ThunderboltError):
    """A command building or tearing down the lab failed; the message names the command and its stderr."""


def subprocess_runner(argv: Sequence[str]) -> CommandResult:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise ConfigError(f"`{argv[0]}` not found: the lab needs iproute2 (ip, tc) and procps (sysctl)") from None
    return CommandResult(done.returncode, done.stdout, done.stderr)


def running_as_root() -> bool:
    return os.geteuid() == 0


def require_linux(platform: str) -> None:
    """Refuse at once off Linux: every lab action needs network namespaces, iproute2 and tc.

    `platform` is `sys.platform` ("linux", "darwin", ...), passed in so the check is testable anywhere.
    """
    if not platform.startswith("linux"):
        raise ConfigError(f"`lab` needs Linux network namespaces (ip netns, tc), and this host is {platform!r}; "
                          "run the lab on a Linux machine or VM, or use `launch --hostfile` with real Macs")


def require_root(is_root: Callable[[], bool], what: str) -> None:
    if not is_root():
        raise ConfigError(f"`lab {what}` needs root (it creates network namespaces); run it with sudo")


def _check(runner: Runner, argv: Sequence[str]) -> CommandResult:
    result = runner(argv)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise LabCommandError(f"`{' '.join(argv)}` failed (exit {result.returncode}): "
                              f"{detail[-1] if detail else 'no output'}")
    return result


def parse_netns_list(text: str) -> list[str]:
    """`ip netns list` prints `name` or `name (id: N)` per line."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def lab_namespaces(name: str, runner: Runner = subprocess_runner) -> list[str]:
    """The namespaces that exist now and belong to lab `name` (exactly `<name>-mac<digits>`)."""
    pattern = re.compile(re.escape(namespace_prefix(check_name(name))) + r"\d+$")
    listed = parse_netns_list(_check(runner, ["ip", "netns", "list"]).stdout)
    return sorted((n for n in listed if pattern.match(n)), key=lambda n: int(n.rsplit("mac", 1)[1]))


def lab_up(plan: LabPlan, runner: Runner = subprocess_runner, directory: str | os.PathLike | None = None,
           is_root: Callable[[], bool] = running_as_root) -> Path:
    """Build the lab; on any failure remove what was built and raise LabCommandError."""
    require_root(is_root, "up")
    existing = lab_namespaces(plan.name, runner)
    if existing:
        raise ConfigError(f"lab {plan.name!r} already exists ({', '.join(existing)}); "
                          f"run `lab down --name {plan.name}` first or pick another --name")
    # State first: if we die half-way, `down` still knows the full plan (it also matches the prefix).
    path = save_state(plan, directory)
    try:
        for argv in plan.commands:
            _check(runner, argv)
    except BaseException:
        _remove(plan.name, plan.namespaces, runner, directory)
        raise
    return path


def lab_down(name: str, runner: Runner = subprocess_runner, directory: str | os.PathLike | None = None,
             is_root: Callable[[], bool] = running_as_root) -> list[str]:
    """Remove lab `name`: namespaces from its state file and any left with its prefix. -> removed names."""
    require_root(is_root, "down")
    try:
        planned = load_state(name, directory).namespaces
    except ConfigError:
        planned = []  # no or damaged state file: the prefix alone still finds the namespaces
    return _remove(name, planned, runner, directory)


def _remove(name: str, planned: list[str], runner: Runner, directory: str | os.PathLike | None) -> list[str]:
    present = lab_namespaces(name, runner)
    doomed = [n for n in planned if n in present] + [n for n in present if n not in planned]
    for argv in teardown_commands(doomed):
        _check(runner, argv)
    remove_state(name, directory)
    return doomed


def counters_argv(namespace: str, ifnames: Sequence[str]) -> list[str]:
    # `ip netns exec` mounts the namespace's own /sys, so these paths show its interfaces.
    files = [f"/sys/class/net/{dev}/statistics/{kind}_bytes" for dev in ifnames for kind in ("rx", "tx")]
    return ["ip", "netns", "exec", namespace, "cat", *files]


def parse_counters(ifnames: Sequence[str], text: str) -> dict[str, tuple[int, int]]:
    values = [int(v) for v in text.split()]
    if len(values) != 2 * len(ifnames):
        raise LabCommandError(f"expected {2 * len(ifnames)} byte counters, read {len(values)}")
    return {dev: (values[2 * i], values[2 * i + 1]) for i, dev in enumerate(ifnames)}


def read_counters(namespace: str, ifnames: Sequence[str],
                  runner: Runner = subprocess_runner) -> dict[str, tuple[int, int]]:
    """{interface: (rx_bytes, tx_bytes)} inside one namespace."""
    if not ifnames:
        return {}
    return parse_counters(ifnames, _check(runner, counters_argv(namespace, ifnames)).stdout)


def qdisc_kinds(namespace: str, dev: str, runner: Runner = subprocess_runner) -> list[str]:
    """Root qdisc kinds on a device (e.g. ['tbf']), for status and for tests that check shaping."""
    out = _check(runner, ["tc", "-n", namespace, "qdisc", "show", "dev", dev]).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("qdisc ") and " root " in line]
