"""The shm transport takes its settings from the Config it is given (parsed from THUNDERBOLT_SHM_*)."""
from __future__ import annotations

import pytest

from .shm_harness import run_shm

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_shm_settings_reach_the_transport_through_the_config(tmp_path) -> None:
    seg_dir = tmp_path / "segments"
    seg_dir.mkdir()
    script = """
result({"dir": str(t.own.path.parent) if t.own.path else None, "slot": t.slot_bytes, "spin": t.spin,
        "window": t.window is not None})
t.close()
"""
    env = {"THUNDERBOLT_SHM_DIR": str(seg_dir), "THUNDERBOLT_SHM_SLOT": "8K", "THUNDERBOLT_SHM_SPIN_US": "5",
           "THUNDERBOLT_SHM_WINDOW": "0"}
    for res in run_shm(script, 2, tmp_path, timeout=100, env=env):
        assert res.json() == {"dir": str(seg_dir), "slot": 8 << 10, "spin": pytest.approx(5e-6), "window": False}
    assert list(seg_dir.iterdir()) == []  # segments unlinked once every rank had mapped them
