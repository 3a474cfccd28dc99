"""Process helpers for the reliability suite: start N ranks, watch when each one exits, always reap.

Unlike tests/core/mp.py this records *when* every process ended (the detection-time figures need it) and
lets a scenario act on the running ranks (kill one, SIGSTOP one, cut a cable) while they work.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tests.core.mp import REPO, free_port


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen
    out_path: Path
    err_path: Path
    exited_at: float | None = None  # wall clock (time.time()), comparable with what ranks print

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def tagged(self, tag: str) -> list[object]:
        """Every `TAG {json}` line this rank printed, parsed."""
        prefix = tag + " "
        return [json.loads(ln[len(prefix):]) for ln in self.stdout().splitlines() if ln.startswith(prefix)]


@dataclass
class Ranks:
    ranks: list[Rank] = field(default_factory=list)

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def poll(self) -> None:
        now = time.time()
        for r in self.ranks:
            if r.exited_at is None and r.proc.poll() is not None:
                r.exited_at = now

    def wait(self, deadline: float, step: float = 0.02) -> bool:
        """Wait (wall clock `deadline`) for every rank to exit; False if some are still running."""
        while True:
            self.poll()
            if not self.alive():
                return True
            if time.time() >= deadline:
                return False
            time.sleep(step)

    def kill_all(self) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must not outlive us
                    try:
                        os.killpg(r.proc.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        for r in self.ranks:
            try:
                r.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.poll()


def rank_env(world: int, port: int, extra: dict | None = None, master: str = "127.0.0.1") -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED"))}
    # TB_RELIABILITY_CODE=DIR runs the ranks on another copy of the package (to try a patch side by side).
    code = os.environ.get("TB_RELIABILITY_CODE")
    base.update({"MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                 "PYTHONPATH": f"{code}:{REPO}" if code else str(REPO), "OMP_NUM_THREADS": "1",
                 "PYTHONUNBUFFERED": "1"})
    # These scenarios test the TCP path (the one Thunderbolt uses). Ranks on one host would otherwise get the
    # shared-memory transport under THUNDERBOLT_TRANSPORT=auto; TB_RELIABILITY_TRANSPORT=shm|auto tests that.
    base["THUNDERBOLT_TRANSPORT"] = os.environ.get("TB_RELIABILITY_TRANSPORT", "tcp")
    base.update(extra or {})
    return base


def start_ranks(script: str, world: int, workdir: Path, env: dict | None = None,
                wrap: Callable[[int], Sequence[str]] | None = None, master: str = "127.0.0.1",
                rank_env_fn: Callable[[int], dict] | None = None) -> Ranks:
    """Start `world` ranks of `script`; `wrap(rank)` prefixes the command (e.g. `ip netns exec NS`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "rank_script.py"
    path.write_text(script)
    base = rank_env(world, free_port(), env, master)
    ranks = Ranks()
    try:
        for r in range(world):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
            e.update(rank_env_fn(r) if rank_env_fn else {})
            out, err = workdir / f"rank{r}.out", workdir / f"rank{r}.err"
            argv = [*(wrap(r) if wrap else []), sys.executable, str(path)]
            with open(out, "w") as fo, open(err, "w") as fe:
                p = subprocess.Popen(argv, env=e, stdout=fo, stderr=fe, start_new_session=True, cwd=workdir)
            ranks.ranks.append(Rank(r, p, out, err))
    except BaseException:
        ranks.kill_all()
        raise
    return ranks
