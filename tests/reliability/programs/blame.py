"""Ranks of test_blame.py: which rank an error blames.

- `sigstop`: all_reduce in a loop; rank 2 SIGSTOPs itself 0.3 s after the barrier (STOPPED), the others print
  their error (ERROR) with the ranks it names. Environment: TB_TIMEOUT, TB_N (elements).
- `frozen_receiver`: rank 1 SIGSTOPs itself; rank 0 sends it 64 MB as a broadcast's root or with send.
- `dies_in_set_up`: rank TB_DIES exits (code 3) right after publishing its endpoint; the others report
  how init_process_group failed and how long it took.
- `woken`: 3 ranks, a broadcast from rank 0, which calls it a second late, then an all_reduce. Rank 2
  freezes itself inside the broadcast (STOPPED), the first time its wait comes back from a quiet sleep,
  before it looks at the deadline again; ranks 0 and 1 finish the broadcast and time out in the
  all_reduce. Every rank prints its first error (ERROR); ranks 0 and 1 then stay (sockets open) until
  killed. The test wakes rank 2 once the others gave up. Environment: TB_TIMEOUT.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, emit, main, outcome, result


def sigstop() -> Exit | None:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))
    r = dist.get_rank()
    x = torch.ones(int(os.environ["TB_N"]))
    dist.barrier()
    if r == 2:
        def stop() -> None:
            time.sleep(0.3)
            emit("STOPPED", time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Thread(target=stop, daemon=True).start()
    try:
        while True:
            dist.all_reduce(x)
            x.fill_(1.0)
    except Exception as exc:
        emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:1500], "ranks": getattr(exc, "ranks", None),
                       "peer": getattr(exc, "peer", None)})
        return Exit(1, hard=True)


def frozen_receiver() -> Exit | None:
    """Rank 1 SIGSTOPs itself (STOPPED) right after a barrier; rank 0 then sends it TB_N float32 elements as a
    broadcast's root or a point-to-point send (TB_OP) and reports its error (ERROR), with the seconds from
    the call to the error. Environment: TB_TIMEOUT, TB_N, TB_OP."""
    timeout = float(os.environ["TB_TIMEOUT"])
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=timeout))
    r = dist.get_rank()
    x = torch.ones(int(os.environ["TB_N"]))
    dist.barrier()
    if r == 1:
        emit("STOPPED", time.time())
        os.kill(os.getpid(), signal.SIGSTOP)
        return Exit(0, hard=True)
    time.sleep(0.5)  # rank 1 is stopped by now
    t0 = time.monotonic()
    try:
        if os.environ["TB_OP"] == "broadcast":
            dist.broadcast(x, 0)
            dist.barrier()  # a root that only sends may finish first; its next call waits on rank 1
        else:
            dist.send(x, 1)
    except Exception as exc:
        emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:1500], "ranks": getattr(exc, "ranks", None),
                       "seconds": time.monotonic() - t0, "timeout": timeout})
    return Exit(1, hard=True)


def woken() -> Exit | None:
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ["TB_TIMEOUT"])))
    r = dist.get_rank()
    x = torch.ones(256)
    dist.barrier()
    if r == 2:
        watchers = dist.distributed_c10d._get_default_group().transport.watchers

        def freeze() -> None:  # (called by the thread that waits, after a poll() with nothing to do)
            del watchers["freeze"]
            emit("STOPPED", time.time())
            os.kill(os.getpid(), signal.SIGSTOP)

        watchers["freeze"] = freeze
    elif r == 0:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        dist.broadcast(x, 0)
        t0 = time.monotonic()
        dist.all_reduce(x)
    except Exception as exc:
        emit("ERROR", {"type": type(exc).__name__, "msg": str(exc)[:1500], "ranks": getattr(exc, "ranks", None),
                       "seconds": time.monotonic() - t0})
    else:
        emit("PASSED", time.time())
    if r != 2:
        time.sleep(120)  # the woken rank's ABORTs to read are in its sockets, not an EOF
    return Exit(0, hard=True)


def dies_in_set_up() -> Exit | None:
    import torch_thunderbolt.rendezvous.tcp as bootstrap

    if os.environ["RANK"] == os.environ["TB_DIES"]:
        # Dies right after publishing its endpoint (the acceptor starts just after the store.set).
        bootstrap._Acceptor.start = lambda self: os._exit(3)
    t0 = time.monotonic()
    res = outcome(lambda: dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=40)))
    res["seconds"] = time.monotonic() - t0
    result(res)
    if os.environ["RANK"] == "0":
        time.sleep(5)  # rank 0 serves the store: a survivor still in set-up would see the store vanish instead
    return Exit(0, hard=True)


if __name__ == "__main__":
    main({"sigstop": sigstop, "frozen_receiver": frozen_receiver, "dies_in_set_up": dies_in_set_up, "woken": woken})
