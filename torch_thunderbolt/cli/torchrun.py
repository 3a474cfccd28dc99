"""`torch-thunderbolt torchrun [--exit-barrier-timeout S] TORCHRUN_ARGS...`: torchrun for jobs that shrink.

The same arguments as torchrun, given as they are (no `--` needed); only a leading `--exit-barrier-timeout`
is ours. See torch_thunderbolt/launch/torchrun.py for what differs from torchrun, and
docs/fault-tolerance.md ("Running a job that shrinks") for the commands.
"""
from __future__ import annotations

import argparse
from typing import Sequence

OWN_OPTION = "--exit-barrier-timeout"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(OWN_OPTION, type=float, default=300.0, metavar="SECONDS",
                        help="longest wait, once this node's workers are done, for the other nodes' agents "
                             "(torch's exit barrier; default 300, torch's). An agent whose workers failed does "
                             "not make the others wait; a node lost whole does, for this long")
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER,
                        help="torchrun's arguments, the program and its arguments, as for torchrun")


def prepare_argv(argv: Sequence[str]) -> list[str]:
    """Our leading options, then `--`, then torchrun's: argparse would otherwise take torchrun's options
    (`--nnodes` ...) for unknown ones of ours."""
    argv = list(argv)
    own: list[str] = []
    while argv:
        if argv[0] in ("-h", "--help") and not own:
            return argv
        if argv[0] == OWN_OPTION and len(argv) > 1:
            own += argv[:2]
            argv = argv[2:]
        elif argv[0].startswith(OWN_OPTION + "="):
            own.append(argv.pop(0))
        else:
            break
    return [*own, "--", *argv] if argv[:1] != ["--"] else [*own, *argv]


def run(args: argparse.Namespace) -> int:
    from ..launch.torchrun import run_torchrun

    rest = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    return run_torchrun(rest, exit_barrier_timeout=args.exit_barrier_timeout)
