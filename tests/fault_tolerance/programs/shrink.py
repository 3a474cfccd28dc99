"""Ranks of test_shrink.py: a group loses ranks (or is shrunk while every rank is alive), the ranks that stay
call `dist.shrink_group`, and every op family on the shrunk group is checked against the reference
(tests/fault_tolerance/op_checks.py). Parameters from the environment:

- TEST_EXCLUDE: the ranks of the default group to exclude ("2", "1,3");
- TEST_HOW: how they go: `exit` (os._exit right after an op), `kill` (SIGKILL while their ops are in flight),
  `healthy` (alive: they go on calling ops on the old group, and report what they get);
- TEST_CHECKS: `all` (every op family, the default) or `one` (one all_reduce);
- TEST_SUBGROUP=1: a new_group on the shrunk group (its ranks 0 and the last), every op family on it;
- TEST_AGAIN=K: then rank K of the shrunk group exits hard and the others shrink again;
- TEST_FLAGS=abort: shrink with SHRINK_ABORT (else SHRINK_DEFAULT).

(`pending`, what the shrink flags do to an op of the old group still pending, reads TEST_FLAGS only.) A rank
that stays reports a RESULT (the loss, the shrunk group, the checks), then SUB and AGAIN lines when
asked; an excluded one that is alive a RESULT of its calls."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import (Exit, emit, main, outcome, pretend_hosts, rank, register_pid, result,
                                               workdir, world)

from ..op_checks import LARGE, GroupChecks

LOSS_STEP = 3  # the excluded ranks go during this step of the loop of ops


def _init() -> None:
    register_pid()
    pretend_hosts()
    dist.init_process_group("thunderbolt", init_method="env://",
                            timeout=timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "60"))))


def _ranks(name: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, "").split(",") if x.strip()]


def _pg(group: Any = None) -> Any:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _record(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "msg": str(exc), "peer": getattr(exc, "peer", None)}


def _lose(excluded: list[int], how: str) -> dict[str, Any]:
    """Every rank runs the same loop of large async all_reduces; the excluded ranks go at LOSS_STEP (`exit`:
    once its ops are done; `kill`: with two of its ops in flight). A rank that stays runs until an op fails:
    the record says how it failed, and lists any op that completed with a wrong result."""
    r, w = rank(), world()
    checks = GroupChecks()
    wrong: list[str] = []
    for step in range(200):
        ts = [checks.data(LARGE, r) + k for k in range(2)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        if r in excluded and step == LOSS_STEP and how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            for k, work in enumerate(works):
                work.wait()
                want = checks.total(LARGE) + k * w
                if not torch.equal(ts[k], want):
                    wrong.append(f"step {step} op {k}: {(ts[k] != want).sum().item()} wrong")
        except Exception as exc:  # noqa: BLE001 - what the loss gave is the record
            return {**_record(exc), "step": step, "wrong": wrong}
        if r in excluded and step == LOSS_STEP:
            os._exit(0)
    return {"type": None, "msg": "no op failed", "peer": None, "step": None, "wrong": wrong}


def _checks(group: Any = None) -> list[str]:
    if os.environ.get("TEST_CHECKS", "all") == "one":
        checks = GroupChecks(group)
        t = checks.data(1000, checks.rank)
        dist.all_reduce(t, group=group)
        checks.check("all_reduce", t, checks.total(1000))
        return checks.bad
    return GroupChecks(group).every_op()


def _shrink(excluded: list[int]) -> dict[str, Any]:
    """shrink_group(excluded) on the default group, then one all_reduce on the shrunk group: how long that
    took, and what the shrunk group is."""
    old = _pg()
    t0 = time.monotonic()
    flags = dist.distributed_c10d.SHRINK_ABORT if os.environ.get("TEST_FLAGS") == "abort" else 0
    new = dist.shrink_group(excluded, shrink_flags=flags)
    x = torch.ones(10)
    dist.all_reduce(x)
    took = time.monotonic() - t0
    return {"ms": took * 1000, "rank": dist.get_rank(), "world": dist.get_world_size(),
            "default": new is _pg(), "same_engine": new.transport.engine is old.transport.engine,
            "ones": x.tolist() == [float(new.size())] * 10, "kind": new.transport.kind,
            "shape": new._comm.shape.kind, "old_usable": old.usable}


def _subgroup() -> dict[str, Any]:
    """new_group of the shrunk group's ranks 0 and last: the members' every op exact, over the same links."""
    w = dist.get_world_size()
    ranks = [0, w - 1]
    sub = dist.new_group(ranks)
    if dist.get_rank() not in ranks:
        return {"member": False}
    return {"member": True, "same_engine": sub.transport.engine is _pg().transport.engine,
            "bad": _checks(sub), "world": sub.size()}


def _again(victim: int) -> dict[str, Any]:
    """Rank `victim` of the shrunk group exits hard after one more all_reduce; the others shrink again."""
    x = torch.ones(1000)
    dist.all_reduce(x)
    if dist.get_rank() == victim:
        os._exit(0)
    loss = outcome(lambda: [dist.all_reduce(torch.ones(LARGE)) for _ in range(100)])
    shrunk = _shrink([victim])
    return {"loss": loss, "shrunk": shrunk, "bad": _checks()}


def shrink() -> Exit:
    _init()
    r = rank()
    excluded, how = _ranks("TEST_EXCLUDE"), os.environ["TEST_HOW"]
    if how == "healthy" and r in excluded:
        return _excluded_alive()
    x = torch.ones(10)
    # (every link is up) With SHRINK_ABORT on a healthy group a faster rank's shrink ends this op at once
    # where this rank is still in it: it must fail naming the shrink, and the shrink goes on.
    first = outcome(lambda: dist.all_reduce(x)) if os.environ.get("TEST_FLAGS") == "abort" else dist.all_reduce(x)
    if how == "healthy":
        loss = None
    else:
        loss = _lose(excluded, how)
    shrunk = _shrink(excluded)
    result({"loss": loss, "shrunk": shrunk, "bad": _checks(), "first": first})
    if os.environ.get("TEST_SUBGROUP") == "1":
        emit("SUB", _subgroup())
    if "TEST_AGAIN" in os.environ:
        emit("AGAIN", _again(int(os.environ["TEST_AGAIN"])))
    dist.destroy_process_group()
    return Exit(0)


def _excluded_alive() -> Exit:
    """A rank the others shrink away while it is alive: it goes on calling ops on the old group. The first
    is the one every rank runs before the others shrink: this rank may still be in it when they do (it
    then fails as the later ones do), else it is exact."""
    x = torch.ones(10)
    first = outcome(lambda: dist.all_reduce(x))
    first["exact"] = x.tolist() == [float(world())] * 10
    calls = [outcome(lambda: dist.all_reduce(torch.ones(LARGE))) for _ in range(2)]
    calls.append(outcome(lambda: dist.broadcast(torch.ones(10), src=0)))
    result({"excluded": True, "first": first, "calls": calls})
    dist.destroy_process_group()
    return Exit(0)


def late() -> Exit:
    """3 ranks, the last one slow: ranks 0 and 1 time out waiting for it in an all_reduce (TEST_TIMEOUT), shrink
    it away and run an all_reduce on the shrunk group. Then the slow rank comes to that op on the old group
    (TEST_OP: the all_reduce, all it needs already there; or a broadcast from itself, which only sends), and
    reports it as its first call. The ranks that stay wait until it is done (their links stay open)."""
    _init()
    r, w = rank(), world()
    dist.all_reduce(torch.ones(4))  # (every link and the small op's buffers made)
    done = workdir() / "late_done"
    if r == w - 1:
        time.sleep(float(os.environ["TEST_TIMEOUT"]) + 1.5)
        op = os.environ["TEST_OP"]
        first = outcome(lambda: dist.all_reduce(torch.ones(4)) if op == "all_reduce"
                        else dist.broadcast(torch.ones(4), src=r))
        calls = [outcome(lambda: dist.all_reduce(torch.ones(4)))]
        done.write_text("")
        result({"excluded": True, "first": first, "calls": calls})
        return Exit(0)
    timed_out = outcome(lambda: dist.all_reduce(torch.ones(4)) if os.environ["TEST_OP"] == "all_reduce"
                        else dist.broadcast(torch.ones(4), src=w - 1))
    dist.shrink_group([w - 1])
    x = torch.ones(4)
    dist.all_reduce(x)
    for _ in range(300):
        if done.exists():
            break
        time.sleep(0.1)
    result({"timed_out": timed_out, "exact": x.tolist() == [float(w - 1)] * 4})
    dist.destroy_process_group()
    return Exit(0)


def timing() -> Exit:
    """For the figures (scripts/shrink_times.py): every rank runs small all_reduces; the last rank, at the
    30th, says when (KILLED, wall clock) and SIGKILLs itself. The others report when the loss reached them,
    and when the first all_reduce on the group they shrank to was done."""
    _init()
    r, w = rank(), world()
    x = torch.ones(1000)
    err_at = None
    for i in range(100000):
        if r == w - 1 and i == 30:
            emit("KILLED", {"at": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(x)
        except Exception:  # noqa: BLE001 - the loss
            err_at = time.time()
            break
    dist.shrink_group([w - 1])
    y = torch.ones(1000)
    dist.all_reduce(y)
    result({"err_at": err_at, "done_at": time.time(), "exact": y.tolist() == [float(w - 1)] * 1000})
    dist.destroy_process_group()
    return Exit(0)


def mismatch() -> Exit:
    """4 ranks; rank 3 exits hard; the others disagree on whom to exclude (rank 0: [3], rank 1: [2, 3], rank 2:
    [1, 3]), then all retry with [3]."""
    _init()
    r = rank()
    x = torch.ones(10)
    dist.all_reduce(x)
    if r == 3:
        return Exit(0, hard=True)
    loss = outcome(lambda: [dist.all_reduce(torch.ones(LARGE)) for _ in range(100)])
    lists = {0: [3], 1: [2, 3], 2: [1, 3]}
    first = outcome(lambda: dist.shrink_group(lists[r]))
    # Rank 0's first call names the group the others' retries make: it may still be waiting when they come.
    retry = first if first["ok"] else outcome(lambda: dist.shrink_group([3]))
    out = {"loss": loss, "first": first, "retry": retry}
    if retry["ok"]:
        out["bad"] = _checks()
    result(out)
    dist.destroy_process_group()
    return Exit(0)


def pending() -> Exit:
    """3 ranks, all alive; ranks 0 and 1 shrink rank 2 away (TEST_FLAGS) with an op of the old group pending.
    Every rank runs op E and waits for it; then op L, which rank 2 joins only 2 s later. Rank 0 calls
    shrink_group right after issuing L; rank 1 issues L, waits 1 s, notes whether L is over, then calls
    shrink_group. Each reports how E and L went (and rank 1 whether L was over before its call)."""
    _init()
    r, w = rank(), world()
    flags = dist.distributed_c10d.SHRINK_ABORT if os.environ.get("TEST_FLAGS") == "abort" else 0
    e = torch.full((LARGE,), float(r + 1))
    dist.all_reduce(e)
    out: dict[str, Any] = {"e_exact": e.tolist() == [float(w * (w + 1) // 2)] * LARGE}
    if r == 2:
        time.sleep(2.0)
    ell = torch.full((LARGE,), float(r + 1))
    work = dist.all_reduce(ell, async_op=True)
    if r == 1:
        time.sleep(1.0)
        out["l_over_before_call"] = work.is_completed()
    if r in (0, 1):
        dist.shrink_group([2], shrink_flags=flags)
    out["l"] = outcome(work.wait)
    out["l_wrong"] = out["l"]["ok"] and ell.tolist() != [float(w * (w + 1) // 2)] * LARGE
    result(out)
    dist.destroy_process_group()
    return Exit(0)


if __name__ == "__main__":
    main({"shrink": shrink, "late": late, "mismatch": mismatch, "timing": timing, "pending": pending})
