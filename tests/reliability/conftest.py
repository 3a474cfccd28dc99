"""Puts the leftovers check (test_zz_leftovers.py) at the very end of the whole run, after every other
directory's tests, and snapshots what already existed before the tests started (other people's labs)."""
from __future__ import annotations

import pytest

from .leftovers import Snapshot, take_snapshot

SNAPSHOT = pytest.StashKey[Snapshot]()


def pytest_collection_modifyitems(session, config, items) -> None:
    last = [it for it in items if it.nodeid.startswith("tests/reliability/test_zz_leftovers.py")]
    if last:
        rest = [it for it in items if it not in last]
        items[:] = rest + last
    config.stash[SNAPSHOT] = take_snapshot()


@pytest.fixture
def before_tests(request) -> Snapshot:
    return request.config.stash.get(SNAPSHOT, None) or Snapshot(frozenset(), frozenset())
