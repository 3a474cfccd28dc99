"""The macOS code paths of the runtime, run on Linux with a darwin Platform (torch_thunderbolt.platform)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.platform import IOREG, RDMA_CTL, SYSCTL, Platform, current
from torch_thunderbolt.transport import shm_segment as segs
from torch_thunderbolt.rendezvous.hosts import host_identity

from torch_thunderbolt.testing.leftovers import shm_entries

DARWIN = Platform.for_system("darwin")

IOREG_OUT = """+-o J316cAP  <class IOPlatformExpertDevice, id 0x100000221, registered, matched, active, busy 0 (0 ms)>
    {{
      "IOPlatformSerialNumber" = "{serial}"
      "IOPlatformUUID" = "{uuid}"
      "model" = <"Mac14,6">
    }}
"""


def fake_mac(uuid: str, boot: str, calls: list | None = None):
    """The tools of one Mac: ioreg with its IOPlatformUUID, sysctl with its boot session."""
    def run(argv: list[str]) -> str:
        if calls is not None:
            calls.append(argv)
        if argv == [IOREG, "-rd1", "-c", "IOPlatformExpertDevice"]:
            return IOREG_OUT.format(serial="C02XYZ", uuid=uuid)
        if argv == [SYSCTL, "-n", "kern.bootsessionuuid"]:
            return boot + "\n"
        return ""
    return run


def test_two_macs_with_the_same_hostname_are_different_hosts() -> None:
    a = host_identity(DARWIN, fake_mac("5B2E6C1A-0000-4D3E-9F00-000000000001", "B00T-A"))
    b = host_identity(DARWIN, fake_mac("5B2E6C1A-0000-4D3E-9F00-000000000002", "B00T-A"))
    assert a != b  # the hostname alone (plus Linux-only /proc facts) would make them one host


def test_the_same_mac_is_the_same_host_and_a_reboot_is_not() -> None:
    calls: list = []
    uuid = "5B2E6C1A-0000-4D3E-9F00-000000000001"
    first = host_identity(DARWIN, fake_mac(uuid, "B00T-A", calls))
    assert host_identity(DARWIN, fake_mac(uuid, "B00T-A")) == first
    assert host_identity(DARWIN, fake_mac(uuid, "B00T-B")) != first
    assert uuid in first and "B00T-A" in first
    assert [IOREG, "-rd1", "-c", "IOPlatformExpertDevice"] in calls and [SYSCTL, "-n", "kern.bootsessionuuid"] in calls
    assert all(argv[0].startswith("/") for argv in calls)  # by absolute path (ssh's PATH may lack /usr/sbin)


def test_linux_host_identity_keeps_boot_id_and_network_namespace() -> None:
    linux = Platform.for_system("linux")
    ident = host_identity(linux, lambda argv: pytest.fail(f"no tools on Linux: {argv}"))
    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert fh.read().strip() in ident
    assert "net:[" in ident


def test_a_segment_is_seen_without_dev_shm_and_gone_once_unlinked() -> None:
    """macOS has no /dev/shm to list: the leftovers check and live_segments still see a live segment (from
    its marker, probed) and no longer see it once unlinked; listing /dev/shm would find nothing there."""
    assert DARWIN.shm_list_dir is None
    seg = segs.create(4096)
    try:
        assert seg.name in segs.live_segments(DARWIN)
        assert seg.name in shm_entries(DARWIN)
    finally:
        seg.unlink()
        seg.close()
    assert seg.name not in segs.live_segments(DARWIN) and seg.name not in shm_entries(DARWIN)


def test_a_marker_without_its_segment_is_not_a_live_segment(tmp_path) -> None:
    """A creator that died between writing its marker and creating the segment left no segment: the probe
    says so, where a marker listing alone would report one."""
    seg = segs.create(4096)
    name = seg.name
    segs._unlink_name(name, None)  # the segment goes, the marker stays
    try:
        assert (segs.marker_dir() / name).exists()
        assert name not in segs.live_segments(DARWIN)
    finally:
        seg.unlink()
        seg.close()


def test_the_platform_of_this_machine() -> None:
    plat = current()
    assert plat == Platform.for_system(plat.name, plat.machine)
    assert DARWIN.loopback == "lo0" and DARWIN.max_socket_io <= 2**31 - 1 and not DARWIN.has_proc
    with pytest.raises(Exception):
        DARWIN.name = "linux"  # frozen: nothing can change a Platform behind the code's back


def test_ring_head_and_tail_sit_on_separate_128_byte_cache_lines() -> None:
    """Apple silicon's cache line is 128 bytes: head (sender) and tail (receiver) 64 bytes apart shared one,
    so every publish invalidated the other side's line."""
    from torch_thunderbolt.transport import shm_ring as ring

    assert ring.TAIL_OFFSET - ring.HEAD_OFFSET >= 128 and ring.HEAD_OFFSET % 128 == 0 and ring.TAIL_OFFSET % 128 == 0
    mv = memoryview(bytearray(ring.ring_bytes(2, 64)))
    w, r = ring.RingWriter(mv, 2, 64), ring.RingReader(mv, 2, 64)
    w.put(0, 0, 0, 1, 0, 0, memoryview(b"abc"), 3)
    r.pop()
    ctl = mv[: ring.CTL_BYTES].cast("Q")
    assert ctl[ring.HEAD_OFFSET // 8] == 1 and ctl[ring.TAIL_OFFSET // 8] == 1
    assert [i for i, v in enumerate(ctl) if v] == [ring.HEAD_OFFSET // 8, ring.TAIL_OFFSET // 8]
    for x in (ctl, w.ctl, r.ctl):
        x.release()


def test_shared_memory_is_refused_where_no_full_memory_barrier_is_known() -> None:
    from torch_thunderbolt.rendezvous.kinds import KINDS, choose, refused
    from torch_thunderbolt.transport import ordering

    barrier = lambda: None  # noqa: E731 - stands in for libSystem's OSMemoryBarrier
    missing = lambda name: None  # noqa: E731 - a libSystem without it
    mac_fences = ordering.fences(DARWIN, lambda name: barrier if name == "OSMemoryBarrier" else None)
    assert mac_fences == ordering.Fences(barrier, barrier, barrier)  # all three are the dmb (arm64 reorders all)
    x86 = ordering.fences(Platform.for_system("linux", "x86_64"))
    # x86 is TSO: acquire and release cost nothing, only the sleep handshake's store-then-load needs a fence
    assert x86.acquire is x86.release is ordering.nothing and x86.full is not ordering.nothing
    assert ordering.shm_refusal(DARWIN, lambda name: barrier) is None
    assert "OSMemoryBarrier" in ordering.shm_refusal(DARWIN, missing)  # a lock is no full barrier on arm64
    assert "riscv64" in ordering.shm_refusal(Platform.for_system("linux", "riscv64"))
    assert ordering.shm_refusal(Platform.for_system("linux", "x86_64")) is None
    # Such a rank offers no shared memory: the table gives its pairs TCP, and it says why (group.connect logs it).
    ok, mac = {"shm": None, "tcp": None}, {"shm": ordering.shm_refusal(DARWIN, missing), "tcp": None}
    for setting in ("shm", "auto"):
        kinds = choose(KINDS, setting, ["h"] * 3, [ok, ok, mac])
        assert kinds[2] == ["tcp", "tcp", ""] and kinds[0][1] == "shm"
        # (no rank offers rdma here either; its refusal is logged quietly and is not what this test is about)
        shm = [(row.name, peers, why) for row, peers, why in refused(KINDS, 2, ["h"] * 3, [ok, ok, mac], kinds)
               if row.name == "shm"]
        assert len(shm) == 1 and shm[0][1] == [0, 1] and "OSMemoryBarrier" in shm[0][2]


def _doctor_facts(**kw):
    from torch_thunderbolt.doctor import Facts

    base = dict(system="Darwin", python="3.12", torch="2.13.0", backend_registered=True, env={},
                interfaces={"lo0": ["127.0.0.1"], "en2": ["10.77.0.1"]}, thunderbolt_ifnames=["en2"],
                mtus={"en2": 9000}, max_socket_buffer=8 << 20)
    base.update(kw)
    return Facts(**base)


def test_doctor_names_the_local_network_setting_when_macos_refuses_a_peer() -> None:
    import errno

    from torch_thunderbolt.doctor import FAIL, OK, WARN, run_checks
    from torch_thunderbolt.platform import LOCAL_NETWORK_SETTING

    def finding(**kw):
        return {f.check: f for f in run_checks(_doctor_facts(**kw))}.get("Local Network permission")

    denied = finding(local_network_privacy=True, local_network_probes={"10.77.0.2:29500": errno.EHOSTUNREACH})
    assert denied.status == FAIL and LOCAL_NETWORK_SETTING in denied.fix and "10.77.0.2:29500" in denied.detail
    assert finding(local_network_privacy=True, local_network_probes={"10.77.0.2:29500": 0}).status == OK
    unchecked = finding(local_network_privacy=True)
    assert unchecked.status == WARN and "MASTER_ADDR" in unchecked.fix and LOCAL_NETWORK_SETTING in unchecked.fix
    assert finding(local_network_privacy=False) is None  # Linux: nothing to check


def test_doctor_probes_master_addr_and_counts_a_refusal_as_reached() -> None:
    import socket

    from torch_thunderbolt.doctor import probe_addresses, probe_connect

    assert probe_addresses({"MASTER_ADDR": "10.77.0.2", "MASTER_PORT": "29500"}) == [("10.77.0.2", 29500)]
    assert probe_addresses({"MASTER_ADDR": "127.0.0.1"}) == [] and probe_addresses({}) == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert probe_connect(("127.0.0.1", free)) == 0  # refused by the host: the permission is not the problem


def test_doctor_reports_the_socket_buffer_a_stream_really_gets() -> None:
    from torch_thunderbolt.doctor import OK, WARN, run_checks

    env = {"THUNDERBOLT_SOCKET_BUFFER": str(16 << 20)}
    found = {f.check: f for f in run_checks(_doctor_facts(env=env, effective_socket_buffer=4 << 20))}
    assert found["socket buffers"].status == WARN and str(4 << 20) in found["socket buffers"].detail
    found = {f.check: f for f in run_checks(_doctor_facts(env=env, effective_socket_buffer=16 << 20,
                                                          max_socket_buffer=0))}
    assert found["socket buffers"].status == OK and str(16 << 20) in found["socket buffers"].detail


def test_doctor_gathers_the_darwin_facts_without_proc(monkeypatch) -> None:
    """In darwin mode: /proc is not read (a Mac has none), kern.ipc.maxsockbuf comes from sysctl by path,
    the effective socket buffer is measured and the Local Network probe runs."""
    from torch_thunderbolt import doctor

    calls: list = []

    class Res:
        stdout = "8388608\n"
        stderr = ""
        returncode = 0

    class Probe(Res):  # the verbs probe's child process: no provider on this Mac
        stdout = '{"provider": null, "error": "no RDMA device", "devices": []}\n'

    def run(argv, timeout=None):
        calls.append(argv)
        return Probe() if "rdma_probe" in " ".join(argv) else Res()

    monkeypatch.setattr(doctor, "_read_first", lambda path: pytest.fail(f"read {path} on a Mac"))
    monkeypatch.setattr(doctor, "probe_connect", lambda target: 65)
    monkeypatch.setenv("MASTER_ADDR", "10.77.0.2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    f = doctor.gather_facts(run, DARWIN)
    assert f.max_socket_buffer == 8388608 and [SYSCTL, "-n", "kern.ipc.maxsockbuf"] in calls
    assert f.effective_socket_buffer > 0 and f.local_network_probes == {"10.77.0.2:9": 65}
    assert f.rdma is not None and f.rdma.error == "no RDMA device" and [RDMA_CTL, "status"] in calls


def test_the_runtime_asks_the_platform_not_sys_platform() -> None:
    """OS checks live in torch_thunderbolt/platform.py; the runtime layers take a Platform instead, so the
    macOS paths stay testable on Linux. (The tools — topo, lab, launch, bench — have their own checks.)"""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "torch_thunderbolt"
    pattern = re.compile(r"sys\.platform|platform\.system\(\)|platform\.machine\(\)")
    found = [f"{p.relative_to(root)}:{i}" for sub in ("transport", "backend", "algorithms", "protocol", "compression")
             for p in sorted((root / sub).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    found += [f"doctor.py:{i}" for i, line in enumerate((root / "doctor.py").read_text().splitlines(), 1)
              if "platform.system() !=" in line or "sys.platform" in line]
    assert not found, "use torch_thunderbolt.platform.current() / a Platform argument:\n" + "\n".join(found)


@pytest.mark.parametrize("system, names_dev_shm", [("darwin", False), ("linux", True)])
def test_the_shm_dir_hint_names_only_directories_the_system_has(system: str, names_dev_shm: bool) -> None:
    from torch_thunderbolt import config
    from torch_thunderbolt.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        config._shm_dir("/proc", "THUNDERBOLT_SHM_DIR", Platform.for_system(system))  # nothing can be created there
    text = str(info.value)
    assert "THUNDERBOLT_SHM_DIR=/proc" in text and "/tmp" in text
    assert ("/dev/shm" in text) == names_dev_shm, text
