"""Every operating-system difference the runtime depends on, in one place.

The runtime asks a `Platform` instead of looking at `sys.platform`, `/proc` or `/dev/shm` itself, so the macOS
behaviour can be exercised on a Linux box: code that differs takes a `plat: Platform | None = None` argument
(None = `current()`), and a test passes `Platform.for_system("darwin")`. Nothing here is mutable.

The facts behind the macOS values (XNU sources, Apple technotes) are collected in the project's
reference notes; each field says what it changes.
"""
from __future__ import annotations

import os
import platform as _std_platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

INT_MAX = 2**31 - 1
# One send/recv moves at most this many bytes. XNU fails a call over INT_MAX with EINVAL (Linux returns a
# partial count); 1 GiB is far below that and far above what one call moves on any link, so the cap costs
# nothing and both systems run the same loop.
SOCKET_IO_CAP = 1 << 30

LINUX_TCP_USER_TIMEOUT = 18  # linux/tcp.h, for Pythons built without socket.TCP_USER_TIMEOUT
# macOS has no TCP_USER_TIMEOUT; TCP_RXT_CONNDROPTIME (netinet/tcp.h: 0x80, seconds) drops a connection
# whose retransmissions go unanswered that long. Python's socket module does not name it.
DARWIN_TCP_RXT_CONNDROPTIME = 0x80
# Offsets in Linux's struct tcp_info (linux/tcp.h) of what `send_state` reads; tcpi_snd_wnd, the last field
# read, exists from Linux 5.4 on.
TCP_INFO_PROBES = 3  # (one byte)
TCP_INFO_SND_MSS = 16
TCP_INFO_UNACKED = 24
TCP_INFO_LAST_ACK_RECV = 56  # milliseconds ago
TCP_INFO_NOTSENT_BYTES = 144
TCP_INFO_SND_WND = 228

# macOS tools by absolute path: a non-login ssh session's PATH may not hold them, and a user's PATH could
# shadow them.
IOREG = "/usr/sbin/ioreg"
SYSCTL = "/usr/sbin/sysctl"
RDMA_CTL = "/usr/bin/rdma_ctl"  # RDMA over Thunderbolt on/off (macOS 26.2+; enabling it needs Recovery)
PMSET = "/usr/bin/pmset"  # power source and sleep settings (`doctor`)

# Documented in the message of every Local Network failure and in `doctor`.
LOCAL_NETWORK_SETTING = "System Settings › Privacy & Security › Local Network"


class SendState(NamedTuple):
    """The sending side of one TCP connection as its kernel sees it (`Platform.send_state`)."""

    window: int  # bytes the peer last said it has room for, counted from the first unacknowledged byte (0: closed)
    in_flight: int  # segments sent and not acknowledged yet
    unsent: int  # bytes written by the program that the kernel has not sent yet
    segment: int  # the largest segment it sends (bytes)
    acked_ago: float  # seconds since the peer last acknowledged anything (a window probe's answer included)
    probes: int  # window probes sent since the peer last answered (any acknowledgement answers them all)


@dataclass(frozen=True)
class Platform:
    """What differs between the systems we run on. Build one with `current()` or `for_system()`."""

    name: str  # "linux", "darwin", or another sys.platform value (no guarantees there)
    machine: str  # "x86_64", "arm64", "aarch64", ... (platform.machine(), lower case)
    max_socket_io: int = SOCKET_IO_CAP  # bytes per sendmsg/recv_into call (see SOCKET_IO_CAP)
    # What SO_SNDBUF/SO_RCVBUF above the system's limit does: "cap" (Linux clamps silently) or "enobufs"
    # (the BSDs and macOS up to 14.3 refuse the call; the caller retries with less). macOS 14.4 and later
    # clamp silently too; the size read back after setting it shows either kind of cap.
    sockbuf_over_limit: str = "enobufs"
    # getsockopt(SO_RCVBUF) reports this many times what was set (Linux doubles it for bookkeeping).
    sockbuf_reported_factor: int = 1
    loopback: str = "lo0"  # gloo fails to start when given an interface name that does not exist
    # Who shares memory with whom: "boot-id+netns" (Linux: /proc boot id and network namespace, so lab
    # netns "Macs" differ) or "platform-uuid+boot-session" (macOS: IOPlatformUUID and kern.bootsessionuuid,
    # since two Macs may share a hostname). "hostname" elsewhere.
    host_identity: str = "hostname"
    has_proc: bool = False
    shm_list_dir: str | None = None  # where POSIX shm objects show up as files (/dev/shm); None: unlistable
    # (level, option, milliseconds per unit) of the per-socket "unacknowledged data for this long = link lost"
    # option, or None where there is none.
    link_timeout: tuple[int, int, int] | None = None
    # Whether that option also ends a connection whose peer is alive but keeps its receive window closed
    # (a rank busy elsewhere, or frozen, does not read): Linux applies TCP_USER_TIMEOUT to zero-window probes
    # answered or not, macOS's TCP_RXT_CONNDROPTIME counts retransmissions only. Where it does, the TCP links
    # lift the option while the kernel holds data the peer's window has no room for (`send_state`,
    # transport/tcp.py).
    timeout_on_closed_window: bool = False
    tcp_congestion: bool = False  # per-socket TCP_CONGESTION exists (THUNDERBOLT_CC works)
    # macOS 15+ "Local Network" privacy: connections to directly attached subnets fail with EHOSTUNREACH or
    # EPERM when the app the process runs under lacks the permission. Retrying cannot help.
    local_network_privacy: bool = False
    # Where the kernel lists RDMA devices (Linux sysfs): absent, there is none and the verbs library need not
    # be loaded to say so. None: no such place (macOS: ask librdma.dylib).
    rdma_sysfs: str | None = None

    @classmethod
    def for_system(cls, name: str, machine: str | None = None) -> "Platform":
        """The Platform of `name` (a sys.platform value) on `machine` (default: arm64 for darwin, else this
        machine's). Tests use it to run the macOS code paths on Linux."""
        if machine is None:
            machine = "arm64" if name == "darwin" else _std_platform.machine()
        machine = machine.lower()
        if name.startswith("linux"):
            return cls(name="linux", machine=machine, sockbuf_over_limit="cap", sockbuf_reported_factor=2,
                       loopback="lo", host_identity="boot-id+netns", has_proc=True, shm_list_dir="/dev/shm",
                       link_timeout=(socket.IPPROTO_TCP,
                                     getattr(socket, "TCP_USER_TIMEOUT", LINUX_TCP_USER_TIMEOUT), 1),
                       timeout_on_closed_window=True, tcp_congestion=True, local_network_privacy=False,
                       rdma_sysfs="/sys/class/infiniband")
        if name == "darwin":
            return cls(name="darwin", machine=machine, sockbuf_over_limit="enobufs", sockbuf_reported_factor=1,
                       loopback="lo0", host_identity="platform-uuid+boot-session", has_proc=False,
                       shm_list_dir=None, link_timeout=(socket.IPPROTO_TCP, DARWIN_TCP_RXT_CONNDROPTIME, 1000),
                       tcp_congestion=False, local_network_privacy=True)
        return cls(name=name, machine=machine)  # the BSDs and others: conservative defaults

    def send_state(self, sock: socket.socket) -> "SendState | None":
        """What the kernel holds to send on a TCP socket and the room the peer gives it (TCP_INFO), or None
        where this system does not tell (only Linux is asked, 5.4 and later) or the socket is gone."""
        if self.name != "linux" or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SND_WND + 4)
        except OSError:
            return None
        if len(raw) < TCP_INFO_SND_WND + 4:  # an older kernel's shorter struct
            return None

        def u32(offset: int) -> int:
            return int.from_bytes(raw[offset : offset + 4], sys.byteorder)

        return SendState(window=u32(TCP_INFO_SND_WND), in_flight=u32(TCP_INFO_UNACKED),
                         unsent=u32(TCP_INFO_NOTSENT_BYTES), segment=u32(TCP_INFO_SND_MSS),
                         acked_ago=u32(TCP_INFO_LAST_ACK_RECV) / 1000, probes=raw[TCP_INFO_PROBES])

    @property
    def is_x86(self) -> bool:
        return self.machine in ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")

    @property
    def is_arm64(self) -> bool:
        return self.machine in ("arm64", "aarch64")


def run_tool(argv: list[str]) -> str:
    """stdout of a system tool (run by absolute path), or "" when it is missing or fails."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout if res.returncode == 0 else ""


def spin_cores(plat: "Platform | None" = None, run: Callable[[list[str]], str] | None = None) -> int:
    """How many of this host's cores the ranks' spin decisions count (busy-polling pays only while every
    local rank has one of its own): `os.cpu_count()`, except on macOS, where that counts the efficiency
    cores too, which run a rank several times slower and carry the system's background work; there the
    performance cores (`sysctl hw.perflevel0.physicalcpu`, perflevel0 being the fastest level, macOS 12
    and later), or `os.cpu_count()` where the key is missing (Intel Macs). Every rank of a host gets the
    same answer, which the shared window's size relies on. `run` runs a tool, for tests."""
    plat = plat or current()
    if plat.name == "darwin":
        text = (run or run_tool)([SYSCTL, "-n", "hw.perflevel0.physicalcpu"]).strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return os.cpu_count() or 1


def current() -> Platform:
    """This machine's Platform (built on each call: cheap, and no module state to go stale in tests)."""
    return Platform.for_system(sys.platform, _std_platform.machine())


def macos_version(text: str | None = None) -> tuple[int, ...] | None:
    """This Mac's macOS version as numbers ((26, 3) for 26.3), or `text`'s; None elsewhere or unknown. RDMA
    over Thunderbolt needs 26.2, and receives above 4 KiB 26.3."""
    if text is None:
        if sys.platform != "darwin":
            return None
        text = _std_platform.mac_ver()[0]
    try:
        return tuple(int(x) for x in text.split(".")) if text else None
    except ValueError:
        return None
