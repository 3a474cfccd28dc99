"""RSS and Python allocations of the shared-window collectives alone: two ranks, N random-size ops straight
on the Communicator (no torch.distributed layer, no ring collectives), RSS sampled every N/10 ops and the
top tracemalloc growth between op N/6 and the end.

    python scripts/reliability/window_rss.py --ops 30000 --kinds all_reduce,broadcast,reduce_scatter
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import tracemalloc
from datetime import timedelta
from pathlib import Path

# Run from a checkout without installing (under `sudo`, `python` may be another interpreter): the package
# is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rank_main(args: argparse.Namespace) -> None:
    """One rank (started by main through torch_thunderbolt.testing.ranks): its RSS trace and top growth."""
    import psutil
    import torch
    import torch.distributed as dist

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60))
    comm = Communicator(connect_shm(store, rank, world, Config(), 60, ShmOptions()), Config(), timeout=60)
    rng, proc, trace = random.Random(args.seed), psutil.Process(), []
    tracemalloc.start(10)
    first = None
    for i in range(args.ops):
        n, kind = rng.randint(0, args.max_elems), rng.choice(args.kinds)
        x = torch.ones(n)
        if kind == "all_reduce":
            comm.all_reduce(x)
        elif kind == "broadcast":
            comm.broadcast(x, rng.randrange(world))
        else:
            m = n // world
            comm.reduce_scatter(torch.empty(m), x[: m * world], [m] * world)
        if i == args.ops // 6:
            first = tracemalloc.take_snapshot()
        if i % max(1, args.ops // 10) == 0:
            trace.append(proc.memory_info().rss >> 20)
    top = tracemalloc.take_snapshot().compare_to(first, "lineno")[:5]
    print("RESULT " + json.dumps({"trace": trace, "top": [str(t) for t in top]}), flush=True)
    comm.t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=30000)
    ap.add_argument("--kinds", default="all_reduce,broadcast,reduce_scatter")
    ap.add_argument("--max-elems", type=int, default=300000)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        args.kinds = args.kinds.split(",")
        rank_main(args)
        return
    from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks

    rank_args = ["--rank", "--ops", str(args.ops), "--kinds", args.kinds, "--max-elems", str(args.max_elems),
                 "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory(prefix="tb-window-rss-") as tmp:
        # Separate processes (each imports torch itself, as it must on macOS) that keep our environment.
        results = run_ranks(Path(__file__), 2, Path(tmp), args=rank_args, setup=LOOPBACK.but(strip=()),
                            timeout=1800)
    for res in results:
        out = res.json()
        print(f"rank {res.rank}: RSS MB every {args.ops // 10} ops: {out['trace']}")
        for line in out["top"]:
            print("   ", line)


if __name__ == "__main__":
    main()
