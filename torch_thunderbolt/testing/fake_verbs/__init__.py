"""The fake verbs fabric: RDMA devices made of files, for tests and for running whole jobs without the
hardware. Create one, point processes at it, inject faults, remove it:

    with fake_fabric(devices={"rdma_fake0": "10.201.0.1", "rdma_fake1": "10.201.0.2"}, max_qp=4) as fabric:
        run_ranks(program, 2, tmp_path, env=fabric_env(fabric))   # THUNDERBOLT_VERBS=fake:<dir>
        fabric.set_fault("rdma_fake1", "port_up", 0)              # from here, any time, any process

- `fabric.py`: the directory every process shares (devices, limits, file layout) and its faults (`Fabric`);
- `provider.py`: `FakeProvider`, the ctypes callbacks the real binding (`transport/verbs.py`) runs over
  unchanged, enforcing Apple's rules;
- here: `fake_fabric`, `fabric_env`, and `open_provider`, the entry the runtime calls.

How a job reaches it without the runtime importing testing/: THUNDERBOLT_VERBS=fake:/path names the
provider; config.py (which parses every setting) maps the name "fake" to this module in VERBS_PROVIDERS,
and `transport/providers.open_provider` imports the module by that name only when a job names it, as it
would a plugin, and calls its `open_provider(arg)`. A package without testing/ gives a ConfigError there.

From a shell:

    python -m torch_thunderbolt.testing.fake_verbs create /tmp/fab [--device rdma_fake0=10.201.0.1 ...]
                                                                    [--limit max_qp=4 ...]
    python -m torch_thunderbolt.testing.fake_verbs fault /tmp/fab rdma_fake0 port_up 0
    python -m torch_thunderbolt.testing.fake_verbs reboot /tmp/fab rdma_fake0

Nothing measured on a fake fabric is RDMA speed: its delivery is memory copies and Python.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from .fabric import DEFAULT_LIMITS, FAULTS, Fabric, FabricDevice
from .provider import FakeProvider

ENV = "THUNDERBOLT_VERBS"


def open_provider(fabric: str) -> FakeProvider:
    """The provider over the fabric in directory `fabric` (THUNDERBOLT_VERBS=fake:<fabric>)."""
    return FakeProvider(fabric)


def fabric_env(fabric: Fabric) -> dict[str, str]:
    """The environment that makes a process use `fabric`."""
    return {ENV: f"fake:{fabric.path}"}


@contextlib.contextmanager
def fake_fabric(path: str | Path | None = None, devices: Mapping[str, str | None] | None = None,
                **limits: Any) -> Iterator[Fabric]:
    """A new fabric (in `path`, else a fresh temporary directory), removed with everything in it when the
    block ends, even on failure. `devices`: name -> IPv4 address or None; `limits`: DEFAULT_LIMITS keys."""
    root = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="tbverbs-"))
    fabric = Fabric.create(root, devices, **limits)
    try:
        yield fabric
    finally:
        fabric.close()
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["DEFAULT_LIMITS", "ENV", "FAULTS", "Fabric", "FabricDevice", "FakeProvider", "fabric_env", "fake_fabric",
           "open_provider"]
