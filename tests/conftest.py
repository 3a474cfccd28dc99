"""A test session must leave nothing behind: no child or rank process, no listening socket, no lab namespace,
no shared-memory segment, except what existed before it started (other people's labs and jobs).

Checked once, after the last test, by a session fixture that every test uses: anything left fails the run
(an error at the teardown of the last test, listing what was found). The checks themselves are
torch_thunderbolt.testing.leftovers, whose unit tests are in tests/reliability/test_leftovers_checks.py.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from torch_thunderbolt.testing.leftovers import Snapshot, session_leftovers, take_snapshot

BEFORE = pytest.StashKey[Snapshot]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[BEFORE] = take_snapshot()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Torn down after every other fixture of the session (it is set up first), so module fixtures such as
    the labs of tests/lab_cluster are gone by the time it looks."""
    yield
    before = request.config.stash.get(BEFORE, None) or Snapshot(frozenset(), frozenset())
    found = {what: items for what, items in session_leftovers(before, tmp_path_factory.getbasetemp()).items()
             if items}
    assert not found, "the test session left these behind:\n" + "\n".join(
        f"{what}:\n  " + "\n  ".join(items) for what, items in found.items())
