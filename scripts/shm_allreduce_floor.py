"""The CPU floor of the shared-window all_reduce for 2 ranks: one rank's share of the data movement, run
alone in one process (no peer, no waits, the peer's buffer already in this core's cache), against one
memcpy of the whole tensor. Whatever the synchronisation costs, a 2-rank window all_reduce cannot beat
this number, and with two ranks sharing the memory bus it will not reach it.

    python scripts/shm_allreduce_floor.py --bytes 64M --rounds 256K,512K,1M,2M

Per round of R bytes a rank: copies its peer's half in (R/2), reduces its own half reading its input
and the peer's buffer (R/2, three streams), copies the result into its tensor (R/2), and copies the peer's
result out (R/2); see algorithms/windowed.py.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch_thunderbolt.config import parse_size


def one_rank(x: torch.Tensor, round_bytes: int, mine: torch.Tensor, peer: torch.Tensor) -> None:
    cap = round_bytes // x.element_size() // 2
    for lo in range(0, x.numel(), 2 * cap):
        mine[cap:].copy_(x[lo + cap : lo + 2 * cap])
        torch.add(x[lo : lo + cap], peer[:cap], out=mine[:cap])
        x[lo : lo + cap].copy_(mine[:cap])
        x[lo + cap : lo + 2 * cap].copy_(peer[cap:])


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--rounds", default="256K,512K,1M,2M")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(parse_size(args.bytes) // 4)
    y = torch.empty_like(x)
    for _ in range(2):  # interleaved, so a drifting machine moves every line alike
        ms = statistics.median(timed(lambda: y.copy_(x), args.repeats))
        print(f"memcpy {args.bytes}: {ms:.2f} ms")
        for r in args.rounds.split(","):
            n = parse_size(r) // x.element_size()
            mine, peer = torch.zeros(n), torch.randn(n)  # the window's buffers: made once, as in the backend
            t = timed(lambda: one_rank(x, parse_size(r), mine, peer), args.repeats)
            print(f"one rank's share, rounds of {r}: median {statistics.median(t):.2f} ms "
                  f"[{min(t):.2f}-{max(t):.2f}]")


if __name__ == "__main__":
    main()
