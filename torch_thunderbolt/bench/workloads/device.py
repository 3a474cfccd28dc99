"""The device a workload's model runs on: this host's CPU, the untimed fake accelerator, or the timed
emulated Apple-silicon GPU (`testing.apple_gpu`) in timing-only mode.

On the timed device the host returns from each kernel at once and the kernel completes on the device's
timeline after its modelled time, as on a Mac; `synchronize` waits for the timeline. In timing-only mode
nothing is computed and the weights are never written, so an 8B model's 16 GB are address space only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ...errors import ConfigError


@dataclass
class Device:
    name: str                # the --device value
    torch_device: torch.device
    synchronize: Callable[[], None]
    timed: bool              # kernels take modelled time on a timeline of their own
    timing_only: bool        # nothing is computed: values are meaningless, only times count
    busy_seconds: Callable[[], float] | None = None  # the timeline's modelled busy time so far
    chip: Any = None         # the timed device's preset (its published figures)
    fuser: Callable[[nn.Module], nn.Module] | None = None  # apple_gpu.fuse where the device has it
    record_spans: Callable[[bool], list[tuple[float, float]]] | None = None  # the timed device's busy spans

    def fuse(self, module: nn.Module) -> nn.Module:
        """`module` as one block-level kernel on the timed device in timing-only mode (its forward one
        timeline entry, its backward another, each the sum of its ops' modelled times): op by op, the
        emulator's own per-kernel cost on this host would set the pace instead of the modelled GPU.
        Elsewhere the module itself."""
        return self.fuser(module) if self.fuser is not None and self.timing_only else module

    @property
    def is_cpu(self) -> bool:
        return self.torch_device.type == "cpu"

    def describe(self) -> str:
        if self.name == "cpu":
            return "this host's CPU (computes)"
        if self.name == "fake":
            return "the untimed fake accelerator (device tensors computed on this host's CPU)"
        return (f"timed emulated {self.name} GPU, timing only, copies to and from the host timed and not done "
                "(model: docs/devices.md)")


def open_device(name: str) -> Device:
    """Install (once per process, before the first backward pass) and describe the device `name`."""
    if name == "cpu":
        return Device(name, torch.device("cpu"), lambda: None, timed=False, timing_only=False)
    if name == "fake":
        from ...testing import fake_device

        fake_device.install()
        return Device(name, torch.device(fake_device.DEFAULT_NAME, 0), lambda: None, timed=False,
                      timing_only=False)
    try:
        from ...testing import apple_gpu  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ConfigError(f"--device {name}: the timed emulated GPU (torch_thunderbolt.testing.apple_gpu) cannot "
                          f"be imported ({exc}); use --device cpu or fake") from exc
    from ...testing import apple_gpu_blocks

    gpu = apple_gpu.install(preset=name, exact=False)
    gpu.host_copies = False  # staging copies at the modelled bandwidth, as a Mac's GPU makes them
    return Device(name, torch.device(gpu.device), gpu.synchronize, timed=True, timing_only=not gpu.exact,
                  busy_seconds=gpu.busy_seconds, chip=gpu.chip, fuser=apple_gpu_blocks.fuse,
                  record_spans=gpu.record_spans)


def place(build: Callable[[torch.device], nn.Module], device: Device,
          prepare: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The module `build(device)` makes, then `prepare` (a parallelization) applied, on `device`.
    Timing-only: built and prepared on the meta device and given storage on the device that is never
    written (no host memory is touched, no initialisation is run)."""
    prepare = prepare or (lambda m: m)
    if device.timing_only:
        meta = torch.device("meta")
        with meta:
            module = build(meta)
        return prepare(module).to_empty(device=device.torch_device)
    return prepare(build(device.torch_device))
