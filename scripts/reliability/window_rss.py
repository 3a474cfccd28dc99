"""RSS and Python allocations of the shared-window collectives alone: two ranks, N random-size ops straight
on the Communicator (no torch.distributed layer, no ring collectives), RSS sampled every N/10 ops and the
top tracemalloc growth between op N/6 and the end.

    python scripts/reliability/window_rss.py --ops 30000 --kinds all_reduce,broadcast,reduce_scatter
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import tracemalloc
from datetime import timedelta


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
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
    q.put((rank, trace, [str(t) for t in top]))
    comm.t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=30000)
    ap.add_argument("--kinds", default="all_reduce,broadcast,reduce_scatter")
    ap.add_argument("--max-elems", type=int, default=300000)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    args.kinds = args.kinds.split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: each rank imports torch itself, as it must on macOS (fork + torch/Metal crashes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            rank, trace, top = q.get(timeout=1800)
            print(f"rank {rank}: RSS MB every {args.ops // 10} ops: {trace}")
            for line in top:
                print("   ", line)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
