"""Stalled ranks and mismatched calls on 3 ranks, beyond tests/core/test_failures.py (2 ranks, size/dtype/op):
a clear error on every rank, naming the op and the culprits; never a hang, never silent corruption."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import stall_mismatch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def _env(timeout: float) -> dict:
    # the TCP path (Thunderbolt's); on one host THUNDERBOLT_TRANSPORT=auto would pick shared memory
    return {"TB_TIMEOUT": str(timeout), "THUNDERBOLT_TRANSPORT": "tcp"}


@pytest.mark.parametrize("nbytes", [64, 4 << 20], ids=["one-shot", "ring"])
def test_stalled_rank_is_named_on_every_waiting_rank(nbytes: int, tmp_path) -> None:
    results = run_ranks(stall_mismatch, 3, tmp_path, args=["stall"], timeout=60,
                        env=dict(_env(2), TB_NBYTES=str(nbytes)), expect_ok=False)
    for res in results[:2]:
        out = res.json()
        assert out["ok"] is False and out["type"] == "CollectiveTimeout", (res.rank, out)
        assert "Timed out" in out["msg"] and "all_reduce" in out["msg"], out
        assert "[2]" in out["msg"], (res.rank, out["msg"])  # the rank that did not arrive
        assert 1.5 < out["seconds"] < 10, out


# Each kind's world size; the calls each rank makes are programs/stall_mismatch.CALLS. All must fail with
# MismatchError on every rank.
MISMATCH = {"collective": 3, "order": 2, "size-one-rank": 3, "dtype-ring": 3, "root": 3}


@pytest.mark.parametrize("kind", list(MISMATCH))
def test_mismatched_calls_fail_on_every_rank(kind: str, tmp_path) -> None:
    world = MISMATCH[kind]
    results = run_ranks(stall_mismatch, world, tmp_path, args=["mismatch"], timeout=60,
                        env=dict(_env(6), TB_KIND=kind), expect_ok=False)
    outs = [res.json() for res in results]
    assert any(o.get("type") == "MismatchError" or o["after"].get("type") == "MismatchError" for o in outs), outs
    for rank, out in enumerate(outs):
        if kind != "root":  # the call itself must fail
            assert out["ok"] is False, f"rank {rank} finished a mismatched {kind} call without an error: {outs}"
        # A root that only sends may finish before the other root's data shows up: then the next call fails.
        first = out if not out["ok"] else out["after"]
        # On 3 ranks a rank may hear of it first as the FIN of a rank that already failed
        # (test_abort_relay.py checks that case deterministically).
        allowed = ("MismatchError", "PeerLostError") if world > 2 else ("MismatchError",)
        assert first["ok"] is False and first["type"] in allowed, (rank, outs)
        assert first["seconds"] < 5, (rank, out)
        assert out["after"]["ok"] is False and out["after"]["seconds"] < 5, (rank, out)
