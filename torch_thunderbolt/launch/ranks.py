"""Pure construction of every rank's environment and command line (no processes started here).

The environment matches what torchrun gives a worker (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT, ...), plus THUNDERBOLT_IFNAME/GLOO_SOCKET_IFNAME from the hostfile
so both our backend and gloo use the Thunderbolt interfaces rather than Wi-Fi or LAN, plus the job's
THUNDERBOLT_SECRET. That one is kept apart (`RankSpec.private_env`): it never goes on a command line, where
`ps` would show it to every user of the launching and the remote host; ssh ranks read it from stdin.

A bare `python`/`python3`/`python3.12` at the start of the command becomes an interpreter by absolute
path. On ssh hosts: the host's `python`, else the launcher's --python, else its own sys.executable (a
non-login ssh shell on a Mac has PATH=/usr/bin:/bin:/usr/sbin:/sbin, with no `python` and a `python3`
that is Apple's 3.9 without torch); the remote script checks the program exists before starting it. On
local and lab hosts (this machine): the launcher's own interpreter, since under a stock `sudo` the PATH is
sudo's `secure_path`, where `python` is not the venv's (or does not exist).
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ConfigError
from .hostfile import Host

DEFAULT_MASTER_PORT = 29500
# Environment variables that must not appear in any argv (see the module docstring).
PRIVATE_VARS = ("THUNDERBOLT_SECRET",)


@dataclass(frozen=True)
class RankSpec:
    rank: int
    host: Host
    local_rank: int
    env: dict[str, str]  # what the launcher sets for this rank
    argv: list[str]  # what to start on this machine
    cwd: str | None = None  # for local/lab ranks (ssh ranks `cd` inside argv)
    env_in_argv: bool = False  # ssh: env travels inside the remote command, not the local process
    label: str = field(default="")
    # Never in argv: the local process env for local/lab ranks, one line each on the ssh channel's stdin
    # for ssh ranks (the remote script reads them in this order). repr=False: not in logs or tracebacks.
    private_env: dict[str, str] = field(default_factory=dict, repr=False)

    def stdin_preamble(self) -> bytes:
        """What the launcher writes to an ssh rank's stdin before anything else."""
        return "".join(f"{v}\n" for v in self.private_env.values()).encode() if self.env_in_argv else b""


def master_address(hosts: Sequence[Host]) -> str:
    """An address of host 0 that every rank can reach, for the rendezvous store (control traffic only).

    Macs with one /30 per cable do not forward between cables, so beyond a pair host 0's Thunderbolt
    address is usually not reachable from every host. When the hostfile's cable list shows that, the
    store goes on host 0's ssh address instead; data still flows over THUNDERBOLT_IFNAME. Without cable
    information the first Thunderbolt address is trusted (the lab routes between all its addresses).
    """
    first = hosts[0]
    if first.exec == "local" and all(h.exec == "local" for h in hosts):
        return first.addresses[0] if first.addresses else "127.0.0.1"
    others = {h.name for h in hosts[1:]}
    if first.links and first.exec != "lab":
        for addr in first.addresses:
            if others <= {peer for a, peer in first.links if a == addr}:
                return addr
        if first.ssh_address:
            return first.ssh_address
    if first.addresses:
        return first.addresses[0]
    if first.ssh_address:
        return first.ssh_address
    raise ConfigError(f"cannot choose MASTER_ADDR: host {first.name!r} has no 'addresses' and no 'ssh' "
                      "(add its Thunderbolt address to the hostfile or pass --master-addr)")


def rank_env(hosts: Sequence[Host], host_index: int, local_rank: int, nproc_per_host: int, master_addr: str,
             master_port: int, extra_env: Mapping[str, str] | None = None,
             inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun-compatible variables for one rank; host env then `extra_env` (--env) override them."""
    host = hosts[host_index]
    world = len(hosts) * nproc_per_host
    rank = host_index * nproc_per_host + local_rank
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
           "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc_per_host),
           "GROUP_RANK": str(host_index), "GROUP_WORLD_SIZE": str(len(hosts)), "ROLE_RANK": str(rank),
           "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default"}
    if host.ifname:
        env["THUNDERBOLT_IFNAME"] = host.ifname
        # Gloo opens one context per listed device and every rank must list the same number, so a
        # middle host with two cables would hang it: give gloo only the first interface.
        env["GLOO_SOCKET_IFNAME"] = host.ifname.split(",")[0]
    # As torchrun does: K ranks sharing one machine's cores must not each take all of them. The hosts of a
    # lab (and "local" ones) are all this machine: an emulated Mac's rank would otherwise run torch's
    # kernels on every core here while the other Macs' ranks wait for one (their TCP and Python starved:
    # a 3-Mac ring's 1 Gbit/s reduce_scatter took 0.3-0.55 of the cable bound instead of 0.9).
    here = nproc_per_host * (1 if host.exec == "ssh" else sum(h.exec != "ssh" for h in hosts))
    if here > 1 and "OMP_NUM_THREADS" not in (inherited or {}):
        env["OMP_NUM_THREADS"] = "1"
    env.update(host.env)
    env.update(extra_env or {})
    return env


def remote_script(env: Mapping[str, str], cmd: Sequence[str], cwd: str, private: Sequence[str] = ()) -> str:
    """POSIX sh script run on the remote host: same cwd, env exported, stopped when ssh goes away.

    Without a tty, killing the local ssh does not signal the remote process. So the job runs in the
    background while `cat` waits on the ssh channel's stdin; when the channel closes (launcher killed
    ssh, or the connection dropped) cat sees EOF and the job gets SIGTERM. `wait` returns its status.
    The `private` variables come first on stdin, one line each (`read` takes one line off a pipe, no
    more), so their values are in no argv on either host; exit 125 if the channel closes before that.
    """
    reads = "".join(f"IFS= read -r {k} || exit 125; export {k}; " for k in private)
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    job = f"cd {shlex.quote(cwd)} && exec env {assigns} {shlex.join(cmd)}"
    return (reads + "exec 3<&0; (" + job + ") </dev/null & p=$!; "
            "(cat <&3 >/dev/null; kill -TERM $p 2>/dev/null) >/dev/null 2>&1 & "
            "wait $p")


_BARE_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def bare_python(cmd: Sequence[str], interpreter: str) -> list[str]:
    """`cmd` with a bare python name at its start replaced by `interpreter` (an absolute path)."""
    if not cmd or not _BARE_PYTHON.match(cmd[0]):
        return list(cmd)
    return [interpreter, *cmd[1:]]


def host_command(host: Host, cmd: Sequence[str], python: str, here: str = sys.executable) -> list[str]:
    """`cmd` as run on `host`: a bare python name becomes an interpreter's absolute path (see the module
    doc): on ssh hosts the host's or `python`, on this machine `here`, the launcher's own."""
    return bare_python(cmd, (host.python or python) if host.exec == "ssh" else here)


def program_check(host: Host, program: str) -> str:
    """sh code failing with exit 127 and a message naming the host and the path when `program` (absolute)
    is not executable there; "" for a bare name (the remote shell reports those itself)."""
    if not program.startswith("/"):
        return ""
    message = (f"torch-thunderbolt launch: host {host.name}: no program at {program} there; install the same "
               "Python environment at that path on every host, or give this host's interpreter as \"python\" "
               "in the hostfile (or --python for all hosts)")
    return f"[ -x {shlex.quote(program)} ] || {{ echo {shlex.quote(message)} >&2; exit 127; }}; "


def ssh_argv(host: Host, env: Mapping[str, str], cmd: Sequence[str], cwd: str,
             ssh_options: Sequence[str] = (), private: Sequence[str] = ()) -> list[str]:
    # The remote login shell may be zsh (macOS default): hand the script to sh explicitly.
    remote = "sh -c " + shlex.quote(program_check(host, cmd[0]) + remote_script(env, cmd, cwd, private))
    return ["ssh", "-o", "BatchMode=yes", *ssh_options, "--", str(host.ssh), remote]


def lab_namespace(host: Host) -> str:
    return host.namespace or f"{host.lab}-{host.name}"


def rank_argv(host: Host, env: Mapping[str, str], cmd: Sequence[str], cwd: str,
              ssh_options: Sequence[str] = (), private: Sequence[str] = ()) -> tuple[list[str], bool]:
    """(argv to start locally, whether the env is already inside argv). `private`: names of variables
    an ssh rank reads from stdin instead."""
    if host.exec == "ssh":
        return ssh_argv(host, env, cmd, cwd, ssh_options, private), True
    if host.exec == "lab":
        return ["ip", "netns", "exec", lab_namespace(host), *cmd], False
    return list(cmd), False


def build_rank_specs(hosts: Sequence[Host], nproc_per_host: int, cmd: Sequence[str], *, cwd: str,
                     master_addr: str | None = None, master_port: int = DEFAULT_MASTER_PORT,
                     extra_env: Mapping[str, str] | None = None, ssh_options: Sequence[str] = (),
                     inherited: Mapping[str, str] | None = None, secret: str | None = None,
                     python: str = sys.executable) -> list[RankSpec]:
    """Every rank of the job, in rank order (host 0's ranks first). `secret`: the job's THUNDERBOLT_SECRET
    (one given in the hostfile's env or --env wins); it and any other PRIVATE_VARS go to `private_env`.
    `python`: the interpreter's absolute path on ssh hosts without their own `python` (see the module doc)."""
    if not cmd:
        raise ConfigError("expected a command to launch: launch [OPTIONS] -- python train.py ...")
    if not isinstance(nproc_per_host, int) or nproc_per_host < 1:
        raise ConfigError(f"--nproc-per-host must be a positive integer, got {nproc_per_host!r}")
    if not 0 < master_port < 65536:
        raise ConfigError(f"--master-port must be from 1 to 65535, got {master_port}")
    if not python.startswith("/"):
        raise ConfigError(f"--python {python!r} must be an absolute path (over ssh a Mac's PATH is only "
                          "/usr/bin:/bin:/usr/sbin:/sbin, where python3 is Apple's 3.9 without torch)")
    addr = master_addr or master_address(hosts)
    specs = []
    for h, host in enumerate(hosts):
        for local in range(nproc_per_host):
            env = rank_env(hosts, h, local, nproc_per_host, addr, master_port, extra_env, inherited)
            private = private_env(env, secret)
            argv, inside = rank_argv(host, env, host_command(host, cmd, python), cwd, ssh_options, list(private))
            rank = h * nproc_per_host + local
            specs.append(RankSpec(rank=rank, host=host, local_rank=local, env=env, argv=argv,
                                  cwd=None if inside else cwd, env_in_argv=inside, label=f"rank {rank}",
                                  private_env=private))
    return specs


def private_env(env: dict[str, str], secret: str | None) -> dict[str, str]:
    """Moves PRIVATE_VARS out of `env` (in place) into the returned dict, adding THUNDERBOLT_SECRET =
    `secret` unless `env` had one. Values are sent as lines, so none may hold a line break."""
    private = {k: env.pop(k) for k in PRIVATE_VARS if k in env}
    if secret is not None:
        private.setdefault("THUNDERBOLT_SECRET", secret)
    for k, v in private.items():
        if "\n" in v or "\r" in v:
            raise ConfigError(f"{k}: must be a single line (its value is not shown)")
    return private


def parse_env_assignments(items: Sequence[str]) -> dict[str, str]:
    """`--env NAME=value` options -> dict, with a clear error for anything else."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not (name.replace("_", "a").isalnum() and not name[0].isdigit()):
            raise ConfigError(f"--env {item!r} is invalid: expected NAME=value")
        out[name] = value
    return out
