"""The whole algorithm grid of tests/core/test_algorithms.py, over the shm transport in real processes.

One launch per world size runs every case of every family for every algorithm; each rank checks its own
results against algorithms/reference.py and reports the failures."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import SHM, run_ranks

from .programs import algorithm_grid

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_algorithm_grid_over_shm(world: int, tmp_path) -> None:
    algos = "auto,direct,ring,chain"
    # A 4K shared window: "auto" all_reduce and broadcast take the windowed path in many rounds.
    results = run_ranks(algorithm_grid, world, tmp_path, setup=SHM, timeout=280,
                        env={"ALGOS": algos, "THUNDERBOLT_SHM_WINDOW": "4K"})
    outs = [res.json() for res in results]
    for res, out in zip(results, outs):
        assert out["nfails"] == 0, (res.rank, out["fails"])
        assert out["done"] > 100
    assert len({o["digest"] for o in outs}) == 1  # float sums bit-identical on every rank
