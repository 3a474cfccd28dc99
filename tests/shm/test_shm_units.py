"""Single-process pieces of the shm transport: ring layout, options, segments and the stale-segment janitor."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.transport import shm_ring as ring
from torch_thunderbolt.transport import shm_segment as segs
from torch_thunderbolt.protocol import control
from torch_thunderbolt.transport.shm import BELL, ShmLink
from torch_thunderbolt.rendezvous.hosts import host_identity
from torch_thunderbolt.rendezvous.shm import ShmOptions

from torch_thunderbolt.testing.ranks import REPO


def test_ring_roundtrip_wraps_and_reports_full() -> None:
    slots, slot = 3, 4096
    mv = memoryview(bytearray(ring.ring_bytes(slots, slot)))
    w, rd = ring.RingWriter(mv, slots, slot), ring.RingReader(mv, slots, slot)
    for i in range(10):  # several laps around the ring
        assert not rd.pending()
        while w.free() > 0 and w.head < (i + 1) * 2:
            k = w.head
            w.put(1, 1, 0xABCDEF01, 7, k, k * 10, memoryview(bytes([k % 256]) * (k % 5)), 999)
        assert w.free() == slots - 2 or w.head == (i + 1) * 2
        for _ in range(2):
            space, kind, sig, tag, seq, off, n, total = rd.peek()
            assert (space, kind, sig, tag, off, n, total) == (1, 1, 0xABCDEF01, 7, seq * 10, seq % 5, 999)
            assert bytes(rd.payload(n)) == bytes([seq % 256]) * n
            rd.pop()
    w.put(0, 1, 0, 0, 0, 0, memoryview(b""), 0)
    w.put(0, 1, 0, 0, 0, 0, memoryview(b""), 0)
    w.put(0, 1, 0, 0, 0, 0, memoryview(b""), 0)
    assert w.free() == 0  # full until the reader pops
    rd.pop()
    assert w.free() == 1


def test_layout_offsets_do_not_overlap() -> None:
    world, slots, slot = 5, 2, 8192
    size = ring.segment_bytes(world, slots, slot)
    for owner in range(world):
        spans = sorted((ring.ring_offset(owner, s, slots, slot), ring.ring_bytes(slots, slot))
                       for s in range(world) if s != owner)
        assert spans[0][0] >= ring.HEADER_BYTES
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b
        assert spans[-1][0] + spans[-1][1] <= size


@pytest.mark.parametrize("env", [{"THUNDERBOLT_SHM_SLOT": "1000"}, {"THUNDERBOLT_SHM_SLOTS": "1"},
                                 {"THUNDERBOLT_SHM_SLOT": "lots"},
                                 {"THUNDERBOLT_SHM_WINDOW": "1000"}, {"THUNDERBOLT_SHM_WINDOW": "2G"}])
def test_bad_options_raise_config_error_naming_the_variable(env) -> None:
    with pytest.raises(ConfigError, match=next(iter(env))):
        ShmOptions.from_env(env)


def test_options_parse() -> None:
    o = ShmOptions.from_env({"THUNDERBOLT_SHM_SLOT": "256K", "THUNDERBOLT_SHM_SLOTS": "8"})
    assert (o.slot_bytes, o.slots, o.spin_us) == (256 << 10, 8, None)  # the spin is no setting: automatic
    assert ShmOptions.from_env({}) == ShmOptions()
    assert ShmOptions.from_env({"THUNDERBOLT_SHM_WINDOW": "0"}).window_bytes == 0
    assert ShmOptions.from_env({"THUNDERBOLT_SHM_WINDOW": "4M"}).window_bytes == 4 << 20


def test_options_come_from_the_config() -> None:
    """The shm settings are Config fields (one parser, also the doctor's); the transport reads its Config."""
    cfg = dataclasses.replace(Config.from_env({"THUNDERBOLT_SHM_SLOT": "64K", "THUNDERBOLT_SHM_SLOTS": "3",
                                               "THUNDERBOLT_SHM_WINDOW": "8K"}), shm_spin_us=7)
    assert ShmOptions.from_config(cfg) == ShmOptions(slot_bytes=64 << 10, slots=3, spin_us=7, window_bytes=8 << 10)
    assert ShmOptions.from_config(Config()) == ShmOptions()  # same defaults, automatic ones still None


def test_segments_go_to_the_configured_dir_which_is_never_created(tmp_path) -> None:
    seg = segs.create(1 << 16, str(tmp_path))
    try:
        assert seg.path is not None and seg.path.parent == tmp_path and seg.path.exists()
    finally:
        seg.unlink()
        seg.close()
    assert not seg.path.exists()
    with pytest.raises(FileNotFoundError):  # Config rejects a missing THUNDERBOLT_SHM_DIR before this
        segs.create(1 << 16, str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


def test_default_window_is_bigger_when_ranks_outnumber_cores(monkeypatch) -> None:
    from torch_thunderbolt.rendezvous import shm as shm_connect
    monkeypatch.setattr(shm_connect.os, "cpu_count", lambda: 2)
    assert shm_connect.default_window_bytes(2) == 1 << 20
    assert shm_connect.default_window_bytes(4) == 4 << 20


def test_segment_names_fit_macos_and_carry_the_pid() -> None:
    name = segs.new_name()
    assert len("/" + name) <= 31
    assert segs.creator_pid(name) == os.getpid()
    assert segs.creator_pid("psm_1234") is None


def test_segment_create_attach_unlink() -> None:
    seg = segs.create(1 << 16)
    try:
        assert seg.name in segs.live_segments()
        peer = segs.attach(seg.name, 1 << 16, str(seg.path) if seg.path else None)
        seg.mm[0:4] = b"abcd"
        assert peer.mm[0:4] == b"abcd"
        seg.unlink()
        assert seg.name not in segs.live_segments()
        assert peer.mm[0:4] == b"abcd"  # mappings outlive the name
        peer.close()
    finally:
        seg.unlink()
        seg.close()
    assert segs.cleanup_stale_segments() == [] or seg.name not in segs.live_segments()


@pytest.mark.timeout(60)
def test_janitor_removes_segments_of_dead_creators_only(tmp_path) -> None:
    """A process that dies (kill -9) between creating its segment and unlinking it leaves it behind;
    `cleanup_stale_segments` removes it, and leaves a live process's segment alone."""
    code = ("import sys, time; from torch_thunderbolt.transport import shm_segment as s; "
            "seg = s.create(1 << 16); print(seg.name, flush=True); time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    try:
        names = [p.stdout.readline().strip() for p in procs]
        assert all(n in segs.live_segments() for n in names)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        segs.cleanup_stale_segments()
        # Not `in removed`: another job's janitor on this host (every connect_shm runs one) may be first.
        assert names[0] not in segs.live_segments()
        assert names[1] in segs.live_segments()  # its creator is alive
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(segs.creator_pid(n) == procs[1].pid for n in segs.live_segments()):
            segs.cleanup_stale_segments()
            time.sleep(0.05)
    assert not [n for n in segs.live_segments() if segs.creator_pid(n) in (procs[0].pid, procs[1].pid)]


def test_host_identity_is_stable() -> None:
    assert host_identity() == host_identity()
    assert host_identity().split("|")[0]


class _Sink:
    """The least of a sink (transport/base.py) that a shm link's control wire needs, to pump it by hand."""

    def __init__(self) -> None:
        self.rank, self.broken, self.posts, self.error = 0, None, 0, None
        self.heard: list = []

    def failed(self, peer, exc, where="", address="") -> None:
        self.error = exc

    def said(self, peer, msg) -> None:
        self.heard.append(msg)


def _link(sock: socket.socket) -> tuple[ShmLink, _Sink]:
    kind = SimpleNamespace(slot_bytes=0, to_ring=set())
    link = ShmLink(kind, 1, sock, 1, None, None, SimpleNamespace(pending=lambda: False), None)
    link.sink = _Sink()
    return link, link.sink


def test_a_reset_after_bye_is_an_orderly_close_not_a_lost_peer() -> None:
    # Linux reports ECONNRESET (after the data) when a Unix socket is closed with unread bytes in it: a peer
    # that said BYE and closed with our doorbells unread must not count as lost.
    ours, theirs = socket.socketpair()
    with ours:
        ours.send(BELL * 2)
        theirs.send(BELL + control.encode(control.Bye()) + BELL)
        theirs.shutdown(socket.SHUT_RDWR)
        theirs.close()
        ours.setblocking(False)
        pe, wire = _link(ours)
        pe.pump(woken=True)
        assert pe.bye and pe.eof and wire.error is None


def test_a_reset_without_bye_is_a_lost_peer() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        ours.send(BELL)
        theirs.close()
        ours.setblocking(False)
        pe, wire = _link(ours)
        pe.pump(woken=True)
        assert wire.error is not None
