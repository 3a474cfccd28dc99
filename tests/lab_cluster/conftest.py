"""Real emulated clusters (root only): one lab per topology, torn down whatever the tests do."""
from __future__ import annotations

from typing import Iterator

import pytest

from torch_thunderbolt.lab.view import Lab
from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab

# Unshaped cables with reno: correctness tests want speed, not realism (bbr caps veth at ~1.5 GB/s).
SHAPES = {"chain3": (3, "chain"), "ring3": (3, "ring"), "mesh4": (4, "mesh")}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def cluster(request) -> Iterator[Lab]:
    """Each of the three cluster shapes in turn, one lab per shape for the whole module."""
    skip_unless_lab()
    hosts, topology = SHAPES[request.param]
    with lab_session(hosts, topology, cc="reno") as lab:
        yield lab


@pytest.fixture(scope="module")
def chain3() -> Iterator[Lab]:
    skip_unless_lab()
    with lab_session(3, "chain", cc="reno") as lab:
        yield lab


@pytest.fixture
def pair2cables() -> Iterator[Lab]:
    skip_unless_lab()
    with lab_session(2, "pair", cables=2, rate="5gbit", cc="reno") as lab:
        yield lab
