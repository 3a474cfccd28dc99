"""Non-blocking compressed all-reduce returning a torch Future (what DDP communication hooks need).

Two traps shape this module (both reproduced on gloo):
- Waiting for a collective inside a future callback deadlocks once every backend worker thread sits
  in such a callback (8 concurrent chains hang gloo's 2 workers). So phase 2 is launched from the
  callback without waiting, and its completion fills a result future.
- Collectives launched from callbacks would interleave nondeterministically with the ones the training
  thread launches, and backends pair collectives by issue order. So phase 2 runs on a second process
  group that nothing else uses, and an `OrderedLauncher` issues phase 2 in the order phase 1 was issued,
  whatever order the all_to_alls complete in. Errors travel as values and are re-raised inside a
  `.then` callback: C++ callers such as DDP only see errors raised there.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .allreduce import all_gather_fn
from .stages import decode_result, encode_inputs, reduce_shard
from .codecs import Codec
from .scheme import chunk_layout


class OrderedLauncher:
    """Runs launch callables in ticket order: ticket k's launch waits until tickets < k launched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued = 0
        self._next = 0
        self._waiting: dict[int, Optional[Callable[[], None]]] = {}

    def take(self) -> int:
        with self._lock:
            self._issued += 1
            return self._issued - 1

    def submit(self, ticket: int, launch: Optional[Callable[[], None]]) -> None:
        """Register ticket's launch (None: nothing to launch) and run every launch now in order.
        Launch callables must not raise; they are run under the lock so that the issue order holds."""
        with self._lock:
            self._waiting[ticket] = launch
            while self._next in self._waiting:
                ready = self._waiting.pop(self._next)
                self._next += 1
                if ready is not None:
                    ready()


@dataclass
class Residuals:
    """Error-feedback memory of one tensor: what phase 1 and phase 2 encodings lost last time."""

    local: torch.Tensor
    shard: torch.Tensor


@dataclass
class AsyncGroups:
    """The group phase 1 runs on, the private group of phase 2, and the launcher ordering phase 2."""

    main: Optional[dist.ProcessGroup]
    phase2: Optional[dist.ProcessGroup]
    launcher: OrderedLauncher = field(default_factory=OrderedLauncher)


def make_phase2_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """A new group with the same ranks and backend as `group`; every member must call this together."""
    base = group if group is not None else dist.group.WORLD
    return dist.new_group(
        ranks=dist.get_process_group_ranks(base),
        backend=dist.get_backend(base),
        use_local_synchronization=True,
    )


def unwrap_result(fut: torch.futures.Future) -> torch.Tensor:
    """A future's value, or its error (carried as a value) raised: C++ callers see only raised errors."""
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


def all_reduce_future(
    flat: torch.Tensor, codec: Codec, groups: AsyncGroups, residuals: Optional[Residuals] = None
) -> torch.futures.Future:
    """Start summing fp32 `flat` ([numel]) across groups.main; the future yields a new fp32 [numel].

    Call in the same order on every rank (DDP calls hooks in bucket order)."""
    world = dist.get_world_size(groups.main)
    layout = chunk_layout(flat.numel(), world)
    done: torch.futures.Future = torch.futures.Future()
    ticket = groups.launcher.take()
    sent = encode_inputs(flat, layout, codec, residuals.local if residuals else None)
    received = torch.empty_like(sent)
    gathered = torch.empty_like(sent)

    def finish(fut: torch.futures.Future) -> None:
        try:
            fut.wait()
            done.set_result(decode_result(gathered, layout, codec))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, re-raised by unwrap_result
            done.set_result(exc)

    def phase2(fut: torch.futures.Future) -> None:
        try:
            fut.wait()
            mine = reduce_shard(received, layout, codec, residuals.shard if residuals else None)
        except BaseException as exc:  # noqa: BLE001
            done.set_result(exc)
            groups.launcher.submit(ticket, None)
            return

        def launch() -> None:
            try:
                work = all_gather_fn()(gathered, mine, group=groups.phase2, async_op=True)
                work.get_future().then(finish)
            except BaseException as exc:  # noqa: BLE001
                done.set_result(exc)

        groups.launcher.submit(ticket, launch)

    try:
        work = dist.all_to_all_single(received, sent, group=groups.main, async_op=True)
        work.get_future().then(phase2)
    except BaseException:
        groups.launcher.submit(ticket, None)
        raise
    return done.then(unwrap_result)


def completed_future(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
