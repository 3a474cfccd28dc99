"""`torch-thunderbolt doctor`: check this machine's setup and say how to fix what is wrong."""
from __future__ import annotations

import argparse
import json
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable findings")
    p.add_argument("--firewall-command", action="store_true",
                   help="print the commands that let this Python accept incoming connections through the macOS "
                        "firewall (the binary that actually listens, for a framework build, Homebrew or a venv)")


def run(args: argparse.Namespace) -> int:
    if args.firewall_command:
        return firewall_command()
    from ..doctor import FAIL, gather_facts, run_checks

    findings = run_checks(gather_facts())
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for f in findings:
            print(f"[{f.status:>4}] {f.check}: {f.detail}")
            if f.fix:
                print(f"       -> {f.fix}")
    return 1 if any(f.status == FAIL for f in findings) else 0


def firewall_command() -> int:
    from ..macos_firewall import allow_commands, listening_binary, this_interpreter

    binary = listening_binary(this_interpreter())
    if sys.platform != "darwin":
        print(f"# not a Mac: these are the commands a Mac would need for {binary}", file=sys.stderr)
    print("\n".join(allow_commands(binary)))
    return 0
