"""Bring a lab up for one test (or script) and always tear it down.

    with lab_session(3, "chain", rate="10gbit") as lab:
        lab.run("mac2", ["ping", "-c1", lab.addresses("mac0")[0]])

pytest users: `lab_skip_reason()` says why labs cannot run here (None when they can).
Each session gets a unique name, so parallel test runs and other engineers' labs never collide.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from typing import Iterator

from .executor import lab_down, lab_up, running_as_root
from .plan import plan_lab
from .view import Lab


def unique_lab_name(stem: str = "tbt") -> str:
    return f"{stem}{os.getpid() % 100000}-{uuid.uuid4().hex[:6]}"


def lab_skip_reason() -> str | None:
    """Why a real lab cannot be built here, or None."""
    if not running_as_root():
        return "needs root to create network namespaces (run the lab tests as root)"
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2/procps)"
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces"
    return None


@contextlib.contextmanager
def lab_session(hosts: int, topology: str, cables: int = 1, rate: str | None = None,
                mtu: int | None = None, *, cc: str | None = None, name: str | None = None,
                state_directory: str | None = None) -> Iterator[Lab]:
    """A running lab for the duration of the `with` block; removed even if the block raises."""
    name = name or unique_lab_name()
    own_dir = state_directory is None
    directory = state_directory or tempfile.mkdtemp(prefix="tb-lab-state-")
    plan = plan_lab(hosts, topology, cables, rate, mtu, name=name, cc=cc)
    try:
        lab_up(plan, directory=directory)
        yield Lab(plan)
    finally:
        try:
            lab_down(name, directory=directory)
        finally:
            if own_dir:
                shutil.rmtree(directory, ignore_errors=True)


_ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.sendall(conn.recv(64))
"""

_ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
    s.sendall(b"tb-lab-ping")
    sys.exit(0 if s.recv(64) == b"tb-lab-ping" else 1)
"""


def tcp_ping(lab: Lab, src: int | str, dst: int | str, address: str, timeout: float = 5.0) -> bool:
    """Can `src` open a TCP connection to `address` served by `dst`, and echo through it?

    The lab has no ping binary guarantee, so a pair of tiny Python processes stands in for ICMP.
    """
    import subprocess
    import sys

    server = subprocess.Popen(lab.exec_argv(dst, [sys.executable, "-c", _ECHO_SERVER, address, str(timeout)]),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = server.stdout.readline().strip()
        if not port.isdigit():
            return False
        client = lab.run(src, [sys.executable, "-c", _ECHO_CLIENT, address, port, str(timeout)],
                         capture_output=True, timeout=timeout + 5)
        return client.returncode == 0
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
