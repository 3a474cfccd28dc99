"""DDP training that survives a Mac leaving: checkpoints every K steps, resumes with however many ranks
the elastic restart gives it, and reaches the same weights whatever the world size.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1       # a new store per restart (docs/fault-tolerance.md)
    torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=MAC0_TB_ADDRESS:29400 --rdzv-id=job1 --local-addr=THIS_MAC_TB_ADDRESS \\
        --rdzv-conf=last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3,is_host=true \\
        examples/elastic_train.py --checkpoint-dir /shared/ckpt --steps 60 --every 10    # is_host=false elsewhere
    python examples/elastic_train.py --reference --steps 60 --out ref.pt      # one process, no torch.distributed

Why the result does not depend on the world size: step s always trains on the same global batch of
`--global-batch` samples, made from (seed, s) alone, and each of the W ranks takes an equal contiguous
slice of it (the global batch must be divisible by every world size the job may have: 12 serves 1, 2, 3,
4 and 6). Each rank's loss is the SUM of its samples' losses divided by the global batch size times W; DDP
sums the gradients and divides by W, so every rank steps with d/dw (sum of all per-sample losses / global
batch), the single-process full-batch gradient. Only the order of the float additions differs (a slice's
sum, then the all-reduce's), so weights agree to rounding (float64 here: ~1e-15 relative per step).

The checkpoint holds the model, the optimizer (its momentum) and the number of steps done. Rank 0 writes
it to a temporary file in the same directory and renames it into place, so a kill mid-write leaves the
previous checkpoint whole; every rank loads the newest at start. Steps after the last checkpoint are lost
and re-run after a restart: on the same batches, so the weights are those of an uninterrupted run.
On real Macs `--checkpoint-dir` must be storage every Mac reads (a shared volume), or copied to the Macs
that restart.

Each rank prints one `ELASTIC {...}` JSON line when it starts (world size, step resumed from) and when
it finishes (the final weights' checksum); rank 0 writes the final weights to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

SEED = 1234
IN, HIDDEN, OUT = 16, 32, 4


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of global step `step`: a function of (seed, step) only, so any rank of any world size
    (or the reference) rebuilds exactly the same ones."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(size, IN, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :OUT] * 2.0) + 0.1 * torch.randn(size, OUT, generator=g, dtype=torch.float64)
    return x, y


def shard(step: int, size: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    if size % world:
        raise SystemExit(f"rank {rank}: --global-batch {size} is not divisible by the world size {world}; "
                         "pick a global batch divisible by every world size the job may restart with")
    per = size // world
    x, y = global_batch(step, size)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def sum_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def save_atomic(state: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on one filesystem: readers see the old file or the new one, never half


def load_latest(path: Path) -> dict | None:
    return torch.load(path, weights_only=True) if path.exists() else None


def reference(args: argparse.Namespace) -> nn.Module:
    """One process, the full global batch each step, no torch.distributed: what the job must reach."""
    model = make_model()
    opt = make_optimizer(model)
    for step in range(args.steps):
        x, y = global_batch(step, args.global_batch)
        opt.zero_grad()
        (sum_loss(model, x, y) / args.global_batch).backward()
        opt.step()
    return model


def emit(obj: dict) -> None:
    print("ELASTIC " + json.dumps(obj), flush=True)


def train(args: argparse.Namespace) -> nn.Module:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_thunderbolt  # noqa: F401  (registers backend "thunderbolt")

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.checkpoint_dir) / "checkpoint.pt"
    model = make_model()
    opt = make_optimizer(model)
    state = load_latest(ckpt)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DDP(model)  # broadcasts rank 0's weights: equal anyway, every rank loaded the same file
    emit({"event": "start", "rank": rank, "world": world, "from_step": start,
          "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "time": time.time()})
    for step in range(start, args.steps):
        x, y = shard(step, args.global_batch, rank, world)
        opt.zero_grad()
        # DDP divides the summed gradients by `world`: multiplying by it here leaves sum/global_batch.
        (sum_loss(ddp, x, y) * (world / args.global_batch)).backward()
        opt.step()
        if step == start:
            emit({"event": "first_step", "rank": rank, "world": world, "step": step, "time": time.time()})
        done = step + 1
        if done % args.every == 0 and done < args.steps:
            if rank == 0:
                save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done}, ckpt)
            dist.barrier()  # nobody runs ahead of a checkpoint that might still be unwritten
            if rank == 0:
                emit({"event": "checkpoint", "step": done, "world": world, "time": time.time()})
        if args.pace:
            time.sleep(args.pace)  # stands in for a real model's compute, so a kill lands mid-training
    emit({"event": "done", "rank": rank, "world": world, "checksum": checksum(model)})
    dist.destroy_process_group()
    return model if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument("--global-batch", type=int, default=12,
                        help="samples per step over all ranks; divisible by every world size (default 12)")
    parser.add_argument("--checkpoint-dir", default="elastic_ckpt")
    parser.add_argument("--out", default=None, help="write the final weights here (rank 0)")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--backend", default="thunderbolt")
    parser.add_argument("--reference", action="store_true", help="one process, no torch.distributed")
    args = parser.parse_args()
    if args.every < 1 or args.steps < 1 or args.global_batch < 1:
        parser.error("--steps, --every and --global-batch must be >= 1")
    if args.reference:
        model = reference(args)
        emit({"event": "done", "rank": 0, "world": 1, "checksum": checksum(model)})
    else:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        model = train(args)
    if model is not None and args.out:
        save_atomic({k: v.clone() for k, v in model.state_dict().items()}, Path(args.out))


if __name__ == "__main__":
    main()
