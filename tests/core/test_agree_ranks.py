"""Settings that must agree, in real processes: ranks started with different values fail set-up with a
ConfigError on every rank, naming the variable and each rank's value, before any collective runs (the
thread-level tests of every setting are in test_agree.py)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import agree_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

CASES = {
    # Unchecked, an fp16 rank beside a bf16 one gets [3.56, 2.08] and [160.0, 2.63] for 1.5 + 2.5, no error.
    "compression": ("THUNDERBOLT_COMPRESSION", "fp16", "bf16", "tcp"),
    # Unchecked, a MismatchError worded as a size mismatch between two identical all_reduce calls.
    "small": ("THUNDERBOLT_SMALL", "1K", "64K", "tcp"),
    "shm_slots": ("THUNDERBOLT_SHM_SLOTS", "2", "8", "auto"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_started_with_different_settings_fail_set_up_on_every_rank(case, tmp_path) -> None:
    var, a, b, transport = CASES[case]
    results = run_ranks(agree_ranks, 2, tmp_path, args=["init"], timeout=90, env={"THUNDERBOLT_TRANSPORT": transport},
                        per_rank={0: {var: a}, 1: {var: b}})
    for res in results:
        out = res.json()
        assert out["ok"] is False and out["type"] == "ConfigError", (res.rank, out)
        assert f"{var} differs between ranks: rank 0 {a}, rank 1 {b}" in out["msg"], (res.rank, out["msg"])
        assert "every rank" in out["msg"] and "needs the same value" in out["msg"], out["msg"]


def test_the_same_settings_on_every_rank_run(tmp_path) -> None:
    results = run_ranks(agree_ranks, 2, tmp_path, args=["init"], timeout=90,
                        env={"THUNDERBOLT_TRANSPORT": "tcp", "THUNDERBOLT_COMPRESSION": "bf16"})
    for res in results:
        out = res.json()
        assert out["ok"] and out["op"]["ok"], out
        assert out["sum"] == [4.0, 4.0], out
