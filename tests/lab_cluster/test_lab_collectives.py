"""Every collective with backend="thunderbolt" on a 3-Mac chain, a 3-Mac ring and a 4-Mac mesh of the lab,
each compared with exact expected values (small sizes take the one-shot algorithms, large ones the
ring/chain pipelines with several chunks and an element count no rank count divides)."""
import pytest

from ..core.collective_checks import EVERY_COLLECTIVE
from .labrun import run_on_lab

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

EXPECTED_SHAPE = {"chain": "chain", "ring": "ring", "mesh": "mesh"}

COLLECTIVES = """
dist.init_process_group("thunderbolt", init_method="env://")
pg = dist.group.WORLD
W = WORLD
""" + EVERY_COLLECTIVE + """
every_collective()
check_barrier(0.5)
result({"shape": pg._comm.shape.kind, "order": pg._comm.shape.order, "bad": bad})
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_every_collective_is_exact(cluster, tmp_path):
    runs = run_on_lab(cluster, COLLECTIVES, tmp_path, timeout=200)
    for run in runs:
        got = run.json()
        assert got["bad"] == [], f"rank {run.rank} on {cluster.plan.topology}: {got['bad']}"
        assert got["shape"] == EXPECTED_SHAPE[cluster.plan.topology]
    if cluster.plan.topology == "chain":
        assert runs[0].json()["order"] in ([0, 1, 2], [2, 1, 0])
