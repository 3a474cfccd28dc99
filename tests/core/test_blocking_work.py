"""The work of a blocking all_reduce (torch's `async_op=False`) that ran in the caller's thread: one per
group serves them all (torch waits on it at once and drops it), and only a success gets it."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from torch_thunderbolt.backend.process_group import ThunderboltProcessGroup
from torch_thunderbolt.backend.work import WaitedWork
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import MismatchError
from torch_thunderbolt.transport.memory import MemoryHub

pytestmark = pytest.mark.skipif(not hasattr(dist.AllreduceOptions(), "asyncOp"),
                                reason="this torch's AllreduceOptions has no asyncOp: no call is known to block")


def _opts(blocking: bool) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.asyncOp = not blocking
    return opts


def _on_both(fn) -> list:
    """fn(group, rank) on the two ranks of a memory hub at once; their results (or exceptions)."""
    hub = MemoryHub(2)
    pgs = [ThunderboltProcessGroup(hub.transports[r], Config(), 30.0) for r in range(2)]
    out: list = [None, None]

    def run(r: int) -> None:
        try:
            out[r] = fn(pgs[r], r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_blocking_calls_share_one_finished_work_holding_the_last_result() -> None:
    def body(pg: ThunderboltProcessGroup, r: int):
        a, b = torch.full((8,), float(r + 1)), torch.full((8,), float(r + 10))
        wa = pg.allreduce([a], _opts(blocking=True))
        assert wa.wait()
        wb = pg.allreduce([b], _opts(blocking=True))
        assert wb.wait()
        fut_value = wb.get_future().wait()
        wc = pg.allreduce([a], _opts(blocking=False))
        wc.wait()
        return wa, wb, wb.result(), fut_value, wc, a, b

    for wa, wb, result, fut_value, wc, a, b in _on_both(body):
        assert wa is wb and isinstance(wa, WaitedWork) and wa.is_success()
        assert result[0] is b and fut_value[0] is b  # the last blocking op's tensors
        assert wc is not wa and not isinstance(wc, WaitedWork)  # an async work is the caller's own
        assert torch.equal(b, torch.full((8,), 21.0)) and torch.equal(a, torch.full((8,), 6.0))


def test_a_failed_blocking_call_gets_a_work_of_its_own_with_the_error() -> None:
    def body(pg: ThunderboltProcessGroup, r: int):
        ok = pg.allreduce([torch.ones(4)], _opts(blocking=True))
        bad = pg.allreduce([torch.ones(4 if r == 0 else 8)], _opts(blocking=True))
        with pytest.raises(MismatchError):
            bad.wait()
        return ok, bad

    for ok, bad in _on_both(body):
        assert isinstance(ok, WaitedWork) and bad is not ok and not bad.is_success()
