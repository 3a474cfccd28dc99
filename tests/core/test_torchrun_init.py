"""thunderbolt:// under real torchrun, whose agent serves the job's store (TORCHELASTIC_USE_AGENT_STORE):
a URL naming another port is served by rank 0, as outside torchrun (torch's tcp:// made every rank a client
of a store nobody served, and the job hung); a URL naming torchrun's own port uses torchrun's store."""
from __future__ import annotations

import pytest

from torch_thunderbolt.backend.registration import agent_store_elsewhere
from torch_thunderbolt.testing.ranks import free_port, run_torchrun

from .programs import torchrun_init

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.mark.parametrize("port", ["own", "torchrun's"])
def test_a_thunderbolt_url_works_under_torchrun(port, tmp_path) -> None:
    res = run_torchrun(torchrun_init, 2, tmp_path, args=["init"], timeout=120,
                       env={"TB_PORT": str(free_port()) if port == "own" else "", "THUNDERBOLT_TRANSPORT": "tcp"})
    outs = {o["rank"]: o for o in res.results()}
    assert set(outs) == {0, 1}, res.stdout[-3000:] + res.stderr[-3000:]
    for r, o in outs.items():
        assert o["ok"], (r, o)
        assert o["sum"] == [3.0] * 4, (r, o)
    assert res.returncode == 0, res.stderr[-3000:]


def test_rank_0_serves_the_store_only_where_torchrun_serves_another_one() -> None:
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "29500"}
    assert agent_store_elsewhere(29600, agent)
    assert not agent_store_elsewhere(29500, agent)  # torchrun's own store, reached by the URL's address
    assert not agent_store_elsewhere(29600, {"MASTER_PORT": "29500"})  # no agent store: torch's rank 0 serves
    assert not agent_store_elsewhere(29600, {"TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": "29500"})
