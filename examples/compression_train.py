"""Measure gradient compression: all-reduce error per mode, then DDP training with each hook.

    python examples/compression_train.py                    # 2 ranks on gloo, 500 steps per mode
    python examples/compression_train.py --backend thunderbolt --steps 200 --modes fp32,int8

Starts --world-size local processes (loopback). Part 1 all-reduces random tensors through each mode and
prints the error against the exact fp64 sum; part 2 trains the same MLP from the same seed on the same
synthetic data once per mode (fp32 = DDP without hook) and prints the final loss and the time.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from torch_thunderbolt.compression import compressed_all_reduce, wire_bytes
from torch_thunderbolt.hooks import CompressionState, bf16_hook, fp16_hook, int8_hook
from torch_thunderbolt.transport.netif import loopback_ifname

TRAIN_MODES = {
    "fp32": (None, False),
    "int8": (int8_hook, True),
    "int8-noef": (int8_hook, False),
    "fp16": (fp16_hook, False),
    "bf16": (bf16_hook, False),
}


def error_table(rank: int, world: int, numel: int, block: int) -> list[str]:
    """Relative errors of compressed_all_reduce on two kinds of data, per mode."""
    lines = [f"{'data':<14}{'mode':<6}{'rel L2 err':>12}{'max err/max|sum|':>18}{'wire B/rank':>14}{'vs fp32':>9}"]
    kinds = {
        "gaussian": lambda g: torch.randn(world, numel, generator=g),
        # gradient-like: most entries tiny, a few large (what block scaling must cope with)
        "heavy-tailed": lambda g: torch.randn(world, numel, generator=g) * torch.rand(world, numel, generator=g).pow(6),
    }
    for kind, make in kinds.items():
        inputs = make(torch.Generator().manual_seed(7))
        exact = inputs.double().sum(dim=0)
        for mode in ("int8", "fp16", "bf16"):
            result = compressed_all_reduce(inputs[rank].clone(), mode, block_size=block).double()
            err = result - exact
            sent = wire_bytes(numel, mode, world, block)
            lines.append(
                f"{kind:<14}{mode:<6}{(err.norm() / exact.norm()).item():>12.2e}"
                f"{(err.abs().max() / exact.abs().max()).item():>18.2e}{sent:>14,}"
                f"{sent / wire_bytes(numel, 'none', world):>9.3f}"
            )
    return lines


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random 'teacher' MLP labels Gaussian inputs into 10 classes."""
    g = torch.Generator().manual_seed(1234)
    teacher = [torch.randn(64, 128, generator=g), torch.randn(128, 10, generator=g)]
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train(rank: int, mode: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(final train loss averaged over the last 50 steps, held-out loss, seconds) for one mode."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps, batch, block = args.steps, args.batch, args.block_size
    hook, ef = TRAIN_MODES[mode]
    model = DDP(make_model(args.hidden))
    if hook is not None:
        model.register_comm_hook(CompressionState(block_size=block, error_feedback=ef), hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(steps * batch, seed=100 + rank)  # each rank its own shard of the data
    losses = []
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.barrier()
    seconds = time.perf_counter() - start
    xt, yt = make_data(4096, seed=99)
    with torch.no_grad():
        held_out = nn.functional.cross_entropy(model.module(xt), yt).item()
    tail = losses[-50:]
    return sum(tail) / len(tail), held_out, seconds


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())  # "lo" on Linux, "lo0" on macOS
    if args.backend == "thunderbolt":
        import torch_thunderbolt  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    try:
        lines = error_table(rank, args.world_size, args.numel, args.block_size)
        if rank == 0:
            print(f"# all-reduce error, {args.world_size} ranks, {args.numel:,} fp32 elements, block {args.block_size}")
            print("\n".join(lines), flush=True)
            params = sum(p.numel() for p in make_model(args.hidden).parameters())
            print(f"\n# DDP training: MLP 64-{args.hidden}-{args.hidden}-10 ({params:,} params), "
                  f"batch {args.batch}/rank, SGD lr 0.05 m 0.9, {args.steps} steps, "
                  f"backend {args.backend}, {args.world_size} ranks")
            print(f"{'mode':<11}{'train loss':>12}{'held-out loss':>15}{'time (s)':>10}", flush=True)
        for mode in args.modes:
            train_loss, held_out, seconds = train(rank, mode, args)
            if rank == 0:
                print(f"{mode:<11}{train_loss:>12.4f}{held_out:>15.4f}{seconds:>10.2f}", flush=True)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", help="gloo (default) or thunderbolt")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256, help="MLP width (gradient size grows as its square)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--numel", type=int, default=1_000_000, help="elements in the error measurement")
    p.add_argument("--modes", default=",".join(TRAIN_MODES), help=f"comma list of {', '.join(TRAIN_MODES)}")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in TRAIN_MODES]
    if unknown or args.world_size < 1 or args.steps < 1:
        p.error(f"bad --modes {unknown}" if unknown else "--world-size and --steps must be >= 1")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mp.spawn(rank_main, args=(args, free_port()), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
