#!/usr/bin/env python3
"""Time N back-to-back small all_reduces on 2 local ranks, with nothing else running (no gloo beside it):
what one small op costs the thunderbolt backend alone.

    python scripts/small_op_loop.py --transport shm      # or tcp; --bytes 4096 --ops 3000
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_thunderbolt.testing import program  # noqa: E402
from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks  # noqa: E402


def loop() -> None:
    import torch
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    dist.init_process_group("thunderbolt")
    x = torch.ones(int(os.environ["TB_BYTES"]) // 4)
    for _ in range(200):
        dist.all_reduce(x)
    n = int(os.environ["TB_OPS"])
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    program.result({"us_per_op": (time.perf_counter() - t0) / n * 1e6})
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=3000)
    args = ap.parse_args()
    env = {"THUNDERBOLT_TRANSPORT": args.transport, "TB_BYTES": str(args.bytes), "TB_OPS": str(args.ops)}
    with tempfile.TemporaryDirectory() as work:
        runs = run_ranks(Path(__file__), 2, Path(work), env=env, setup=LOOPBACK, timeout=300)
    times = [r.json()["us_per_op"] for r in runs]
    print(f"{args.bytes}-byte all_reduce over {args.transport}, 2 ranks, {args.ops} ops: "
          f"{max(times):.1f} us per op (slowest rank)")
    return 0


if __name__ == "__main__":
    if os.environ.get("RANK") is not None:
        loop()
    else:
        sys.exit(main())
