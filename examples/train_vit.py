"""Data-parallel ViT training (DDP) on synthetic images, and the ViT-B/16 gradient all_reduce on its own.

Training reports step time, images/s and two views of communication cost:
  * busy share: the time at least one gradient bucket's all_reduce is in flight (timed by wrapping the
    DDP communication hook), over the step time; it overlaps with backward compute;
  * exposed share: (step time - step time without communication) / step time, the no-communication step
    measured afterwards with DDP's `no_sync()`.
`--compression int8|fp16|bf16` uses torch_thunderbolt.hooks (fp16/bf16 fall back to torch's own hooks when
that is not installed). `--allreduce-only` times one all_reduce of the ViT-B/16 gradient (86.6 M floats).
`--device mps` trains on the Mac's GPU (`auto`, the default, picks it where there is one); `--fake-mps`
stands in for it with the fake accelerator of torch_thunderbolt.testing (to test without a Mac).

    python examples/train_vit.py --backend gloo --preset small --steps 5 --json vit.json
    torchrun --nproc-per-node 2 examples/train_vit.py --preset base --compression int8 --device mps
    python examples/train_vit.py --backend gloo --allreduce-only --steps 10
"""
from __future__ import annotations

import argparse
import importlib
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from models.launch import RankInfo, add_launch_args, import_thunderbolt, launch, median, pick_device, run_main
from torch_thunderbolt.testing.models.vit import PRESETS, SyntheticImages, ViT, make_config, param_count

COMPRESSIONS = ("int8", "fp16", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--image-size", type=int, default=None, help="override the preset's image size")
    p.add_argument("--batch", type=int, default=8, help="images per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (DDP builds buckets)")
    p.add_argument("--nosync-steps", type=int, default=None,
                   help="steps without communication for the baseline (default: --steps; 0 skips)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--compression", choices=COMPRESSIONS, default=None)
    p.add_argument("--device", choices=("auto", "cpu", "mps"), default="auto",
                   help="where the model trains (auto: mps where there is one, else cpu)")
    p.add_argument("--fake-mps", action="store_true",
                   help="for tests: torch_thunderbolt.testing's fake accelerator stands in for mps")
    p.add_argument("--allreduce-only", action="store_true",
                   help="only time all_reduce of a float32 tensor of the ViT-B/16 gradient size")
    p.add_argument("--numel", type=int, default=None, help="--allreduce-only tensor size (floats)")
    args = p.parse_args(argv)
    if min(args.batch, args.steps) < 1 or args.warmup < 0:
        raise ValueError("--batch and --steps must be >= 1, --warmup >= 0")
    if args.nosync_steps is None:
        args.nosync_steps = args.steps
    make_config(args.preset, image_size=args.image_size)  # fail early on a bad size
    if not args.fake_mps:
        pick_device(args.device)  # fail early when mps is asked for where there is none
    select_hook(args.compression)  # fail early when int8 is asked for without torch_thunderbolt.hooks
    return args


Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def select_hook(compression: str | None) -> tuple[Hook, Callable[[], Any], str]:
    """(hook, state factory, description) for DDP.register_comm_hook."""
    if compression is None:
        return default_hooks.allreduce_hook, lambda: None, "allreduce_hook (torch)"
    try:
        import_thunderbolt()
        hooks = importlib.import_module("torch_thunderbolt.hooks")
    except ImportError as exc:
        fallback = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        if compression not in fallback:
            raise ValueError(f"--compression {compression} needs torch_thunderbolt.hooks ({exc})") from exc
        return fallback[compression], lambda: None, f"{fallback[compression].__name__} (torch)"
    return (getattr(hooks, f"{compression}_hook"), lambda: hooks.CompressionState(process_group=None),
            f"torch_thunderbolt.hooks.{compression}_hook")


class CommRecorder:
    """Wraps a DDP comm hook; records (start, end) of every bucket's communication future."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.intervals: list[tuple[float, float]] = []

    def wrap(self, hook: Hook) -> Hook:
        # No annotations: DDP compares them to the real classes and this module's are strings.
        def timed_hook(state, bucket):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            fut = hook(state, bucket)

            def done(f: torch.futures.Future) -> torch.Tensor:
                value = f.value()  # re-raises a failed all_reduce into DDP
                with self._lock:
                    self.intervals.append((start, time.perf_counter()))
                return value

            return fut.then(done)

        return timed_hook

    def take_busy_seconds(self) -> float:
        """Length of the union of recorded intervals (buckets overlap each other); clears them."""
        with self._lock:
            spans, self.intervals = sorted(self.intervals), []
        busy, end = 0.0, float("-inf")
        for s, e in spans:
            if e > end:
                busy += e - max(s, end)
                end = e
        return busy


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, images: torch.Tensor,
               labels: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    opt.step()
    return loss.item()


def rank_device(args: argparse.Namespace) -> torch.device:
    """The device this rank trains on. The fake accelerator must be installed in each rank's process
    before its first backward pass (autograd counts the devices then)."""
    if not args.fake_mps or args.device == "cpu":
        return pick_device(args.device)
    import_thunderbolt()
    fake_device = importlib.import_module("torch_thunderbolt.testing.fake_device")
    fake_device.install()
    return torch.device(fake_device.DEFAULT_NAME, 0)


def train(args: argparse.Namespace, info: RankInfo) -> dict[str, Any] | None:
    cfg = make_config(args.preset, image_size=args.image_size)
    device = rank_device(args)
    torch.manual_seed(args.seed)
    ddp = DDP(ViT(cfg).to(device), bucket_cap_mb=args.bucket_mb)
    hook, make_state, hook_name = select_hook(args.compression)
    recorder = CommRecorder()
    ddp.register_comm_hook(make_state(), recorder.wrap(hook))
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    data = SyntheticImages(cfg, args.seed)

    losses, step_s, busy_s = [], [], []
    for step in range(args.warmup + args.steps):
        images, labels = data.batch(args.batch, info.rank, step)
        images, labels = images.to(device), labels.to(device)
        t0 = time.perf_counter()
        losses.append(train_step(ddp, opt, images, labels))
        elapsed = time.perf_counter() - t0
        busy = recorder.take_busy_seconds()
        if step >= args.warmup:
            step_s.append(elapsed)
            busy_s.append(busy)
    # Mean loss over ranks per step, gathered once at the end so it does not disturb the timing.
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    losses = (loss_t / info.world).tolist()

    # Baseline without communication; replicas drift apart from here on, which no longer matters.
    nosync_s = []
    for step in range(args.nosync_steps):
        images, labels = data.batch(args.batch, info.rank, 10_000 + step)
        images, labels = images.to(device), labels.to(device)
        t0 = time.perf_counter()
        with ddp.no_sync():
            train_step(ddp, opt, images, labels)
        nosync_s.append(time.perf_counter() - t0)
    if info.rank:
        return None
    step_med, busy_med = median(step_s), median(busy_s)
    nosync_med = median(nosync_s) if nosync_s else float("nan")
    params = sum(p.numel() for p in ddp.parameters())
    result = {
        "example": "train_vit", "mode": "ddp", "backend": info.backend, "world_size": info.world,
        "device": device.type,
        "preset": args.preset, "config": asdict(cfg), "params": params, "grad_bytes": params * 4,
        "batch_per_rank": args.batch, "threads_per_rank": torch.get_num_threads(),
        "compression": args.compression, "hook": hook_name, "bucket_mb": args.bucket_mb,
        "step_ms": [s * 1e3 for s in step_s], "step_ms_median": step_med * 1e3,
        "images_per_s": args.batch * info.world / step_med,
        "comm_busy_ms_median": busy_med * 1e3, "comm_busy_share": busy_med / step_med,
        "nosync_step_ms_median": nosync_med * 1e3, "comm_exposed_share": (step_med - nosync_med) / step_med,
        "losses": losses, "torch": torch.__version__,
    }
    print(f"ViT DDP: backend {info.backend}, device {device.type}, preset {args.preset} "
          f"({params / 1e6:.1f} M params, image "
          f"{cfg.image_size}), {info.world} ranks x batch {args.batch}, {result['threads_per_rank']} "
          f"thread(s)/rank, hook {hook_name}\n"
          f"  step {step_med * 1e3:.1f} ms (median of {len(step_s)}), {result['images_per_s']:.2f} images/s\n"
          f"  all_reduce in flight {busy_med * 1e3:.1f} ms/step ({100 * result['comm_busy_share']:.0f}% of "
          f"step); step without comm {nosync_med * 1e3:.1f} ms -> exposed comm "
          f"{100 * result['comm_exposed_share']:.0f}%\n"
          f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return result


def allreduce_only(args: argparse.Namespace, info: RankInfo) -> dict[str, Any] | None:
    numel = args.numel or param_count(make_config("base"))
    tensor = torch.empty(numel, dtype=torch.float32)
    times = []
    for i in range(args.warmup + args.steps):
        tensor.fill_(1.0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    # Every rank must see world_size everywhere: a wrong sum is a broken backend, not a slow one.
    if not torch.all(tensor == info.world):
        raise AssertionError(f"all_reduce result wrong on rank {info.rank}")
    if info.rank:
        return None
    t = median(times)
    algbw = numel * 4 / t / 1e9
    result = {"example": "train_vit", "mode": "allreduce-only", "backend": info.backend,
              "world_size": info.world, "numel": numel, "bytes": numel * 4,
              "threads_per_rank": torch.get_num_threads(), "ms": [x * 1e3 for x in times],
              "ms_median": t * 1e3, "ms_min": min(times) * 1e3, "algbw_GBps": algbw,
              "busbw_GBps": algbw * 2 * (info.world - 1) / info.world, "torch": torch.__version__}
    print(f"all_reduce {numel} floats ({numel * 4 / 1e6:.1f} MB), backend {info.backend}, "
          f"{info.world} ranks: "
          f"median {t * 1e3:.1f} ms (min {result['ms_min']:.1f}) over {len(times)}, algbw {algbw:.2f} GB/s, "
          f"busbw {result['busbw_GBps']:.2f} GB/s")
    return result


def worker(args: argparse.Namespace, info: RankInfo) -> dict[str, Any] | None:
    return allreduce_only(args, info) if args.allreduce_only else train(args, info)


def main(argv: list[str] | None = None) -> int:
    return launch(worker, parse_args(argv))


if __name__ == "__main__":
    run_main(main)
