"""THUNDERBOLT_DEBUG=1 does what the README says: the group's set-up and every op are logged."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import debug_logging

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.mark.parametrize("env,transport", [({"THUNDERBOLT_DEBUG": "1"}, "auto"),
                                           ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "tcp"), ({}, "auto")],
                         ids=["debug-shm", "torch-detail-tcp", "off"])
def test_debug_logs_the_group_and_every_op(env, transport, tmp_path):
    results = run_ranks(debug_logging, 2, tmp_path, timeout=90, env=dict(env, THUNDERBOLT_TRANSPORT=transport))
    for res in results:
        lines = [ln for ln in res.stderr.splitlines() if "torch_thunderbolt" in ln and " DEBUG " in ln]
        if not env:
            assert not lines, res.stderr[-2000:]
            continue
        text = "\n".join(lines)
        assert f"rank {res.rank}: group" in text, res.stderr[-3000:]
        assert "all_reduce(float32, MAX)" in text and "broadcast(float32, root 0)" in text, text
