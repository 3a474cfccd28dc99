"""A/B of shared-memory configurations in the same processes: every variant gets its own shm transport,
and the ranks alternate between them call by call, so a drifting machine slows all variants alike.

    python scripts/shm_window_ab.py --op all_reduce --bytes 64M --iters 15 --windows 1M,2M,0
    python scripts/shm_window_ab.py --op reduce_scatter --bytes 64M --world 4 --windows 2M,0

`--windows`: THUNDERBOLT_SHM_WINDOW values (0 = no window: the collectives run over the slot rings).
Prints, per variant, the median / p10 / p90 of the per-call maximum over ranks.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
from datetime import timedelta


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config, parse_size
    from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    comms = {}
    for i, w in enumerate(args.windows):
        opts = ShmOptions(window_bytes=parse_size(w))
        comms[w] = Communicator(connect_shm(dist.PrefixStore(f"v{i}", store), rank, world, Config(), 60, opts),
                                Config(), timeout=60)
    x = torch.randn(parse_size(args.bytes) // 4)
    out = torch.empty(x.numel() // world)
    calls = {
        "all_reduce": lambda c: c.all_reduce(x),
        "broadcast": lambda c: c.broadcast(x, 0),
        "reduce_scatter": lambda c: c.reduce_scatter(out, x, [x.numel() // world] * world),
    }
    call = calls[args.op]
    times: dict[str, list[float]] = {w: [] for w in args.windows}
    for it in range(args.iters + args.warmup):
        for w in args.windows:
            c = comms[w]
            c.barrier()
            t0 = time.perf_counter()
            for _ in range(args.reps):
                call(c)
            if it >= args.warmup:
                times[w].append((time.perf_counter() - t0) / args.reps)
            if args.op == "all_reduce":
                x.div_(world)  # keep values bounded over many iterations
    q.put((rank, times))
    for c in comms.values():
        c.t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=["all_reduce", "broadcast", "reduce_scatter"], default="all_reduce")
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="back-to-back calls per timed block")
    ap.add_argument("--windows", default="2M,0")
    args = ap.parse_args()
    args.windows = [w.strip() for w in args.windows.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: each rank imports torch itself, as it must on macOS (fork + torch/Metal crashes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=900) for _ in range(args.world))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for w in args.windows:
        ts = sorted(max(got[r][w][i] for r in range(args.world)) for i in range(args.iters))
        med, p10, p90 = ts[len(ts) // 2], ts[len(ts) // 10], ts[len(ts) * 9 // 10]
        print(f"{args.op} {args.bytes} world {args.world} window {w:>5}: median {med * 1e6:9.1f} us  "
              f"p10 {p10 * 1e6:9.1f}  p90 {p90 * 1e6:9.1f}")


if __name__ == "__main__":
    main()
