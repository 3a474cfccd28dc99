"""Run one rank per emulated Mac of a lab: the torchrun environment each rank would get from `launch --lab`,
THUNDERBOLT_IFNAME / GLOO_SOCKET_IFNAME from the lab, every process reaped even when the test fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from torch_thunderbolt.lab.view import Lab

from ..core.mp import kill_all

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = 29611  # inside the lab's own namespaces, so it never collides with the host's ports

PRELUDE = """
import json, os, sys, time
import torch
import torch.distributed as dist
import torch_thunderbolt
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)
"""


@dataclass
class RankRun:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> object:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise AssertionError(f"rank {self.rank} printed no RESULT line\nstdout:\n{self.stdout[-2000:]}\n"
                                 f"stderr:\n{self.stderr[-3000:]}")
        return json.loads(lines[-1][len("RESULT "):])


def rank_env(lab: Lab, rank: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Host `rank` of the lab runs rank `rank`; the store sits on mac0's first cable address."""
    host = lab.hosts()[rank]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED", "GLOO_"))}
    ifnames = lab.ifname_env(host)
    base.update({"MASTER_ADDR": lab.addresses("mac0")[0], "MASTER_PORT": str(MASTER_PORT),
                 "WORLD_SIZE": str(len(lab.hosts())), "RANK": str(rank), "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                 "PYTHONUNBUFFERED": "1", "THUNDERBOLT_IFNAME": ifnames,
                 "GLOO_SOCKET_IFNAME": ifnames.split(",")[0]})
    base.update(env or {})
    return base


def run_on_lab(lab: Lab, script: str, tmp_path: Path, timeout: float = 60.0,
               env: Mapping[str, str] | None = None, expect_ok: bool = True,
               per_rank: Mapping[int, Mapping[str, str]] | None = None) -> list[RankRun]:
    """Run `script` (Python source, PRELUDE prepended) as one rank on every lab host; `per_rank[r]`
    adds to rank r's environment only (e.g. a THUNDERBOLT_IFNAME naming one of its cables)."""
    path = tmp_path / "lab_rank.py"
    path.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(script))
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(len(lab.hosts())):
            extra = {**(env or {}), **(per_rank or {}).get(rank, {})}
            procs.append(subprocess.Popen(lab.exec_argv(rank, [sys.executable, str(path)]),
                                          env=rank_env(lab, rank, extra), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = _collect(procs, time.monotonic() + timeout, timeout)
    finally:
        kill_all(procs)
    if expect_ok:
        for res in results:
            assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}\n{res.stderr[-4000:]}"
    return results


def _collect(procs: list[subprocess.Popen], deadline: float, timeout: float) -> list[RankRun]:
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_all(procs)
            outs = [p.communicate() for p in procs]
            detail = "\n".join(f"--- rank {i} stderr:\n{o[1][-2000:]}" for i, o in enumerate(outs))
            raise AssertionError(f"ranks hung (killed after {timeout}s)\n{detail}") from None
        results.append(RankRun(rank, proc.returncode, out, err))
    return results


def counter_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """{ifname: (rx bytes, tx bytes)} that moved between two `Lab.counters` readings."""
    return {dev: (after[dev][0] - before[dev][0], after[dev][1] - before[dev][1]) for dev in after}
