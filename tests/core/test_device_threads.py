"""Tensors on an accelerator (a fake PrivateUse1 device standing in for mps): exact results written back in
place, async ops that return before they are done, and every op on a device tensor run by a thread that
issued, waited on or (autograd) consumes the collective — never by a thread of the backend's (on a Mac,
Metal encoding from two threads at once crashes the process). DDP on the device, with and without hooks,
trains bit for bit as DDP on the CPU.

Emulated: the device (torch_thunderbolt.testing.fake_device runs each op at once on host memory and logs
its thread). Not emulated: MPS's asynchronous execution and its missing dtypes."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import device_threads

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("world,env", [(2, {}), (2, {"THUNDERBOLT_TRANSPORT": "tcp"}), (3, {"THUNDERBOLT_TRANSPORT": "tcp"})],
                         ids=["2-auto", "2-tcp", "3-tcp"])
def test_device_tensors_are_exact_and_only_touched_by_the_callers_threads(world, env, tmp_path):
    for res in run_ranks(device_threads, world, tmp_path, timeout=270, env=env):
        checks = res.json()
        bad = {k: v for k, v in checks.items() if v is not True}
        assert not bad, f"rank {res.rank}: {bad}"
        assert "async_16MB_returns_unfinished" in checks and "ddp_default" in checks
