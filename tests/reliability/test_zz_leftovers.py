"""Runs last (conftest.py moves it after every other test): the run left nothing behind."""
from __future__ import annotations

import gc
import time

import pytest

from .leftovers import child_processes, lab_namespaces, listening_sockets, processes_mentioning, shm_entries

pytestmark = pytest.mark.timeout(60)


def _settled(check, seconds: float = 5.0) -> list[str]:
    """`check()` until it finds nothing (processes being reaped, sockets being closed) or time runs out."""
    end = time.monotonic() + seconds
    while True:
        gc.collect()  # stores and transports closed only when collected
        found = check()
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.2)


def test_no_child_processes_are_left() -> None:
    assert _settled(child_processes) == []


def test_no_rank_processes_of_this_run_are_left(tmp_path_factory) -> None:
    base = str(tmp_path_factory.getbasetemp())
    assert _settled(lambda: processes_mentioning(base)) == []


def test_no_listening_sockets_are_left() -> None:
    assert _settled(listening_sockets) == []


def test_no_lab_namespaces_are_left(before_tests) -> None:
    assert _settled(lambda: sorted(lab_namespaces() - before_tests.namespaces)) == []


def test_no_shared_memory_segments_are_left(before_tests) -> None:
    assert _settled(lambda: sorted(shm_entries() - before_tests.shm)) == []
