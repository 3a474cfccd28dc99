#!/usr/bin/env python3
"""Where a small all_reduce's time goes: the same 4 KB all_reduce timed at each layer on 2 local ranks, and
what one op costs in calls into our package and in lock acquisitions.

    python scripts/small_op_layers.py --transport tcp      # or shm; --bytes 4096 --ops 5000 --runs 3

Layers, each timed as a loop of back-to-back ops on both ranks (the slower rank's time per op):
- `engine`: the engine's exchange of the op's messages alone (`Transport.exchange`, no reduction);
- `communicator`: `Communicator.all_reduce` (the kept small op: exchange, reduction, op bookkeeping);
- `process group`: `ThunderboltProcessGroup.allreduce(...).wait()` (torch's arguments, the turn, the Work);
- `torch`: `dist.all_reduce` (torch's own dispatch on top: the floor `bench --floor` measures).
Then one rank runs the torch loop under cProfile and reports, per op, the calls into torch_thunderbolt
(functions of the package) and the lock acquisitions (`acquire` and a `with` on a lock). Timings move with
the machine's load: compare layers of one run, and runs of one version against another (scripts/ab_previous).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_thunderbolt.testing import program  # noqa: E402
from torch_thunderbolt.testing.ranks import LOOPBACK, SHM, run_ranks  # noqa: E402


def _timed(fn, n: int) -> float:
    import torch.distributed as dist

    for _ in range(200):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def loop() -> None:
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    dist.init_process_group("thunderbolt")
    rank, n = dist.get_rank(), int(os.environ["TB_OPS"])
    pg = dist.distributed_c10d._get_default_group()
    t = pg.transport
    comm = pg._comm
    x = torch.ones(int(os.environ["TB_BYTES"]) // 4)
    peer = 1 - rank
    own, into = memoryview(x.numpy()).cast("B"), memoryview(bytearray(x.numel() * 4))
    tag = [1 << 40]

    def exchange() -> None:
        tag[0] += 1
        key = (t.coll, tag[0], 0)
        t.exchange([(peer, key, own)], [(peer, key, into)], 0, None, "exchange")

    out = {"engine": _timed(exchange, n), "communicator": _timed(lambda: comm.all_reduce(x), n),
           "process group": _timed(lambda: pg.allreduce([x]).wait(), n), "torch": _timed(lambda: dist.all_reduce(x), n)}
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    for _ in range(n):
        dist.all_reduce(x)
    if rank == 0:
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        ours = sum(v[1] for k, v in stats.items() if "torch_thunderbolt" in k[0]) / n
        # (a `with` on a lock shows as its __exit__: the profiler sees no call of __enter__)
        locks = sum(v[1] for k, v in stats.items() if k[2] in ("<method 'acquire' of '_thread.lock' objects>",
                                                              "<method 'acquire' of '_thread.RLock' objects>",
                                                              "<method '__exit__' of '_thread.lock' objects>",
                                                              "<method '__exit__' of '_thread.RLock' objects>")) / n
        top = sorted(((v[1] / n, f"{k[2]} ({Path(k[0]).name}:{k[1]})") for k, v in stats.items()
                      if "torch_thunderbolt" in k[0]), reverse=True)
        out.update(calls=ours, locks=locks, top=top[:40])
    program.result(out)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=("shm", "tcp"), default="tcp")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="also list the package's functions called per op")
    args = ap.parse_args()
    env = {"THUNDERBOLT_TRANSPORT": args.transport, "TB_BYTES": str(args.bytes), "TB_OPS": str(args.ops)}
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as work:
            res = [r.json() for r in run_ranks(Path(__file__), 2, Path(work), env=env,
                                               setup=SHM if args.transport == "shm" else LOOPBACK, timeout=600)]
        runs.append(res)
    print(f"{args.bytes}-byte all_reduce over {args.transport}, 2 ranks, {args.ops} ops a loop, {args.runs} runs "
          f"(the slower rank's us per op: each run, then the median)")
    for layer in ("engine", "communicator", "process group", "torch"):
        each = [max(r[layer] for r in res) for res in runs]
        print(f"  {layer:14} {' '.join(f'{v:7.1f}' for v in each)}   median {statistics.median(each):7.1f}")
    first = next(r for r in runs[-1] if "calls" in r)
    print(f"  per op on rank 0: {first['calls']:.1f} calls into torch_thunderbolt, {first['locks']:.1f} lock "
          f"acquisitions")
    if args.calls:
        for count, name in first["top"]:
            print(f"    {count:6.2f}  {name}")
    return 0


if __name__ == "__main__":
    if os.environ.get("RANK") is not None:
        loop()
    else:
        sys.exit(main())
