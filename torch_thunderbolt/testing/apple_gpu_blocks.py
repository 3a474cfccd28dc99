"""Block-level kernels on the timed Apple-silicon GPU (`testing.apple_gpu`), in timing-only mode.

The emulator runs each aten op through a Python kernel on this host: hundreds of microseconds of host time
per op here, where MPS encodes one in 5-20 us. Op by op, a transformer's step (hundreds of kernels per block)
is paced by the emulator's own host cost, not by the modelled GPU, and a workload would time the emulator.
`fuse(module)` makes a module one entry on the device timeline for its forward and one for its backward:

- the first call with a given key (the shapes and dtypes of its tensor arguments, the types of its other
  arguments, training or not, grad mode) runs the module op by op on the timed device and reads what that
  cost on the timeline: the sum of its kernels' modelled times, launch costs included (`gpu.busy_seconds()`
  across the call; with grad enabled, across a backward pass through it as well, by `torch.autograd.grad`,
  which leaves every `.grad` alone);
- every later call with that key puts one entry of that length on the timeline and returns new device
  tensors of the outputs' shapes (allocation launches no kernel); under autograd, its backward puts one entry
  of the backward's length on the timeline and returns a gradient for every input and parameter that needs
  one, so `.grad` accumulates and DDP's Reducer hooks and buckets run for real, in block order.

What this approximates, besides what the timed device already does (docs/devices.md): a block's parameter
gradients all appear when its whole backward ends (op by op, each appears as its own kernel ends: within one
block's backward, a few ms on the presets); and neither the values of its other arguments (a decode step's position) nor state the module keeps
between calls (a KV cache's length) are part of the key, so a decode step costs what the first step with
those shapes cost, and a fused module does not update such state after its first call. A fused
module in exact mode, or on any other device, is the module itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import fake_device


@dataclass(frozen=True)
class _Out:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class _Cost:
    forward_s: float
    forward_kernels: int
    backward_s: float
    backward_kernels: int
    outs: tuple[_Out, ...]
    single: bool  # the module returned one tensor, not a tuple


def _timed_device(device: torch.device) -> Any:
    """The TimedDevice behind `device`, or None (exact mode, another device)."""
    if device.type in ("cpu", "meta", "cuda"):
        return None
    try:
        executor = fake_device.module(device.type).executor
    except (KeyError, AttributeError, ValueError):
        return None
    if executor is None or getattr(executor, "exact", True) or not hasattr(executor, "charge"):
        return None
    return executor


class _Block(torch.autograd.Function):
    """One block-level kernel: forward and backward each one timeline entry of the measured length."""

    @staticmethod
    def forward(ctx: Any, gpu: Any, cost: _Cost, device: torch.device, n_inputs: int,  # type: ignore[override]
                *tensors: torch.Tensor) -> Any:
        ctx.gpu, ctx.cost, ctx.device = gpu, cost, device
        ctx.shapes = [(t.shape, t.dtype) for t in tensors]
        gpu.charge(cost.forward_s, cost.forward_kernels)
        outs = tuple(torch.empty(o.shape, dtype=o.dtype, device=device) for o in cost.outs)
        return outs[0] if cost.single else outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.gpu.charge(ctx.cost.backward_s, ctx.cost.backward_kernels)
        needs = ctx.needs_input_grad[4:]
        out = [torch.empty(shape, dtype=dtype, device=ctx.device) if need else None
               for (shape, dtype), need in zip(ctx.shapes, needs)]
        return (None, None, None, None, *out)


class Fused(nn.Module):
    """`inner` as block-level kernels on the timed device in timing-only mode (module docstring)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._costs: dict[Any, _Cost] = {}

    def __getattr__(self, name: str) -> Any:
        """The inner module's attributes (its config, its parts) read through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        params = [p for p in self.inner.parameters() if p.requires_grad]
        device = (tensors or params or [torch.empty(0)])[0].device
        gpu = _timed_device(device)
        if gpu is None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return self.inner(*args, **kwargs)
        # Other arguments count by their type only: a decode step's position (and the KV cache it indexes)
        # must not make every token a new key.
        key = (tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else type(a)
                     for a in args), tuple(sorted((k, type(v).__name__) for k, v in kwargs.items())),
               self.training, torch.is_grad_enabled())
        cost = self._costs.get(key)
        if cost is None:
            cost, result = self._measure(gpu, args, kwargs, tensors, params)
            self._costs[key] = cost
            return result
        if not torch.is_grad_enabled():
            gpu.charge(cost.forward_s, cost.forward_kernels)
            outs = tuple(torch.empty(o.shape, dtype=o.dtype, device=device) for o in cost.outs)
            return outs[0] if cost.single else outs
        return _Block.apply(gpu, cost, device, len(tensors), *tensors, *params)

    def _measure(self, gpu: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                 params: list[torch.Tensor]) -> tuple[_Cost, Any]:
        """Run `inner` op by op once: its output (returned as this call's) and what it cost on the timeline."""
        before = gpu.stats()
        result = self.inner(*args, **kwargs)
        mid = gpu.stats()
        single = isinstance(result, torch.Tensor)
        outs = (result,) if single else tuple(result)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError(f"apple_gpu_blocks.fuse({type(self.inner).__name__}): the module must return a tensor "
                            f"or a tuple of tensors, not {type(result).__name__}")
        backward_s, backward_kernels = 0.0, 0
        wrt = [t for t in tensors if t.requires_grad] + params
        graded = [o for o in outs if o.requires_grad]
        if torch.is_grad_enabled() and wrt and graded:
            torch.autograd.grad(graded, wrt, grad_outputs=[torch.empty_like(o) for o in graded],
                                retain_graph=True, allow_unused=True)
            after = gpu.stats()
            backward_s = after["busy_s"] - mid["busy_s"]
            backward_kernels = int(after["kernels"] - mid["kernels"])
        cost = _Cost(mid["busy_s"] - before["busy_s"], int(mid["kernels"] - before["kernels"]), backward_s,
                     backward_kernels, tuple(_Out(tuple(o.shape), o.dtype, o.requires_grad) for o in outs), single)
        return cost, result

    def costs(self) -> list[tuple[float, int, float, int]]:
        """Per key measured: (forward seconds, kernels, backward seconds, kernels)."""
        return [(c.forward_s, c.forward_kernels, c.backward_s, c.backward_kernels) for c in self._costs.values()]


def fuse(module: nn.Module) -> nn.Module:
    """`module` as block-level kernels on the timed device (timing-only mode); elsewhere it runs as itself."""
    return Fused(module)
