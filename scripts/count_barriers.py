#!/usr/bin/env python3
"""Count the memory fences each shared-memory op makes, and time what one fence call costs.

    python scripts/count_barriers.py                       # 2 and 4 ranks, with and without the window
    python scripts/count_barriers.py --ranks 2 --ops 100 --no-rings

Each rank wraps the fence functions of `transport/ordering.py` (acquire, release, full) with counters
before it joins the group, then runs each case (warm-up ops, then --ops counted ones) and reports calls
per op by kind. Cases: all_reduce and broadcast of 4 KB and 1 MB, and a send/recv ping-pong between rank
pairs (0-1, 2-3: one send and one receive per rank per op, over the slot rings), once with the shared
window (the default) and once with THUNDERBOLT_SHM_WINDOW=0 (collectives over the rings).

The parent then times, as medians of interleaved repeats: a call through ctypes of a libc function that
does no work and takes nothing (`getpagesize`, the shape of libSystem's OSMemoryBarrier), the lock fence
(x86's full fence), the fences this machine selected, and an empty Python function. On arm64 macOS every
fence is one such ctypes call plus a `dmb ish`; on x86 acquire and release are nothing and only `full` is
the lock. Counts depend on timing a little (a rank that sleeps makes the sleep handshake's fences), so
each line shows the rank mean and the range over ranks.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_thunderbolt.testing import program  # noqa: E402
from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks  # noqa: E402

KINDS = ("acquire", "release", "full")
CASES = (("all_reduce", 4096), ("all_reduce", 1 << 20), ("broadcast", 4096), ("broadcast", 1 << 20),
         ("sendrecv", 4096), ("sendrecv", 1 << 20))
WARM = 20


def _count_fences(sites: dict[str, int] | None) -> dict[str, int]:
    """Wrap the ordering module's fences with counters (the code looks them up on the module each call);
    with `sites`, count by calling function too."""
    from torch_thunderbolt.transport import ordering

    counts = dict.fromkeys(KINDS, 0)
    for kind in KINDS:
        fn = getattr(ordering, kind)

        def counted(fn=fn, kind=kind) -> None:
            counts[kind] += 1
            if sites is not None:
                code = sys._getframe(1).f_code
                site = f"{kind} in {getattr(code, 'co_qualname', code.co_name)}"
                sites[site] = sites.get(site, 0) + 1
            fn()

        setattr(ordering, kind, counted)
    return counts


def _op(name: str, nbytes: int, rank: int, world: int):
    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x)
    if name == "broadcast":
        return lambda: dist.broadcast(x, 0)
    partner = rank ^ 1
    if partner >= world:
        return lambda: None
    if rank % 2 == 0:
        return lambda: (dist.send(x, partner), dist.recv(x, partner))
    return lambda: (dist.recv(x, partner), dist.send(x, partner))


def rank_main() -> None:
    sites: dict[str, int] | None = {} if os.environ.get("TB_SITES") else None
    counts = _count_fences(sites)
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    dist.init_process_group("thunderbolt")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(os.environ["TB_OPS"])
    out = {}
    for name, nbytes in CASES:
        op = _op(name, nbytes, rank, world)
        for _ in range(WARM):
            op()
        dist.barrier()
        for k in KINDS:
            counts[k] = 0
        if sites is not None:
            sites.clear()
        for _ in range(n):
            op()
        out[f"{name} {nbytes}"] = {k: counts[k] / n for k in KINDS}
        if sites is not None:
            out[f"{name} {nbytes}"]["sites"] = {k: v / n for k, v in sorted(sites.items())}
        dist.barrier()
    program.result(out)
    dist.destroy_process_group()


def _per_call_ns(fn, number: int = 100_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e9


def time_calls(rounds: int) -> dict[str, float]:
    """Median ns per call of each candidate, measured in interleaved rounds."""
    from torch_thunderbolt.transport import ordering

    noop = ctypes.CDLL(None).getpagesize
    noop.restype, noop.argtypes = None, []
    lock = threading.Lock()

    def lock_fence() -> None:
        lock.acquire()
        lock.release()

    def empty() -> None:
        pass

    candidates = {"ctypes no-op (getpagesize)": noop, "lock acquire+release": lock_fence,
                  "empty Python function": empty,
                  **{f"ordering.{k} (this machine)": getattr(ordering, k) for k in KINDS}}
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples[name].append(_per_call_ns(fn))
    return {name: statistics.median(v) for name, v in samples.items()}


def count(world: int, window: bool, ops: int, sites: bool) -> dict[str, list[dict]]:
    env = {"THUNDERBOLT_TRANSPORT": "shm", "TB_OPS": str(ops), "TB_SITES": "1" if sites else ""}
    if not window:
        env["THUNDERBOLT_SHM_WINDOW"] = "0"
    with tempfile.TemporaryDirectory() as work:
        runs = run_ranks(Path(__file__), world, Path(work), env=env, setup=LOOPBACK, timeout=900)
    per_rank = [r.json() for r in runs]
    return {case: [r[case] for r in per_rank] for case in per_rank[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes (\"\": time the calls only)")
    ap.add_argument("--ops", type=int, default=100, help="counted ops per case")
    ap.add_argument("--no-rings", action="store_true", help="skip the runs with THUNDERBOLT_SHM_WINDOW=0")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--sites", action="store_true", help="also show calls per op by calling function (rank 0)")
    args = ap.parse_args()
    ns = time_calls(args.rounds)
    print("ns per call (median of %d interleaved rounds, each the best of 3 x 100000 calls):" % args.rounds)
    for name, v in ns.items():
        print(f"  {name:36s} {v:7.1f}")
    ctypes_ns, lock_ns = ns["ctypes no-op (getpagesize)"], ns["lock acquire+release"]
    print(f"\nfences per op (rank mean [min-max]); cost: arm64 macOS = every fence x {ctypes_ns:.0f} ns "
          f"(a ctypes call, plus the dmb); x86 = full x {lock_ns:.0f} ns")
    print(f"{'case':22s} {'ranks':>5s} {'memory':>6s} {'acquire':>14s} {'release':>14s} {'full':>14s} "
          f"{'arm64 us':>8s} {'x86 us':>7s}")
    for world in [int(w) for w in args.ranks.split(",") if w]:  # --ranks "": the timings alone
        for window in (True,) if args.no_rings else (True, False):
            for case, ranks in count(world, window, args.ops, args.sites).items():
                cols = []
                means = {}
                for k in KINDS:
                    vals = [r[k] for r in ranks]
                    means[k] = statistics.mean(vals)
                    cols.append(f"{means[k]:5.2f} [{min(vals):.1f}-{max(vals):.1f}]")
                arm = sum(means.values()) * ctypes_ns / 1000
                x86 = means["full"] * lock_ns / 1000
                print(f"{case:22s} {world:5d} {'window' if window else 'rings':>6s} {cols[0]:>14s} {cols[1]:>14s} "
                      f"{cols[2]:>14s} {arm:8.2f} {x86:7.2f}")
                for site, per_op in ranks[0].get("sites", {}).items():
                    print(f"    rank 0: {per_op:5.2f} {site}")
    return 0


if __name__ == "__main__":
    sys.exit(rank_main() if "RANK" in os.environ else main())  # run_ranks starts this file as each rank
