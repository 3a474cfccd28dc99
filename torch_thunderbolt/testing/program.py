"""The rank program's side of testing.ranks: what a program started by `run_ranks` imports to know who it
is, to report back, and to set itself up the way a family of runs expects.

A program reports with one-line JSON records on stdout, which the test reads back from `RankResult`:
`result(obj)` (read by `.json()`), `emit("TAG", obj)` for anything else (`.tagged("TAG")`), and `save(obj)`
for what JSON cannot carry (tensors). It runs one of several scenarios chosen by its first argument:

    def kill_9() -> Exit | None: ...
    if __name__ == "__main__":
        main({"kill_9": kill_9, "stall": stall})

Parameters come from the environment (the test's `env=`), never from editing the program's text.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:
    import torch.distributed as dist

    from torch_thunderbolt.transport.engine import Transport


WORKDIR_ENV = "TEST_WORKDIR"  # set by testing.ranks: the run's directory


def saved_name(rank: int) -> str:
    """The file of `save` in the run's directory."""
    return f"rank{rank}.pt"


def rank() -> int:
    return int(os.environ["RANK"])


def world() -> int:
    return int(os.environ["WORLD_SIZE"])


def workdir() -> Path:
    """The run's directory (shared by its ranks): where a program may leave files for the test."""
    return Path(os.environ.get(WORKDIR_ENV, "."))


def emit(tag: str, obj: Any) -> None:
    """One `TAG {json}` line, written at once: the test may read it while this rank still runs. One write
    call for the whole line (after whatever the program printed before it): ranks that share one pipe, as
    torchrun's workers do, must not interleave their lines, and a pipe keeps a write of up to PIPE_BUF
    bytes whole where print's separate writes of text and newline may be split by another writer."""
    sys.stdout.flush()
    line = f"{tag} {json.dumps(obj)}\n".encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line):]


def result(obj: Any) -> None:
    emit("RESULT", obj)


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run fn; how it went as a JSON-able record (its error's type, message and blamed peer, if any)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the record is what the test checks
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc), "seconds": time.monotonic() - t0,
                "peer": getattr(exc, "peer", None)}
    return {"ok": True, "seconds": time.monotonic() - t0}


def save(obj: Any) -> None:
    """Store `obj` with torch.save for RankResult.saved()."""
    import torch

    torch.save(obj, workdir() / saved_name(rank()))


def register_pid() -> None:
    """Tell the runner this rank's pid (before creating anything): its SegmentCheck.OF_RANKS counts the
    segments of these pids only, since other jobs on this host may be setting up meanwhile."""
    (workdir() / f"pid_{rank()}").write_text(str(os.getpid()))


def pretend_hosts() -> None:
    """Under TEST_FAKE_HOSTS=1 (the HYBRID setup) this rank claims host rank // TEST_RANKS_PER_HOST (2 by
    default) by replacing `hosts.host_identity` before any group is created, so `auto` picks the hybrid
    transport exactly as it would across real hosts. In a lab, network namespaces make the hosts instead."""
    if os.environ.get("TEST_FAKE_HOSTS") != "1":
        return
    from torch_thunderbolt.rendezvous import hosts

    name = f"test-host-{rank() // int(os.environ.get('TEST_RANKS_PER_HOST', '2'))}"
    hosts.host_identity = lambda: name


@dataclass(frozen=True)
class ShmRank:
    """A rank of a shm transport built straight from the run's environment (no process group)."""
    rank: int
    world: int
    store: "dist.TCPStore"
    transport: "Transport"


def shm_rank(timeout: float = 60.0) -> ShmRank:
    """Register this rank's pid, open the run's TCPStore (rank 0 serves it) and connect the shm transport
    with the run's THUNDERBOLT_SHM_* settings, as a job would."""
    import torch.distributed as dist

    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.shm import connect_shm

    register_pid()
    r, w = rank(), world()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0,
                          timeout=timedelta(seconds=timeout))
    return ShmRank(r, w, store, connect_shm(store, r, w, Config.from_env(), timeout))


def shm_snippet_namespace() -> dict[str, Any]:
    """For a rank program whose body is still text (testing.ranks.shm_snippet): connect as `shm_rank` does
    and return the names such a body may use (the rank `r`, the world `w`, the transport `t`, its `store`,
    result, outcome and the usual modules)."""
    import signal

    import torch
    import torch.distributed as dist

    import torch_thunderbolt
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.shm import connect_shm
    from torch_thunderbolt.transport.base import ANY_SOURCE

    me = shm_rank()
    return {"json": json, "os": os, "sys": sys, "time": time, "signal": signal, "timedelta": timedelta,
            "torch": torch, "dist": dist, "torch_thunderbolt": torch_thunderbolt, "Config": Config,
            "connect_shm": connect_shm, "ANY_SOURCE": ANY_SOURCE, "result": result, "outcome": outcome,
            "r": me.rank, "w": me.world, "store": me.store, "t": me.transport}


@dataclass(frozen=True)
class Exit:
    """What a scenario returns to end its process with `code`; `hard` uses os._exit, skipping interpreter
    teardown (the atexit hooks that would shut down a group broken on purpose, or wait for a dead peer)."""
    code: int = 0
    hard: bool = False


Scenario = Callable[[], Optional[Exit]]


def main(scenarios: Mapping[str, Scenario], argv: list[str] | None = None) -> None:
    """Run the scenario named by the first argument (it may be left out when there is only one)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv and len(scenarios) == 1:
        argv = list(scenarios)
    if not argv or argv[0] not in scenarios:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(scenarios)}}}")
    end = scenarios[argv[0]]()
    sys.stdout.flush()
    sys.stderr.flush()
    if end is not None:
        if end.hard:
            os._exit(end.code)
        sys.exit(end.code)
