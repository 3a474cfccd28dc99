"""The fake accelerator (torch_thunderbolt.testing.fake_device) is faithful: models train on it bit for bit
as on the CPU (one optimizer step after another), views and in-place ops behave as on the CPU. The device
tests of the backend rely on it standing in for mps.

Each test runs its checks in a process of its own: the device is installed once per process, before torch's
autograd engine starts its device threads."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import fake_models

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def run(scenario, tmp_path):
    (res,) = run_ranks(fake_models, 1, tmp_path, args=[scenario], timeout=100)
    return res.json()


def test_models_train_bit_for_bit_as_on_the_cpu(tmp_path):
    out = run("models", tmp_path)
    assert set(out) == set(fake_models.MODELS)
    for name, got in out.items():
        assert got["identical"], f"{name}: differs from the CPU by up to {got['max_diff']}"
        # backward ran on autograd's device thread, as it does for mps tensors
        assert any(t != "MainThread" for t in got["threads"]), (name, got["threads"])


def test_views_strides_and_in_place_ops_behave_as_on_the_cpu(tmp_path):
    bad = {k: v for k, v in run("semantics", tmp_path).items() if v is not True}
    assert not bad


def test_sdpa_takes_the_math_path_as_any_non_cpu_device(tmp_path):
    assert run("sdpa_default", tmp_path) == {"close": True, "equal_to_math": True}
