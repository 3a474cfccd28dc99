"""Fake verbs fabrics for tests and scripts: create one, point processes at it, inject faults, remove it.

    with fake_fabric(devices={"rdma_fake0": "10.201.0.1", "rdma_fake1": "10.201.0.2"}, max_qp=4) as fabric:
        run_ranks(program, 2, tmp_path, env=fabric_env(fabric))   # THUNDERBOLT_VERBS=fake:<dir>
        fabric.set_fault("rdma_fake1", "port_up", 0)              # from here, any time, any process

The fabric itself (rules, faults, file layout) is `torch_thunderbolt.transport.fakeverbs`; a process
selects it with THUNDERBOLT_VERBS=fake:/path (parsed by config.py, like every setting). From a shell:

    python -m torch_thunderbolt.testing.fake_verbs create /tmp/fab [--device rdma_fake0=10.201.0.1 ...]
                                                                    [--limit max_qp=4 ...]
    python -m torch_thunderbolt.testing.fake_verbs fault /tmp/fab rdma_fake0 port_up 0
    python -m torch_thunderbolt.testing.fake_verbs reboot /tmp/fab rdma_fake0

Nothing measured on a fake fabric is RDMA speed: its delivery is memory copies and Python.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from torch_thunderbolt.transport.fakeverbs import DEFAULT_LIMITS, FAULTS, Fabric

ENV = "THUNDERBOLT_VERBS"


def fabric_env(fabric: Fabric) -> dict[str, str]:
    """The environment that makes a process use `fabric`."""
    return {ENV: f"fake:{fabric.path}"}


@contextlib.contextmanager
def fake_fabric(path: str | Path | None = None, devices: Mapping[str, str | None] | None = None,
                **limits: Any) -> Iterator[Fabric]:
    """A new fabric (in `path`, else a fresh temporary directory), removed with everything in it when the
    block ends, even on failure. `devices`: name -> IPv4 address or None; `limits`: DEFAULT_LIMITS keys."""
    root = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="tbverbs-"))
    fabric = Fabric.create(root, devices, **limits)
    try:
        yield fabric
    finally:
        fabric.close()
        shutil.rmtree(root, ignore_errors=True)


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
