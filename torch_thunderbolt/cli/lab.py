"""`torch-thunderbolt lab up|down|exec|status|hostfile`: thin shell over torch_thunderbolt.lab."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from ..errors import ConfigError


def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default="tblab",
                        help="lab name; its namespaces are NAME-mac0, NAME-mac1, ... (default tblab)")
    common.add_argument("--state-dir", default=None,
                        help="where the lab's JSON state lives (default $THUNDERBOLT_LAB_STATE_DIR "
                             "or /run/torch-thunderbolt)")
    sub = parser.add_subparsers(dest="lab_command", metavar="ACTION")
    up = sub.add_parser("up", parents=[common], help="build the emulated cluster (root)")
    up.add_argument("--hosts", type=int, required=True, help="number of emulated Macs")
    up.add_argument("--topology", choices=("pair", "chain", "ring", "mesh"), default="chain")
    up.add_argument("--cables", type=int, default=1, help="cables between each cabled pair (default 1)")
    up.add_argument("--rate", default="10gbit",
                    help="tbf rate per cable end, e.g. 10gbit, 5gbit, none (default 10gbit; this box "
                         "cannot hold more than ~10gbit)")
    up.add_argument("--mtu", type=int, default=None, help="MTU of every cable (default: kernel's 1500)")
    up.add_argument("--cc", choices=("reno", "bbr", "cubic"), default=None,
                    help="TCP congestion control inside every namespace")
    up.add_argument("--base", default=None, help="private IPv4 network the /30s come from (10.213.0.0/16)")
    up.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    sub.add_parser("down", parents=[common], help="remove everything the lab made (root)")
    st = sub.add_parser("status", parents=[common], help="hosts, cables, addresses, rates, byte counters")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    hf = sub.add_parser("hostfile", parents=[common], help="write a `launch` hostfile for this lab")
    hf.add_argument("-o", "--output", default="-", help="file to write (default stdout)")
    ex = sub.add_parser("exec", parents=[common], help="run a command inside one host: exec HOST -- CMD")
    ex.add_argument("host", help="host index (0) or name (mac0)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")


def run(args: argparse.Namespace, platform: str | None = None) -> int:
    from ..lab.executor import require_linux

    action = getattr(args, "lab_command", None)
    if action is None:
        raise ConfigError("expected an action: up, down, exec, status or hostfile")
    # Before anything else: off Linux every action would fail later, one command at a time, less clearly.
    require_linux(sys.platform if platform is None else platform)
    return {"up": _up, "down": _down, "status": _status, "hostfile": _hostfile, "exec": _exec}[action](args)


def _up(args: argparse.Namespace) -> int:
    from ..lab.executor import lab_up
    from ..lab.blueprint import DEFAULT_BASE, plan_lab

    plan = plan_lab(args.hosts, args.topology, args.cables, args.rate, args.mtu, name=args.name, cc=args.cc,
                    base=args.base or DEFAULT_BASE)
    if args.dry_run:
        print("\n".join(" ".join(argv) for argv in plan.commands))
        return 0
    path = lab_up(plan, directory=args.state_dir)
    from ..lab.view import Lab

    lab = Lab(plan)
    print(f"lab {plan.name} is up ({len(plan.hosts)} hosts, {plan.topology}); state in {path}")
    for host in lab.hosts():
        print(f"  {host}: netns {lab.namespace(host)}, {lab.ifname_env(host)} = "
              f"{', '.join(lab.addresses(host))}")
    print(f"run inside one: torch-thunderbolt lab exec --name {plan.name} mac0 -- CMD")
    return 0


def _down(args: argparse.Namespace) -> int:
    from ..lab.executor import lab_down

    removed = lab_down(args.name, directory=args.state_dir)
    print(f"lab {args.name}: removed {', '.join(removed)}" if removed else f"lab {args.name}: nothing to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ..lab.executor import running_as_root
    from ..lab.view import Lab, format_status, status_rows

    lab = Lab.load(args.name, args.state_dir)
    counters = {h: lab.counters(h) for h in lab.hosts()} if running_as_root() else None
    rows = status_rows(lab.plan, counters)
    if args.json:
        print(json.dumps({"name": lab.name, "topology": lab.plan.topology, "rate": lab.plan.rate,
                          "mtu": lab.plan.mtu, "cc": lab.plan.cc, "interfaces": rows}, indent=1))
    else:
        print(format_status(lab.plan, rows))
        if counters is None:
            print("(byte counters need root)")
    return 0


def _hostfile(args: argparse.Namespace) -> int:
    from ..lab.view import Lab

    text = json.dumps(Lab.load(args.name, args.state_dir).hostfile(), indent=1) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as fh:
            fh.write(text)
    return 0


def _exec(args: argparse.Namespace) -> int:
    from ..lab.executor import require_root, running_as_root
    from ..lab.view import Lab
    from ..launch.ranks import bare_python

    # A bare `python` is this interpreter: under a stock sudo, PATH is secure_path, without the venv.
    cmd = bare_python(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, sys.executable)
    if not cmd:
        raise ConfigError("expected a command: lab exec HOST -- CMD [ARGS...]")
    lab = Lab.load(args.name, args.state_dir)
    require_root(running_as_root, "exec")
    try:
        return subprocess.run(lab.exec_argv(args.host, cmd), check=False).returncode
    except KeyboardInterrupt:
        return 130
