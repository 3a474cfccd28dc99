"""A training job that goes on when one of its ranks is lost: the ranks that remain catch the
`PeerLostError`, leave the lost rank out with `dist.shrink_group`, and finish their steps on the smaller
group, with no restart and no checkpoint.

    torch-thunderbolt launch --on-failure shrink --nproc-per-host 3 -- \\
        python examples/shrink_job.py --kill-rank 2 --kill-step 5       # rank 2 kills itself at step 5
    torch-thunderbolt launch --on-failure shrink --nproc-per-host 3 -- \\
        python examples/shrink_job.py --steps 200 --pace 0.1           # kill -9 any rank's pid yourself

On several Macs: `--hostfile hosts.json` (or one `torch-thunderbolt torchrun` per Mac), as in
docs/fault-tolerance.md, "Running a job that shrinks". Without `--on-failure shrink` the launcher (and
torchrun with several workers per node) stops the other ranks as soon as one dies.

Data parallel by hand, so each step is one visible collective: every rank holds the whole (tiny) model,
computes the gradient of its slice of the step's global batch, and `all_reduce`s the flattened gradients.
Step s always trains on the same `--global-batch` samples, made from (seed, s) alone; rank r of w takes
the r-th of w near-equal slices, and its loss is the SUM of its samples' squared errors divided by the
global batch, so the summed gradient is the whole batch's mean-loss gradient whatever the world size.

When the all_reduce raises `PeerLostError`, its `peer` is the lost rank (numbered in the current group).
The ranks that remain call `dist.shrink_group([peer])`, which makes the shrunk group the default one;
`dist.get_rank()` / `dist.get_world_size()` (torch's API, on the new group) give their new numbers, 0..n-1
in their old order. They agree on the steps every one of them finished (the smallest: a rank may have
completed the step the loss broke while another did not), put the weights back as they were before that
step, and go on, re-slicing each batch over n ranks.

Checks, each exact or to float64 rounding: every step's all_reduce counts the samples it summed, which must
be the global batch; at the end the replicas' weights must be equal bit for bit across the ranks that
remain, and equal a one-process run of the same steps to 1e-9 relative. Each rank prints one line
`SHRINK_JOB {json}` and exits 0 when all hold (1 when one does not).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

SEED = 1234
IN, HIDDEN, OUT = 8, 16, 2
TOLERANCE = 1e-9


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s samples: a function of (seed, step) only, the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(size, IN, generator=g, dtype=torch.float64)
    return x, torch.sin(2.0 * x[:, :OUT])


def my_slice(step: int, size: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, size)
    lo, hi = rank * size // world, (rank + 1) * size // world
    return x[lo:hi], y[lo:hi]


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, size: int) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / size


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_weights(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, model.parameters())


def apply_gradient(model: nn.Module, flat_grad: torch.Tensor, lr: float) -> None:
    set_weights(model, weights(model) - lr * flat_grad)


def reference(args: argparse.Namespace) -> torch.Tensor:
    """One process, every step once on its whole global batch: the weights the job must reach."""
    model = make_model()
    for step in range(args.steps):
        model.zero_grad()
        batch_loss(model, *global_batch(step, args.global_batch), args.global_batch).backward()
        apply_gradient(model, torch.cat([p.grad.reshape(-1) for p in model.parameters()]), args.lr)
    return weights(model)


def train(args: argparse.Namespace) -> int:
    from torch_thunderbolt import PeerLostError  # importing torch_thunderbolt registers the backend

    if not hasattr(dist, "shrink_group"):
        raise SystemExit("this torch has no dist.shrink_group: see docs/fault-tolerance.md, 'A torch without "
                         "dist.shrink_group'")
    dist.init_process_group(args.backend)
    first_rank, first_world = dist.get_rank(), dist.get_world_size()
    members = list(range(first_world))  # the first rank of each rank of the current group
    lost: list[dict] = []
    model = make_model()
    before = {0: weights(model)}  # the weights before step s, for the last two steps
    step, agreed = 0, True
    while step < args.steps:
        try:
            if not agreed:  # just shrunk: go back to the last step every rank that remains finished
                done = torch.tensor([step])
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
                step, agreed = int(done.item()), True
                set_weights(model, before[step])
            if first_rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost Mac, in one line
            rank, world = dist.get_rank(), dist.get_world_size()
            x, y = my_slice(step, args.global_batch, rank, world)
            model.zero_grad()
            batch_loss(model, x, y, args.global_batch).backward()
            # The gradients and, last, how many samples this rank took: after the sum, the global batch.
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [torch.tensor([float(len(x))])])
            dist.all_reduce(flat)
        except PeerLostError as exc:
            lost.append({"rank": members.pop(exc.peer), "step": step, "time": time.time()})
            print(f"shrink_job: rank {first_rank}: lost rank {lost[-1]['rank']} at step {step}: {exc}",
                  file=sys.stderr, flush=True)
            dist.shrink_group([exc.peer])  # only the ranks that stay call it; it replaces the default group
            agreed = False
            continue
        if flat[-1].item() != args.global_batch:
            raise SystemExit(f"rank {first_rank}: step {step}'s all_reduce summed {flat[-1].item():g} samples, "
                             f"expected the global batch of {args.global_batch}")
        apply_gradient(model, flat[:-1], args.lr)
        step += 1
        before[step] = weights(model)
        before.pop(step - 2, None)
        if args.pace:
            time.sleep(args.pace)  # stands in for a real model's compute, so a kill by hand lands mid-run
    mine = weights(model)
    lowest, highest = mine.clone(), mine.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    same = bool(torch.equal(lowest, mine) and torch.equal(highest, mine))
    ref = reference(args)
    diff = float(((mine - ref).abs().max() / ref.abs().max()).item())
    report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "first_rank": first_rank,
              "first_world": first_world, "steps": step, "lost": lost, "replicas_equal": same,
              "max_relative_difference": diff, "ok": same and diff <= TOLERANCE}
    print("SHRINK_JOB " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    return 0 if report["ok"] else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step over all ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself at --kill-step")
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--backend", default="thunderbolt")
    args = parser.parse_args()
    if args.steps < 1 or args.global_batch < 1:
        parser.error("--steps and --global-batch must be >= 1")
    sys.exit(train(args))


if __name__ == "__main__":
    main()
