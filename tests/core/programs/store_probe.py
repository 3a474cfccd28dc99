"""Ranks of test_store_probe.py: rank 1 of a job whose store nobody serves (MASTER_PORT refused), through
torch's init_process_group with each init method. torch's own timeout is 10 minutes here, so only our probe
can end it in time; gloo shows that other backends keep torch's behaviour (its timeout: 3 s here). And the
ranks of a job whose settings the backend refuses (`refused_settings`), timed."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend and the probes
from torch_thunderbolt.testing.program import main, result


def outcome(backend: str, init_method: str, seconds: float) -> dict:
    try:
        dist.init_process_group(backend, init_method=init_method, timeout=timedelta(seconds=seconds))
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        return {"error": type(exc).__name__, "message": str(exc)}
    dist.destroy_process_group()
    return {"error": None}


def refused() -> None:
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    result({"env": outcome("thunderbolt", "env://", 600),
            "thunderbolt": outcome("thunderbolt", f"thunderbolt://{addr}:{port}", 600),
            "tcp": outcome("thunderbolt", f"tcp://{addr}:{port}?rank=1&world_size=2", 600),
            "gloo": outcome("gloo", "env://", 3)})


def refused_settings() -> None:
    started = time.monotonic()
    out = outcome("thunderbolt", "env://", 600)
    result({**out, "seconds": time.monotonic() - started})


if __name__ == "__main__":
    main({"refused": refused, "refused_settings": refused_settings})
