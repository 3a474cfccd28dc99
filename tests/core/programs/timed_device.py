"""Programs of test_apple_gpu.py: the timed Apple-silicon GPU (testing.apple_gpu) in a process of its own
(the device is installed once per process, before autograd starts its device threads). Each scenario
reports its measurements; the test judges them."""
from __future__ import annotations

import copy
import datetime
import os
import time

import torch

from torch_thunderbolt.testing import apple_gpu, fake_device
from torch_thunderbolt.testing.program import main, result


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _warm(gpu: apple_gpu.TimedDevice) -> None:
    """Run each op the scenarios time once on small shapes: an op's first run on meta tensors loads torch's
    meta kernels (seconds), which is host time no later call pays."""
    x = torch.ones(8, 8, device=gpu.device)
    (x @ x + x).relu().sum().cpu()
    torch.nn.functional.linear(torch.ones(1, 8, device=gpu.device), x)
    gpu.synchronize()
    gpu.reset()


def matmul_timing() -> None:
    """A matmul of a known modelled time: when issuing returns, when synchronize returns, what the model
    says, and the formula's inputs."""
    gpu = apple_gpu.install(os.environ.get("PRESET", "m4-pro"), exact=False)
    _warm(gpu)
    n = 6144  # ~60 ms on the M4 Pro preset: long enough to tell waiting from not on a busy host
    a = torch.empty(n, n, device=gpu.device)
    b = torch.empty(n, n, device=gpu.device)
    gpu.synchronize()
    gpu.reset()
    t0 = time.monotonic()
    c = a @ b
    issued = time.monotonic() - t0
    pending = gpu.pending_seconds()
    gpu.synchronize()
    done = time.monotonic() - t0
    chip = gpu.chip
    result({"issue_s": issued, "done_s": done, "pending_s": pending, "stats": gpu.stats(), "n": n,
            "peak_flops": chip.peak_flops(torch.float32), "bandwidth": chip.bandwidth, "launch_s": gpu.launch_s,
            "shape": list(c.shape), "on_device": c.device.type == gpu.device.type})


def async_semantics() -> None:
    """Which host calls wait for the timeline: a long matmul is issued, then a copy to the host of a tensor
    it does not touch (it waits: one in-order queue); a copy issued before the matmul does not wait for it;
    an event's query and synchronize; a blocking host-to-device copy waits, a non-blocking one does not."""
    gpu = apple_gpu.install("m4-pro", exact=False)
    _warm(gpu)
    n = 6144  # ~60 ms on the M4 Pro preset: long enough to tell waiting from not on a busy host
    a = torch.empty(n, n, device=gpu.device)
    small = torch.arange(10.0).to(gpu.device)
    gpu.synchronize()
    out: dict[str, float | bool] = {}

    t0 = time.monotonic()
    small.cpu()
    out["copy_before_s"] = time.monotonic() - t0

    gpu.reset()
    t0 = time.monotonic()
    a @ a
    out["modelled_s"] = gpu.busy_seconds()
    out["issue_s"] = time.monotonic() - t0
    event = gpu.record()
    out["event_query_at_issue"] = event.query()
    values = small.cpu()
    out["copy_after_s"] = time.monotonic() - t0
    out["copy_values_exact"] = bool(torch.equal(values, torch.arange(10.0)))
    out["event_query_after_copy"] = event.query()

    t0 = time.monotonic()
    a @ a
    torch.ones(4).to(gpu.device)  # blocking: waits for the queue ahead of it
    out["h2d_blocking_s"] = time.monotonic() - t0
    gpu.synchronize()

    t0 = time.monotonic()
    a @ a
    torch.ones(4).to(gpu.device, non_blocking=True)
    out["h2d_non_blocking_s"] = time.monotonic() - t0
    event = gpu.record()
    event.synchronize()
    out["event_synchronize_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    a @ a
    host = torch.empty(10)
    host.copy_(small, non_blocking=True)  # to the host, non-blocking: returns at once
    out["d2h_non_blocking_s"] = time.monotonic() - t0
    gpu.synchronize()

    t0 = time.monotonic()
    a @ a
    (small + 1).sum().item()  # the host reads a value: waits
    out["item_s"] = time.monotonic() - t0
    result(out)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)).softmax(-1))


def exact_matches_cpu() -> None:
    """Exact mode: a small model's forward, backward and SGD step on the device equal the CPU's bit for bit;
    the timeline advanced for each kernel. Timing-only mode: same shapes, no arithmetic (zeros)."""
    gpu = apple_gpu.install("m2-ultra", exact=True)
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 16),
                                    _Mlp())
    dev_model = copy.deepcopy(cpu_model).to(gpu.device)
    x = torch.randn(8, 3, 8, 8)
    out = {}
    for model, dev in ((cpu_model, "cpu"), (dev_model, gpu.device)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(x.to(dev)).pow(2).sum()
        loss.backward()
        opt.step()
        out[str(dev)] = [p.detach().cpu() for p in model.parameters()] + [loss.detach().cpu()]
    got, want = out[str(gpu.device)], out["cpu"]
    kernels = gpu.stats()["kernels"]
    # torch's formulas: 2 per multiply-add; the backward pass takes the input and weight gradients of the
    # linear layers and the weight gradient of the convolution (its input needs none)
    flops = gpu.stats()["flops"]
    linear = 2 * 8 * (144 * 16 + 16 * 32 + 32 * 4)
    conv = 2 * 8 * 4 * 6 * 6 * 3 * 3 * 3
    expected_flops = 3 * linear + 2 * conv
    # Timing-only: the same model gives outputs of the right shape, made of zeros (nothing computed).
    timing = apple_gpu.install("m2-ultra", exact=False)
    y = dev_model(x.to(gpu.device))
    ys = y.cpu()
    result({"identical": all(torch.equal(g, w) for g, w in zip(got, want)), "kernels": kernels,
            "flops": flops, "expected_flops": expected_flops,
            "timing_shape": list(ys.shape), "timing_zeros": bool((ys == 0).all()),
            "timing_kernels": timing.stats()["kernels"],
            "computed": sorted(timing.computed)})


def large_model() -> None:
    """Timing-only mode builds a model of GBs on the device without touching its memory, and a batch-1
    forward takes the time of reading its weights at the chip's achieved bandwidth."""
    gpu = apple_gpu.install("m2-ultra", exact=False)
    _warm(gpu)
    before = _rss_bytes()
    layers = int(os.environ.get("LAYERS", "24"))
    with torch.device(gpu.device):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 14336 if i % 2 == 0 else 4096, bias=False,
                                                      dtype=torch.float16) for i in range(layers)])
    built = _rss_bytes()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.zeros(1, 4096, dtype=torch.float16).to(gpu.device)
    with torch.no_grad():
        for i in range(2):  # the second pass reuses the first one's plans
            gpu.synchronize()
            gpu.reset()
            y = x
            for layer in model:
                y = layer(y if y.shape[-1] == 4096 else y[:, :4096])
            gpu.synchronize()
    result({"weights": weights, "rss_build": built - before, "rss_after": _rss_bytes() - before,
            "stats": gpu.stats(), "bandwidth": gpu.chip.bandwidth, "launch_s": gpu.launch_s})


def collectives() -> None:
    """Two ranks over this backend on timed-device tensors: an all_reduce moves the real bytes in both modes,
    a DDP step in timing-only mode completes, and no device op ran on a thread of the backend's."""
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    gpu = apple_gpu.install("m2-ultra", exact=os.environ.get("EXACT") == "1")
    log = fake_device.install()
    dist.init_process_group("thunderbolt", device_id=gpu.device, timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    out: dict[str, object] = {}
    for n in (5, 300_000):
        x = (torch.arange(n, dtype=torch.float32) % 7 + r).to(gpu.device)
        dist.all_reduce(x)
        want = sum(torch.arange(n, dtype=torch.float32) % 7 + q for q in range(w))
        out[f"all_reduce_{n}"] = bool(torch.equal(x.cpu(), want))
        y = (torch.arange(n, dtype=torch.float32) + r).to(gpu.device)
        dist.all_reduce(y, async_op=True).wait()
        want = sum(torch.arange(n, dtype=torch.float32) + q for q in range(w))
        out[f"all_reduce_async_{n}"] = bool(torch.equal(y.cpu(), want))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Mlp().to(gpu.device), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16).to(gpu.device)).sum().backward()
        opt.step()
    gpu.synchronize()
    out["ddp_steps"] = True
    out["on_backend_threads"] = log.on_backend_threads()
    out["threads"] = sorted(log.threads())
    out["kernels"] = gpu.stats()["kernels"]
    dist.destroy_process_group()
    result(out)


def staging_overlaps() -> None:
    """Two ranks, exact mode: collectives issued on device tensors whose kernels the timeline has not reached
    (a `charge` of `lead` seconds stands for the backward kernels ahead of a DDP bucket). Per op: how long
    issuing took the host, whether it was complete at once, when it was done (from the lead's start), the
    device's idle time between the kernels before and after it (the host spends `host` seconds issuing the
    next ones, as autograd does), and the values."""
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    gpu = apple_gpu.install("m4-pro", exact=True)
    log = fake_device.install()
    dist.init_process_group("thunderbolt", device_id=gpu.device, timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    lead, host = 0.3, 0.05
    out: dict[str, object] = {"lead_s": lead}
    for name, n in (("all_reduce_1MB", 300_000), ("all_reduce_small", 5), ("all_gather_1MB", 300_000),
                    ("all_reduce_transposed", 300_000)):
        base = torch.arange(n, dtype=torch.float32) % 7 + r
        # (transposed: a strided view, which is copied to the host through a contiguous device copy)
        x = base.to(gpu.device).view(600, 500).t() if name.endswith("transposed") else base.to(gpu.device)
        gathered = torch.empty(w * n, device=gpu.device)
        dist.barrier()
        gpu.synchronize()
        gpu.record_spans(True)
        charged = time.monotonic()  # the timeline is idle: the lead ends no earlier than charged + lead
        gpu.charge(lead)
        x.mul_(2)  # queued after the lead: the op must see it
        t0 = time.monotonic()
        if name.startswith("all_gather"):
            work = dist.all_gather_into_tensor(gathered, x, async_op=True)
        else:
            work = dist.all_reduce(x, async_op=True)
        issued = time.monotonic() - t0
        complete_at_issue = work.is_completed()
        time.sleep(host)  # the host issuing the next kernels
        gpu.charge(lead)
        work.wait()
        done = time.monotonic() - charged
        gpu.synchronize()
        spans = gpu.record_spans(False)
        idle = sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
        if name.startswith("all_gather"):
            want = torch.cat([(torch.arange(n, dtype=torch.float32) % 7 + q) * 2 for q in range(w)])
            exact = bool(torch.equal(gathered.cpu(), want))
        else:
            want = sum((torch.arange(n, dtype=torch.float32) % 7 + q) * 2 for q in range(w))
            if name.endswith("transposed"):
                want = want.view(600, 500).t()
            exact = bool(torch.equal(x.cpu(), want))
        out[name] = {"issue_s": issued, "complete_at_issue": complete_at_issue, "done_s": done, "idle_s": idle,
                     "exact": exact}
    out["on_backend_threads"] = log.on_backend_threads()
    dist.destroy_process_group()
    result(out)


def ddp_hand_over() -> None:
    """Two ranks, exact mode, every kernel 20 ms long (`launch_s`): DDP on a 6-layer MLP, one bucket per
    layer or so, each bucket's all_reduce issued on the device bucket from a comm hook that notes when the
    call returned. Per rank: when the last hook returned after backward() began, the backward's modelled
    time, the hooks' count, whether the gradients equal the CPU's sum over ranks, and the ops on backend
    threads."""
    import copy as copy_

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_thunderbolt  # noqa: F401 - registers the backend

    gpu = apple_gpu.install("m4-pro", exact=True, launch_s=0.02)
    log = fake_device.install()
    dist.init_process_group("thunderbolt", device_id=gpu.device, timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    model = DDP(copy_.deepcopy(cpu).to(gpu.device), bucket_cap_mb=32 * 33 * 4 / 2**20)
    returned: list[float] = []

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations it finds
        work = dist.all_reduce(bucket.buffer(), async_op=True)  # sums: the reference sums too
        returned.append(time.monotonic())
        return work.get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(q)) for q in range(w)]
    out: dict[str, object] = {}
    for step in range(2):  # the second step, after DDP's first-iteration bucket rebuild, is measured
        model.zero_grad(set_to_none=True)
        loss = model(xs[r].to(gpu.device)).sum()
        gpu.synchronize()
        returned.clear()
        busy0 = gpu.busy_seconds()
        t0 = time.monotonic()
        loss.backward()
        gpu.synchronize()
        out = {"last_return_s": max(returned) - t0, "backward_s": gpu.busy_seconds() - busy0,
               "hooks": len(returned)}
    for x in xs:
        cpu(x).sum().backward()  # accumulates: the sum over ranks
    out["exact"] = all(torch.equal(p.grad.cpu(), q.grad) for p, q in zip(model.module.parameters(), cpu.parameters()))
    out["on_backend_threads"] = log.on_backend_threads()
    dist.destroy_process_group()
    result(out)


def staging_timeout() -> None:
    """Two ranks, exact mode, a group with a 1 s timeout: an all_reduce of a tensor the device reaches only
    after 3 s. What waiting on it raises, and after how long."""
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend

    gpu = apple_gpu.install("m4-pro", exact=True)
    dist.init_process_group("thunderbolt", device_id=gpu.device, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    x = torch.ones(300_000).to(gpu.device)
    dist.barrier(group=group)
    gpu.synchronize()
    t0 = time.monotonic()
    gpu.charge(3.0)
    work = dist.all_reduce(x, group=group, async_op=True)
    issued = time.monotonic() - t0
    error = ""
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    raised = time.monotonic() - t0
    gpu.synchronize()
    dist.destroy_process_group()
    result({"issue_s": issued, "raised_s": raised, "error": error})


def calibration() -> None:
    """The calibration table (docs/devices.md): every published row against the model."""
    result(apple_gpu.calibration_table())


if __name__ == "__main__":
    main({"matmul_timing": matmul_timing, "async_semantics": async_semantics, "exact_matches_cpu": exact_matches_cpu,
          "large_model": large_model, "collectives": collectives, "staging_overlaps": staging_overlaps,
          "staging_timeout": staging_timeout, "ddp_hand_over": ddp_hand_over,
          "calibration": calibration})
