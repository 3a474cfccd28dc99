"""The shm transport takes its settings from the Config it is given (parsed from THUNDERBOLT_SHM_*)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import SHM, run_ranks, shm_snippet

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_shm_settings_reach_the_transport_through_the_config(tmp_path) -> None:
    seg_dir = tmp_path / "segments"
    seg_dir.mkdir()
    script = """
shm = t.link_kind("shm")
result({"dir": str(shm.own.path.parent) if shm.own.path else None, "slot": shm.slot_bytes,
        "window": t.window_memory is not None})
t.close()
"""
    env = {"THUNDERBOLT_SHM_DIR": str(seg_dir), "THUNDERBOLT_SHM_SLOT": "8K", "THUNDERBOLT_SHM_WINDOW": "0"}
    for res in run_ranks(shm_snippet(script, tmp_path), 2, tmp_path, setup=SHM, timeout=100, env=env):
        assert res.json() == {"dir": str(seg_dir), "slot": 8 << 10, "window": False}
    assert list(seg_dir.iterdir()) == []  # segments unlinked once every rank had mapped them


def test_a_group_all_on_this_host_gets_its_shared_window_by_default(tmp_path) -> None:
    """The shm kind attaches the window to its engine: the windowed collectives must be what runs."""
    script = """
from torch_thunderbolt.algorithms.collectives import Communicator
comm = Communicator(t, Config.from_env(), timeout=30)
x = torch.full((1000,), float(r + 1))
comm.all_reduce(x)
result({"window": comm.window is not None and comm.window.world == w,
        "rounds": comm.window.rounds if comm.window else 0, "sum": x[0].item()})
t.close()
"""
    for res in run_ranks(shm_snippet(script, tmp_path), 3, tmp_path, setup=SHM, timeout=100):
        assert res.json() == {"window": True, "rounds": 1, "sum": 6.0}
