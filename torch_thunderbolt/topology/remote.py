"""Reaching other hosts: gather their dumps over ssh, and run the plan's commands (`--apply`).

Both go through the same `run` seam as local discovery, so tests use a fake runner and no ssh.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError, ThunderboltError
from .discover import RunCommand
from .model import Host, load_host_dump
from .addressing import Command

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
NOT_FOUND = 127  # what a shell exits with when the program does not exist
# `sudo -n` over ssh cannot ask for a password: say how to allow exactly what --apply runs.
SUDO_HINT = (". --apply runs networksetup and ifconfig with `sudo -n` on {host}, which cannot ask for a password "
             "there: allow exactly these commands without one (the sudoers line in the README's first-day "
             "section, added with `sudo visudo -f /etc/sudoers.d/torch-thunderbolt` on {host}), or run "
             "the printed commands on {host} yourself")


def remote_dump_argv(python: str) -> list[str]:
    """The dump command for an ssh host, run by the interpreter's absolute path.

    A non-login ssh shell on a Mac has PATH=/usr/bin:/bin:/usr/sbin:/sbin: no `torch-thunderbolt`
    script there, and its `python3` is Apple's 3.9 without torch. So the remote runs the same
    interpreter path as here (the usual case: the same install on every Mac), or `--python`.
    """
    return [python, "-m", "torch_thunderbolt", "topo", "--dump", "-"]


def parse_ssh_list(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise ConfigError("--ssh needs a comma-separated list of hosts, e.g. --ssh mac1.local,mac2.local")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"--ssh lists a host twice: {text}")
    return hosts


def ssh_argv(target: str, remote: list[str]) -> list[str]:
    return ["ssh", *SSH_OPTIONS, target, shlex.join(remote)]


def gather_over_ssh(targets: list[str], run: RunCommand, python: str = sys.executable) -> list[Host]:
    """Each target's `topo --dump -`, with `ssh` set to the target so the hostfile can reuse it."""
    if not python.startswith("/"):
        raise ConfigError(f"--python {python!r} must be an absolute path: over ssh a Mac's PATH is only "
                          "/usr/bin:/bin:/usr/sbin:/sbin, where `python3` is Apple's 3.9 without torch")
    hosts = []
    remote = remote_dump_argv(python)
    for target in targets:
        result = run(ssh_argv(target, remote))
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ThunderboltError(f"ssh {target}: `{shlex.join(remote)}` failed "
                                   f"(exit {result.returncode}): {detail[0]}{_dump_hint(target, python, result)}")
        host = load_host_dump(result.stdout, f"dump from {target}")
        host.ssh = target
        hosts.append(host)
    return hosts


def _dump_hint(target: str, python: str, result) -> str:
    """The next step when the remote interpreter is missing or lacks the package."""
    text = result.stderr + result.stdout
    if result.returncode == NOT_FOUND:
        return (f". There is no Python at {python} on {target}: install torch-thunderbolt there at the same "
                "path, or pass --python with the path of the interpreter that has it on the --ssh hosts")
    if "No module named" in text:
        return (f". {python} on {target} has no torch_thunderbolt: install it into that interpreter, or pass "
                "--python with the path of one that has it")
    return ""


@dataclass
class ApplyResult:
    ran: list[Command]
    skipped: list[Command]  # already satisfied
    unreachable: list[Command]  # host neither local nor reachable over ssh


def apply_commands(commands: list[Command], run: RunCommand, local: str, ssh: dict[str, str],
                   is_root: bool, log: Callable[[str], None] = lambda _: None) -> ApplyResult:
    """Run the unsatisfied commands: locally for `local`, over ssh for hosts in `ssh`.

    Stops at the first failure (later commands usually depend on earlier ones) with an error that
    names the host, the command and what it printed.
    """
    result = ApplyResult([], [], [])
    for cmd in commands:
        if cmd.satisfied:
            result.skipped.append(cmd)
            continue
        if cmd.host == local:
            argv = list(cmd.argv) if is_root else ["sudo", *cmd.argv]
        elif cmd.host in ssh:
            argv = ssh_argv(ssh[cmd.host], ["sudo", "-n", *cmd.argv])  # -n: fail, don't hang on a prompt
        else:
            result.unreachable.append(cmd)
            continue
        log(f"[{cmd.host}] {cmd.shell()}")
        done = run(argv)
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            hint = SUDO_HINT.format(host=cmd.host) if cmd.host != local and "password" in detail[0] else ""
            raise ThunderboltError(f"on {cmd.host}: `{cmd.shell()}` failed (exit {done.returncode}): {detail[0]}{hint}")
        result.ran.append(cmd)
    return result
