"""Short soak in CI: 300 random collectives on 3 ranks (ops, dtypes, sizes, subgroups, async batches), every
result checked against the reference. The 1e5-op run: scripts/reliability/soak.py."""
from __future__ import annotations

import pytest

from tests.core.mp import run_ranks

from .soak import SCRIPT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_short_soak_has_no_mismatches(tmp_path) -> None:
    env = {"TB_OPS": "300", "TB_SEED": "7", "THUNDERBOLT_TRANSPORT": "tcp"}  # tcp: the Thunderbolt path
    results = run_ranks(SCRIPT, 3, tmp_path, timeout=150, env=env)
    outs = [r.json() for r in results]
    assert all(o["mismatches"] == 0 for o in outs), outs
    assert all(o["participated"] > 200 for o in outs), outs


def test_the_soak_checker_catches_a_wrong_element(tmp_path) -> None:
    env = {"TB_OPS": "5", "TB_SEED": "7", "TB_SELFTEST": "1", "THUNDERBOLT_TRANSPORT": "tcp"}
    results = run_ranks(SCRIPT, 2, tmp_path, timeout=120, env=env)
    assert any(r.json()["mismatches"] > 0 for r in results)
