"""Every collective with backend="thunderbolt" on a 3-Mac chain, a 3-Mac ring and a 4-Mac mesh of the lab,
each compared with exact expected values (small sizes take the one-shot algorithms, large ones the
ring/chain pipelines with several chunks and an element count no rank count divides)."""
import pytest

from torch_thunderbolt.testing.lab import lab_setup, lab_world
from torch_thunderbolt.testing.ranks import run_ranks

from .programs import on_lab

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

EXPECTED_SHAPE = {"chain": "chain", "ring": "ring", "mesh": "mesh"}


@pytest.mark.timeout(240)
def test_every_collective_is_exact(cluster, tmp_path):
    runs = run_ranks(on_lab, lab_world(cluster), tmp_path, args=["collectives"], setup=lab_setup(cluster),
                     timeout=200)
    for run in runs:
        got = run.json()
        assert got["bad"] == [], f"rank {run.rank} on {cluster.plan.topology}: {got['bad']}"
        assert got["shape"] == EXPECTED_SHAPE[cluster.plan.topology]
    if cluster.plan.topology == "chain":
        assert runs[0].json()["order"] in ([0, 1, 2], [2, 1, 0])
