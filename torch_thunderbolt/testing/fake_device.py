"""A fake accelerator that stands in for `mps` on Linux, and records which thread runs each op on it.

torch can register a pure-Python backend for its PrivateUse1 device
(`torch.utils.backend_registration._setup_privateuseone_for_python_backend`); one boxed fallback kernel
then receives every aten op that has no other kernel for the device. Here the fake device's memory is host
memory, and a fake tensor is exactly a CPU tensor seen through the device:

- every fake *storage* is a PrivateUse1 storage of the same size whose Python object carries the CPU
  storage that owns the bytes (`_tb_host`). torch keeps a storage's Python object alive as long as the
  storage, so the bytes live exactly as long as any fake tensor on them;
- a fake tensor's sizes, strides and storage offset are those of the CPU tensor it stands for, so the CPU
  view behind any fake tensor is that storage read with the fake tensor's own metadata (`host_view`);
- the kernel runs the op on those CPU views and hands back fake tensors with the results' metadata: on
  the storage of the argument a view or in-place op shares it with (views stay views), on a new fake
  storage otherwise, and the fake argument itself for in-place and `out=` ops (after taking over any
  metadata change, e.g. `resize_` or `transpose_`).

So every op computes exactly what it computes on the CPU, with the same strides, the same kernels and the
same random streams: a model trains on this device bit for bit as on the CPU, except where torch itself
chooses differently by device type (see `SDPA_NOTE`). Each op appends `(op name, thread name)` to the
device's log, so a test can assert that no op on a device tensor ran on a thread of the backend's (the
property that matters on a Mac, where Metal command encoding from two threads at once crashes the process;
every thread the backend starts is named `tb-...`).

Every op runs through the module's `executor`: by default the op itself on the CPU views, at once; the
timed Apple-silicon GPU (`testing.apple_gpu`) puts its own there, which models each op's time on an in-order
device timeline and may skip the arithmetic (see that module). `torch.<name>.Event()` stands for
torch.mps.Event (`record`, `query`, `synchronize`): a point on the executor's timeline, done at once
without one.

What it does not emulate (by default): asynchronous execution (ops run at once), separate device memory (a fake
tensor's `data_ptr()` is its host address, but the backend treats it as unreadable: it is not a CPU
tensor), MPS's missing dtypes (float64), pinned memory (DDP's `find_unused_parameters=True` asks the
accelerator for it and fails here).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

DEFAULT_NAME = "tbfake"

SDPA_NOTE = ("F.scaled_dot_product_attention chooses its kernel by device type: the CPU's fused kernel on "
             "the CPU, the math path (matmul, softmax) on any other device, as on a Mac; the two agree to "
             "float rounding, not bit for bit. Under torch.nn.attention.sdpa_kernel(SDPBackend.MATH) the "
             "CPU runs the math path too and the results are identical.")

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_SET = torch.ops.aten.set_.source_Storage_storage_offset


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

    def on_backend_threads(self) -> list[tuple[str, str]]:
        """The entries made on a thread the backend started (every one is named `tb-...`)."""
        with self.lock:
            return [(o, t) for o, t in self.entries if t.startswith("tb-")]


class Executor(Protocol):
    """Runs each op of the device on its CPU views (the hook of the timed device, `testing.apple_gpu`)."""

    def execute(self, op: Any, fn: Callable[..., Any], args: Any, kwargs: Any, on_device: dict[int, torch.Tensor],
                to_cpu: bool) -> Any:
        """Run aten op `op` (computed by `fn`, which is `op` itself or the host copy that stands for
        `_copy_from`) on `args`/`kwargs`, whose tensors are CPU views; `on_device` holds the ids of those
        that stand for device tensors; `to_cpu`: the op was asked for a CPU result (`device="cpu"`)."""

    def synchronize(self) -> None:
        """Block until every op issued so far is done."""

    def record(self) -> Any:
        """A point at the current end of the timeline: an object with `query()` and `synchronize()`."""


class _Event:
    """torch.mps.Event's interface on the fake device: a point on its executor's timeline, recorded by
    `record()`; without an executor every op is done when issued, so the event is done at once."""

    def __init__(self, module: "_Module") -> None:
        self._module = module
        self._at: Any = None

    def record(self, stream: object = None) -> None:
        executor = self._module.executor
        self._at = executor.record() if executor is not None else None

    def query(self) -> bool:
        return self._at is None or bool(self._at.query())

    def synchronize(self) -> None:
        if self._at is not None:
            self._at.synchronize()

    def wait(self, stream: object = None) -> None:
        """Make later work wait for this event: one in-order timeline does already."""


class _Module:
    """What torch expects of a device module (torch.<name>), plus this process's op log and executor."""

    def __init__(self) -> None:
        self.log = DeviceLog()
        self.executor: Executor | None = None  # None: each op runs at once (the plain fake device)

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
        if self.executor is not None:
            self.executor.synchronize()

    def Event(self, enable_timing: bool = False) -> _Event:  # noqa: N802 - as torch.mps.Event
        return _Event(self)


def module(name: str = DEFAULT_NAME) -> _Module:
    """The device module of the fake device registered as `name` (install() first)."""
    if torch._C._get_privateuse1_backend_name() != name:
        raise RuntimeError(f"the fake device {name!r} is not installed (call fake_device.install first)")
    return getattr(torch, name)


def install(name: str = DEFAULT_NAME) -> DeviceLog:
    """Register the fake device as torch's PrivateUse1 backend named `name` (once per process: torch
    allows one) and return its op log."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() == name:
        return getattr(torch, name).log
    module = _Module()
    _setup_privateuseone_for_python_backend(name, backend_module=module)
    kernel = _fallback(module, name)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(kernel, "PrivateUse1")
    # Convolutions on a device torch has no kernels for go to these two ops, whose default kernels
    # (registered for every device, so the fallback never sees them) raise: run the CPU's own choice.
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("convolution_overrideable", _as(kernel, torch.ops.aten.convolution.default), "PrivateUse1")
    aten.impl("convolution_backward_overrideable", _as(kernel, _convolution_backward), "PrivateUse1")
    # Ops with a CPU kernel and a generic one for other devices (native_layer_norm, softmax, the structured
    # element-wise ops) would run the generic one here, which rounds differently: run the CPU's.
    for qualified in _cpu_ops_with_generic_kernels():
        base, _, overload = qualified[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        aten.impl(qualified[len("aten::"):], _as(kernel, op), "PrivateUse1")
    module._libs = (lib, aten)  # kept alive with the module: dropping a Library unregisters its kernels
    return module.log


def _cpu_ops_with_generic_kernels() -> list[str]:
    """aten ops (with overload) that have a CPU kernel and a CompositeExplicitAutograd one, which every
    device without its own kernel (this one) would otherwise run instead of the fallback."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [n for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and has(n, "CPU") and not has(n, "PrivateUse1")
            and (has(n, "CompositeExplicitAutograd") or has(n, "CompositeExplicitAutogradNonFunctional"))]


def _as(kernel: Callable[..., Any], op: Any) -> Callable[..., Any]:
    """A kernel for one op that runs `op` (an aten op or a function of CPU tensors) through `kernel`."""
    return lambda *args, **kwargs: kernel(op, *args, **kwargs)


class _ConvolutionBackward:
    """convolution_backward_overrideable's arguments handed to the CPU's convolution_backward (which
    also takes the bias sizes, and computes the bias gradient as a CPU convolution's backward does)."""

    _schema = torch.ops.aten.convolution_backward_overrideable.default._schema

    @staticmethod
    def name() -> str:
        return "aten::convolution_backward_overrideable"

    def aten_args(self, grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Any,
                  padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                  output_mask: Any) -> tuple[Any, tuple[Any, ...]]:
        """The aten op this stands for, and its arguments (what torch's flop counter knows)."""
        bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
        return torch.ops.aten.convolution_backward.default, (grad_output, x, weight, bias_sizes, stride, padding,
                                                             dilation, transposed, output_padding, groups,
                                                             output_mask)

    def __call__(self, *args: Any) -> Any:
        op, aten_args = self.aten_args(*args)
        return op(*aten_args)


_convolution_backward = _ConvolutionBackward()


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor a fake-device tensor stands for: its storage's host bytes read with its own sizes,
    strides and offset (a view: writing it writes the device tensor). Makes no device op."""
    host = t.untyped_storage()._tb_host
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.shape, t.stride())


def values(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a fake-device tensor's values, read without the dispatcher (nothing logged)."""
    if t.device.type == "cpu":
        return t.detach().clone()
    return host_view(t.detach()).clone()


def _device_storage(host: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """A device storage over the bytes of CPU storage `host`, which it keeps alive."""
    storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), device, host.nbytes())
    storage._tb_host = host
    return storage


def _point(t: torch.Tensor, storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """Make fake tensor `t` a view of `storage` with the sizes, strides and offset of CPU tensor `like`.
    The CPU kernel of `set_` only rewrites the tensor's metadata, whatever its device."""
    _SET.redispatch(_CPU_KEYS, t, storage, like.storage_offset(), like.shape, like.stride())
    return t


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """fn over the leaves of an op's arguments or results (tensors, and lists, tuples and dicts of them).
    torch's pytree does the same at about twice the cost, which every op of the device pays."""
    if type(x) in (list, tuple):
        return type(x)(_map(fn, v) for v in x)
    if type(x) is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _copy_between(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`_copy_from` on CPU views: what a copy between the device and the host, or within the device, does."""
    dst.copy_(src)
    return dst


def _written_arguments(schema: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments an op writes (in-place and out= ops)."""
    return [(i, arg.name) for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _fallback(module: _Module, name: str) -> Callable[..., Any]:
    device = torch.device(name, 0)
    cpu = torch.device("cpu")
    written: dict[Any, list[tuple[int, str]]] = {}  # per op, computed once

    def kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
        module.log.add(str(op.name()))
        schema = op._schema
        storages: dict[int, torch.UntypedStorage] = {}  # host storage -> the device storage over it
        fakes: dict[int, torch.Tensor] = {}  # id(CPU view) -> the fake tensor it stands for

        def unwrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.device.type == name:
                fake_storage = x.untyped_storage()
                storages.setdefault(fake_storage._tb_host._cdata, fake_storage)
                raw = host_view(x)
                fakes[id(raw)] = x
                return raw
            if isinstance(x, torch.UntypedStorage) and x.device.type == name:
                storages.setdefault(x._tb_host._cdata, x)
                return x._tb_host
            if isinstance(x, torch.device) and x.type == name:
                return cpu
            return x

        raw_args = _map(unwrap, args)
        raw_kwargs = _map(unwrap, kwargs)
        explicit = kwargs.get("device")
        to_cpu = isinstance(explicit, torch.device) and explicit.type == "cpu"
        # _copy_from (src, dst, non_blocking): either side may be on the CPU; it has no CPU kernel, and it
        # hands back dst as it is.
        copy = schema.name == "aten::_copy_from"
        fn = _copy_between if copy else op
        executor = module.executor
        if executor is None:
            out = fn(*raw_args, **raw_kwargs)
        else:
            out = executor.execute(op, fn, raw_args, raw_kwargs, fakes, to_cpu)
        if copy:
            return args[1]

        def storage_for(raw: torch.Tensor) -> torch.UntypedStorage:
            host = raw.untyped_storage()
            held = storages.get(host._cdata)
            if held is None or held.nbytes() != host.nbytes() or held.data_ptr() != host.data_ptr():
                held = _device_storage(host, device)  # new bytes, or bytes a resize_ moved
                storages[host._cdata] = held
            return held

        # In-place ops may also change an argument's metadata (resize_ by an out= op, transpose_, set_):
        # the fake argument takes over its CPU view's.
        writes = written.get(op)
        if writes is None:
            writes = written[op] = _written_arguments(schema)
        for i, arg_name in writes:
            if i < len(args):
                fake, raw = args[i], raw_args[i]
            elif arg_name in kwargs:
                fake, raw = kwargs[arg_name], raw_kwargs[arg_name]
            else:
                continue
            for f, r in zip(fake if isinstance(fake, (list, tuple)) else [fake],
                            raw if isinstance(raw, (list, tuple)) else [raw]):
                if isinstance(f, torch.Tensor) and f.device.type == name and (
                        f.shape != r.shape or f.stride() != r.stride() or f.storage_offset() != r.storage_offset()
                        or f.untyped_storage()._tb_host._cdata != r.untyped_storage()._cdata
                        or f.untyped_storage().nbytes() != r.untyped_storage().nbytes()):
                    _point(f, storage_for(r), r)

        def rewrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            fake = fakes.get(id(x))
            if fake is not None:  # an in-place or out= op hands back its argument
                return fake
            if to_cpu:
                return x
            return _point(torch._C._acc.create_empty_tensor([0], x.dtype), storage_for(x), x)

        return _map(rewrap, out)

    return kernel
