"""`torch-thunderbolt launch [--hostfile F | --lab NAME] [--nproc-per-host K] [--on-failure stop|shrink]
-- python train.py ...`"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import socket
import sys

from ..errors import ConfigError


def configure(parser: argparse.ArgumentParser) -> None:
    from ..launch.supervise import ON_FAILURE

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--hostfile", help="JSON list of hosts (see README); without it all ranks run here")
    src.add_argument("--lab", metavar="NAME", help="run on every host of a running `lab` (no hostfile needed)")
    parser.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (default 1)")
    parser.add_argument("--via", choices=("ssh", "lab", "local"), default=None,
                        help="how to reach every host, overriding the hostfile's 'exec'")
    parser.add_argument("--lab-state-dir", default=None, help="state directory of the lab (with --lab)")
    parser.add_argument("--master-addr", default=None,
                        help="rendezvous address (default: host 0's first Thunderbolt address)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default 29500; a free port in local mode)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for every rank (repeatable)")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                        help="extra ssh option, e.g. --ssh-option=-p2222 (repeatable)")
    parser.add_argument("--python", metavar="PATH", default=sys.executable,
                        help="interpreter on ssh hosts, by absolute path, for a command starting with python/"
                             "python3 (default: this one's; a hostfile host's \"python\" wins)")
    parser.add_argument("--on-failure", choices=ON_FAILURE, default=ON_FAILURE[0],
                        help="when a rank fails: stop the others (default), or let them go on without it, for "
                             "a job that calls dist.shrink_group (exit 0 when the ranks that remain finish with "
                             "0; see docs/fault-tolerance.md)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    parser.add_argument("--dry-run", action="store_true", help="print each rank's env and command, run nothing")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the program and its arguments")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(args: argparse.Namespace):
    from ..launch.hostfile import local_hosts, parse_hostfile, read_hostfile

    if args.lab:
        from ..lab.view import Lab

        return parse_hostfile(Lab.load(args.lab, args.lab_state_dir).hostfile(), args.via)
    if args.hostfile:
        return read_hostfile(args.hostfile, args.via)
    return local_hosts()


def bridge_warning(hosts, python: str, run=None, system: str = sys.platform) -> str:
    """On a Mac: whether this Mac's bridge holds again a port the hostfile's hosts use (a reboot puts them
    back, topology/persist.py), as the warning to print; "" otherwise."""
    if system != "darwin":
        return ""
    from ..topology.discover import subprocess_runner
    from ..topology.persist import launch_bridge_check

    in_use = sorted({n.strip() for h in hosts if h.ifname for n in h.ifname.split(",") if n.strip()})
    advice = launch_bridge_check(run or subprocess_runner, in_use, python)
    return f"torch-thunderbolt launch: warning: on this Mac, {advice}" if advice else ""


def run(args: argparse.Namespace) -> int:
    from ..launch.ranks import DEFAULT_MASTER_PORT, build_rank_specs, parse_env_assignments
    from ..config import parse_secret
    from ..launch.supervise import supervise

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.grace < 0:
        raise ConfigError(f"--grace must be >= 0 seconds, got {args.grace}")
    hosts = _hosts(args)
    if any(h.exec == "lab" for h in hosts) and not args.dry_run:
        from ..lab.executor import require_linux

        require_linux(sys.platform)  # lab ranks start with `ip netns exec`: one clear error, not one per rank
    port = args.master_port
    if port is None:
        local_only = all(h.exec == "local" for h in hosts)
        port = _free_port() if local_only else DEFAULT_MASTER_PORT
    # One fresh secret per job authenticates its TCP streams (the rendezvous store cannot keep one: anyone
    # who reaches MASTER_PORT reads it). The user's own THUNDERBOLT_SECRET, if set, is used instead.
    secret = os.environ.get("THUNDERBOLT_SECRET", "").strip() or secrets.token_hex(32)
    if not secret.startswith("@"):  # a bad one of the user's fails here, not on every rank (an @file may
        parse_secret(secret)  # exist only on the hosts, so it is left to them)
    specs = build_rank_specs(hosts, args.nproc_per_host, cmd, cwd=os.getcwd(), master_addr=args.master_addr,
                             master_port=port, extra_env=parse_env_assignments(args.env),
                             ssh_options=args.ssh_option, inherited=os.environ, secret=secret,
                             python=args.python)
    warning = bridge_warning(hosts, args.python)
    if warning:
        print(warning, file=sys.stderr)
    if args.dry_run:
        for spec in specs:
            env = " ".join([f"{k}={shlex.quote(v)}" for k, v in spec.env.items()] +
                           [f"{k}=(hidden)" for k in spec.private_env])
            print(f"# {spec.label} on {spec.host.name} ({spec.host.exec}): {env}")
            print(shlex.join(spec.argv))
        return 0
    return supervise(specs, grace=args.grace, on_failure=args.on_failure)
