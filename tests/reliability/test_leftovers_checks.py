"""The leftovers checks (torch_thunderbolt.testing.leftovers) see what they look for, and the end-of-session
check of tests/conftest.py fails a run that leaves something behind."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from torch_thunderbolt.testing.leftovers import (LAB_NAMESPACE, child_processes, listening_sockets,
                                                 processes_mentioning)
from torch_thunderbolt.testing.ranks import REPO

pytestmark = pytest.mark.timeout(30)


def test_a_child_process_and_a_listener_are_seen() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    lst = socket.create_server(("127.0.0.1", 0))
    try:
        assert any(str(child.pid) in c for c in child_processes())
        assert any(f":{lst.getsockname()[1]}" in s for s in listening_sockets())
    finally:
        child.kill()
        child.wait()
        lst.close()


def test_a_process_running_in_the_run_directory_is_seen(tmp_path) -> None:
    """Ranks run their program from the source tree with the run's directory as working directory."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path)
    try:
        assert any(str(child.pid) in c for c in processes_mentioning(str(tmp_path)))
        assert not any(str(child.pid) in c for c in processes_mentioning(str(tmp_path) + "x"))
    finally:
        child.kill()
        child.wait()


def test_lab_namespace_names_are_recognised() -> None:
    assert LAB_NAMESPACE.match("tblab-mac0") and LAB_NAMESPACE.match("tbt16867-68ee01-mac2")
    assert not LAB_NAMESPACE.match("docker-ns") and not LAB_NAMESPACE.match("tblab-mac")


LEAKY = """
import socket
LISTENERS = []

def test_leaves_a_listener():
    LISTENERS.append(socket.create_server(("127.0.0.1", 0)))  # open until the session ends
"""

CLEAN = """
import socket

def test_closes_its_listener():
    socket.create_server(("127.0.0.1", 0)).close()
"""


def _session(tmp_path, test_text: str) -> subprocess.CompletedProcess:
    """A pytest session of one test module with tests/conftest.py as its only plugin."""
    (tmp_path / "test_one.py").write_text(textwrap.dedent(test_text))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=25)


@pytest.mark.timeout(60)
def test_the_session_check_fails_a_run_that_leaves_a_listener(tmp_path) -> None:
    done = _session(tmp_path, LEAKY)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 passed, 1 error" in done.stdout and "listening sockets" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(60)
def test_the_session_check_passes_a_run_that_leaves_nothing(tmp_path) -> None:
    done = _session(tmp_path, CLEAN)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed" in done.stdout and "error" not in done.stdout, done.stdout[-3000:]
