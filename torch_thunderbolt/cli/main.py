"""`torch-thunderbolt` command line: a thin dispatcher over one module per subcommand.

Each subcommand module defines `configure(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int`, and imports torch (if at all) inside `run`. One that passes another
tool's arguments through (`torchrun`) also defines `prepare_argv(argv) -> argv`, which puts the `--` its
parser needs before them. Building the parser imports every module, so `--help`, `topo`, `launch` and `lab`
never pay ~2 s for `import torch`. The package's own import does not register the backend in this process
(torch_thunderbolt/__init__.py); the subcommands that use it (bench, demo, doctor) register it themselves.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shlex
import shutil
import sys
from typing import Sequence

from ..errors import ConfigError, ThunderboltError

DESCRIPTION = ("Tools for the 'thunderbolt' torch.distributed backend. On a new Mac: doctor, then topo, then "
               "launch (see the README's first-day section).")

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("torch_thunderbolt.cli.demo", "run a small all_reduce/send-recv demo on local ranks"),
    "bench": ("torch_thunderbolt.cli.bench", "nccl-tests-style benchmark, side by side with gloo"),
    "topo": ("torch_thunderbolt.cli.topo", "discover Thunderbolt links, check for loops, plan addresses"),
    "lab": ("torch_thunderbolt.cli.lab", "an emulated N-Mac cluster from Linux network namespaces"),
    "launch": ("torch_thunderbolt.cli.launch", "start ranks on several hosts (torchrun-compatible env)"),
    "torchrun": ("torch_thunderbolt.cli.torchrun", "torchrun whose agents do not wait for a node that failed "
                 "(jobs that shrink)"),
    "doctor": ("torch_thunderbolt.cli.doctor", "check this machine's setup for torch-thunderbolt"),
    "selfcheck": ("torch_thunderbolt.cli.selfcheck", "check everything (ops, links, bench, faults) and write a report"),
}


def self_command(executable: str = sys.executable, path: str | None = None, cwd: str | None = None) -> str:
    """`torch-thunderbolt` as the user can type it here: the bare name when PATH finds this environment's
    script (an activated venv), else that script's path (relative to `cwd` inside it: `.venv/bin/...`), else
    this interpreter with `-m torch_thunderbolt` (a checkout that was not installed)."""
    script = os.path.join(os.path.dirname(executable), "torch-thunderbolt")
    if not os.path.isfile(script):
        return f"{shlex.quote(executable)} -m torch_thunderbolt"
    found = shutil.which("torch-thunderbolt", path=os.environ.get("PATH", "") if path is None else path)
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "torch-thunderbolt"
    here = os.path.abspath(cwd or os.getcwd())
    inside = here != os.sep and os.path.commonpath([here, os.path.abspath(script)]) == here
    return shlex.quote(os.path.relpath(script, here) if inside else script)


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-thunderbolt", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # a subcommand that passes another tool's arguments through
        prepare = getattr(importlib.import_module(SUBCOMMANDS[argv[0]][0]), "prepare_argv", None)
        if prepare is not None:
            argv = [argv[0], *prepare(argv[1:])]
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ConfigError, ThunderboltError) as exc:
        print(f"torch-thunderbolt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
