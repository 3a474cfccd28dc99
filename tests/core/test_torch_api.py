"""The public torch.distributed API on real processes over loopback, checked against local references."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import free_port, run_ranks

from .programs import torch_api

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _check_all(results) -> None:
    for res in results:
        checks = res.json()
        bad = {k: v for k, v in checks.items() if v is not True}
        assert not bad, f"rank {res.rank}: {bad}"


@pytest.mark.parametrize("world, transport", [(1, "auto"), (2, "tcp"), (2, "shm"), (3, "tcp"), (3, "shm")])
def test_whole_api(world: int, transport: str, tmp_path) -> None:
    _check_all(run_ranks(torch_api, world, tmp_path, args=["whole_api"], timeout=150,
                         env={"THUNDERBOLT_TRANSPORT": transport}))


@pytest.mark.parametrize("init", ["tcp", "file", "thunderbolt"])
def test_init_methods(init: str, tmp_path) -> None:
    url = {"tcp": f"tcp://127.0.0.1:{free_port()}", "file": f"file://{tmp_path}/rdzv",
           "thunderbolt": f"thunderbolt://127.0.0.1:{free_port()}"}[init]
    for res in run_ranks(torch_api, 2, tmp_path, args=["init_method"], timeout=60, env={"TEST_INIT": url}):
        assert res.json() == [3.0, 3.0, 3.0]
