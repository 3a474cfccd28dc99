"""`torch-thunderbolt doctor`: check this machine's setup and say how to fix what is wrong."""
from __future__ import annotations

import argparse
import json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable findings")


def run(args: argparse.Namespace) -> int:
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
