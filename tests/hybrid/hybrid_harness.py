"""Rank scripts for hybrid (shm + TCP) runs on one machine: each rank pretends to live on host `rank // 2`
(two ranks per emulated host) by replacing `hosts.host_identity` in its own process before the group
is created, so `auto` picks the hybrid exactly as it would across real hosts."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from torch_thunderbolt.lab.view import Lab
from torch_thunderbolt.transport import shm_segment

from ..core.mp import PRELUDE, RankResult, kill_all, run_ranks
from ..lab_cluster.labrun import RankRun, _collect, rank_env
from ..shm.shm_harness import leftovers

HYBRID_PRELUDE = PRELUDE + """
import signal
from torch_thunderbolt.rendezvous import hosts
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
PER_HOST = int(os.environ.get("TEST_RANKS_PER_HOST", "2"))
if os.environ.get("TEST_FAKE_HOSTS") == "1":  # not in the lab: there network namespaces make the hosts
    hosts.host_identity = lambda: f"test-host-{RANK // PER_HOST}"
"""


def _ours_left(before: set[str]) -> list[str]:
    """Segments and doorbell sockets that appeared since `before` and whose creator is dead: ours (every
    rank has exited by now). Those of live processes belong to other jobs setting up concurrently."""
    left = []
    for name in leftovers() - before:
        pid = shm_segment.creator_pid(name.removesuffix(".sock"))
        if pid is None or not shm_segment._alive(pid):
            left.append(name)
    return sorted(left)


def run_hybrid(script: str, world: int, tmp_path: Path, timeout: float = 60.0, env: dict | None = None,
               expect_ok: bool = True) -> list[RankResult]:
    """Run `script` (after HYBRID_PRELUDE) as `world` ranks; asserts no shm segment or socket is left."""
    before = leftovers()
    try:
        return run_ranks(HYBRID_PRELUDE + script, world, tmp_path, timeout, {"TEST_FAKE_HOSTS": "1", **(env or {})},
                         expect_ok)
    finally:
        left = _ours_left(before)
        shm_segment.cleanup_stale_segments()
        assert not left, f"shared-memory leftovers after the run: {left}"


def run_hybrid_lab(lab: Lab, script: str, tmp_path: Path, per_host: int = 2, timeout: float = 60.0,
                   expect_ok: bool = True) -> list[RankRun]:
    """Run `script` as `per_host` ranks in each emulated host of `lab` (rank r on host r // per_host)."""
    path = tmp_path / "hybrid_lab_rank.py"
    path.write_text(textwrap.dedent(HYBRID_PRELUDE) + textwrap.dedent(script))
    world = per_host * len(lab.hosts())
    before = leftovers()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            host = rank // per_host
            env = dict(rank_env(lab, host), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                       LOCAL_WORLD_SIZE=str(per_host), TEST_RANKS_PER_HOST=str(per_host))
            procs.append(subprocess.Popen(lab.exec_argv(host, [sys.executable, str(path)]), env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        results = _collect(procs, time.monotonic() + timeout, timeout)
    finally:
        kill_all(procs)
        left = _ours_left(before)
        shm_segment.cleanup_stale_segments()
        assert not left, f"shared-memory leftovers after the run: {left}"
    if expect_ok:
        for res in results:
            assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}\n{res.stderr[-4000:]}"
    return results
