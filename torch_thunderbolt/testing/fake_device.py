"""A fake accelerator that stands in for `mps` on Linux, and records which thread runs each op on it.

torch can register a pure-Python backend for its PrivateUse1 device
(`torch.utils.backend_registration._setup_privateuseone_for_python_backend`). Here every tensor of the fake
device wraps a real CPU tensor (`raw`); one boxed fallback kernel runs any aten op on the raw tensors,
re-wraps the results (views stay views, in-place ops write the raw tensor) and appends
`(op name, thread name)` to the device's log. So a test can assert both the values and that no op on a
device tensor ran on a thread of the backend's: the property that matters on a Mac, where Metal command
encoding from two threads at once crashes the process.

What it does not emulate: asynchronous execution (ops run at once), device memory, MPS's missing dtypes.
Limit: a fake tensor's own strides are always contiguous (torch offers no Python way to build a
PrivateUse1 tensor with other strides), so ops on non-contiguous views (a transposed weight inside a model's
backward) are not faithful: use it for contiguous tensors, as the backend's tests do.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map

DEFAULT_NAME = "tbfake"


@dataclass
class DeviceLog:
    """The ops run on fake-device tensors, in order: (aten op name, thread name)."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str) -> None:
        with self.lock:
            self.entries.append((op, threading.current_thread().name))

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def threads(self) -> set[str]:
        with self.lock:
            return {t for _, t in self.entries}

    def ops(self) -> list[str]:
        with self.lock:
            return [o for o, _ in self.entries]


class _Module:
    """What torch expects of a device module (torch.<name>), plus this process's fake-device state: the op
    log, and the CPU tensor behind each fake tensor, keyed by its StorageImpl (shared by the shallow copies
    autograd makes without calling any kernel, e.g. `detach()`)."""

    def __init__(self) -> None:
        self.log = DeviceLog()
        self.raws: dict[int, torch.Tensor] = {}

    def wrap(self, raw: torch.Tensor) -> torch.Tensor:
        t = torch._C._acc.create_empty_tensor(list(raw.shape), raw.dtype)
        self.raws[t.untyped_storage()._cdata] = raw
        return t

    def raw(self, t: torch.Tensor) -> torch.Tensor:
        raw = self.raws[t.untyped_storage()._cdata]
        if raw.shape != t.shape:
            raise AssertionError(f"fake device: a view {tuple(t.shape)} of {tuple(raw.shape)} made without a kernel")
        return raw

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device: object = None) -> None:
        pass


def install(name: str = DEFAULT_NAME) -> DeviceLog:
    """Register the fake device as torch's PrivateUse1 backend named `name` (once per process: torch
    allows one) and return its op log."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() == name:
        return getattr(torch, name).log
    module = _Module()
    _setup_privateuseone_for_python_backend(name, backend_module=module)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback(module, name), "PrivateUse1")
    module._lib = lib  # kept alive with the module: dropping the Library unregisters the kernel
    return module.log


def _fallback(module: _Module, name: str):
    def on_device(x: object) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == name

    def unwrap(x: object) -> object:
        return module.raw(x) if on_device(x) else x

    def kernel(op, *args, **kwargs):
        module.log.add(str(op.name()))
        schema = op._schema
        if schema.name == "aten::_copy_from":  # (src, dst): either side may be on the CPU
            src, dst = args[0], args[1]
            unwrap(dst).copy_(unwrap(src))
            return dst
        kw = {k: unwrap(v) for k, v in kwargs.items()}
        if isinstance(kw.get("device"), torch.device) and kw["device"].type == name:
            kw["device"] = torch.device("cpu")
        out = op(*tree_map(unwrap, args), **kw)
        # In-place and out= ops return their mutated input: hand back that fake tensor itself.
        mutated = [a for a, arg in zip(args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
        mutated += [v for k, v in kwargs.items() if k == "out" and on_device(v)]
        if len(mutated) == 1 and isinstance(out, torch.Tensor):
            return mutated[0]
        to_cpu = isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cpu"
        return tree_map(lambda x: module.wrap(x) if isinstance(x, torch.Tensor) and not to_cpu else x, out)

    return kernel


def values(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a fake-device tensor's values, read without the dispatcher (nothing logged)."""
    if t.device.type == "cpu":
        return t.clone()
    return getattr(torch, t.device.type).raws[t.untyped_storage()._cdata].clone()
