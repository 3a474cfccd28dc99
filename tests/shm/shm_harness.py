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
from torch_thunderbolt.transport.shm import connect_shm
r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0, timeout=timedelta(seconds=60))
t = connect_shm(store, r, w, Config(), 60)
"""

# Small rings by default, so multi-slot messages and full rings are exercised.
SMALL_RINGS = {"THUNDERBOLT_SHM_SLOT": "4K", "THUNDERBOLT_SHM_SLOTS": "2"}


def leftovers() -> set[str]:
    """Our segments and doorbell sockets that currently exist on this host (any job)."""
    names = set(shm_segment.live_segments())
    d = shm_segment.marker_dir()
    if d.is_dir():
        names |= {p.name for p in d.glob(f"{shm_segment.PREFIX}*.sock")}
    return names


def run_shm(script: str, world: int, tmp_path: Path, timeout: float = 90.0, env: dict | None = None,
            expect_ok: bool = True) -> list[RankResult]:
    """Run `script` (after SHM_PRELUDE) as `world` ranks; asserts the run left no segment behind."""
    before = leftovers()
    try:
        return run_ranks(SHM_PRELUDE + script, world, tmp_path, timeout, dict(SMALL_RINGS, **(env or {})),
                         expect_ok)
    finally:
        left = leftovers() - before  # segments are unlinked right after setup: even kill -9 leaves none
        shm_segment.cleanup_stale_segments()
        assert not left, f"shared-memory leftovers after the run: {sorted(left)}"
