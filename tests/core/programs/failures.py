"""Ranks of test_failures.py: dead peers, stalls, mismatched calls, clean teardown. Each scenario starts the
default group with the timeout TB_TIMEOUT (60 s when unset) and reports with result()."""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import psutil
import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import emit, main, outcome, result, workdir


def _init() -> tuple[int, int]:
    timeout = float(os.environ.get("TB_TIMEOUT", "60"))
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def kill_9() -> None:
    """Rank 2 kills itself (SIGKILL) at its 20th all_reduce of TEST_SIZE bytes."""
    r, _ = _init()
    x = torch.ones(int(os.environ["TEST_SIZE"]) // 4)

    def loop() -> None:
        for i in range(100000):
            if r == 2 and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(x)
    result(outcome(loop))


def stalled() -> None:
    """Rank 1 never arrives in time."""
    r, _ = _init()

    def op() -> None:
        if r == 1:
            time.sleep(6)  # never arrives in time
            return
        dist.all_reduce(torch.ones(10))
    result(outcome(op))


def _late_op(op: str, r: int, late: int) -> None:
    """One op of TEST_OP: a small all_reduce, a broadcast from the late rank (which only sends), or a send from
    the late rank to rank 0."""
    x = torch.ones(4)
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "broadcast":
        dist.broadcast(x, late)
    elif r == late:
        dist.send(x, 0)
    elif r == 0:
        dist.recv(x, late)


def late() -> None:
    """The last rank comes to an op (TEST_OP) well after the others timed out in it (TB_TIMEOUT): every rank
    reports that op and the next. The others stay until it is done (their links stay open)."""
    r, w = _init()
    late_rank, op = w - 1, os.environ["TEST_OP"]
    dist.all_reduce(torch.ones(4))  # (every link and the small op's buffers made)
    if r == late_rank:
        time.sleep(float(os.environ["TB_TIMEOUT"]) + 1.5)
    res = outcome(lambda: _late_op(op, r, late_rank))
    res["after"] = outcome(lambda: dist.all_reduce(torch.ones(4)))
    done = workdir() / "late_done"
    if r == late_rank:
        done.write_text("")
    else:
        for _ in range(300):
            if done.exists():
                break
            time.sleep(0.1)
    result(res)


def init_again() -> None:
    """Rank 1's first process dies before it could join; rank 0's init_process_group fails (its set-up
    times out waiting for rank 1 after THUNDERBOLT_CONNECT_TIMEOUT=3), and rank 0 says RETRY. The test then
    starts rank 1 again (TEST_LIFE=2), and both init under a new prefix of rank 0's store, as
    docs/fault-tolerance.md says (rank 0 waiting up to the group's timeout: a new process takes seconds to
    start on a loaded machine), then run an all_reduce."""
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    if r == 1 and os.environ.get("TEST_LIFE") != "2":
        os._exit(0)  # (dies before it joins the group)

    def init(attempt: int) -> None:
        dist.init_process_group("thunderbolt", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=r,
                                world_size=w, timeout=datetime.timedelta(seconds=30))

    res: dict = {}
    if r == 0:
        os.environ["THUNDERBOLT_CONNECT_TIMEOUT"] = "3"
        res["first"] = outcome(lambda: init(0))
        del os.environ["THUNDERBOLT_CONNECT_TIMEOUT"]
        emit("RETRY", {})
    res["again"] = outcome(lambda: init(1))
    if res["again"]["ok"]:
        x = torch.ones(4)
        dist.all_reduce(x)
        res["sum"] = x.tolist()
        dist.barrier()
        dist.destroy_process_group()
    result(res)


def mismatched() -> None:
    """The ranks disagree on the size, the dtype or the op (TEST_KIND); then every rank tries once more."""
    r, _ = _init()
    kind = os.environ["TEST_KIND"]

    def op() -> None:
        if kind == "size":
            dist.all_reduce(torch.ones(10 + r))
        elif kind == "dtype":
            dist.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64))
        else:
            x = torch.ones(10)
            dist.all_reduce(x) if r == 0 else dist.broadcast(x, 0)
    res = outcome(op)
    res["after"] = outcome(lambda: dist.all_reduce(torch.ones(3)))
    result(res)


def destroy() -> None:
    """Threads and connections before, during and after a group's life."""
    _init()
    before = threading.active_count()
    g = dist.new_group(backend="thunderbolt")
    for _ in range(3):
        dist.all_reduce(torch.ones(1 << 20), group=g, async_op=True).wait()
    conns_during = len([c for c in psutil.Process().net_connections() if c.status == "ESTABLISHED"])
    # Counted by both before either closes: a loaded rank that counted after its peer's destroy saw every
    # connection in CLOSE_WAIT.
    dist.barrier()
    dist.destroy_process_group()
    # Background threads (torch's store, our keeper) close theirs moments later; under load that took > 0.2 s.
    for waited in range(50):
        time.sleep(0.1)
        conns_after = [c for c in psutil.Process().net_connections() if c.status in ("ESTABLISHED", "LISTEN")]
        if not conns_after:
            break
    result({"threads_before": before, "threads_after": threading.active_count(), "conns_during": conns_during,
            "conns_after": len(conns_after), "waited": waited})


if __name__ == "__main__":
    main({"kill_9": kill_9, "stalled": stalled, "late": late, "init_again": init_again, "mismatched": mismatched,
          "destroy": destroy})
