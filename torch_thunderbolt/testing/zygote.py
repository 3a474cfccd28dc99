"""A process that imports torch once and forks rank processes from it: a rank starts in milliseconds instead
of the seconds a fresh interpreter takes to import torch (about 4 s of CPU for four ranks here, most of a
short fault trial). `testing.ranks.start_ranks(..., zygote=z)` uses it; the ranks are the same programs with
the same environment, started by fork instead of exec.

The zygote is a child of the caller that runs `serve`: single-threaded (a fork copies only the forking
thread, so it must hold no lock another thread could own), it reads spawn requests on its stdin, forks, and
reports each child's pid and, when the child ends, its exit status (as `subprocess` gives it: -N for signal
N) on its stdout, one JSON line each. A forked rank leads a session of its own (so killpg ends it and what
it started), has /dev/null as stdin, its output in the files asked for, the environment asked for, and a
fresh seed for `random`.

What differs from a fresh interpreter: modules imported by the zygote (`preload`) were imported under the
zygote's environment, not the rank's; a module that reads the environment at import time sees the zygote's.
Preload only what reads nothing at import (torch, the backend's modules); the rank program itself is run
anew in each child.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

# What a rank of a torch.distributed program imports first, and what takes the time.
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                 "torch_thunderbolt", "torch_thunderbolt.backend.process_group", "torch_thunderbolt.rendezvous.group")


class Zygote:
    """The caller's handle on a zygote process (use as a context manager). `spawn` forks one rank;
    `collect` reads what the zygote reported so far."""

    def __init__(self, preload: Sequence[str] = TORCH_PRELOAD, env: Mapping[str, str] | None = None,
                 ready_seconds: float = 120.0) -> None:
        code = f"from torch_thunderbolt.testing import zygote; zygote.serve({list(preload)!r})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=dict(os.environ if env is None else env), start_new_session=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out = self._proc.stdout
        self._buf = b""
        self.exits: dict[int, int] = {}  # pid -> exit status, as reported
        ready = self._next(time.monotonic() + ready_seconds)
        if ready.get("ready") is not True:
            self.close()
            raise RuntimeError(f"the zygote did not start: {ready}")

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, out: Path, err: Path) -> int:
        """Fork a rank running `argv` (["-m", module, *args] or [path, *args]); its pid."""
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err)}
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        while True:
            msg = self._next(time.monotonic() + 30.0)
            if "pid" in msg:
                return int(msg["pid"])
            if "failed" in msg:
                raise RuntimeError(f"the zygote could not fork {argv}: {msg['failed']}")

    def collect(self) -> None:
        """Take in every exit the zygote reported so far (no waiting)."""
        while self._readable(0.0):
            self._next(time.monotonic() + 5.0)

    def wait_for(self, pid: int, seconds: float | None) -> int | None:
        """The exit status of `pid` once the zygote reports it, waiting at most `seconds` (None: for ever)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while pid not in self.exits:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if self._readable(0.05 if left is None else min(0.05, left)):
                self._next(time.monotonic() + 5.0)
            elif self._proc.poll() is not None:
                raise RuntimeError(f"the zygote exited ({self._proc.returncode}) before rank pid {pid} did")
        return self.exits[pid]

    def close(self) -> None:
        """End the zygote (its stdin closes); ranks still running are the caller's to kill."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipe (each message read is taken in: `exits` grows as they come) ---------------------------------
    def _readable(self, seconds: float) -> bool:
        return b"\n" in self._buf or bool(select.select([self._out], [], [], seconds)[0])

    def _next(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise RuntimeError("the zygote did not answer in time")
            chunk = os.read(self._out.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the zygote exited ({self._proc.wait()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg = json.loads(line)
        if "exit" in msg:
            self.exits[int(msg["exit"])] = int(msg["status"])
        return msg


class ZygoteProcess:
    """A forked rank as `testing.ranks.Rank` sees a process (the part of `subprocess.Popen` it uses)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.collect()
            self.returncode = self.zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait_for(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode


# -- the zygote's side ---------------------------------------------------------------------------------------
def _say(msg: dict[str, Any]) -> None:
    os.write(1, json.dumps(msg).encode() + b"\n")  # unbuffered: nothing is left in a buffer a child copies


def _child(req: dict[str, Any]) -> None:
    """In the forked child: become the rank, run its program, exit (never returns)."""
    code = 1
    try:
        os.setsid()
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the rank's streams, over the new descriptors
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(req["env"])
        import random

        random.seed()
        import runpy

        argv = req["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's error, reported as an interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(preload: Sequence[str]) -> None:
    """The zygote's loop (run in its own process): import `preload`, then fork on each request until stdin
    closes, reporting pids and exits."""
    import importlib
    import threading

    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:
        _say({"ready": False, "why": f"{threading.active_count()} threads after importing {list(preload)}"})
        return
    _say({"ready": True})
    buf = b""
    live: set[int] = set()
    while True:
        readable = select.select([0], [], [], 0.02)[0]
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live.discard(pid)
            _say({"exit": pid, "status": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            req = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _say({"failed": str(exc)})
                continue
            if pid == 0:
                _child(req)
            live.add(pid)
            _say({"pid": pid})
