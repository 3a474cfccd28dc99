"""One-way latency of a plain `dist.send`/`dist.recv` ping-pong, per round trip, thunderbolt and gloo in the
same two processes (the bench times blocks of calls after a barrier; this times every round trip).

    torchrun --nproc-per-node 2 scripts/p2p_latency.py --bytes 4K --trips 3000
    THUNDERBOLT_TRANSPORT=tcp torchrun --nproc-per-node 2 scripts/p2p_latency.py --interleave

Without --interleave each backend runs all its round trips in one go (thunderbolt first, then gloo);
with it the two alternate in blocks of 20, as in the bench. Prints median / p10 / p90 of one way
(= round trip / 2) over the round trips after the first 10 %.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.config import parse_size

BLOCK = 20


def trip(rank: int, group, x: torch.Tensor, y: torch.Tensor) -> None:
    if rank == 0:
        dist.send(x, 1, group=group)
        dist.recv(y, 1, group=group)
    else:
        dist.recv(y, 0, group=group)
        dist.send(x, 0, group=group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="4K")
    ap.add_argument("--trips", type=int, default=3000)
    ap.add_argument("--interleave", action="store_true")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    groups = {"thunderbolt": dist.new_group(backend="thunderbolt"), "gloo": dist.new_group(backend="gloo")}
    x = torch.ones(parse_size(args.bytes) // 4)
    y = torch.empty_like(x)
    times: dict[str, list[float]] = {name: [] for name in groups}
    clock = time.perf_counter_ns
    order = [list(groups.items())] if not args.interleave else None
    for b in range(0, args.trips, BLOCK if args.interleave else args.trips):
        pairs = order[0] if order else list(groups.items())[:: 1 if (b // BLOCK) % 2 == 0 else -1]
        for name, group in pairs:
            for _ in range(BLOCK if args.interleave else args.trips):
                t = clock()
                trip(rank, group, x, y)
                times[name].append((clock() - t) / 2e3)
    if rank == 0:
        for name, ts in times.items():
            ts = sorted(ts[len(ts) // 10 :])
            print(f"{name}: one way {args.bytes} median {statistics.median(ts):.1f} us, "
                  f"p10 {ts[len(ts) // 10]:.1f}, p90 {ts[9 * len(ts) // 10]:.1f} ({len(ts)} round trips)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
