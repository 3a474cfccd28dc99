"""Start N local ranks as subprocesses (`python -m torch_thunderbolt bench ...` with torchrun's env).

Each child gets its own session so that a terminal Ctrl-C reaches only this parent, which then ends
every child itself: no rank is ever left behind, whether a rank fails, the run times out, or the user
interrupts.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..errors import ThunderboltError

POLL_SECONDS = 0.05
GRACE_SECONDS = 3.0
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # so children import this very checkout


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base: Mapping[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun would give local rank `rank` (the backend's settings come with the flags)."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several ranks on one host
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, base.get("PYTHONPATH", "")) if p)
    return env


def child_command(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch_thunderbolt", "bench", *argv]


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every child's session, then SIGKILL whatever is still there after a grace period."""
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, GRACE_SECONDS)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def supervise(procs: Sequence[subprocess.Popen], timeout: float, clock: Callable[[], float] = time.monotonic) -> int:
    """Wait for all children; the first failure (or the timeout) ends the others. Returns an exit code."""
    deadline = clock() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if any(c is None for c in codes):
                    print(f"torch-thunderbolt bench: rank {rank} exited with {code}; stopping the other ranks",
                          file=sys.stderr)
                return code if code > 0 else 128 - code  # killed by a signal: shell convention
            if all(c == 0 for c in codes):
                return 0
            if clock() > deadline:
                raise ThunderboltError(f"bench did not finish within --timeout {timeout:g} s; ranks stopped")
            time.sleep(POLL_SECONDS)
    finally:
        _stop(procs)


class Terminated(ThunderboltError):
    """This supervisor got SIGTERM; raised so that the ranks are stopped on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated("stopped by SIGTERM; ranks stopped")


def run_local(nproc: int, argv: Sequence[str], timeout: float, environ: Mapping[str, str] | None = None) -> int:
    """Spawn `nproc` ranks of this benchmark on 127.0.0.1 and wait for them."""
    port = free_port()
    base = dict(os.environ if environ is None else environ)
    procs: list[subprocess.Popen] = []
    # The ranks live in their own sessions, so a SIGTERM to us must be passed on by us.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        try:
            for rank in range(nproc):
                procs.append(subprocess.Popen(child_command(argv), env=child_env(base, rank, nproc, port),
                                              start_new_session=True))
        except OSError as exc:
            _stop(procs)
            raise ThunderboltError(f"cannot start local rank {len(procs)}: {exc}") from exc
        return supervise(procs, timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)
