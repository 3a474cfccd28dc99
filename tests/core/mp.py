"""Real multi-process runs over loopback: N ranks of a script, torchrun-style environment, always reaped."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> object:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise AssertionError(f"rank {self.rank} printed no RESULT line\nstdout:\n{self.stdout}\n"
                                 f"stderr:\n{self.stderr[-3000:]}")
        return json.loads(lines[-1][len("RESULT "):])


def run_ranks(script: str, world: int, tmp_path: Path, timeout: float = 60.0, env: dict | None = None,
              expect_ok: bool = True) -> list[RankResult]:
    """Run `script` (Python source) as `world` ranks. Every process is killed when time runs out."""
    path = tmp_path / f"rank_script_{world}.py"
    path.write_text(textwrap.dedent(script))
    port = free_port()
    procs = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED"))}
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                 "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    base.update(env or {})
    try:
        for r in range(world):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
            procs.append(subprocess.Popen([sys.executable, str(path)], env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        results = []
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                outs = [p.communicate() for p in procs]
                detail = "\n".join(f"--- rank {i} stderr:\n{o[1][-2000:]}" for i, o in enumerate(outs))
                raise AssertionError(f"ranks hung (killed after {timeout}s)\n{detail}") from None
            results.append(RankResult(r, p.returncode, out, err))
    finally:
        kill_all(procs)
    if expect_ok:
        for res in results:
            assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}\n{res.stderr[-4000:]}"
    return results


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's whole session (ranks lead their own), then reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


PRELUDE = """
import json, os, sys, time
import torch
import torch.distributed as dist
import torch_thunderbolt
def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)
def outcome(fn):  # run fn; its error (if any) as a JSON-able record
    t0 = time.monotonic()
    try:
        fn()
        return {"ok": True}
    except Exception as exc:
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc), "seconds": time.monotonic() - t0,
                "peer": getattr(exc, "peer", None)}
"""
