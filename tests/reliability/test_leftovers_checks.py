"""The leftovers checks (test_zz_leftovers.py) do see what they look for."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from .leftovers import LAB_NAMESPACE, child_processes, listening_sockets

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


def test_lab_namespace_names_are_recognised() -> None:
    assert LAB_NAMESPACE.match("tblab-mac0") and LAB_NAMESPACE.match("tbt16867-68ee01-mac2")
    assert not LAB_NAMESPACE.match("docker-ns") and not LAB_NAMESPACE.match("tblab-mac")
