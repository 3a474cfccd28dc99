"""The rdma kind's set-up as pure functions: which pairs the table gives RDMA (a common cable), how loudly a
rank says it has none, which device each rank takes, and the lane sizes both ends agree on; and that every
wait on a peer during the set-up ends at once when that peer gave up."""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests.core.test_link_kinds import _connect, _row
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, RdmaError
from torch_thunderbolt.platform import Platform
from torch_thunderbolt.rendezvous import rdma
from torch_thunderbolt.rendezvous.kinds import KINDS, choose
from torch_thunderbolt.rendezvous.records import Records
from torch_thunderbolt.transport.rdma import frame_limit, lane_sizes

RDMA = next(row for row in KINDS if row.name == "rdma")


def test_auto_gives_rdma_only_to_pairs_on_a_common_cable() -> None:
    """Three Macs in a chain a-b-c: a-b and b-c have RDMA cables, a-c do not (TCP through the switch)."""
    hosts = ["a", "b", "c"]
    offers = [{"shm": None, "rdma": None, "tcp": None}] * 3
    reach = [{"rdma": ["10.77.0.0/30"]}, {"rdma": ["10.77.0.0/30", "10.77.0.4/30"]}, {"rdma": ["10.77.0.4/30"]}]
    kinds = choose(KINDS, "auto", hosts, offers, reach)
    assert kinds[0][1] == kinds[1][2] == "rdma" and kinds[0][2] == "tcp"
    with pytest.raises(ConfigError, match="rank 0 and rank 2: rdma: no Thunderbolt cable with RDMA"):
        choose(KINDS, "rdma", hosts, offers, reach)
    same_host = choose(KINDS, "auto", ["a", "a"], offers[:2], reach[:2])
    assert same_host[0][1] == "shm"  # RDMA is for other hosts: shared memory wins within one


@pytest.mark.parametrize("quiet, level", [(True, logging.INFO), (False, logging.WARNING)])
def test_a_rank_without_rdma_says_why_in_one_line(quiet: bool, level: int, caplog) -> None:
    far = _row("far", False, True, refuse={1})
    far = replace(far, quiet=lambda why: quiet)
    caplog.set_level(logging.INFO, logger="torch_thunderbolt")
    run = _connect(2, [far, _row("tcp", False, True)], lambda r: "ab"[r])
    assert not run.errors
    said = [r for r in caplog.records if "not using" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level and "rank 1" in said[0].getMessage()


def test_no_rdma_here_is_quick_and_quiet() -> None:
    why = rdma.offer(Config())  # this Linux machine: no /sys/class/infiniband
    assert why is not None and rdma.no_rdma_here(why)
    assert RDMA.quiet is rdma.no_rdma_here and not rdma.no_rdma_here("port 1 of rdma_en2 is DOWN: plug ...")
    linux = Platform.for_system("linux")
    if linux.rdma_sysfs and not __import__("os").path.isdir(linux.rdma_sysfs):
        assert "infiniband" in why


def _rec(*devices: tuple[str, str, int], max_qp: int = 10) -> dict:
    return {"devices": [{"name": n, "ipv4": "10.0.0.1", "net": net, "limit": limit, "max_qp": max_qp}
                        for n, net, limit in devices]}


def test_each_rank_takes_its_own_device_of_a_fake_fabric_and_a_cable_on_a_mac() -> None:
    fake = [("rdma_fake0", "fake", 512 << 10), ("rdma_fake1", "fake", 512 << 10), ("rdma_fake2", "fake", 512 << 10)]
    records = {r: _rec(*fake) for r in range(3)}
    for r in range(3):
        choices = rdma.choose_devices(r, [p for p in range(3) if p != r], records, [0, 1, 2])
        assert {c.device for c in choices.values()} == {f"rdma_fake{r}"}  # by place on the host
        assert all(c.msg_size == 8192 and c.bulk_size == 65536 for c in choices.values())
        assert all(c.others[0] == f"rdma_fake{(r + 1) % 3}" for c in choices.values())  # when it is full
    world4 = {r: _rec(*fake) for r in range(4)}
    assert {c.bulk_size for c in rdma.choose_devices(0, [1, 2, 3], world4, [0, 1, 2, 3]).values()} == {0}
    # Macs: one device per cable; a pair takes the cable both are on; macOS 26.2's 4 KiB receives win.
    macs = {0: _rec(("rdma_en2", "10.77.0.0/30", 512 << 10), ("rdma_en3", "10.77.0.4/30", 512 << 10)),
            1: _rec(("rdma_en5", "10.77.0.4/30", 4096))}
    [(peer, choice)] = rdma.choose_devices(0, [1], macs, [0]).items()
    assert choice.device == "rdma_en3" and (choice.msg_size, choice.bulk_size) == (4096, 0)
    with pytest.raises(ConfigError, match="no RDMA path to rank 1"):
        rdma.choose_devices(0, [1], {0: macs[0], 1: _rec(("rdma_en2", "10.88.0.0/30", 4096))}, [0])


def test_frame_limits_follow_macos_and_the_port() -> None:
    darwin, linux = Platform.for_system("darwin"), Platform.for_system("linux")
    assert frame_limit(1 << 30, darwin, (26, 2)) == 4096 and frame_limit(1 << 30, darwin, (26, 3)) == 512 << 10
    assert frame_limit(65536, darwin, (26, 3)) == 65536 and frame_limit(0, linux) == 512 << 10
    assert frame_limit(100000, linux) == 65536  # a power of two at most what the port says
    assert lane_sizes(4096, 512 << 10) == (4096, 0) and lane_sizes(32768, 65536) == (8192, 32768)


def test_every_wait_on_a_peer_ends_at_once_when_it_gave_up_rdma_or_the_set_up() -> None:
    """Rank 1 gave up RDMA (its device failed), rank 2 the whole set-up: rank 0 waiting for either of them for
    a control connection, a hello or a barrier raises their reason at once, not at its deadline."""
    store = dist.HashStore()
    Records(store, 1, b"", 0.0).give_up("rdma", RdmaError("ibv_create_qp on rdma_fake1 failed", device="rdma_fake1"))
    Records(store, 2, b"", 0.0).announce(ConfigError("rank 2: something of its own"))
    mine = Records(store, 0, b"", time.monotonic() + 60)
    deadline = time.monotonic() + 60
    started = time.monotonic()
    gave_up = "rank 0: rank 1 gave up setting up rdma links: ibv_create_qp on rdma_fake1 failed"
    acceptor = SimpleNamespace(done=threading.Event(), fatal=None, conns={})  # nobody connects
    with pytest.raises(RdmaError, match=gave_up) as info:
        rdma._await_control(mine, acceptor, 0, {1}, deadline)  # type: ignore[arg-type]
    assert info.value.device == "rdma_fake1" and info.value.rank == 1
    with pytest.raises(ConfigError, match="rank 2 gave up during set-up: ConfigError: rank 2: something"):
        rdma._await_control(mine, acceptor, 0, {2}, deadline)  # type: ignore[arg-type]
    silent = SimpleNamespace(take_hello=lambda: False, device=SimpleNamespace(name="rdma_fake0"))
    with pytest.raises(RdmaError, match=gave_up):
        rdma._await_hellos(0, {1: silent}, deadline, mine)  # type: ignore[dict-item]
    for closed_before in (True, False):  # the peer's control connection closed before our send, or after it
        ours, theirs = socket.socketpair()
        if closed_before:
            theirs.close()
        else:
            threading.Timer(0.2, theirs.close).start()
        try:
            with pytest.raises(RdmaError, match=gave_up):
                rdma._barrier(mine, {1: ours}, rdma.READY, 0, deadline)
        finally:
            ours.close()
            theirs.close()
    assert time.monotonic() - started < 30  # (every deadline was 60 s away)
