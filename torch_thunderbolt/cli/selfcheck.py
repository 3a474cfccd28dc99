"""`torch-thunderbolt selfcheck [--quick] [--hostfile F]`: every check on this machine (2 ranks) or on every
host of the launched job, with a report to attach (docs/selfcheck.md)."""
from __future__ import annotations

import argparse
import os


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer and smaller figures: under a minute")
    p.add_argument("--hostfile", default=None, help="run on every host of this hostfile (through `launch`)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT", help="with --hostfile (repeatable)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks without a launcher (default 2)")
    p.add_argument("--out-dir", default=".", help="where the report goes (default: here)")
    p.add_argument("--check-timeout", type=float, default=None,
                   help="seconds for one check (default 30, 15 with --quick)")
    p.add_argument("--cable-rate", default=None, metavar="RATE",
                   help="rate of one cable per direction (e.g. 40gbit) when the interfaces do not say")
    p.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="TEST ONLY, never for a real report: plant a fault to check the selfcheck itself: "
                        "wrong:RANK:OP (that rank corrupts its result of op family OP) or hang:RANK[:OP]")


def run(args: argparse.Namespace) -> int:
    from ..bench.bounds import parse_cable_rate
    from ..bench.config import rank_env
    from ..config import parse_injections
    from ..errors import ConfigError
    from ..selfcheck.model import FAMILIES, Options

    timeout = args.check_timeout if args.check_timeout is not None else 15.0 if args.quick else 30.0
    if timeout <= 0:
        raise ConfigError(f"bad --check-timeout {timeout}: expected seconds > 0")
    if args.nproc < 2:
        raise ConfigError(f"bad --nproc {args.nproc}: the selfcheck needs at least 2 ranks")
    opts = Options(quick=args.quick, out_dir=os.path.abspath(args.out_dir), check_timeout=timeout,
                   cable_rate=parse_cable_rate(args.cable_rate), injections=parse_injections(args.inject, FAMILIES),
                   nproc=args.nproc)
    if not os.path.isdir(opts.out_dir):
        raise ConfigError(f"--out-dir {args.out_dir}: no such directory")
    env = rank_env(os.environ)
    if env is not None:
        from ..selfcheck.rank import Selfcheck

        return Selfcheck(opts, env).run()
    from ..selfcheck import local

    if args.hostfile:
        from .main import main

        if not local.hosts_answer(args.hostfile, args.ssh_option):
            return 1
        return main(local.launch_argv(args.hostfile, opts.to_argv(), args.ssh_option))
    return local.run_here(opts, opts.to_argv())
