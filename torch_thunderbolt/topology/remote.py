"""Reaching other hosts: gather their dumps over ssh, and run the plan's commands (`--apply`).

Both go through the same `run` seam as local discovery, so tests use a fake runner and no ssh.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError, ThunderboltError
from .discover import RunCommand
from .model import Host, load_host_dump
from .plan import Command

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
REMOTE_DUMP = ["torch-thunderbolt", "topo", "--dump", "-"]


def parse_ssh_list(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise ConfigError("--ssh needs a comma-separated list of hosts, e.g. --ssh mac1.local,mac2.local")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"--ssh lists a host twice: {text}")
    return hosts


def ssh_argv(target: str, remote: list[str]) -> list[str]:
    return ["ssh", *SSH_OPTIONS, target, shlex.join(remote)]


def gather_over_ssh(targets: list[str], run: RunCommand) -> list[Host]:
    """Each target's `topo --dump -`, with `ssh` set to the target so the hostfile can reuse it."""
    hosts = []
    for target in targets:
        result = run(ssh_argv(target, REMOTE_DUMP))
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ThunderboltError(f"ssh {target}: `{' '.join(REMOTE_DUMP)}` failed "
                                   f"(exit {result.returncode}): {detail[0]}")
        host = load_host_dump(result.stdout, f"dump from {target}")
        host.ssh = target
        hosts.append(host)
    return hosts


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
            raise ThunderboltError(f"on {cmd.host}: `{cmd.shell()}` failed (exit {done.returncode}): {detail[0]}")
        result.ran.append(cmd)
    return result
