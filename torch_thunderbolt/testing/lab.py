"""Emulated clusters (Linux network namespaces, root only) for tests and scripts: bring a lab up for a block
and always take it down, and run ranks on its hosts with the environment `launch --lab` would give them.

    with lab_session(3, "chain", rate="10gbit") as lab:
        results = run_ranks(program, lab_world(lab), tmp_path, setup=lab_setup(lab))

`lab_skip_reason()` says why labs cannot run here (None when they can); `skip_unless_lab()` is the pytest
form. Each session gets a unique name, so parallel test runs and other engineers' labs never collide.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from typing import Iterator

from torch_thunderbolt.lab.executor import lab_down, lab_up, running_as_root
from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.lab.view import Lab

from .ranks import Setup

# The rendezvous port inside the lab's own namespaces, so it never collides with the host's ports.
MASTER_PORT = 29611


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


def skip_unless_lab() -> None:
    """Skip the calling test (or fixture) with the reason when labs cannot be built here (not root, ...)."""
    import pytest

    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)


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


def lab_world(lab: Lab, per_host: int = 1) -> int:
    return per_host * len(lab.hosts())


def lab_setup(lab: Lab, per_host: int = 1) -> Setup:
    """Runs of `per_host` ranks in each emulated host of `lab` (rank r on host r // per_host), each inside its
    host's namespace with THUNDERBOLT_IFNAME = the host's cables and GLOO_SOCKET_IFNAME = its first one;
    the store on mac0's first cable address. Combine with `.but(segments=...)` for hybrid runs."""
    hosts = lab.hosts()

    def rank_env(rank: int, world: int) -> dict[str, str]:
        ifnames = lab.ifname_env(hosts[rank // per_host])
        return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host),
                "TEST_RANKS_PER_HOST": str(per_host), "THUNDERBOLT_IFNAME": ifnames,
                "GLOO_SOCKET_IFNAME": ifnames.split(",")[0]}

    return Setup(strip=("THUNDERBOLT_", "TORCH_DISTRIBUTED", "GLOO_"), master_addr=lab.addresses(hosts[0])[0],
                 master_port=MASTER_PORT, rank_env=rank_env,
                 wrap=lambda rank: lab.exec_argv(hosts[rank // per_host], []))


def counter_delta(before: dict[str, tuple[int, int]],
                  after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """{ifname: (rx bytes, tx bytes)} that moved between two `Lab.counters` readings."""
    return {dev: (after[dev][0] - before[dev][0], after[dev][1] - before[dev][1]) for dev in after}


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
