"""`--workload vit-ddp`: a ViT trained under DistributedDataParallel, phase by phase, on every measured backend.

Per iteration and backend (backends interleaved, their order alternating), each phase timed by every rank
from a common start, the device synchronised at its end:
  compute   forward + backward under `no_sync()` (no exchange);
  step      forward + backward with DDP's exchange (DDP waits for it at the end of backward);
  exchange  the exchange alone: every bucket's all_reduce (or hook) of DDP's own bucket sizes, issued at
            once, then waited on.
hidden = (compute + exchange - step) / exchange per iteration (metrics.hidden_share); exposed =
(step - compute) / step.

Device tensors and gloo: gloo has no kernels for a device (mps, or its stand-ins here), so a Mac user of
gloo exchanges through host memory; the gloo rows on a device do exactly that with `host_allreduce_hook`
(copy the bucket to the CPU, all_reduce it there, DDP copies the result back), where thunderbolt takes the
device bucket itself. The compression hooks (torch_thunderbolt.hooks) stage through the CPU on both.
DDP also broadcasts the order of its rebuilt buckets after the first step, on the parameters' device, which
gloo cannot do: on a device every row (thunderbolt's too, so that both exchange the same buckets) keeps the
buckets DDP first made, in reverse parameter order (`_KeepBuckets`).
"""
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import hooks
from ...testing.models import vit
from .device import Device, place

# No `from __future__ import annotations` here: DDP compares a comm hook's annotations with real objects.


def host_allreduce_hook(group, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations it finds
    """torch's allreduce_hook through host memory: what gloo needs for a bucket on a device."""
    flat = bucket.buffer().detach().to("cpu").div_(dist.get_world_size(group))
    return dist.all_reduce(flat, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def traced_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations it finds
    """A bucket's all_reduce that notes, in `state`'s list, when the bucket was handed over, when the call
    returned (`issued`: the issuing thread was held until then) and when its bytes were exchanged (`done`: a
    watcher thread waits on host work only, never on the device). A diagnostic: it sums without averaging.
    Each backend's own path: thunderbolt takes the device bucket itself (its copy to host memory queued on
    the device, device.py); gloo, which has no device kernels, a copy to a host buffer kept per bucket,
    which waits for the device to reach the bucket."""
    group, marks, buffers, staged = state
    handed = time.monotonic()
    src = bucket.buffer().detach()
    if staged or src.is_cpu:
        flat = buffers.get(bucket.index())
        if flat is None or flat.numel() != src.numel():
            flat = buffers[bucket.index()] = torch.empty(src.numel(), dtype=src.dtype)
        flat.copy_(src)
        work = dist.all_reduce(flat, group=group, async_op=True)
        host, nbytes = work, flat.numel() * flat.element_size()
    else:
        work = dist.all_reduce(src, group=group, async_op=True)
        host, nbytes = getattr(work, "host", work), src.numel() * src.element_size()
    issued = time.monotonic()

    def watch() -> None:
        host.wait()
        marks.append({"bucket": bucket.index(), "bytes": nbytes, "handed": handed, "issued": issued,
                      "done": time.monotonic()})

    threading.Thread(target=watch, name="bench-timeline", daemon=True).start()
    return work.get_future().then(lambda f: f.value()[0])


class _KeepBuckets:
    """DDP's reducer with the rebuild of its buckets turned off; everything else passes through."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


HOOKS: dict[str, Callable] = {"int8": hooks.int8_hook, "bf16": hooks.bf16_hook, "fp16": hooks.fp16_hook}


@dataclass(frozen=True)
class Case:
    hook: str
    bucket_cap_mb: float
    batch: int

    @property
    def key(self) -> str:
        return f"hook={self.hook} bucket_cap_mb={self.bucket_cap_mb:g} batch={self.batch}"


@dataclass
class Phases:
    """One rank's times of one case and backend, seconds per iteration."""
    compute: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    exchange: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # the device's modelled busy time in `compute`


class _Trainer:
    """One backend's DDP model of one case, and its phases."""

    def __init__(self, cfg: vit.ViTConfig, case: Case, group: Any, kind: str, device: Device,
                 traced: bool = False) -> None:
        torch.manual_seed(0)  # the same weights on every rank: DDP's initial broadcast is not needed
        module = place(lambda d: vit.ViT(cfg).to(d), device)
        # One block-level kernel per transformer block, patch embedding and head (device.fuse): DDP's hooks
        # still fire per parameter, at the end of each block's backward.
        module.patch_embed, module.head = device.fuse(module.patch_embed), device.fuse(module.head)
        for i, block in enumerate(module.blocks):
            module.blocks[i] = device.fuse(block)
        self.device, self.group = device, group
        self.staged = case.hook == "none" and kind == "gloo" and not device.is_cpu
        # Buckets of bucket_cap_mb from the first step (bucket_cap_mb_list): DDP's default puts every
        # parameter in one bucket for the first step and rebuilds the buckets after it, which the rows on a
        # device cannot do (_KeepBuckets): one bucket of every gradient would leave nothing to overlap.
        self.model = DDP(module, process_group=group, bucket_cap_mb=case.bucket_cap_mb,
                         bucket_cap_mb_list=[case.bucket_cap_mb], init_sync=False)
        self.hook: Optional[Callable] = None
        self.state: Any = None
        self.marks: list[dict] = []
        if traced:
            self.hook, self.state = traced_allreduce_hook, (group, self.marks, {}, kind == "gloo")
        elif case.hook != "none":
            self.hook, self.state = HOOKS[case.hook], hooks.CompressionState(process_group=group)
        elif self.staged:
            self.hook, self.state = host_allreduce_hook, group
        if self.hook is not None:
            self.model.register_comm_hook(self.state, self.hook)
        if not device.is_cpu:  # after register_comm_hook, which hands the reducer itself to torch's C++
            self.model.reducer = _KeepBuckets(self.model.reducer)
        self.how = "host copy + gloo" if self.staged else ("hook" if case.hook != "none" else "device tensors"
                                                           if not device.is_cpu else "cpu tensors")

    def fwd_bwd(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(self.model(images), labels).backward()
        self.device.synchronize()  # the device's queued work belongs to the phase (as on mps)
        return time.perf_counter() - t0

    def exchange(self, control: Any) -> float:
        buckets = self.model.reducer._get_zeros_like_grad_buckets()  # buckets of DDP's own sizes
        dist.barrier(group=control)
        t0 = time.perf_counter()
        if self.hook is None:
            for work in [dist.all_reduce(b.buffer(), group=self.group, async_op=True) for b in buckets]:
                work.wait()
        else:
            for fut in [self.hook(self.state, b) for b in buckets]:
                fut.wait()
        self.device.synchronize()
        return time.perf_counter() - t0


def traced_step(cfg: vit.ViTConfig, case: Case, group: Any, kind: str, device: Device, images: torch.Tensor,
                labels: torch.Tensor) -> dict:
    """One step with the exchange, traced, on a model of its own (after one untraced step): when the device
    was busy, and when each bucket was handed over, issued and done, in ms from the step's start. The buckets
    go through `traced_allreduce_hook`, each backend's own path."""
    trainer = _Trainer(cfg, case, group, kind, device, traced=True)
    trainer.fwd_bwd(images, labels)
    deadline = time.monotonic() + 60.0
    while len(trainer.marks) < len(trainer.model.reducer._get_zeros_like_grad_buckets()) and time.monotonic() < deadline:
        time.sleep(0.01)
    trainer.marks.clear()
    if device.record_spans is not None:
        device.record_spans(True)
    trainer.model.zero_grad(set_to_none=True)
    t0 = time.monotonic()
    loss = F.cross_entropy(trainer.model(images), labels)
    forward = device.record_spans(True) if device.record_spans is not None else []
    loss.backward()
    device.synchronize()
    end = time.monotonic()
    backward = device.record_spans(False) if device.record_spans is not None else []
    n = len(trainer.model.reducer._get_zeros_like_grad_buckets())
    while len(trainer.marks) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    ms = lambda t: round((t - t0) * 1e3, 2)  # noqa: E731
    return {"step_ms": ms(end), "forward_spans_ms": [(ms(a), ms(b)) for a, b in forward],
            "backward_spans_ms": [(ms(a), ms(b)) for a, b in backward],
            "buckets": sorted(({**m, "handed": ms(m["handed"]), "issued": ms(m["issued"]), "done": ms(m["done"])}
                               for m in trainer.marks), key=lambda m: m["issued"])}


def run(model: str, cases: list[Case], groups: list[Any], kinds: list[str], device: Device, rank: int,
        iters: int, warmup: int, control: Any = None, timeline: bool = False) -> tuple[dict[str, list[Phases]], dict]:
    """This rank's phases per case key and backend (in the order of `groups`), and what the model is."""
    cfg = vit.make_config(model)
    data = vit.SyntheticImages(cfg, seed=0, max_classes=4)
    out: dict[str, list[Phases]] = {}
    how: dict[str, list[str]] = {}
    traces: dict[str, list[dict]] = {}  # per case key, per backend: this rank's traced step
    for case in cases:
        images, labels = data.batch(case.batch, rank, 0)
        images, labels = images.to(device.torch_device), labels.to(device.torch_device)
        trainers = [_Trainer(cfg, case, g, k, device) for g, k in zip(groups, kinds)]
        phases = [Phases() for _ in trainers]
        for it in range(warmup + iters):
            order = list(enumerate(trainers)) if it % 2 == 0 else list(enumerate(trainers))[::-1]
            for i, trainer in order:
                dist.barrier(group=control)
                busy0 = device.busy_seconds() if device.busy_seconds else 0.0
                with trainer.model.no_sync():
                    compute = trainer.fwd_bwd(images, labels)
                busy = (device.busy_seconds() - busy0) if device.busy_seconds else 0.0
                dist.barrier(group=control)
                step = trainer.fwd_bwd(images, labels)
                exchange = trainer.exchange(control)
                if it >= warmup:
                    p = phases[i]
                    p.compute.append(compute)
                    p.step.append(step)
                    p.exchange.append(exchange)
                    p.busy.append(busy)
        out[case.key] = phases
        how[case.key] = [t.how for t in trainers]
        del trainers
        if timeline and case.hook == "none":
            for i, (g, k) in enumerate(zip(groups, kinds)):
                dist.barrier(group=control)
                traces.setdefault(case.key, []).append(traced_step(cfg, case, g, k, device, images, labels))
    params = vit.param_count(cfg)
    return out, {"config": cfg.__dict__, "params": params, "grad_bytes": params * 4, "how": how, "traces": traces}


def describe_trace(trace: dict) -> list[str]:
    """A traced step in a few lines: the device's forward and backward, the buckets' exchange, and how much of
    it the backward covered."""
    forward, backward, buckets = trace["forward_spans_ms"], trace["backward_spans_ms"], trace["buckets"]
    if not buckets:
        return ["  no bucket was traced"]
    lines = []
    if forward and backward:
        fwd_end = forward[-1][1]
        bwd_end = backward[-1][1]
        busy = sum(b - a for a, b in backward)
        lines.append(f"  device: forward ends at {fwd_end:.0f} ms, backward at {bwd_end:.0f} ms (busy {busy:.0f} of "
                     f"its {bwd_end - fwd_end:.0f} ms: the rest it waited for the host)")
    else:
        bwd_end = trace["step_ms"]
    total = sum(m["bytes"] for m in buckets)
    covered = sum(m["bytes"] for m in buckets if m["done"] <= bwd_end)
    first, last = buckets[0], max(buckets, key=lambda m: m["done"])
    waits = sum(m["issued"] - m["handed"] for m in buckets)
    lines.append(f"  exchange: {len(buckets)} buckets, {total / 1e6:.0f} MB; first issued at {first['issued']:.0f} ms, last "
                 f"done at {last['done']:.0f} ms; {covered / 1e6:.0f} MB ({covered / total:.2f}) done before the "
                 f"backward ended; handing buckets over took {waits:.0f} ms of the backward's host thread")
    span = max(last["done"] - first["issued"], 1e-9)
    lines.append(f"  the exchange moved {total / 1e6 / span * 1e3:.0f} MB/s from its first issue to its end; the step "
                 f"ended at {trace['step_ms']:.0f} ms")
    return lines


def summarize(per_rank: list[Phases], batch: int, world: int) -> dict[str, float]:
    """One case and backend over all ranks: medians of each phase (each iteration the slowest rank's), the
    median of the per-iteration hidden share, the exposed share and images/s from the medians."""
    from ..metrics import hidden_share
    from .spec import exposed_share

    n = len(per_rank[0].step)
    per = {k: [max(getattr(r, k)[i] for r in per_rank) for i in range(n)] for k in ("compute", "step", "exchange",
                                                                                    "busy")}
    med = {k: statistics.median(v) for k, v in per.items()}
    hidden = statistics.median(hidden_share(per["compute"][i], per["step"][i], per["exchange"][i]) for i in range(n))
    return {"step_s": med["step"], "compute_s": med["compute"], "exchange_s": med["exchange"],
            "device_busy_s": med["busy"], "device_share": med["busy"] / med["compute"] if med["compute"] > 0 else 0.0,
            "hidden": hidden, "exposed": exposed_share(med["step"], med["compute"]),
            "images_per_s": batch * world / med["step"] if med["step"] > 0 else 0.0, "iters": n}
