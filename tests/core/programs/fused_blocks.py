"""Programs of test_apple_gpu_blocks.py: block-level kernels (testing.apple_gpu_blocks) on the timed
Apple-silicon GPU, in a process of their own (the device is installed once, before autograd starts)."""
from __future__ import annotations

import torch
from torch import nn

from torch_thunderbolt.testing import apple_gpu, apple_gpu_blocks, fake_device
from torch_thunderbolt.testing.program import main, result


def _block() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def _step(gpu: apple_gpu.TimedDevice, model: nn.Module, x: torch.Tensor) -> dict:
    """One forward and backward: modelled seconds and kernels of each, and the ops the host ran for them."""
    log = fake_device.module(gpu.device.type).log
    for p in [x, *model.parameters()]:
        p.grad = None  # AccumulateGrad takes the gradient as it is: no add kernels in the backward
    grad_out = torch.empty(64, 128, 256, device=gpu.device)
    gpu.synchronize()
    gpu.reset()
    log.clear()
    y = model(x)
    fwd = gpu.stats()
    fwd_ops = len(log.ops())
    y.backward(grad_out)
    total = gpu.stats()
    return {"forward_s": fwd["busy_s"], "forward_kernels": fwd["kernels"],
            "backward_s": total["busy_s"] - fwd["busy_s"], "backward_kernels": total["kernels"] - fwd["kernels"],
            "forward_host_ops": fwd_ops, "host_ops": len(log.ops())}


def timing_only() -> None:
    """The same block op by op and fused, two steps each: what each step cost on the timeline, how many ops
    the host ran, and which parameters got gradients."""
    gpu = apple_gpu.install("m2-ultra", exact=False)
    dev = gpu.device
    plain = _block().to(dev)
    fused = apple_gpu_blocks.fuse(_block().to(dev))
    x = torch.empty(64, 128, 256, device=dev, requires_grad=True)
    out = {"plain": [_step(gpu, plain, x) for _ in range(2)], "fused": [], "grads": [], "measured": None}
    for _ in range(2):
        out["fused"].append(_step(gpu, fused, x))
        out["grads"].append([list(p.grad.shape) if p.grad is not None else None for p in fused.parameters()])
    out["param_shapes"] = [list(p.shape) for p in fused.parameters()]
    out["measured"] = fused.costs()
    with torch.no_grad():
        gpu.synchronize()
        gpu.reset()
        y = fused(x)
        out["no_grad"] = {"busy_s": gpu.stats()["busy_s"], "shape": list(y.shape), "first": fused.costs()}
    result(out)


def exact() -> None:
    """Exact mode: a fused block computes what the block computes."""
    gpu = apple_gpu.install("m2-ultra", exact=True)
    torch.manual_seed(0)
    block = _block()
    fused = apple_gpu_blocks.fuse(_block())
    fused.inner.load_state_dict(block.state_dict())
    x = torch.randn(4, 8, 256)
    want = block(x)
    got = apple_gpu_blocks.fuse(fused.inner.to(gpu.device))(x.to(gpu.device)).cpu()
    result({"equal": bool(torch.equal(want, got))})


def host_copies_off() -> None:
    """Timing-only with host copies off (what the workloads run): a large copy to the host is timed and not
    done, a small one is done; both wait for the timeline as before."""
    gpu = apple_gpu.install("m2-ultra", exact=False)
    gpu.host_copies = False
    big = torch.ones(1 << 20).to(gpu.device)  # 4 MB: not done either (the device keeps zero pages)
    small = torch.arange(8.0).to(gpu.device)
    gpu.synchronize()
    gpu.reset()
    into = torch.full((1 << 20,), 7.0)
    into.copy_(big)
    timed = gpu.stats()
    out = {"big_untouched": bool((into == 7.0).all()), "big_kernels": timed["kernels"],
           "big_busy_s": timed["busy_s"], "bandwidth": gpu.chip.bandwidth,
           "small_copied": small.cpu().tolist() == [float(i) for i in range(8)]}
    gpu.host_copies = True
    into.copy_(torch.full((1 << 20,), 3.0).to(gpu.device))
    out["on_again_copied"] = bool((into == 3.0).all())
    result(out)


if __name__ == "__main__":
    main({"timing_only": timing_only, "exact": exact, "host_copies_off": host_copies_off})
