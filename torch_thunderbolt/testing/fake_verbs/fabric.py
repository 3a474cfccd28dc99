"""The fake fabric's shared state: a directory any number of processes share, its file layout and
the faults any of them may set. The provider that turns it into verbs calls is `provider.py`.

    fabric.json         devices (name, interface, IPv4 address) and limits, written once by `Fabric.create`
    control             one slot of 16 int64 words per device: faults and state any process may change
    lock                flock()ed around every read-modify-write of `control` and every count of QPs/MRs
    <device>/qp<N>      a queue pair's receive side: a header and a ring the peer's sends are copied into
    <device>/mr/...     one marker per registered memory region (counted against the limit)
    <device>/held/...   one marker per open device context, protection domain and completion queue
    chan/...            completion channels: FIFOs a sender writes a CQ id into when that CQ is armed

Faults, per device, settable at any time from any process (`Fabric`): `drop_next` (lose that many of
its next messages), `drop_every` (lose every k-th message of each of its QPs), `stall` (messages from
or to it are held, neither delivered nor lost nor completed, until cleared: a stalled peer or link),
`port_up` = 0 (query_port says DOWN, RTR fails with ENETDOWN, messages from or to it are lost),
`present` = 0 (the device disappears: every call on a context of it fails with ENODEV, poll_cq returns
-ENODEV, it is not listed; restoring it makes a new device, old contexts stay dead), `wedge_on_reconnect`
(the first RTR after any QP of the device was destroyed wedges the port: that RTR and every later one fail
with ETIMEDOUT and query_port fails with ETIMEDOUT after `hang_ms`, until `reboot`). Dropped messages are
counted in the sending device's slot (`Fabric.dropped`).

What a process holds on the fabric (`Fabric.held_by(pid)`: its queue pairs, memory regions, protection
domains, contexts, completion queues and channels) is what a Mac's kernel would hold for it; a provider
closed with objects still open frees them and counts them in the device's slot (`Fabric.left_open`), so a
binding that skips a destroy call is seen even though the fake cleans up after it.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from ...transport import verbs as v
from ...transport.shm_segment import process_alive

VERSION = 1
DEFAULT_LIMITS: dict[str, Any] = {
    "max_qp": 10,  # per device; the 11th ibv_create_qp fails with EBUSY (mlx #3162, PR #4209)
    "max_mr": 100,  # per device; then ibv_reg_mr returns NULL (mlx #3162; the errno is our choice: ENOMEM)
    "max_qp_wr": 32,  # outstanding sends/receives per QP; ~32 safe, ENOMEM beyond (hellas-ai PRs #35/#39)
    "max_sge": 4,
    "max_cqe": 4096,
    "frame_bytes": 4096,  # Thunderbolt frame
    "max_frame_shift": 7,  # receives of 4 KiB x 2^k, k <= 7 (JACCL's 512 KiB on macOS 26.3; 0 on 26.2)
    "no_receive": "drop",  # a send with no receive posted: "drop" (UC) or "stall" (TN3205's credits)
    "comp_channel": True,
    "ring_bytes": 8 << 20,  # per QP; what does not fit waits at the sender (held, not lost)
}

# control: one slot of 16 int64 words per device
W_PRESENT, W_PORT_UP, W_IPV4, W_DROP_NEXT, W_DROP_EVERY, W_STALL, W_WEDGE_ON_RECONNECT, W_WEDGED, W_HANG_MS, \
    W_QP_DESTROYED, W_NEXT_QPN, W_GENERATION, W_DROPPED, W_LEFT_OPEN = range(14)
SLOT_WORDS = 16
SLOT = struct.Struct(f"<{SLOT_WORDS}q")
FAULTS = {"present": W_PRESENT, "port_up": W_PORT_UP, "drop_next": W_DROP_NEXT, "drop_every": W_DROP_EVERY,
          "stall": W_STALL, "wedge_on_reconnect": W_WEDGE_ON_RECONNECT, "hang_ms": W_HANG_MS}

# a QP file: header of 16 u64 words, then the ring
H_MAGIC, H_PID, H_STATE, H_REMOTE_QPN, H_GID0, H_GID1, H_RQ_PSN, H_POSTED, H_CLAIMED, H_HEAD, H_TAIL, \
    H_ARMED, H_CHANNEL, H_CQ, H_RING_BYTES, H_DEVICE = range(16)
HEADER_BYTES = 128
QP_MAGIC = 0x54424651_50303031  # "TBFQP001"
DESTROYED = 99  # a QP state word past the verbs ones: the owner destroyed it
RECORD = struct.Struct("<QII")  # length, source QP number, flags
RECORD_BYTES = RECORD.size
WRAP = 1  # flags: the rest of the ring is unused, the next record is at its start


# What `Fabric.held_by` counts; markers in <device>/held/ are named <what>.<pid>.<key> for the last three.
HELD = ("qps", "mrs", "pds", "contexts", "cqs", "channels")


def _owner(name: str) -> int | None:
    """The pid a marker's name starts with (<pid>.<...>)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def pad8(n: int) -> int:
    return (n + 7) & ~7


def link_local_gid(index: int) -> bytes:
    """GID index 0 of device `index`: a link-local address (fe80::/64), as a port always has one."""
    return ipaddress.IPv6Address(f"fe80::ff:fe00:{index + 1:x}").packed


def _ipv4_int(address: str | None) -> int:
    return int(ipaddress.IPv4Address(address)) if address else 0


@dataclass(frozen=True)
class FabricDevice:
    name: str  # rdma_<ifname>
    ifname: str
    ipv4: str | None  # the interface's address at creation (changeable: Fabric.set_ipv4)


class Fabric:
    """A fabric directory: its description, and its control words (faults) for any process to change."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            spec = json.loads((self.path / "fabric.json").read_text())
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"{self.path} is not a fake verbs fabric ({exc})") from exc
        if spec.get("version") != VERSION:
            raise ValueError(f"{self.path}: fabric version {spec.get('version')}, expected {VERSION}")
        self.devices = [FabricDevice(d["name"], d["ifname"], d.get("ipv4")) for d in spec["devices"]]
        self.limits = {**DEFAULT_LIMITS, **spec.get("limits", {})}
        self._index = {d.name: i for i, d in enumerate(self.devices)}
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR)
        fd = os.open(self.path / "control", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, len(self.devices) * SLOT.size)
        finally:
            os.close(fd)
        self.words = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, path: str | os.PathLike[str], devices: Mapping[str, str | None] | None = None,
               **limits: Any) -> "Fabric":
        """A new fabric in the existing empty-or-new directory `path`. `devices`: name -> IPv4 address (or
        None: the interface has none yet); default two devices, rdma_fake0 (10.201.0.1) and rdma_fake1
        (10.201.0.2). `limits` override DEFAULT_LIMITS."""
        unknown = set(limits) - set(DEFAULT_LIMITS)
        if unknown:
            raise ValueError(f"unknown fabric limits {sorted(unknown)}; known: {sorted(DEFAULT_LIMITS)}")
        if limits.get("no_receive", "drop") not in ("drop", "stall"):
            raise ValueError("no_receive: 'drop' or 'stall'")
        devices = {"rdma_fake0": "10.201.0.1", "rdma_fake1": "10.201.0.2"} if devices is None else devices
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, ipv4 in devices.items():
            if ipv4 is not None:
                ipaddress.IPv4Address(ipv4)
            ifname = name.removeprefix("rdma_")
            entries.append({"name": name, "ifname": ifname, "ipv4": ipv4})
            (root / name / "mr").mkdir(parents=True, exist_ok=True)
            (root / name / "held").mkdir(exist_ok=True)
        (root / "chan").mkdir(exist_ok=True)
        (root / "lock").touch()
        control = bytearray(len(entries) * SLOT.size)
        for i, d in enumerate(entries):
            words = [0] * SLOT_WORDS
            words[W_PRESENT], words[W_PORT_UP], words[W_IPV4] = 1, 1, _ipv4_int(d["ipv4"])
            words[W_NEXT_QPN] = 0x100
            SLOT.pack_into(control, i * SLOT.size, *words)
        (root / "control").write_bytes(bytes(control))
        tmp = root / "fabric.json.tmp"
        tmp.write_text(json.dumps({"version": VERSION, "devices": entries, "limits": limits}, indent=1))
        tmp.rename(root / "fabric.json")  # last: a fabric.json means a complete fabric
        return cls(root)

    def close(self) -> None:
        if self._lock_fd >= 0:
            self.words.release()
            self._map.close()
            os.close(self._lock_fd)
            self._lock_fd = -1

    # words --------------------------------------------------------------------------------------------

    def index(self, device: str) -> int:
        try:
            return self._index[device]
        except KeyError:
            raise KeyError(f"no device {device} in fabric {self.path} "
                           f"(has {', '.join(self._index)})") from None

    def word(self, device: int, word: int) -> int:
        return self.words[device * SLOT_WORDS + word]

    def set_word(self, device: int, word: int, value: int) -> None:
        self.words[device * SLOT_WORDS + word] = value

    def slot(self, device: int) -> tuple[int, ...]:
        return SLOT.unpack_from(self._map, device * SLOT.size)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The fabric's lock (flock: between processes; a process's threads hold the provider's lock)."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # faults (any process, any time) ---------------------------------------------------------------------

    def set_fault(self, device: str, fault: str, value: int) -> None:
        """Set one of FAULTS on `device`. `present` 0 -> 1 makes a new device (old contexts stay dead)."""
        i = self.index(device)
        word = FAULTS[fault]
        with self.locked():
            if word == W_PRESENT and value and not self.word(i, W_PRESENT):
                self.set_word(i, W_GENERATION, self.word(i, W_GENERATION) + 1)
            self.set_word(i, word, int(value))
            if word == W_PRESENT and not value:
                self.set_word(i, W_GENERATION, self.word(i, W_GENERATION) + 1)

    def set_ipv4(self, device: str, address: str | None) -> None:
        """Give the device's interface an IPv4 address (GID index 1 appears) or take it away (None)."""
        self.set_word(self.index(device), W_IPV4, _ipv4_int(address))

    def reboot(self, device: str) -> None:
        """What only a reboot cures on a Mac: a wedged port (and the memory of destroyed QPs)."""
        i = self.index(device)
        with self.locked():
            for w in (W_WEDGED, W_QP_DESTROYED, W_WEDGE_ON_RECONNECT):
                self.set_word(i, w, 0)

    def dropped(self, device: str) -> int:
        """Messages from `device` the fabric lost so far (faults, no receive, peer not ready or gone)."""
        return self.word(self.index(device), W_DROPPED)

    def left_open(self, device: str) -> int:
        """Objects of `device` that providers freed when they closed because the binding had not (a queue
        pair, region, CQ, channel, PD or context never destroyed): on a Mac those stay until the process exits."""
        return self.word(self.index(device), W_LEFT_OPEN)

    def held_by(self, pid: int) -> dict[str, int]:
        """What process `pid` holds on the fabric now, over every device: its queue pairs, memory regions,
        protection domains, device contexts, completion queues and completion channels."""
        held = dict.fromkeys(HELD, 0)
        for i, d in enumerate(self.devices):
            for p in (self.path / d.name).glob("qp*"):
                try:
                    with open(p, "rb") as fh:
                        magic, owner = struct.unpack("<QQ", fh.read(16))
                except (OSError, struct.error):
                    continue
                if magic == QP_MAGIC and owner == pid:
                    held["qps"] += 1
            held["mrs"] += sum(1 for p in (self.path / d.name / "mr").iterdir() if _owner(p.name) == pid)
            held_dir = self.path / d.name / "held"
            for p in held_dir.iterdir() if held_dir.is_dir() else ():
                what, _, rest = p.name.partition(".")
                if _owner(rest) == pid and what in held:
                    held[what] += 1
        held["channels"] = sum(1 for p in (self.path / "chan").iterdir() if _owner(p.name) == pid)
        return held

    def held_marker(self, device: int, what: str, pid: int, key: str) -> Path:
        """The marker of one held object (`what`: one of HELD besides qps, mrs and channels)."""
        return self.path / self.devices[device].name / "held" / f"{what}.{pid}.{key}"

    def gid(self, device: int, index: int) -> bytes:
        if index == 0:
            return link_local_gid(device)
        ipv4 = self.word(device, W_IPV4)
        return v.ipv4_gid(str(ipaddress.IPv4Address(ipv4))) if index == 1 and ipv4 else bytes(16)

    def device_of_gid(self, gid: bytes) -> int | None:
        for i in range(len(self.devices)):
            if self.word(i, W_PRESENT) and gid in (self.gid(i, 0), self.gid(i, 1)):
                return i
        return None

    def qp_path(self, device: int, qpn: int) -> Path:
        return self.path / self.devices[device].name / f"qp{qpn}"

    def live_qps(self, device: int) -> list[Path]:
        """The device's QP files whose owner is alive (a dead owner's are removed: the OS frees a dead
        process's queue pairs)."""
        live = []
        for p in (self.path / self.devices[device].name).glob("qp*"):
            try:
                with open(p, "rb") as fh:
                    magic, pid = struct.unpack("<QQ", fh.read(16))
            except (OSError, struct.error):
                continue
            if magic == QP_MAGIC and process_alive(pid):
                live.append(p)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        return live

    def live_mrs(self, device: int) -> int:
        n = 0
        for p in (self.path / self.devices[device].name / "mr").iterdir():
            if process_alive(int(p.name.split(".")[0])):
                n += 1
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        return n


__all__ = ["DEFAULT_LIMITS", "FAULTS", "HELD", "Fabric", "FabricDevice", "link_local_gid"]
