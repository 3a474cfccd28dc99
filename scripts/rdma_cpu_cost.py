#!/usr/bin/env python3
"""What our rdma path costs in Python per small op, on a fake verbs fabric: 2 local ranks, a --bytes
all_reduce over THUNDERBOLT_TRANSPORT=rdma, minus the time spent inside the fake fabric's own callbacks (its
delivery: Python, copies, files), beside the dispatch floor (the null process group of `bench --floor`,
timed the same way in the same processes).

    python scripts/rdma_cpu_cost.py              # --bytes 4096 --ops 3000 --runs 3

FAKE-FABRIC CPU COST, NOT RDMA SPEED: on real Thunderbolt 5 the wire takes ~4 us; here delivery is Python.
What is left after subtracting the fake's callbacks is the work of the backend, the engine and the rdma link
(posting, polling, copying in and out of the registered slots, ctypes calls into the provider), which on a
Mac is the latency on top of the wire. Run it on an otherwise idle machine with a core per rank: the two
ranks work in parallel, so a rank's time per op is its own work plus waiting for the other's message.
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
from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric  # noqa: E402
from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks  # noqa: E402


def _time_fake_callbacks() -> list[float]:
    """Make every callback of the fake provider add the seconds it takes to the returned cell (patched
    before the group creates its provider)."""
    from torch_thunderbolt.testing.fake_verbs import provider as fakeverbs

    spent = [0.0]
    original = fakeverbs.FakeProvider._guard

    def timed(self, name, fn, fail, locked=True):
        inner = original(self, name, fn, fail, locked)

        def call(*args):
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                spent[0] += time.perf_counter() - t0
        return call
    fakeverbs.FakeProvider._guard = timed
    return spent


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend
    from torch_thunderbolt.bench import null

    spent = _time_fake_callbacks()
    null.register()
    dist.init_process_group("thunderbolt")
    floor = dist.new_group(backend=null.NULL_BACKEND)
    x = torch.ones(int(os.environ["TB_BYTES"]) // 4)
    n, out = int(os.environ["TB_OPS"]), []
    for _ in range(int(os.environ["TB_RUNS"])):
        for group in (None, floor):
            for _ in range(200):
                dist.all_reduce(x, group=group)
            fake0, t0 = spent[0], time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x, group=group)
            total = (time.perf_counter() - t0) / n * 1e6
            out.append({"group": "floor" if group else "rdma", "us": total, "fake_us": (spent[0] - fake0) / n * 1e6})
    program.result(out)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work, fake_fabric(Path(work) / "fabric") as fabric:
        env = {**fabric_env(fabric), "THUNDERBOLT_TRANSPORT": "rdma", "TB_BYTES": str(args.bytes),
               "TB_OPS": str(args.ops), "TB_RUNS": str(args.runs)}
        runs = run_ranks(Path(__file__), 2, Path(work) / "run", env=env, setup=LOOPBACK, timeout=900)
    per_rank = [r.json() for r in runs]
    print(f"FAKE-FABRIC CPU COST, NOT RDMA SPEED: {args.bytes}-byte all_reduce, 2 ranks, {args.ops} ops x "
          f"{args.runs} runs (us per op, the slower rank of each run)")
    print(f"{'run':>4} {'total':>8} {'fake':>8} {'ours':>8} {'floor':>7} {'ours/floor':>10}")
    ratios = []
    for i in range(args.runs):
        rdma = [rank[2 * i] for rank in per_rank]
        floor = max(rank[2 * i + 1]["us"] for rank in per_rank)
        slow = max(rdma, key=lambda r: r["us"])
        ours = slow["us"] - slow["fake_us"]
        ratios.append(ours / floor)
        print(f"{i + 1:>4} {slow['us']:8.1f} {slow['fake_us']:8.1f} {ours:8.1f} {floor:7.1f} {ours / floor:10.2f}")
    print(f"median ours/floor: {statistics.median(ratios):.2f} (the target: 3)")
    return 0


if __name__ == "__main__":
    if os.environ.get("RANK") is not None:
        rank_main()
    else:
        sys.exit(main())
