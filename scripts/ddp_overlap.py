"""How much of DDP's gradient exchange hides behind the backward pass, on CPU tensors and on device tensors
(the fake accelerator that stands in for mps on Linux), for the default path and each comm hook.

Two local ranks (world 2 by default) train one ViT over the thunderbolt backend. Per case (hook) and
device, the same processes time, interleaved step by step so a drifting machine slows all alike:
  compute   forward + backward under DDP's no_sync() (no exchange);
  step      forward + backward with DDP's exchange (it finishes inside backward);
  exchange  the exchange alone: every bucket's all_reduce (or hook) issued at once, then waited on.
hidden = (compute + exchange - step) / exchange: 1 when the exchange costs the step nothing, 0 when it
is paid in full on top of the backward pass. It is taken per iteration, from the three phases run back to
back (each the slower rank's), so that a machine whose load drifts compares like with like; the table
shows the medians over --iters of the phases and of `hidden`. `same` says whether the device's gradients
after the exchange equal the CPU's bit for bit (the model runs SDPA's math kernel on both, which any
non-CPU device uses anyway).

    python scripts/ddp_overlap.py                               # default ViT, all cases, tcp on loopback
    python scripts/ddp_overlap.py --lab 1gbit                   # each rank an emulated Mac (root)
    python scripts/ddp_overlap.py --cases default,int8 --iters 5 --transport auto
    python scripts/ddp_overlap.py --async-calls 10              # async 16 MB all_reduce: issue vs done

`--async-calls N` times N `all_reduce(x, async_op=True)` of 16 MB on each device instead: how long the call
takes to return, against how long the op takes to complete (`work.wait()` returning), and the issuing
thread's own CPU time in the call (on the device: the copy of the input to host memory). With
`--stagger-ms M` every rank but 0 issues its call M ms after rank 0, so that while rank 0's call runs the
other rank does not compete with it for this machine's cores (as on two Macs); only rank 0's calls are
shown then, and their completion includes the stagger.

The fake device runs every op on the CPU (in the autograd thread, as mps does), so both devices share the
machine's cores with the backend's worker thread: the figures compare the two paths, not a Mac. Over
loopback the exchange is CPU work too (copies through the kernel), which no overlap can hide when the
ranks' backward passes already keep every core busy; `--lab RATE` puts each rank in an emulated Mac of a
lab (network namespaces, a cable of RATE between them), where the exchange waits on the cable instead.

Every op of the fake device is a Python kernel, which holds the GIL: with Python's default 5 ms switch
interval, the backend's worker waits up to 5 ms for the GIL at each step of the exchange while the fake
device's backward pass runs (a 1 MB bucket takes 450 ms instead of 40 at 1 Gbit/s). On mps the backward
pass is C++ and leaves the GIL free, as the CPU's kernels do. `--switch-interval` (0.5 ms by default, on
both devices) takes that artefact out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run from a checkout without installing: the package (and examples/models) are this checkout's.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

CASES = ("default", "torch_allreduce", "torch_fp16", "int8", "fp16", "bf16")


def _hook(case: str):  # noqa: ANN202 - (hook, state factory) for DDP.register_comm_hook, None for default
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torch_thunderbolt import hooks

    if case == "default":
        return None
    if case == "torch_allreduce":
        return default_hooks.allreduce_hook, lambda: None
    if case == "torch_fp16":
        return default_hooks.fp16_compress_hook, lambda: None
    return getattr(hooks, f"{case}_hook"), hooks.CompressionState


def rank_main(args: argparse.Namespace) -> None:
    """One rank: for every case and device, the median times and the gradients' equality."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_thunderbolt  # noqa: F401 - registers the backend
    from models.vit import SyntheticImages, ViT, make_config
    from torch_thunderbolt.testing.fake_device import install, values

    log = install()  # before the first backward pass: autograd counts devices then
    torch.set_num_threads(1)
    sys.setswitchinterval(args.switch_interval)
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    cfg = make_config(args.preset, image_size=args.image_size, patch=args.patch, dim=args.dim, depth=args.depth,
                      heads=args.heads, classes=args.classes)
    data = SyntheticImages(cfg, seed=0)
    images, labels = data.batch(args.batch, rank, 0)
    devices = {"cpu": "cpu", "device": "tbfake"}

    def build(device: str, case: str) -> tuple[DDP, object]:
        torch.manual_seed(0)
        model = DDP(ViT(cfg).to(device), bucket_cap_mb=args.bucket_mb)
        hook = _hook(case)
        state = None
        if hook is not None:
            state = hook[1]()
            model.register_comm_hook(state, hook[0])
        return model, state

    def fwd_bwd(model: DDP, device: str) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(model(images.to(device)), labels.to(device)).backward()
        return time.perf_counter() - t0

    def exchange(model: DDP, state: object, case: str) -> float:
        """Every bucket's exchange, as DDP issues it, on buckets of DDP's sizes (zeros)."""
        buckets = model.reducer._get_zeros_like_grad_buckets()
        hook = _hook(case)
        dist.barrier()
        t0 = time.perf_counter()
        if hook is None:
            works = [dist.all_reduce(b.buffer(), async_op=True) for b in buckets]
            for w in works:
                w.wait()
        else:
            futures = [hook[0](state, b) for b in buckets]
            for f in futures:
                f.wait()
        return time.perf_counter() - t0

    if args.async_calls:
        print("RESULT " + json.dumps(async_calls(args.async_calls, devices, args.stagger_ms / 1e3)), flush=True)
        dist.destroy_process_group()
        return
    out: dict[str, dict[str, object]] = {}
    with sdpa_kernel(SDPBackend.MATH):
        for case in args.cases:
            models = {name: build(dev, case) for name, dev in devices.items()}
            times = {name: {"compute": [], "step": [], "exchange": []} for name in devices}
            for it in range(args.warmup + args.iters):
                for name, dev in devices.items():
                    model, state = models[name]
                    dist.barrier()
                    with model.no_sync():
                        compute = fwd_bwd(model, dev)
                    dist.barrier()
                    step = fwd_bwd(model, dev)
                    comm = exchange(model, state, case)
                    if it >= args.warmup:
                        times[name]["compute"].append(compute)
                        times[name]["step"].append(step)
                        times[name]["exchange"].append(comm)
            # The last step's gradients, after the exchange, on both devices.
            for name, dev in devices.items():
                fwd_bwd(models[name][0], dev)
            grads = {name: [p.grad for p in models[name][0].parameters()] for name in devices}
            same = all(torch.equal(a, values(b)) for a, b in zip(grads["cpu"], grads["device"]))
            backend_ops = len(log.on_backend_threads())
            log.clear()
            out[case] = dict(times)
            out[case]["same"] = same
            out[case]["device_ops_on_backend_threads"] = backend_ops
    params = sum(p.numel() for p in ViT(cfg).parameters())
    print("RESULT " + json.dumps({"cases": out, "params": params, "config": dataclasses.asdict(cfg)}), flush=True)
    dist.destroy_process_group()


def async_calls(calls: int, devices: dict[str, str], stagger: float) -> dict[str, list[tuple[float, float, float]]]:
    """(seconds to return, seconds to complete, the issuing thread's CPU seconds in the call) of `calls` async
    all_reduces of 16 MB per device; one untimed call first (it allocates the staging buffers). Ranks but 0
    issue `stagger` seconds after rank 0."""
    import torch
    import torch.distributed as dist

    late = stagger if dist.get_rank() else 0.0
    out: dict[str, list[tuple[float, float]]] = {}
    for name, dev in devices.items():
        x = torch.ones(4 << 20).to(dev)
        times = []
        for i in range(calls + 1):
            dist.barrier()
            if late:
                time.sleep(late)
            c0, t0 = time.thread_time(), time.perf_counter()
            work = dist.all_reduce(x, async_op=True)
            t1, c1 = time.perf_counter(), time.thread_time()
            work.wait()
            if i:
                times.append((t1 - t0, time.perf_counter() - t0, c1 - c0))
            x.fill_(1.0)
        out[name] = times
    return out


def summary(ranks: list[dict[str, list[float]]]) -> dict[str, float]:
    """Medians of each phase and of the per-iteration hidden share; each iteration's phase times are the
    slowest rank's."""
    from torch_thunderbolt.bench.metrics import hidden_share

    its = range(len(ranks[0]["step"]))
    per = {k: [max(r[k][i] for r in ranks) for i in its] for k in ("compute", "step", "exchange")}
    shares = [hidden_share(per["compute"][i], per["step"][i], per["exchange"][i]) for i in its]
    return {**{k: statistics.median(v) for k, v in per.items()}, "hidden": statistics.median(shares)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "auto", "shm"])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="images per rank")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="DDP bucket_cap_mb (several buckets to overlap)")
    ap.add_argument("--switch-interval", type=float, default=0.0005,
                    help="sys.setswitchinterval in the ranks (seconds; see above)")
    ap.add_argument("--lab", default=None, metavar="RATE",
                    help="run each rank in an emulated Mac joined by a cable of RATE (e.g. 1gbit; needs root)")
    ap.add_argument("--async-calls", type=int, default=0, metavar="N",
                    help="time N async all_reduces of 16 MB per device instead of DDP")
    ap.add_argument("--stagger-ms", type=float, default=0.0, metavar="M",
                    help="with --async-calls: ranks but 0 issue M ms after rank 0 (shown: rank 0's calls)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cases = [c.strip() for c in args.cases.split(",")]
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; expected some of {', '.join(CASES)}")
    if args.rank:
        rank_main(args)
        return
    from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks

    rank_args = ["--rank", "--cases", ",".join(args.cases)]
    for name in ("iters", "warmup", "batch", "preset", "image_size", "patch", "dim", "depth", "heads", "classes",
                 "bucket_mb", "switch_interval", "async_calls", "stagger_ms"):
        rank_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {"THUNDERBOLT_TRANSPORT": args.transport, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="tb-ddp-overlap-") as tmp, contextlib.ExitStack() as stack:
        setup = LOOPBACK
        if args.lab is not None:
            from torch_thunderbolt.testing.lab import lab_session, lab_setup

            setup = lab_setup(stack.enter_context(lab_session(args.world, "chain", rate=args.lab)))
        results = run_ranks(Path(__file__), args.world, Path(tmp), args=rank_args, env=env, setup=setup,
                            timeout=3600)
    got = [res.json() for res in results]
    if args.async_calls:
        for name in ("cpu", "device"):
            # each call as the rank that completed it last saw it (rank 0's alone when staggered)
            calls = [got[0][name][i] if args.stagger_ms else max((g[name][i] for g in got), key=lambda c: c[1])
                     for i in range(args.async_calls)]
            print(f"async all_reduce 16 MB, {name:<6}: returned after " +
                  ", ".join(f"{a * 1e3:.1f}" for a, _, _ in calls) + " ms; complete after " +
                  ", ".join(f"{b * 1e3:.1f}" for _, b, _ in calls) + " ms; ratio " +
                  ", ".join(f"{a / b:.2f}" for a, b, _ in calls) + "; CPU in the call " +
                  ", ".join(f"{c * 1e3:.1f}" for _, _, c in calls) + " ms")
        return
    where = f"a {args.world}-Mac lab, {args.lab} cable" if args.lab else "loopback"
    first = got[0]
    print(f"DDP over thunderbolt ({args.transport}, {where}), world {args.world}, ViT "
          f"{first['params'] / 1e6:.1f} M params ({first['params'] * 4 / 1e6:.0f} MB of gradients), batch "
          f"{args.batch}/rank, buckets {args.bucket_mb} MB; medians of {args.iters}, ms")
    print(f"{'case':<16}{'device':<8}{'compute':>9}{'step':>9}{'exchange':>10}{'hidden':>8}  {'device/cpu':>10}  same")
    for case in args.cases:
        per = {name: summary([g["cases"][case][name] for g in got]) for name in ("cpu", "device")}
        h = {name: t["hidden"] for name, t in per.items()}
        for name in ("cpu", "device"):
            t = per[name]
            ratio = f"{h['device'] / h['cpu']:.2f}" if name == "device" and h["cpu"] > 0 else ""
            same = str(all(g["cases"][case]["same"] for g in got)) if name == "device" else ""
            bad = sum(g["cases"][case]["device_ops_on_backend_threads"] for g in got)
            same += "" if name == "cpu" or not bad else f" ({bad} device ops on backend threads!)"
            print(f"{case:<16}{name:<8}{t['compute'] * 1e3:9.1f}{t['step'] * 1e3:9.1f}{t['exchange'] * 1e3:10.1f}"
                  f"{h[name]:8.2f}  {ratio:>10}  {same}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ranks": got}, indent=1))


if __name__ == "__main__":
    main()
