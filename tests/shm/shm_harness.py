"""Running rank scripts over the shm transport in real processes (built on tests/core/mp.run_ranks)."""
from __future__ import annotations

from pathlib import Path

from torch_thunderbolt.transport import shm_segment

from ..core.mp import PRELUDE, RankResult, run_ranks

# Every rank script starts with this: a TCPStore from the run_ranks environment, then connect_shm.
SHM_PRELUDE = PRELUDE + """
import signal
from datetime import timedelta
from torch_thunderbolt.config import Config
from torch_thunderbolt.transport.base import ANY_SOURCE
from torch_thunderbolt.rendezvous.shm import connect_shm
r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pid_{r}"), "w") as _f:
    _f.write(str(os.getpid()))  # before anything is created: run_shm checks leftovers of these pids only
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0, timeout=timedelta(seconds=60))
t = connect_shm(store, r, w, Config.from_env(), 60)  # THUNDERBOLT_SHM_* of the run, as a job would
"""

# Small rings by default, so multi-slot messages and full rings are exercised.
SMALL_RINGS = {"THUNDERBOLT_SHM_SLOT": "4K", "THUNDERBOLT_SHM_SLOTS": "2"}


def leftovers(pids: set[int] | None = None) -> set[str]:
    """Our segments and doorbell sockets that currently exist on this host: of any job, or only those
    created by `pids` (names carry the creator's pid; other jobs may be running on this host meanwhile)."""
    names = set(shm_segment.live_segments())
    d = shm_segment.marker_dir()
    if d.is_dir():
        names |= {p.name for p in d.glob(f"{shm_segment.PREFIX}*.sock")}
    if pids is None:
        return names
    return {n for n in names if shm_segment.creator_pid(n.removesuffix(".sock")) in pids}


def rank_pids(tmp_path: Path) -> set[int]:
    """Pids of the ranks of the last run in `tmp_path` (each rank writes its own, see SHM_PRELUDE)."""
    texts = [p.read_text().strip() for p in tmp_path.glob("pid_*")]
    return {int(t) for t in texts if t.isdigit()}


def run_shm(script: str, world: int, tmp_path: Path, timeout: float = 90.0, env: dict | None = None,
            expect_ok: bool = True) -> list[RankResult]:
    """Run `script` (after SHM_PRELUDE) as `world` ranks; asserts the run left no segment behind.

    Only this run's ranks count: other jobs on this host (another test run) have segments and doorbell
    sockets while they set up, which are not our leftovers."""
    for old in tmp_path.glob("pid_*"):
        old.unlink()
    try:
        return run_ranks(SHM_PRELUDE + script, world, tmp_path, timeout, dict(SMALL_RINGS, **(env or {})),
                         expect_ok)
    finally:
        # Segments are unlinked right after setup: even kill -9 leaves none.
        left = leftovers(rank_pids(tmp_path))
        shm_segment.cleanup_stale_segments()
        assert not left, f"shared-memory leftovers after the run: {sorted(left)}"
