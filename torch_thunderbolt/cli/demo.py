"""`torch-thunderbolt demo`: start N local ranks, run a few collectives on the thunderbolt backend and print
what happened — the quickest way to see the backend work, no Thunderbolt cable needed."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from ..errors import ConfigError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    p.add_argument("--size", default="64M", help="bytes for the large all_reduce (default 64M)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before everything is stopped")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    if os.environ.get("TB_DEMO_RANK") is not None:
        return _rank_main(args)
    if not 1 <= args.nproc <= 16:
        raise ConfigError(f"--nproc: expected 1 to 16 local ranks, got {args.nproc}")
    port = _free_port()
    procs = []
    for r in range(args.nproc):
        env = dict(os.environ, TB_DEMO_RANK=str(r), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "torch_thunderbolt", "demo", "--size", args.size],
                                      env=env, start_new_session=True))
    deadline = time.monotonic() + args.timeout
    code = 0
    try:
        for p in procs:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
            code = code or rc
            if rc:
                break
    except subprocess.TimeoutExpired:
        print("demo: timed out; stopping every rank", file=sys.stderr)
        code = 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return code


def _rank_main(args: argparse.Namespace) -> int:
    import statistics

    import torch
    import torch.distributed as dist

    from ..backend.registration import register
    from ..config import parse_size
    from .main import self_command

    register()  # the command line's import of the package does not (torch_thunderbolt/__init__.py)
    dist.init_process_group("thunderbolt")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    say(f"torch-thunderbolt demo: {world} local ranks on backend '{dist.get_backend()}' (torch {torch.__version__})")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    say(f"  all_reduce of [rank+1]*4          -> {x.tolist()}  (expected {[world * (world + 1) / 2] * 4})")
    if world > 1:
        if rank == 0:
            dist.send(torch.arange(3.0), dst=1)
        elif rank == 1:
            got = torch.empty(3)
            dist.recv(got, src=0)
            print(f"  rank 1 received from rank 0       -> {got.tolist()}", flush=True)
        dist.barrier()
    names = [None] * world
    dist.all_gather_object(names, f"rank{rank}@{socket.gethostname()}")
    say(f"  all_gather_object                  -> {names}")
    n = parse_size(args.size, "--size") // 4
    big = torch.ones(n)
    for label, count in (("4 KB", 1024), (args.size, n)):
        t = torch.ones(count)
        dist.all_reduce(t)
        times = []
        for _ in range(20 if count <= 1024 else 5):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        bus = 2 * (world - 1) / world * count * 4 / med / 1e9 if world > 1 else 0.0
        say(f"  all_reduce {label:>6}: median {med * 1e6:10.1f} us   busbw {bus:6.2f} GB/s")
    kind = getattr(getattr(dist.group.WORLD, "transport", None), "kind", None)
    if kind:
        say(f"  (these ranks moved their bytes over {kind}; gloo always uses TCP: `bench --transport tcp` compares "
            "the same path)")
    del big
    dist.destroy_process_group()
    say(f"done. Compare with gloo: {self_command()} bench --ops all_reduce --sizes 4K,64M")
    return 0
