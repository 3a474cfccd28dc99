"""Who runs where: one idea of "host" for every decision about sharing memory, and the small socket
helper the set-up handshakes share."""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Callable

from ..platform import IOREG, SYSCTL, Platform, current, run_tool


_IOPLATFORM_UUID = re.compile(r'"IOPlatformUUID"\s*=\s*"([^"]+)"')


def host_identity(plat: Platform | None = None, run: Callable[[list[str]], str] = run_tool) -> str:
    """Who shares memory with whom: the hostname, plus what tells machines and boots apart on `plat`.

    Linux: boot id and network namespace; the namespace makes the emulated Macs of `torch-thunderbolt lab`
    (one netns each, same kernel) count as different hosts, so they keep talking TCP over their emulated
    cables. macOS: the hardware's IOPlatformUUID and kern.bootsessionuuid (no /proc), since two Macs may
    well share a hostname. `run` runs a system tool and returns its stdout ("" on failure), for tests."""
    plat = plat or current()
    parts = [socket.gethostname()]
    if plat.host_identity == "boot-id+netns":
        try:
            parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        except OSError:
            pass
        try:
            parts.append(os.readlink("/proc/self/ns/net"))
        except OSError:
            pass
    elif plat.host_identity == "platform-uuid+boot-session":
        found = _IOPLATFORM_UUID.search(run([IOREG, "-rd1", "-c", "IOPlatformExpertDevice"]))
        parts.append(found.group(1) if found else "")
        parts.append(run([SYSCTL, "-n", "kern.bootsessionuuid"]).strip())
    return "|".join(parts)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from a blocking set-up socket (a handshake), or ConnectionResetError at EOF."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("connection closed during the handshake")
        buf += chunk
    return buf
