"""A rank of the re-init cycles (testing.reliability.reinit): in one process, cycle after cycle, create the
default group (`init_process_group`), run a round of ops checked exact, then end the group the way the
cycle's plan says, and report what the process still holds (testing.leftovers.holdings).

In a cycle with a victim, the victim kills itself (SIGKILL) after its round of ops; every survivor calls
all_reduce until it fails, records the error (it must be a PeerLostError naming the victim), and ends the
group. The driver then starts a replacement process for the victim's rank, which joins from the next cycle
on (TB_FIRST). Each cycle rendezvouses under its own prefix of the driver's store (`cycle<c>/`), so that no
key of an earlier cycle, whose ranks may have died half-way, is read again.

Ends: `destroy` (dist.destroy_process_group), `abort` (torch's _abort_process_group, which calls the
group's abort), `group_abort` (the group's own abort(), then destroy_process_group to forget it in torch).

Environment: TB_PLAN (JSON: a list of {"end", "victim"} per cycle), TB_FIRST (the first cycle this process
takes part in, 0 by default), TB_TIMEOUT (the group's timeout, seconds), TEST_FAKE_HOSTS (pretended hosts),
THUNDERBOLT_VERBS=fake:DIR (count what the process holds on that fabric).
Prints one `CYCLE {...}` line per cycle it finished (`held`: what it holds once collected garbage and
exiting threads allow, with the garbage collector off but for the count of
objects; `at_once`: the counts right after the end), and exits 1 at the first unexpected
failure (a `FAILED {...}` line).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.testing.leftovers import holdings
from torch_thunderbolt.testing.program import Exit, emit, main, pretend_hosts, rank, world

SIZES = (17, 70_003)  # a small op and one past the small-message paths (values stay exact in float32)
TRIES_AFTER_A_KILL = 200  # all_reduce calls a survivor makes before "the loss was never reported" is a failure
SETTLE_SECONDS = 3.0  # how long a count above the previous cycle's may take to come down (threads exiting)
COUNTED = ("fds", "threads", "shm", "shm_maps", "objects")
RELEASED = ("fds", "threads", "shm", "shm_maps")  # what an end must release by itself, garbage collector off


def _fabric() -> Any:
    from torch_thunderbolt.config import Config

    cfg = Config.from_env()
    if cfg.verbs != "fake":
        return None
    from torch_thunderbolt.testing.fake_verbs import Fabric

    return Fabric(cfg.verbs_fabric)


def _check(bad: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        diff = (got != want).nonzero()
        bad.append(f"{what}: {diff.numel()} elements differ, first at {diff[0].tolist() if diff.numel() else '?'}")


def ops_round(cycle: int, bad: list[str]) -> None:
    """all_reduce, broadcast, all_gather and a ring of send/recv at each of SIZES, every result compared
    with the value it must have."""
    r, w = dist.get_rank(), dist.get_world_size()
    root = cycle % w
    for n in SIZES:
        base = torch.arange(n, dtype=torch.float32)
        x = base + 1000 * (r + 1)
        dist.all_reduce(x)
        _check(bad, f"all_reduce {n}", x, base * w + 1000 * w * (w + 1) // 2)
        b = base + cycle if r == root else torch.zeros(n)
        dist.broadcast(b, root)
        _check(bad, f"broadcast {n} from {root}", b, base + cycle)
        outs = [torch.empty(n) for _ in range(w)]
        dist.all_gather(outs, base + 7 * r)
        for q in range(w):
            _check(bad, f"all_gather {n} part {q}", outs[q], base + 7 * q)
        got = torch.empty(n)
        req = dist.isend(base - r, (r + 1) % w)
        dist.recv(got, (r - 1) % w)
        req.wait()
        _check(bad, f"recv {n} from {(r - 1) % w}", got, base - (r - 1) % w)


def end_group(how: str) -> None:
    if how == "destroy":
        dist.destroy_process_group()
    elif how == "abort":
        dist.distributed_c10d._abort_process_group()
    elif how == "group_abort":
        dist.group.WORLD.abort()
        dist.destroy_process_group()
    else:
        raise ValueError(f"unknown end {how!r}")


def settled_holdings(fabric: Any, previous: dict[str, Any] | None) -> tuple[dict[str, Any], float]:
    """holdings() once nothing counted is above the previous cycle's (exiting threads may take a moment), or
    after SETTLE_SECONDS; with the seconds waited. Garbage is collected only for the count of the package's
    live objects: a socket, thread, segment or mapping that an end leaves to the collector counts as held."""
    t0 = time.monotonic()
    while True:
        now = holdings(fabric)
        if previous is None or time.monotonic() - t0 > SETTLE_SECONDS or not any(
                now[k] > previous[k] for k in RELEASED) and now["fabric"] == dict.fromkeys(now["fabric"], 0):
            break
        time.sleep(0.1)
    gc.collect()  # a group dropped by torch is freed when collected
    now["objects"] = holdings(fabric)["objects"]
    return now, round(time.monotonic() - t0, 3)


def cycles() -> Exit | None:
    pretend_hosts()
    plan = json.loads(os.environ["TB_PLAN"])
    first = int(os.environ.get("TB_FIRST", "0"))
    timeout = timedelta(seconds=float(os.environ.get("TB_TIMEOUT", "120")))
    gc.disable()  # (collected only where settled_holdings says: nothing an end holds waits for the collector)
    me, w = rank(), world()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), w, False, timeout=timeout)
    fabric = _fabric()
    previous: dict[str, Any] | None = None
    emit("START", {"first": first, "held": holdings(fabric), "pid": os.getpid()})
    for c in range(first, len(plan)):
        end, victim = plan[c]["end"], plan[c]["victim"]
        t0 = time.monotonic()
        bad: list[str] = []
        lost: dict[str, Any] | None = None
        try:
            dist.init_process_group("thunderbolt", store=dist.PrefixStore(f"cycle{c}/", client), rank=me,
                                    world_size=w, timeout=timeout)
            kind = dist.group.WORLD.transport.kind
            ops_round(c, bad)
            if victim == me:
                os.kill(os.getpid(), signal.SIGKILL)
            if victim is not None:
                for _ in range(TRIES_AFTER_A_KILL):
                    dist.all_reduce(torch.ones(4))
        except PeerLostError as exc:
            if victim is None:
                emit("FAILED", {"cycle": c, "type": type(exc).__name__, "msg": str(exc)[:800]})
                return Exit(1, hard=True)
            lost = {"type": type(exc).__name__, "peer": exc.peer, "msg": str(exc)[:300]}
        except Exception as exc:  # noqa: BLE001 - the driver reports it
            emit("FAILED", {"cycle": c, "type": type(exc).__name__, "msg": str(exc)[:800]})
            return Exit(1, hard=True)
        try:
            end_group(end)
        except Exception as exc:  # noqa: BLE001 - the driver reports it
            emit("FAILED", {"cycle": c, "type": type(exc).__name__, "msg": f"{end}: {str(exc)[:800]}"})
            return Exit(1, hard=True)
        at_once = holdings(fabric)  # before any garbage collection: what the end released by itself
        held, settle = settled_holdings(fabric, previous)
        emit("CYCLE", {"cycle": c, "end": end, "victim": victim, "kind": kind, "bad": bad, "lost": lost,
                       "held": held, "settle_s": settle,
                       "at_once": {k: at_once[k] for k in COUNTED}, "seconds": round(time.monotonic() - t0, 3)})
        previous = held
    return None


if __name__ == "__main__":
    main({"cycles": cycles})
