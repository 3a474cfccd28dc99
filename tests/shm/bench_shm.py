"""Interleaved benchmark: all_reduce over the shm transport, the TCP transport and gloo, in the same
processes, plus single-core memcpy bandwidth measured in the same run.

    .venv/bin/python tests/shm/bench_shm.py --world 2 --repeats 15
    .venv/bin/python tests/shm/bench_shm.py --world 4 --repeats 7 --sizes 4K,64M

Each repeat runs every backend once per size (4 KB: the median of a batch of ops; large: one op), so
all backends see the same moments of this VM's noisy memory bandwidth. Prints medians and [p10-p90].
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _stats(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    return statistics.median(s), s[len(s) // 10], s[min(len(s) - 1, (len(s) * 9) // 10)]


def rank_main(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config, parse_size
    from torch_thunderbolt.rendezvous.tcp import connect_tcp
    from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm

    torch.set_num_threads(1)
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0, timeout=timedelta(seconds=60))
    cfg = Config.from_env()
    comms = {"shm": Communicator(connect_shm(dist.PrefixStore("shm", store), r, w, cfg, 60), cfg, 120)}
    for v in filter(None, args.variants.split(",")):  # name:slot:slots[:spin_us] — other shm settings, same run
        name, slot, slots, *spin = v.split(":")
        opts = ShmOptions(parse_size(slot), int(slots), float(spin[0]) if spin else None)
        comms[name] = Communicator(connect_shm(dist.PrefixStore(name, store), r, w, cfg, 60, opts), cfg, 120)
    if "tcp" in args.backends:
        comms["tcp"] = Communicator(connect_tcp(dist.PrefixStore("tcp", store), r, w, cfg, 60), cfg, 120)
    if "gloo" in args.backends:
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=r, world_size=w)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    bufs = {n: torch.ones(n // 4) for n in sizes}

    def op(backend: str, x: torch.Tensor) -> None:
        comms[backend].all_reduce(x) if backend in comms else dist.all_reduce(x)

    backends = [b for b in args.backends.split(",") if b in comms or b == "gloo"]
    backends += [v.split(":")[0] for v in filter(None, args.variants.split(","))]
    times: dict[str, list[float]] = {f"{b} {n}": [] for b in backends for n in sizes}
    copy_bw: list[float] = []
    src, dst = torch.ones(64 << 18), torch.empty(64 << 18)
    for n in sizes:  # warm-up: plans, page faults
        for b in backends:
            op(b, bufs[n])
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_bw.append((64 << 20) / (time.perf_counter() - t0) / 1e9)
        for n in sizes:
            batch = 50 if n <= 65536 else 1
            for b in backends:
                per = []
                for _ in range(batch):
                    t0 = time.perf_counter()
                    op(b, bufs[n])
                    per.append(time.perf_counter() - t0)
                times[f"{b} {n}"].append(statistics.median(per))
    if r == 0:
        print("RESULT " + json.dumps({"times": times, "copy_gbs": copy_bw}), flush=True)
    for c in comms.values():
        c.t.close()
    if "gloo" in backends:
        dist.destroy_process_group()


def report(res: dict, world: int) -> None:
    cmed, clo, chi = _stats(res["copy_gbs"])
    print(f"single-core memcpy 64 MB: {cmed:.2f} GB/s [{clo:.2f}-{chi:.2f}]")
    keys = sorted(res["times"], key=lambda k: (int(k.split()[1]), k))
    for k in keys:
        b, n = k.split()
        n = int(n)
        med, lo, hi = _stats(res["times"][k])
        busbw = n / med / 1e9 * 2 * (world - 1) / world
        gloo = res["times"].get(f"gloo {n}")
        ratio = f"  x{statistics.median(res['times'][f'gloo {n}']) / med:.1f} vs gloo" if gloo else ""
        print(f"{b:8s} {n:>10d} B  {med * 1e6:10.1f} us [{lo * 1e6:.1f}-{hi * 1e6:.1f}]  busbw {busbw:6.2f} GB/s "
              f"({busbw / cmed * 100:5.1f}% of memcpy){ratio}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sizes", default="4K,64M")
    ap.add_argument("--backends", default="shm,tcp,gloo")
    ap.add_argument("--variants", default="", help="extra shm settings, e.g. shm16:1M:16,spin0:1M:4:0")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks

    rank_args = ["--rank", "--repeats", str(args.repeats), "--sizes", args.sizes, "--backends", args.backends,
                 "--variants", args.variants]
    with tempfile.TemporaryDirectory(prefix="tb-bench-shm-") as tmp:
        # The ranks keep our environment (THUNDERBOLT_SHM_* settings included): the variants are measured
        # under the settings this benchmark is run with.
        results = run_ranks(Path(__file__), args.world, Path(tmp), args=rank_args, setup=LOOPBACK.but(strip=()),
                            timeout=1800)
    print(f"world {args.world}, {args.repeats} repeats, load avg {os.getloadavg()[0]:.1f}")
    report(results[0].json(), args.world)


if __name__ == "__main__":
    main()
