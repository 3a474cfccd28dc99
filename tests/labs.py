"""Shared by the tests that build real network-namespace labs."""
from __future__ import annotations

import pytest

from torch_thunderbolt.lab.testing import lab_skip_reason


def skip_unless_lab() -> None:
    """Skip the calling test (or fixture) with the reason when labs cannot be built here (not root, ...)."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
