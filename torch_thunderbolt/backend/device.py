"""Collectives on tensors of another device (mps): overlapped with the caller, with every device op on a
thread that may touch the device.

The rule: no op on a device tensor, and no future callback (which may run one), on a thread of the
backend's. Metal command encoding from two threads at once crashes the process, and autograd encodes its
kernels while the backend works. An op on device tensors therefore runs in three parts:

1. Issue, in the caller's thread: the copies of the device inputs to host memory are queued on the device
   behind the kernels already issued (`non_blocking`), and an event recorded after them (`DeviceGate`);
   the outputs get host buffers (`DeviceStaging`), and the op itself is the CPU op on those host tensors
   (inline or on the worker, by the CPU path's rules: a large async op returns at once). The caller does
   not wait for the device: a blocking copy would hold it until the device reached the op's inputs, and
   under DDP that thread is autograd's, which meanwhile issues no kernels, so the device would idle at
   every bucket. A device without events (torch.<type>.Event) gets blocking copies instead.
2. The bytes move on the worker, between host buffers only, once the device has passed the event: the
   host op waits for it first, by querying it (which reads a counter the device signals and encodes
   nothing) between short sleeps. An op the caller waits for at once, or a small one whose event is
   already done, runs inline as on the CPU path.
3. Completion, on a thread allowed to touch the device: the host results are copied into the device
   outputs (queued, where the device has events; the host buffers are reused only once the device has
   passed those copies), the work is marked complete and its future's callbacks run. Works complete in
   issue order, at the first of:
   - a thread waiting on it: `work.wait()`, the future's `wait()`/`value()`, or `is_completed()`/`done()`
     once its bytes are in;
   - the issuing thread's next op on the group, for works whose bytes are in;
   - the end of the backward pass it was issued in. DDP issues bucket all_reduces from autograd hooks and
     waits on their futures in C++ at the end of the pass (`Reducer::finalize_backward`, a callback queued
     after the last bucket): the first device op of a pass queues a callback of ours before it, which
     completes the pass's works on autograd's thread, so DDP finds them complete and copies the results
     into `.grad` itself. Inside autograd's final callbacks (DDP's first iteration with `static_graph`) no
     callback can be queued ahead of the caller, so there an op completes before it returns.

A C++ caller waiting on a device op's future without going through any of these (torch.futures.wait_all /
collect_all on such futures) waits until one of them happens. C++ callers also see a failed op's future as
complete: DDP learns of the error from the end-of-pass callback, which raises it into `backward()`.
"""
from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Any, Callable

import torch
from torch.autograd import Variable

from ..errors import CollectiveTimeout
from .work import Work

BACKEND_THREAD_PREFIX = "tb-"  # every thread the backend starts is named so; none may touch the device


def on_backend_thread() -> bool:
    return threading.current_thread().name.startswith(BACKEND_THREAD_PREFIX)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class HostBuffers:
    """Host buffers for staging, kept for reuse by element count and dtype. A fresh buffer costs a page fault
    per 4 KB on its first write (a 16 MB copy took 2 ms into a used buffer and up to 50 ms into a fresh
    one here), and DDP stages buckets of the same sizes every step."""

    KEEP = 8  # free buffers kept per size and dtype

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        # Buffers the device may still read (a queued copy to the device): held, whatever KEEP says, until
        # their events are done, since the device copies from the buffer's memory itself.
        self._busy: list[tuple[list[Any], list[torch.Tensor]]] = []

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor of `t`'s shape and dtype (contents undefined)."""
        with self._lock:
            if self._busy:
                self._reclaim()
            free = self._free.get((t.numel(), t.dtype))
            flat = free.pop() if free else None
        if flat is None:
            flat = torch.empty(t.numel(), dtype=t.dtype)
        return flat.view(t.shape)

    def give(self, buffers: list[torch.Tensor], after: list[Any] | None = None) -> None:
        """Buffers free once the device has passed `after` (events; None: free now)."""
        with self._lock:
            if after:
                self._busy.append((after, buffers))
            else:
                self._put(buffers)

    def _reclaim(self) -> None:
        busy, self._busy = self._busy, []
        for events, buffers in busy:
            if all(e.query() for e in events):
                self._put(buffers)
            else:
                self._busy.append((events, buffers))

    def _put(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            free = self._free.setdefault((b.numel(), b.dtype), [])
            if len(free) < self.KEEP:
                free.append(b.view(-1))


class DeviceGate:
    """Where the device's queue stood once an op's input copies to host memory were queued: the host op
    reads those buffers only after the device has passed it. Waited for by whichever thread runs the host
    op, the group's worker included: querying an event reads a counter the GPU signals
    (MTLSharedEvent.signaledValue under torch.mps.Event.query) and encodes nothing, so it is no device op.
    The wait sleeps between queries: torch's Event.synchronize holds the GIL while it waits."""

    FIRST_PAUSE_S = 20e-6
    LONGEST_PAUSE_S = 0.5e-3  # at most this late after the device gets there

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def ready(self) -> bool:
        if self._events and all(e.query() for e in self._events):
            self._events = []
        return not self._events

    def unpassed(self) -> list[Any]:
        return [] if self.ready() else list(self._events)

    def wait(self, seconds: float, what: str) -> None:
        if self.ready():
            return
        deadline = time.monotonic() + seconds
        pause = self.FIRST_PAUSE_S
        while not self.ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(f"{what}: Timed out after {seconds:.1f}s waiting for the device to reach "
                                        f"the op's inputs (their copies to host memory)")
            time.sleep(min(pause, left))
            pause = min(pause * 2, self.LONGEST_PAUSE_S)


class DeviceStaging:
    """Host stand-ins for an op's device tensors: inputs copied now (queued on the device where it has
    events, `gate`), outputs written back at completion. CPU tensors pass through unchanged (the CPU op reads
    and writes them itself)."""

    def __init__(self, completions: "DeviceCompletions") -> None:
        self._completions = completions
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held: list[torch.Tensor] = []  # pooled buffers, returned once the op is complete
        self.written: set[int] = set()  # storages of the device tensors written at completion
        self._queued: dict[torch.device, None] = {}  # devices with input copies queued and not yet gated
        self._after: list[Any] = []  # events after the write-back's queued copies
        self._gate: DeviceGate | None = None
        self._keep: list[torch.Tensor] = []  # device tensors the queued input copies read

    def _map(self, tensors: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if isinstance(tensors, torch.Tensor):
            return tensors if tensors.is_cpu else fn(tensors)
        if isinstance(tensors, (list, tuple)):
            return type(tensors)(self._map(t, fn) for t in tensors)
        return tensors

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_sparse:  # not pooled
            return t.detach().to("cpu")
        host = self._completions.buffers.take(t)
        self._held.append(host)
        return host

    def _copy_in(self, t: torch.Tensor) -> torch.Tensor:
        # An earlier op still in flight that writes this tensor comes first: collectives take effect in
        # issue order, as on any backend.
        self._completions.settle(t)
        host = self._host(t)
        if not t.is_sparse:
            if self._completions.has_events(t.device):
                # Queued behind the kernels that make `t`, without waiting for them: a blocking copy would
                # hold this thread (autograd's, under DDP) until the device got here, and the device would
                # then idle while this thread issues the next kernels.
                src = t.detach().resolve_conj().resolve_neg()
                if src.stride() != host.stride():
                    # MPS copies to the host asynchronously only between equal strides (otherwise it copies
                    # into a temporary and from there on the host at once, before the device has written
                    # it): a contiguous copy on the device first, kept until the op is complete.
                    src = src.clone(memory_format=torch.contiguous_format)
                    self._keep.append(src)
                host.copy_(src, non_blocking=True)
                self._queued[t.device] = None
            else:
                host.copy_(t.detach())
        return host

    def _buffer_for(self, t: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        self._back.append((t, host))
        self.written.add(_storage_key(t))
        return host

    def read(self, tensors: Any) -> Any:
        """Inputs: host copies of the device tensors, taken now."""
        return self._map(tensors, self._copy_in)

    def write(self, tensors: Any) -> Any:
        """Outputs: host buffers, copied into the device tensors at completion."""
        return self._map(tensors, lambda t: self._buffer_for(t, self._host(t)))

    def read_write(self, tensors: Any) -> Any:
        """In-out tensors (all_reduce, broadcast's root, reduce): host copies now, copied back at completion."""
        return self._map(tensors, lambda t: self._buffer_for(t, self._copy_in(t)))

    def gate(self) -> DeviceGate | None:
        """The point the device must pass before the host op reads its inputs (None: they are in), once the
        inputs are mapped: taken by the group as it hands the host op over (`DeviceCompletions.gate`)."""
        if not self._queued:
            return None
        events = [self._completions.record(d) for d in self._queued]
        self._queued = {}
        self._gate = DeviceGate(events)
        return self._gate

    @property
    def ungated(self) -> bool:
        """Input copies were queued and no host op took their gate."""
        return bool(self._queued)

    def write_back(self) -> None:
        """Copy the host results into the device tensors: a device op, on a thread allowed to run one.
        Queued without waiting where the device has events (later kernels come after them on the device's
        queue); the host buffers stay held until the device has passed them (`release`)."""
        queued: dict[torch.device, None] = {}
        for t, host in self._back:
            if t.is_sparse:
                with torch.no_grad():  # a sparse tensor's detached alias would take the new indices, not `t`
                    t.copy_(host)
            elif self._completions.has_events(t.device):
                t.detach().copy_(host, non_blocking=True)
                queued[t.device] = None
            else:
                t.detach().copy_(host)
        self._back.clear()
        self._after = [self._completions.record(d) for d in queued]

    def release(self) -> None:
        """The op is complete: its host buffers may serve another once the device has read them."""
        held, self._held = self._held, []
        self._keep.clear()
        # (a host op that failed before its gate: the device may still be copying into its buffers)
        unpassed = self._gate.unpassed() if self._gate is not None else []
        self._completions.buffers.give(held, self._after + unpassed)


class DeviceFuture(torch.futures.Future):
    """The future of an op on device tensors. Completed (its callbacks run) only on a thread allowed to
    touch the device; a Python thread that waits on it, or asks whether it is done, completes it itself.
    Its value is the op's device tensors, written. `then` returns a future of the same kind, so waiting
    on a chained future drives the op too."""

    def __init__(self, work: "DeviceWork") -> None:
        super().__init__()
        self._work = work
        self._error: BaseException | None = None

    def wait(self) -> Any:
        self._work.wait()
        value = super().wait()
        if self._error is not None:
            raise self._error
        return value

    def value(self) -> Any:
        return self.wait()

    def done(self) -> bool:
        self._work.is_completed()  # completes the op here if its bytes are in
        return super().done()

    def then(self, callback: Callable[[Any], Any]) -> "DeviceFuture":
        child = DeviceFuture(self._work)
        super().then(callback).add_done_callback(child._take)
        return child

    def _take(self, chained: torch.futures.Future) -> None:
        """The result of a `then` callback, which ran where this future completed (a device thread)."""
        try:
            value = chained.value()
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), and by the end-of-pass callback
            self._error = exc
            self._work.completions.callback_failed(exc)
            value = None
        self.set_result(value)


class DeviceWork(Work):
    """An op on device tensors: the host op's work (`host`, finished by the worker once the bytes are in)
    plus the device part, run by `DeviceCompletions` on a thread allowed to touch the device."""

    device = True

    def __init__(self, host: Work, staging: DeviceStaging, result: Any, completions: "DeviceCompletions") -> None:
        super().__init__(host.what, result)
        self.host = host
        self.staging = staging
        self.completions = completions
        self.issuer = threading.get_ident()
        self.graph_task = -1

    def complete(self) -> None:
        """The device part, once the bytes are in (the host work finished): write the results back, then
        finish, which runs the future's callbacks here. Finished before the callbacks run, since a
        callback may read the future's value (which waits on this work)."""
        exc = self.host.exception()
        if exc is None:
            try:
                self.staging.write_back()
            except BaseException as e:  # noqa: BLE001 - delivered through the work
                exc = e
        self.staging.release()
        with self._lock:
            self._exc = exc
            self._finished = True
            fut = self._raw
        if fut is not None:
            fut.set_result(self._result)

    def wait(self, timeout: Any = None) -> bool:
        if not self._finished:
            seconds = timeout.total_seconds() if timeout is not None and timeout.total_seconds() > 0 else None
            self.completions.complete_through(self, seconds)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        if not self._finished and self.host.is_completed() and not on_backend_thread():
            self.completions.complete_through(self, None)
        return self._finished

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = self._raw = DeviceFuture(self)
                if self._finished:
                    self._raw.set_result(self._result)
        return self._fut


class DeviceCompletions:
    """The device ops of one group not yet complete, in issue order, and who completes them (module doc)."""

    def __init__(self) -> None:
        self.buffers = HostBuffers()
        self._event_types: dict[str, Any] = {}  # device type -> its Event class, None where it has none
        self._issue = threading.local()  # .staging: the device op this thread is issuing (run)
        self.issuing = 0  # device ops being issued, by any thread (the group looks before its fast path)
        self._lock = threading.Lock()
        self._turn = threading.RLock()  # held while completing: one thread at a time, in issue order
        self._pending: collections.deque[DeviceWork] = collections.deque()
        self.pending = self._pending  # the same queue, for a look without the lock or a call (a small op's)
        self._drain_task = -1  # the backward pass whose end-of-pass callback is queued
        # Errors of ops issued in a backward pass, and of callbacks chained on device futures: raised into
        # backward() by the end-of-pass callback (C++ waiters see a completed future as a success).
        self._errors: list[tuple[int, BaseException]] = []

    @property
    def idle(self) -> bool:
        return not self._pending

    def run(self, result: Any, op: Callable[[DeviceStaging], Work]) -> Work:
        """Issue `op` (the CPU op, given a staging to map its device tensors) for `result`'s device tensors.
        Called in the issuing thread."""
        if on_backend_thread():
            raise RuntimeError("torch_thunderbolt: an op on device tensors was issued on a backend thread")
        if self._pending:
            self.complete_ready()
        staging = DeviceStaging(self)
        self._issue.staging = staging
        with self._lock:
            self.issuing += 1
        try:
            host = op(staging)
        except BaseException:
            gate = staging.gate()  # queued copies into buffers about to be dropped: let them land first
            if gate is not None:
                gate.wait(float("inf"), "an op on device tensors")
            raise
        finally:
            self._issue.staging = None
            with self._lock:
                self.issuing -= 1
        if staging.ungated:  # the host op was handed over without waiting for its inputs: it read garbage
            raise RuntimeError(f"{host.what}: torch_thunderbolt bug: the host op of an op on device tensors did "
                               "not take its inputs' gate (DeviceCompletions.gate)")
        work = DeviceWork(host, staging, result, self)
        task = torch._C._current_graph_task_id()
        with self._lock:
            self._pending.append(work)
        if task != -1:
            if torch._C._current_autograd_node() is None:
                # In autograd's final callbacks (DDP's static_graph first pass issues every bucket there and
                # waits right after): nothing can be queued ahead of the caller, so complete now.
                self.complete_through(work, None)
                if work._exc is not None:
                    raise work._exc
                return work
            work.graph_task = task
            if self._drain_task != task:
                self._drain_task = task
                Variable._execution_engine.queue_callback(lambda: self.drain(task))
        if work.host.is_completed():  # ran inline (small, or the caller waits anyway)
            self.complete_ready()
        return work

    def gate(self) -> DeviceGate | None:
        """For the group, as it hands a host op over (to its worker, or inline): complete this thread's works
        whose bytes are in; and, when the host op is the CPU part of a device op this thread is issuing, the
        gate it must pass before reading its inputs (None: nothing to wait for). Taken once per device op."""
        if self._pending:
            self.complete_ready()
        staging = getattr(self._issue, "staging", None)
        if staging is None:
            return None
        self._issue.staging = None
        return staging.gate()

    def has_events(self, device: torch.device) -> bool:
        """Whether `device` has events (torch.<type>.Event, as torch.mps.Event), so copies to and from it can
        be queued and waited for later; without them a copy blocks."""
        kind = self._event_types.get(device.type, self)
        if kind is self:
            kind = self._event_types[device.type] = getattr(getattr(torch, device.type, None), "Event", None)
        return kind is not None

    def record(self, device: torch.device) -> Any:
        """An event at the end of what this thread has queued on `device` so far (has_events first)."""
        event = self._event_types[device.type]()
        event.record()
        return event

    def settle(self, t: torch.Tensor) -> None:
        """Complete every pending op that writes `t` (and those before it) before `t` is read."""
        if not self._pending:
            return
        key = _storage_key(t)
        with self._lock:
            last = next((w for w in reversed(self._pending) if key in w.staging.written), None)
        if last is not None:
            self.complete_through(last, None)

    def complete_ready(self) -> None:
        """Complete, in order, the works at the head whose bytes are in and that this thread issued."""
        me = threading.get_ident()
        if not self._turn.acquire(blocking=False):
            return  # another thread is completing: it keeps the order
        try:
            while True:
                with self._lock:
                    head = self._pending[0] if self._pending else None
                if head is None or head.issuer != me or not head.host.is_completed():
                    return
                self._complete(head)
        finally:
            self._turn.release()

    def complete_through(self, work: DeviceWork, seconds: float | None) -> None:
        """Wait for the bytes of every pending work up to `work` and complete them, in this thread."""
        if on_backend_thread():
            raise RuntimeError(f"{work.what}: a backend thread waited on an op on device tensors")
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._turn:
            while not work._finished:
                with self._lock:
                    head = self._pending[0]
                if not head.host.is_completed():
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        head.host.wait(None if left is None else _timedelta(left))
                    except BaseException:  # noqa: BLE001 - the op's own error: delivered by complete()
                        if not head.host.is_completed():
                            raise CollectiveTimeout(f"{work.what}: Timed out after {seconds:.1f}s waiting for "
                                                    f"it to finish") from None
                self._complete(head)

    def _complete(self, head: DeviceWork) -> None:
        with self._lock:
            self._pending.popleft()
        head.complete()
        if head._exc is not None and head.graph_task != -1:
            with self._lock:
                self._errors.append((head.graph_task, head._exc))

    def callback_failed(self, exc: BaseException) -> None:
        """A callback chained on a device future raised. Outside a backward pass its waiter sees it."""
        task = torch._C._current_graph_task_id()
        if task != -1:
            with self._lock:
                self._errors.append((task, exc))

    def drain(self, task: int) -> None:
        """End of backward pass `task` (autograd's final callback, on its thread): complete the pass's ops,
        and raise the first error among them or their chained callbacks into `backward()`."""
        with self._lock:
            last = next((w for w in reversed(self._pending) if w.graph_task == task), None)
            self._drain_task = -1
        if last is not None:
            self.complete_through(last, None)
        with self._lock:
            errors = [exc for t, exc in self._errors if t == task]
            self._errors = [(t, exc) for t, exc in self._errors if t != task]
        if errors:
            raise errors[0]


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-6))
