"""Ranks of test_testing_ranks.py, which checks the runner itself (torch_thunderbolt.testing.ranks)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from torch_thunderbolt.testing.program import Exit, main, rank, result, workdir


def environment() -> None:
    """What this rank was told: its place in the run and the variables the test looks at."""
    result({"rank": rank(), "cwd": os.getcwd(), "workdir": str(workdir()),
            "env": {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                  "THUNDERBOLT_LEAK", "TEST_GLOBAL", "TEST_MINE", "OMP_NUM_THREADS")}})


def hang() -> None:
    """Starts a child of its own (in its session), records both pids, then never ends."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (workdir() / f"pids_{rank()}").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(120)


def exit_code() -> Exit:
    """Rank 1 fails with code 3, hard (os._exit); rank 0 succeeds."""
    print(f"rank {rank()} says goodbye", file=sys.stderr, flush=True)
    return Exit(3 if rank() == 1 else 0, hard=rank() == 1)


if __name__ == "__main__":
    main({"environment": environment, "hang": hang, "exit_code": exit_code})
