"""On a torch without `dist.shrink_group` registration changes nothing there
(`install_shrink` is False) and the survivors of a loss call `ThunderboltProcessGroup.shrink` themselves:
it returns a group over the same links, usable through its own methods (docs/fault-tolerance.md)."""
from __future__ import annotations

import types
from pathlib import Path

import pytest

from torch_thunderbolt.backend import registration
from torch_thunderbolt.testing.ranks import LOOPBACK, run_ranks

from .programs import old_torch


def _places(c10d: object) -> registration.TorchPlaces:
    return registration.TorchPlaces(c10d, (), {})


def test_install_shrink_leaves_a_torch_without_shrink_group_alone() -> None:
    c10d = types.SimpleNamespace()
    assert registration.install_shrink(_places(c10d)) is False
    assert vars(c10d) == {}


def test_install_shrink_wraps_torchs_functions_once_and_remove_probe_puts_them_back() -> None:
    def _create_shrunk_process_group(new_backend, remaining_ranks, metadata, is_default_group):
        return ("torch's", new_backend)

    def _finalize_shrunk_group(group_info, excluded_ranks_set, new_backend):
        return ("torch's finalized", new_backend)

    torchs = {"_create_shrunk_process_group": _create_shrunk_process_group,
              "_finalize_shrunk_group": _finalize_shrunk_group}
    assert registration.install_shrink(_places(types.SimpleNamespace(
        _create_shrunk_process_group=_create_shrunk_process_group))) is False  # both steps, or nothing
    c10d = types.SimpleNamespace(**torchs)
    places = _places(c10d)
    assert registration.install_shrink(places) and registration.install_shrink(places)
    for name, fn in torchs.items():
        wrapped = getattr(c10d, name)
        assert registration.ours(wrapped) and wrapped.__wrapped__ is fn, name
    # a group not ours: torch's way
    assert c10d._create_shrunk_process_group("a C++ backend", [0, 1], {}, True) == ("torch's", "a C++ backend")
    assert c10d._finalize_shrunk_group({}, {0}, "a C++ backend") == ("torch's finalized", "a C++ backend")
    registration.remove_probe(places)
    assert vars(c10d) == torchs


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_shrink_called_directly_on_a_torch_without_shrink_group(tmp_path: Path) -> None:
    runs = run_ranks(old_torch, 3, tmp_path, args=["direct"], setup=LOOPBACK, timeout=100, expect_ok=False,
                     env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "THUNDERBOLT_TRANSPORT": "tcp"})
    for res in runs[:2]:
        assert res.returncode == 0, (res.rank, res.stderr[-3000:])
        out = res.json()
        assert out["install_shrink"] is False and not out["patched"], out
        assert out["loss"]["type"] == "PeerLostError" and out["loss"]["peer"] == 2, out
        assert out["rank"] == res.rank and out["size"] == 2 and out["same_engine"] and not out["old_usable"], out
        assert out["sum"] == [3.0] and out["bcast"] == [1.0] and out["gathered"] == [0.0, 1.0], out
        assert out["dist_sum"] == [3.0], out
        if res.rank == 1:
            assert out["recv"] == [7.0], out
