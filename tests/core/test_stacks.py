"""DDP, FSDP2 and pipelining running unchanged on the thunderbolt backend, compared with one process."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import stacks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_ddp_matches_single_process(tmp_path) -> None:
    for res in run_ranks(stacks, 2, tmp_path, args=["ddp"], timeout=150):
        out = res.json()
        for k in ("plain", "small_buckets", "no_sync", "unused_params"):
            assert out[k] < 1e-5, (k, out)
        assert out["fp16_hook"] < 1e-2, out


def test_fsdp2_matches_single_process(tmp_path) -> None:
    for res in run_ranks(stacks, 2, tmp_path, args=["fsdp2"], timeout=150):
        assert res.json()["diff"] < 1e-5


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipelining_matches_single_process(schedule: str, tmp_path) -> None:
    for res in run_ranks(stacks, 2, tmp_path, args=["pipelining"], timeout=150, env={"TEST_SCHEDULE": schedule}):
        assert res.json()["diff"] < 1e-5
