"""Ranks of test_shm_harness.py, which tests the runner's shared-memory leftovers check (SHM setup).

- `wait_for_go`: each rank marks that it is up (file up_<rank>), then waits for the file TEST_GO to appear.
- `leak`: rank 1 creates a segment and never unlinks it.
"""
from __future__ import annotations

import os
import time

from torch_thunderbolt.testing.program import main, result, shm_rank, workdir
from torch_thunderbolt.transport import shm_segment


def wait_for_go() -> None:
    me = shm_rank()
    (workdir() / f"up_{me.rank}").touch()
    while not os.path.exists(os.environ["TEST_GO"]):
        time.sleep(0.01)
    me.transport.close()
    result({})


def leak() -> None:
    me = shm_rank()
    if me.rank == 1:
        shm_segment.create(4096)  # never unlinked: a leak of this run
    me.transport.close()
    result({})


if __name__ == "__main__":
    main({"wait_for_go": wait_for_go, "leak": leak})
