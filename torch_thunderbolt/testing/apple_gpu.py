"""An emulated Apple-silicon GPU: the fake accelerator (`testing.fake_device`) in a timed, asynchronous mode.

Every aten op on a device tensor goes onto one in-order device timeline, as every op of MPS goes into its one
command queue: it starts when the host issues it or when the op before it ends, whichever is later, and it
lasts

    max(FLOPs / (peak FLOP/s * calibration), bytes / (memory bandwidth * calibration)) + launch

with FLOPs from `torch.utils.flop_counter`'s formulas (ops it has none for count 0: everything but the matrix
products, convolutions and fused attention), bytes the sizes of the op's input and output tensors (of a
gather, `embedding`/`index_select`/`gather`/`index`, only the rows read), peak FLOP/s the chip's fp32 rate
(fp16 and bf16 run at the same rate on these GPUs), and `launch` a fixed cost per kernel (`LAUNCH_S`). View
and metadata ops (`view`, `transpose`, `as_strided`, `set_`, ...) and allocations (`empty`, ...) launch no
kernel and take no time.

The host thread returns at once, without spending the modelled time. What waits for the timeline, as on a
Mac: a copy between the host and the device, either way (`.cpu()`, `.to("cpu")`, `.to(device)`, `copy_`
with one side on the CPU), unless `non_blocking=True` (MPS commits and waits for a blocking one:
`copy_and_sync` in aten/src/ATen/native/mps/operations/Copy.mm); every op whose result the host reads
(`.item()`, `torch.equal`, ...; their time on the timeline included); `synchronize()` and
`Event.synchronize()`. Each such wait sleeps until the timeline reaches the point it waits for. A copy
within the device goes on the timeline and does not block. A non-blocking copy to the host must be waited
for (an event, `synchronize()`) before its bytes are read, as on MPS; here they are there early.

Two modes:

- exact (`exact=True`): every op computes exactly as on the plain fake device (so exactly as on the CPU);
  only the waiting is modelled;
- timing-only (`exact=False`): what is computed and what is not --
  - computed: every copy between the host and the device (`.to(device)`, `.cpu()`, `copy_` with one side
    on the CPU: so this backend's staging, which is how collectives move data, moves the real bytes),
    every op whose result the host reads (`.item()`, `torch.equal`, ops with a CPU result), views and
    metadata ops, and ops with no meta kernel (data-dependent shapes: `nonzero`, `masked_select`, ...;
    listed in `TimedDevice.computed`);
  - not computed: everything else, copies within the device included (timed, bytes left as they were).
    Outputs get their shape, dtype and strides from the op run on `meta` tensors (once per op and
    argument shapes: the plan is kept), and zeroed memory: untouched anonymous pages from 64 KiB up
    (mmap; torch.zeros would write every byte), so a model's weights cost no memory until something
    writes them. In-place ops (the initialisers `uniform_`, `normal_`, `fill_`, `zero_`; optimiser
    updates; a gradient copied into a DDP bucket) leave their tensor's bytes as they were. Random ops draw
    nothing. Values are therefore zeros or stale, never wrong in shape: a model runs with the data flow of
    the real one, not its numbers. `host_copies = False` (what `bench --workload` sets) leaves copies
    between the host and the device of ZERO_PAGES_FROM bytes or more undone too (timed, and waited for).

The device's op log and its rule stay: every op is logged with its thread, and none may run on a thread of
the backend's (`DeviceLog.on_backend_threads`). Not emulated: overlap of kernels on the GPU (one in-order
queue), caches, power and clock limits, the host cost of encoding (the emulator's own Python cost per op
is real host time here, and is not Metal's).
"""
from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.flop_counter import flop_registry

from . import fake_device

# The fixed cost of one kernel on the device timeline. PyTorch on MPS encodes each aten op by itself: ops
# run as MPSGraph cost ~20 us each to dispatch, ops with their own Metal kernels ~5-8 us in all (M1 Pro,
# pytorch/pytorch#148219; 10 us per command buffer plus 15 us per MPSGraph encode on an M1 Max,
# pytorch/pytorch#82707). A model's ops are a mix of both: 10 us.
LAUNCH_S = 10e-6

ZERO_PAGES_FROM = 64 << 10  # bytes: from here up, outputs of skipped ops are fresh anonymous pages (mmap)

_HALF = (torch.float16, torch.bfloat16)
# Ops that read rows of a table: argument position of the table, whose bytes read are the output's size.
_GATHERS = {"aten::embedding": 0, "aten::index_select": 0, "aten::gather": 0, "aten::index": 0}
# In-place ops that change only a tensor's metadata: no kernel.
_METADATA = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::as_strided_", "aten::transpose_",
             "aten::t_", "aten::squeeze_", "aten::unsqueeze_", "aten::swapdims_", "aten::swapaxes_",
             "aten::detach_", "aten::requires_grad_", "aten::_coalesced_"}
_COPIES = {"aten::_copy_from", "aten::copy_"}
# Allocations: memory, no kernel.
_ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                "aten::empty_like"}


@dataclass(frozen=True)
class Chip:
    """One Apple-silicon GPU, from Apple's published figures (`sources`), and the share of its peaks that
    real kernels achieve (`calibration`, one factor for both, found against published measurements:
    docs/devices.md, "The timed Apple-silicon GPU (emulated)")."""

    name: str
    gpu_cores: int
    fp32_tflops: float
    fp16_tflops: float
    mem_gbps: float
    calibration: float
    sources: tuple[str, ...]

    def peak_flops(self, dtype: torch.dtype) -> float:
        return (self.fp16_tflops if dtype in _HALF else self.fp32_tflops) * 1e12 * self.calibration

    @property
    def bandwidth(self) -> float:
        """Achieved bytes per second."""
        return self.mem_gbps * 1e9 * self.calibration


# Apple publishes each chip's memory bandwidth and GPU cores; of the FP32 peaks only the M2 Ultra's
# (27.2 TFLOPS). The others are cores x 128 FP32 ALUs x 2 (a fused multiply-add) x GPU clock, the clocks
# as listed by hmc-tech (M3 family 1.398 GHz, M4 family 1.678 GHz; its 40-core M3 Max 14.32 and 32-core
# M4 Max 13.74 TFLOPS follow the same rule). FP16 runs at the FP32 rate on these GPUs (same listing).
_APPLE_MAC_PRO = "https://www.apple.com/mac-pro/ (M2 Ultra: 76-core GPU, 27.2 TFLOPS, 800GB/s)"
_APPLE_STUDIO = "https://www.apple.com/mac-studio/specs/ (M3 Ultra 819GB/s; M4 Max 40-core GPU 546GB/s)"
_APPLE_MINI = "https://www.apple.com/mac-mini/specs/ (M4 Pro 20-core GPU, 273GB/s)"
_CLOCKS = "https://hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max (GPU clocks, FP16 = FP32)"
# Calibration: the achieved share of both peaks, one per chip, from docs/devices.md's table: the M2 Ultra's
# balances the seed's 45 ms/token against llama.cpp's measured F16 decode; the M4 Max's and M4 Pro's are
# their llama.cpp rows' (the M4 Max's checked against a measured 4096 matmul); the M3 Ultra, with no
# comparable published row, takes the M2 Ultra's (the same two-die design).
PRESETS: dict[str, Chip] = {
    "m2-ultra": Chip("M2 Ultra (76-core GPU)", 76, 27.2, 27.2, 800.0, 0.75, (_APPLE_MAC_PRO,)),
    "m3-ultra": Chip("M3 Ultra (80-core GPU)", 80, 28.6, 28.6, 819.0, 0.75, (_APPLE_STUDIO, _CLOCKS)),
    "m4-max": Chip("M4 Max (40-core GPU)", 40, 17.2, 17.2, 546.0, 0.79, (_APPLE_STUDIO, _CLOCKS)),
    "m4-pro": Chip("M4 Pro (20-core GPU)", 20, 8.6, 8.6, 273.0, 0.86, (_APPLE_MINI, _CLOCKS)),
}


class Event:
    """A point on the device timeline (as torch.mps.Event): done once the timeline has passed it."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        _sleep_until(self.at)

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds of device time from this event to `end`."""
        return (end.at - self.at) * 1e3


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


def _zeros(shape: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of these sizes and strides over zeroed memory that nothing has written: large ones on
    fresh anonymous pages, which cost no memory until written (torch.zeros writes every byte)."""
    shape, stride = list(shape), list(stride)
    elements = 0 if any(s == 0 for s in shape) else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    nbytes = elements * dtype.itemsize
    if nbytes < ZERO_PAGES_FROM:
        flat = torch.zeros(elements, dtype=dtype)
    else:
        flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)  # the storage keeps the mapping alive
    return flat.as_strided(shape, stride)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Kind:
    """How the timed device treats one aten op (worked out once per op)."""

    view: bool  # a view or a metadata change: no kernel
    allocation: bool  # new memory, no kernel
    copy: bool
    reads_host: bool  # its result is a Python value (a scalar, a bool): the host waits for it
    written: list[tuple[int, str]]  # (position, name) of the arguments it writes
    out_args: set[str]  # the names of its `out=` arguments (written, keyword-only)


def _kind(op: Any) -> _Kind:
    schema = op._schema
    written = fake_device._written_arguments(schema)
    out_args = {a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
    aliasing = any(r.alias_info is not None for r in schema.returns)
    view = (aliasing and not written) or schema.name in _METADATA
    returns_tensors = all(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
                          for r in schema.returns)
    return _Kind(view=view, allocation=schema.name in _ALLOCATIONS, copy=schema.name in _COPIES,
                 reads_host=bool(schema.returns) and not returns_tensors, written=written, out_args=out_args)


class TimedDevice:
    """The fake accelerator's executor in timed mode (module doc). One per process: `install()`."""

    def __init__(self, chip: Chip, exact: bool, name: str = fake_device.DEFAULT_NAME,
                 launch_s: float = LAUNCH_S) -> None:
        self.chip = chip
        self.exact = exact
        # Timing-only: whether copies between the host and the device move their bytes. A Mac's GPU copies at
        # memory bandwidth (what the timeline charges); this host's memcpy runs at a few GB/s, in the issuing
        # thread, so with large copies done for real the host's copying, not the modelled GPU or the
        # exchange, sets the pace of a DDP step. Off (workloads): copies of ZERO_PAGES_FROM bytes or more are
        # timed and not done, and collectives exchange the host buffers' stale bytes.
        self.host_copies = True
        self.launch_s = launch_s
        self.device = torch.device(name, 0)
        self.computed: set[str] = set()  # ops computed in timing-only mode for want of a meta kernel
        self._kinds: dict[Any, _Kind] = {}
        self._plans: dict[Any, _Plan] = {}
        self._lock = threading.Lock()
        self._end = 0.0  # time.monotonic() at which the timeline drains
        self._busy = 0.0
        self._kernels = 0
        self._flops = 0.0
        self._bytes = 0
        self._spans: list[tuple[float, float]] | None = None  # (start, end) of each entry, while recorded

    # -- what a program sees ------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Block until every op issued so far is done (torch.mps.synchronize)."""
        with self._lock:
            end = self._end
        _sleep_until(end)

    def record(self) -> Event:
        """An event at the current end of the timeline (torch.mps.Event().record())."""
        with self._lock:
            return Event(max(self._end, time.monotonic()))

    def busy_seconds(self) -> float:
        """Modelled kernel time so far (since `reset`)."""
        with self._lock:
            return self._busy

    def stats(self) -> dict[str, float]:
        """Kernels, FLOPs, bytes and modelled seconds so far (since `reset`)."""
        with self._lock:
            return {"kernels": self._kernels, "flops": self._flops, "bytes": self._bytes, "busy_s": self._busy}

    def reset(self) -> None:
        """Zero the counters (the timeline itself runs on)."""
        with self._lock:
            self._busy, self._kernels, self._flops, self._bytes = 0.0, 0, 0.0, 0

    def pending_seconds(self) -> float:
        """How far the timeline runs ahead of now: the work issued and not yet done."""
        with self._lock:
            return max(0.0, self._end - time.monotonic())

    def record_spans(self, on: bool = True) -> list[tuple[float, float]]:
        """Start (or stop) keeping the (start, end) of every timeline entry, time.monotonic() seconds; returns
        what was kept since the last start."""
        with self._lock:
            kept, self._spans = self._spans or [], ([] if on else None)
            return kept

    def charge(self, seconds: float, kernels: int = 1, flops: float = 0.0, moved: int = 0) -> float:
        """Put `kernels` kernels lasting `seconds` in all on the timeline as one entry (a block-level kernel
        of `apple_gpu_blocks`, whose time was measured op by op); returns when it ends."""
        end = self._enqueue(seconds, flops, moved)
        if kernels != 1:
            with self._lock:
                self._kernels += kernels - 1
        return end

    # -- the model ------------------------------------------------------------------------------------------

    def kernel_seconds(self, op: Any, args: Any, kwargs: Any, out: Any) -> tuple[float, float, int]:
        """(modelled seconds, FLOPs, bytes) of one kernel: `args`, `kwargs`, `out` as the op saw them (CPU
        or meta tensors, only their metadata is read)."""
        kind = self._kind(op)
        as_aten = getattr(op, "aten_args", None)  # a stand-in for an aten op (fake_device's conv backward)
        if as_aten is not None:
            op, args = as_aten(*args, **kwargs)
        formula = flop_registry.get(op._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        gather = _GATHERS.get(op._schema.name)
        written = sum(_nbytes(t) for t in _tensors(out))
        moved = written
        for i, a in enumerate(args):
            moved += written if i == gather else sum(_nbytes(t) for t in _tensors(a))
        for k, a in kwargs.items():
            if k not in kind.out_args:
                moved += sum(_nbytes(t) for t in _tensors(a))
        dtype = next((t.dtype for t in _tensors(args) if t.is_floating_point()), torch.float32)
        seconds = max(flops / self.chip.peak_flops(dtype), moved / self.chip.bandwidth) + self.launch_s
        return seconds, flops, moved

    def _enqueue(self, seconds: float, flops: float, moved: int) -> float:
        """Put a kernel on the timeline; returns when it ends."""
        with self._lock:
            start = max(time.monotonic(), self._end)
            self._end = start + seconds
            if self._spans is not None:
                self._spans.append((start, self._end))
            self._busy += seconds
            self._kernels += 1
            self._flops += flops
            self._bytes += moved
            return self._end

    def _kind(self, op: Any) -> _Kind:
        kind = self._kinds.get(op)
        if kind is None:
            kind = self._kinds[op] = _kind(op)
        return kind

    # -- fake_device.Executor -------------------------------------------------------------------------------

    def execute(self, op: Any, fn: Callable[..., Any], args: Any, kwargs: Any, on_device: dict[int, torch.Tensor],
                to_cpu: bool) -> Any:
        kind = self._kind(op)
        if kind.view:
            return fn(*args, **kwargs)
        if kind.copy:
            return self._copy(op, fn, args, kwargs, on_device)
        if kind.reads_host or to_cpu:
            out = fn(*args, **kwargs)
            _sleep_until(self._enqueue(*self.kernel_seconds(op, args, kwargs, out)))
            return out
        if self.exact:
            out = fn(*args, **kwargs)
            if not kind.allocation:
                self._enqueue(*self.kernel_seconds(op, args, kwargs, out))
            return out
        return self._skip(op, fn, args, kwargs, kind, on_device)

    def _copy(self, op: Any, fn: Callable[..., Any], args: Any, kwargs: Any,
              on_device: dict[int, torch.Tensor]) -> Any:
        if op._schema.name == "aten::_copy_from":
            src, dst = args[0], args[1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        else:  # copy_(self, src, non_blocking)
            dst, src = args[0], args[1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        src_device, dst_device = id(src) in on_device, id(dst) in on_device
        seconds, flops, moved = self.kernel_seconds(op, (src,), {}, dst)
        end = self._enqueue(seconds, flops, moved)
        if src_device != dst_device and not non_blocking:
            # Between the host and the device, blocking: MPS commits the command buffer and waits for it.
            _sleep_until(end)
        if src_device and dst_device and not self.exact:
            return dst  # within the device: timed, not done (nothing on the host reads device bytes unseen)
        if not self.exact and not self.host_copies and src_device != dst_device and _nbytes(dst) >= ZERO_PAGES_FROM:
            return dst
        return fn(*args, **kwargs)

    def _skip(self, op: Any, fn: Callable[..., Any], args: Any, kwargs: Any, kind: _Kind,
              on_device: dict[int, torch.Tensor]) -> Any:
        """Timing-only: zeroed outputs shaped as the op on meta tensors shapes them; nothing computed. The
        plan (outputs, cost) is kept per op and argument metadata: loops repeat their shapes, and running
        an op on meta tensors costs far more host time than looking the plan up."""
        try:
            key: Any = (op, _signature(args, on_device), _signature(kwargs, on_device))
            plan = self._plans.get(key)
        except TypeError:  # an argument that cannot be hashed
            key, plan = None, None
        if plan is None:
            plan = self._plan(op, fn, args, kwargs, kind, on_device)
            if plan is None:  # no meta kernel (data-dependent shapes): compute it
                self.computed.add(str(op.name()))
                out = fn(*args, **kwargs)
                self._enqueue(*self.kernel_seconds(op, args, kwargs, out))
                return out
            if key is not None:
                self._plans[key] = plan
        if not kind.allocation:
            self._enqueue(plan.seconds, plan.flops, plan.moved)
        raws = _tensors((args, kwargs))
        for k, shape, stride in plan.restride:
            _restride(raws[k], shape, stride)

        def build(x: Any) -> Any:
            if isinstance(x, _Arg):
                return raws[x.k]
            if isinstance(x, _New):
                return _zeros(x.shape, x.stride, x.dtype)
            return x

        return fake_device._map(build, plan.out)

    def _plan(self, op: Any, fn: Callable[..., Any], args: Any, kwargs: Any, kind: _Kind,
              on_device: dict[int, torch.Tensor]) -> "_Plan | None":
        """The op run on meta stand-ins of its arguments: what it returns, how it restrides its written
        arguments, and its cost; None when it has no meta kernel."""
        meta = torch.device("meta")
        position: dict[int, int] = {}  # id(meta stand-in) -> index of its CPU view in _tensors((args, kwargs))
        raws: list[torch.Tensor] = []

        def to_meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                raws.append(x)
                if x.dim() == 0 and id(x) not in on_device:
                    return x  # a CPU scalar (a wrapped number): as on any device, it may stay on the CPU
                m = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=meta)
                position[id(m)] = len(raws) - 1
                return m
            if isinstance(x, torch.device):
                return meta
            return x

        meta_args = fake_device._map(to_meta, args)
        meta_kwargs = fake_device._map(to_meta, kwargs)
        try:
            meta_out = fn(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError):
            return None
        restride = []
        for i, arg_name in kind.written:
            stand_in = meta_args[i] if i < len(meta_args) else meta_kwargs.get(arg_name)
            for m in _tensors(stand_in):
                k = position[id(m)]
                if m.shape != raws[k].shape or m.stride() != raws[k].stride():
                    restride.append((k, tuple(m.shape), tuple(m.stride())))

        def spec(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            k = position.get(id(x))
            if k is not None:  # an in-place or out= op hands back its argument
                return _Arg(k)
            return _New(tuple(x.shape), tuple(x.stride()), x.dtype)

        seconds, flops, moved = self.kernel_seconds(op, meta_args, meta_kwargs, meta_out)
        return _Plan(fake_device._map(spec, meta_out), restride, seconds, flops, moved)


@dataclass(frozen=True)
class _Arg:
    """An op's output that is its k-th tensor argument (in-place and out= ops)."""

    k: int


@dataclass(frozen=True)
class _New:
    """An op's new output: zeroed memory of these sizes, strides and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Plan:
    out: Any  # the op's result with _Arg and _New for its tensors
    restride: list[tuple[int, tuple[int, ...], tuple[int, ...]]]  # (argument k, new sizes, new strides)
    seconds: float
    flops: float
    moved: int


def _signature(x: Any, on_device: dict[int, torch.Tensor]) -> Any:
    """What of an op's arguments decides its outputs' metadata and its cost: tensors' sizes, strides and
    dtypes, everything else by type and value (1 and 1.0 make different outputs)."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, id(x) in on_device)
    if type(x) in (list, tuple):
        return tuple(_signature(v, on_device) for v in x)
    if type(x) is dict:
        return tuple((k, _signature(v, on_device)) for k, v in x.items())
    return (type(x), x)


def _restride(raw: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Give CPU view `raw` these sizes and strides, on new zeroed memory if its own is too small (memory
    of skipped ops may be an mmap, which cannot grow)."""
    shape, stride = list(shape), list(stride)
    need = 0 if any(s == 0 for s in shape) else (raw.storage_offset() + 1
                                                 + sum((n - 1) * st for n, st in zip(shape, stride)))
    if need * raw.element_size() <= raw.untyped_storage().nbytes():
        raw.as_strided_(shape, stride, raw.storage_offset())
    else:
        fresh = _zeros(shape, stride, raw.dtype)
        raw.set_(fresh.untyped_storage(), 0, shape, stride)


def install(preset: str = "m2-ultra", exact: bool = False, name: str = fake_device.DEFAULT_NAME,
            launch_s: float = LAUNCH_S) -> TimedDevice:
    """Register the fake accelerator (as fake_device.install) and put it in timed mode with chip `preset`.
    Idempotent: the same arguments hand back the device already installed; other ones replace it (its
    timeline drained first)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown Apple-silicon preset {preset!r}: one of {', '.join(sorted(PRESETS))}")
    fake_device.install(name)
    module = fake_device.module(name)
    current = module.executor
    if (isinstance(current, TimedDevice) and current.chip == PRESETS[preset] and current.exact == exact
            and current.launch_s == launch_s):
        return current
    if current is not None:
        current.synchronize()
    timed = TimedDevice(PRESETS[preset], exact, name, launch_s)
    module.executor = timed
    return timed


def uninstall(name: str = fake_device.DEFAULT_NAME) -> None:
    """Back to the plain fake device (ops at once, untimed), once the timeline has drained."""
    module = fake_device.module(name)
    if module.executor is not None:
        module.executor.synchronize()
        module.executor = None


# -- calibration ---------------------------------------------------------------------------------------------
#
# One factor per chip (`Chip.calibration`), chosen against published single-Mac figures; the table, its
# sources and the command that reproduces it are in docs/devices.md ("The timed Apple-silicon GPU").

# llama.cpp's Metal backend encodes a whole graph of its own fused kernels into a few command buffers, and
# the GPU runs them back to back (a few µs each: pytorch/pytorch#82707); PyTorch's per-op cost (LAUNCH_S)
# does not apply to it, so its rows are modelled as the roofline alone.
LLAMA_CPP_LAUNCH_S = 0.0


@dataclass(frozen=True)
class Published:
    """A published single-Mac figure the model is checked against: `ms` per token of a decode, or per call
    of an fp32 matmul."""

    preset: str
    what: str
    ms: float
    source: str
    workload: str  # "llama8b", "llama2-7b" (decode, batch 1, fp16) or "matmul4096" (fp32, one call)
    launch_s: float
    position: int = 0  # decode: KV-cache length at which the modelled tokens are decoded


LLAMA_CPP_4167 = "https://github.com/ggml-org/llama.cpp/discussions/4167"
PUBLISHED: tuple[Published, ...] = (
    Published("m2-ultra", "Llama 3 8B, fp16, batch 1, ms/token (the project's seed; an estimate)", 45.0,
              "the project's seed", "llama8b", LAUNCH_S, 128),
    # llama-bench tg128 (128 tokens from an empty cache: the mean cache length is 64), build 8e672ef.
    Published("m2-ultra", "llama.cpp, Llama 2 7B F16, tg128: 41.02 t/s", 1000 / 41.02, LLAMA_CPP_4167,
              "llama2-7b", LLAMA_CPP_LAUNCH_S, 64),
    Published("m4-max", "llama.cpp, Llama 2 7B F16, tg128: 31.64 t/s", 1000 / 31.64, LLAMA_CPP_4167,
              "llama2-7b", LLAMA_CPP_LAUNCH_S, 64),
    Published("m4-max", "PyTorch MPS, fp32 matmul 4096x4096: 10.30 ms (13.3 TFLOPS)", 10.30,
              "https://github.com/chsasank/device-benchmarks/pull/13", "matmul4096", LAUNCH_S),
    Published("m4-pro", "llama.cpp, Llama 2 7B F16, tg128: 17.18 t/s", 1000 / 17.18, LLAMA_CPP_4167,
              "llama2-7b", LLAMA_CPP_LAUNCH_S, 64),
)


def decode_ms_per_token(preset: str, model: str, position: int, launch_s: float = LAUNCH_S,
                        tokens: int = 2) -> dict[str, float]:
    """Decode `tokens` tokens (batch 1, fp16, KV cache of `position` tokens) of a Llama-shaped model on the
    timed device in timing-only mode: modelled ms per token, kernels and bytes per token, and this host's
    time to issue one token (the emulator's own cost, not a Mac's). Installs the timed device."""
    from .models import llama  # the workloads' model: one definition of the decoder

    if model == "llama8b":
        cfg = llama.make_config("llama8b")
    elif model == "llama2-7b":  # Llama 2 7B: multi-head attention, 11008-wide MLP, 32k vocabulary
        cfg = llama.LlamaConfig(vocab_size=32000, layers=32, heads=32, kv_heads=32, intermediate=11008)
    else:
        raise ValueError(f"unknown model {model!r}: llama8b or llama2-7b")
    gpu = install(preset, exact=False, launch_s=launch_s)
    with torch.device("meta"):
        stage = llama.build_stage(cfg, range(cfg.layers), True, True, dtype=torch.float16, device="meta")
    stage = stage.to_empty(device=gpu.device)  # zero pages: nothing written
    caches = stage.new_caches(1)
    token = torch.zeros(1, 1, dtype=torch.long, device=gpu.device)
    stage(token, caches, position - 1)  # plans made once, outside the measurement
    gpu.synchronize()
    gpu.reset()
    start = time.monotonic()
    for i in range(tokens):
        stage(token, caches, position + i)
    host = (time.monotonic() - start) / tokens
    gpu.synchronize()
    stats = gpu.stats()
    return {"ms": stats["busy_s"] / tokens * 1e3, "kernels": stats["kernels"] / tokens,
            "gb": stats["bytes"] / tokens / 1e9, "host_s": host}


def matmul_ms(preset: str, n: int = 4096, launch_s: float = LAUNCH_S) -> dict[str, float]:
    """One fp32 n x n matmul on the timed device: modelled ms."""
    gpu = install(preset, exact=False, launch_s=launch_s)
    a = torch.empty(n, n, device=gpu.device)
    gpu.synchronize()
    gpu.reset()
    a @ a
    stats = gpu.stats()
    return {"ms": stats["busy_s"] * 1e3, "kernels": stats["kernels"], "gb": stats["bytes"] / 1e9, "host_s": 0.0}


def modelled(row: Published, tokens: int = 2) -> dict[str, float]:
    """What the timed device gives for a published row's workload."""
    if row.workload == "matmul4096":
        return matmul_ms(row.preset, 4096, row.launch_s)
    return decode_ms_per_token(row.preset, row.workload, row.position, row.launch_s, tokens)


def calibration_table(tokens: int = 2) -> list[dict[str, Any]]:
    """Every published row against the model: published and modelled ms and the error. Installs the timed
    device (each preset in turn)."""
    rows = []
    for row in PUBLISHED:
        got = modelled(row, tokens)
        rows.append({"preset": row.preset, "calibration": PRESETS[row.preset].calibration, "what": row.what,
                     "published_ms": row.ms, "modelled_ms": got["ms"], "error": got["ms"] / row.ms - 1,
                     "source": row.source, "kernels": got["kernels"], "gb": got["gb"]})
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| chip | calibration | published figure | published ms | modelled ms | error | source |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {PRESETS[r['preset']].name} | {r['calibration']:.2f} | {r['what']} | {r['published_ms']:.1f} "
                     f"| {r['modelled_ms']:.1f} | {r['error']:+.0%} | {r['source']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(_markdown(calibration_table()))
