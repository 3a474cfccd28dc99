"""A/B of shared-memory configurations in the same processes: every variant gets its own shm transport,
and the ranks alternate between them call by call, so a drifting machine slows all variants alike.

    python scripts/shm_window_ab.py --op all_reduce --bytes 64M --iters 15 --windows 1M,2M,0
    python scripts/shm_window_ab.py --op reduce_scatter --bytes 64M --world 4 --windows 2M,0

`--windows`: THUNDERBOLT_SHM_WINDOW values (0 = no window: the collectives run over the slot rings).
Prints, per variant, the median / p10 / p90 of the per-call maximum over ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# Run from a checkout without installing: the package is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_main(args: argparse.Namespace) -> None:
    """One rank (started by main through torch_thunderbolt.testing.ranks): its per-call times per variant."""
    import torch
    import torch.distributed as dist

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config, parse_size
    from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60))
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
    print("RESULT " + json.dumps(times), flush=True)
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
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    raw_windows = args.windows
    args.windows = [w.strip() for w in args.windows.split(",")]
    if args.rank:
        rank_main(args)
        return
    from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks

    rank_args = ["--rank", "--op", args.op, "--bytes", args.bytes, "--iters", str(args.iters), "--warmup",
                 str(args.warmup), "--reps", str(args.reps), "--windows", raw_windows]
    with tempfile.TemporaryDirectory(prefix="tb-shm-window-ab-") as tmp:
        # Separate processes (each imports torch itself, as it must on macOS) that keep our environment.
        results = run_ranks(Path(__file__), args.world, Path(tmp), args=rank_args, setup=LOOPBACK.but(strip=()),
                            timeout=900)
    got = {res.rank: res.json() for res in results}
    for w in args.windows:
        ts = sorted(max(got[r][w][i] for r in range(args.world)) for i in range(args.iters))
        med, p10, p90 = ts[len(ts) // 2], ts[len(ts) // 10], ts[len(ts) * 9 // 10]
        print(f"{args.op} {args.bytes} world {args.world} window {w:>5}: median {med * 1e6:9.1f} us  "
              f"p10 {p10 * 1e6:9.1f}  p90 {p90 * 1e6:9.1f}")


if __name__ == "__main__":
    main()
