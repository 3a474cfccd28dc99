"""The selfcheck's checks on device tensors: on a Mac they run on mps; here on the fake accelerator that
stands in for it (it computes as the CPU does, so what is checked is the path, not mps's kernels)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.selfcheck import ops
from torch_thunderbolt.testing.ranks import run_ranks

from .programs import device_ops


def test_no_float64_on_mps():
    assert "float64" not in ops.dtypes_on("mps")
    assert ops.dtypes_on("cpu") == ops.DTYPES


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_family_and_ddp_on_device_tensors(tmp_path):
    for res in run_ranks(device_ops, 2, tmp_path, timeout=270):
        out = res.json()
        assert set(out["families"]) == set(ops.FAMILIES)
        for family, (count, problems) in out["families"].items():
            assert count > 0 and problems == [], (res.rank, family, problems)
        count, problems = out["spoiled"]
        assert len(problems) == 1 and problems[0].startswith("all_to_all_single"), problems
        assert out["ddp_problems"] == [] and out["ddp_same_as_cpu"]
        assert 0 <= out["overlap"]["hidden"] <= 1 and out["overlap"]["iters"] == 2
