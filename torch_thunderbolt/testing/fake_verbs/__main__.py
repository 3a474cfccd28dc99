"""`python -m torch_thunderbolt.testing.fake_verbs`: create fake verbs fabrics and inject faults into them."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import ENV
from .fabric import DEFAULT_LIMITS, FAULTS, Fabric


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_thunderbolt.testing.fake_verbs",
                                     description="Create fake verbs fabrics and inject faults into them.")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a fabric in DIR")
    create.add_argument("dir")
    create.add_argument("--device", action="append", default=[],
                        help="NAME=IPV4 (or NAME= for no address); default rdma_fake0 and rdma_fake1")
    create.add_argument("--limit", action="append", default=[], help=f"KEY=VALUE, keys: {', '.join(DEFAULT_LIMITS)}")
    fault = sub.add_parser("fault", help="set a fault on a device")
    fault.add_argument("dir")
    fault.add_argument("device")
    fault.add_argument("fault", choices=sorted(FAULTS))
    fault.add_argument("value", type=int)
    reboot = sub.add_parser("reboot", help="unwedge a device's port")
    reboot.add_argument("dir")
    reboot.add_argument("device")
    args = parser.parse_args(argv)
    if args.command == "create":
        devices = {k: (val or None) for k, val in _pairs(args.device, "--device").items()} or None
        limits = {k: json.loads(val) if val not in ("drop", "stall") else val
                  for k, val in _pairs(args.limit, "--limit").items()}
        Fabric.create(args.dir, devices, **limits).close()
        print(f"{ENV}=fake:{Path(args.dir).resolve()}")
        return 0
    fabric = Fabric(args.dir)
    try:
        if args.command == "fault":
            fabric.set_fault(args.device, args.fault, args.value)
        else:
            fabric.reboot(args.device)
    finally:
        fabric.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
