"""The fake verbs fabric keeps Apple's rules and injects faults, driven through the real binding.

Two providers in one process stand for the two Macs (the fabric is files; tests across processes are in
test_fake_verbs_processes.py). Each rule's breach gives the behaviour documented in testing/fake_verbs/provider.py.
"""
from __future__ import annotations

import errno
import select
from typing import Iterator

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, RdmaError
from torch_thunderbolt.testing.fake_verbs import Fabric, fabric_env, fake_fabric
from torch_thunderbolt.transport import verbs as v
from torch_thunderbolt.transport.providers import load_verbs, verbs_from_config

from .fabric_ends import End, make_end, pair, raw_send

OK, RECV = v.IBV_WC_SUCCESS, v.IBV_WC_RECV


@pytest.fixture
def fabric(tmp_path) -> Iterator[Fabric]:
    with fake_fabric(tmp_path / "fabric") as fab:
        yield fab


@pytest.fixture
def ends(fabric: Fabric) -> Iterator[tuple[End, End]]:
    a, b = pair(str(fabric.path))
    yield a, b
    failures = a.verbs.provider.failures + b.verbs.provider.failures  # type: ignore[attr-defined]
    a.close()
    b.close()
    assert not failures  # no exception inside a callback (a bug of the fake)


# --- selection ----------------------------------------------------------------------------------------

def test_thunderbolt_verbs_selects_the_fake_fabric(fabric: Fabric, tmp_path) -> None:
    cfg = Config.from_env(fabric_env(fabric))
    assert (cfg.verbs, cfg.verbs_fabric) == ("fake", str(fabric.path))
    verbs = verbs_from_config(cfg)
    assert verbs.devices() == ["rdma_fake0", "rdma_fake1"]
    verbs.close()
    assert (Config.from_env({}).verbs, Config.from_env({"THUNDERBOLT_VERBS": "system"}).verbs) == ("system",) * 2
    with pytest.raises(ConfigError, match="THUNDERBOLT_VERBS=fake:.*no fake verbs fabric.*fake_verbs create"):
        Config.from_env({"THUNDERBOLT_VERBS": f"fake:{tmp_path / 'nothing'}"})
    with pytest.raises(ConfigError, match="THUNDERBOLT_VERBS: expected 'system' or 'fake:"):
        Config.from_env({"THUNDERBOLT_VERBS": "soft-roce"})


# --- end to end ---------------------------------------------------------------------------------------

def test_send_and_receive_with_scatter_gather(ends: tuple[End, End]) -> None:
    a, b = ends
    a.buffer[0:3000] = bytes(range(256)) * 11 + bytes(184)
    a.buffer[10000:10500] = b"x" * 500
    # a receive of one 4 KiB frame in two pieces; a send gathered from two places (3500 bytes: one frame)
    b.qp.post_recv_sges(7, [(b.addr(0), 1000, b.mr.lkey), (b.addr(50000), 3096, b.mr.lkey)])
    a.qp.post_send_sges(8, [(a.addr(0), 3000, a.mr.lkey), (a.addr(10000), 500, a.mr.lkey)])
    assert a.wait() == [(8, OK, v.IBV_WC_SEND, 3500, a.qp.qp_num)]
    assert b.wait() == [(7, OK, RECV, 3500, b.qp.qp_num)]
    sent = bytes(a.buffer[0:3000]) + b"x" * 500
    assert bytes(b.buffer[0:1000]) + bytes(b.buffer[50000:52500]) == sent
    # both ways, many messages in order, unsignaled sends completed by a later signaled one
    for i in range(16):  # the queue pairs' depth
        a.recv(100 + i, 4096 * i, 4096)
    for i in range(16):
        b.buffer[i] = i
        b.send(200 + i, i, 1 + i, signaled=(i % 4 == 3))
    assert [c[0] for c in b.wait(4)] == [203, 207, 211, 215]
    got = a.wait(16)
    assert [(c[0], c[3]) for c in got] == [(100 + i, 1 + i) for i in range(16)]
    assert all(a.buffer[4096 * i] == i for i in range(16))


def test_device_port_and_gids(fabric: Fabric) -> None:
    end = make_end("fake", str(fabric.path), "rdma_fake1")
    try:
        port = end.device.query_port()
        assert (port.active, port.active_mtu, port.max_mtu, port.gid_tbl_len) == (True, v.IBV_MTU_1024,
                                                                                    v.IBV_MTU_1024, 2)
        gids = end.device.gids()
        assert v.gid_text(gids[0]).startswith("fe80::") and v.gid_ipv4(gids[1]) == "10.201.0.2"
        assert end.device.ipv4_gid_index(address="10.201.0.2") == (1, v.ipv4_gid("10.201.0.2"))
        assert end.device.query_device().phys_port_cnt == 1
        with pytest.raises(RdmaError, match="ibv_query_port on rdma_fake1 failed: Invalid argument"):
            end.device.query_port(2)
    finally:
        end.close()


def test_the_ipv4_mapped_gid_exists_only_while_the_interface_has_an_address(fabric: Fabric) -> None:
    fabric.set_ipv4("rdma_fake0", None)
    verbs = load_verbs("fake", str(fabric.path))
    dev = verbs.open("rdma_fake0")
    try:
        assert dev.query_gid(1) == bytes(16) and dev.ipv4_gid_index() is None
        pd = dev.alloc_pd()
        cq = dev.create_cq(8)
        qp = pd.create_qp(cq, cq, 4, 4)
        qp.to_init()
        with pytest.raises(RdmaError, match="ibv_modify_qp on rdma_fake0 failed: Invalid argument.*to RTR") as exc:
            qp.to_rtr(0x100, v.ipv4_gid("10.201.0.2"), 0, sgid_index=1)
        assert "IPv4-mapped GID" in str(exc.value)
        fabric.set_ipv4("rdma_fake0", "169.254.7.7")
        assert dev.ipv4_gid_index() == (1, v.ipv4_gid("169.254.7.7"))
        qp.to_rtr(0x100, v.ipv4_gid("10.201.0.2"), 0, sgid_index=1)
        qp.close()
        qp = pd.create_qp(cq, cq, 4, 4)
        qp.to_init()
        with pytest.raises(RdmaError) as exc:  # the link-local GID (index 0) does not route
            qp.to_rtr(0x100, v.ipv4_gid("10.201.0.2"), 0, sgid_index=0)
        assert exc.value.errno == errno.EINVAL
    finally:
        dev.close()
        verbs.close()


# --- Apple's rules ------------------------------------------------------------------------------------

def test_only_uc_queue_pairs(ends: tuple[End, End]) -> None:
    a, _ = ends
    with pytest.raises(RdmaError, match="ibv_create_qp on rdma_fake0 failed.*RC queue pair.*only unreliable-connected"):
        a.pd.create_qp(a.cq, a.cq, 4, 4, qp_type=v.IBV_QPT_RC)


def test_only_send(ends: tuple[End, End]) -> None:
    a, _ = ends
    assert raw_send(a, v.IBV_WR_RDMA_WRITE) == -errno.EOPNOTSUPP
    assert a.wait(1, 0.05) == []


@pytest.mark.parametrize("mtu, is_global, port, what", [
    (v.IBV_MTU_2048, 1, 1, "MTU"), (v.IBV_MTU_512, 1, 1, "MTU"), (v.IBV_MTU_1024, 0, 1, "no GRH"),
    (v.IBV_MTU_1024, 1, 2, "port")])
def test_rtr_needs_mtu_1024_grh_and_port_1(fabric: Fabric, mtu: int, is_global: int, port: int, what: str) -> None:
    end = make_end("fake", str(fabric.path), "rdma_fake0")
    try:
        attr = v.ibv_qp_attr(qp_state=v.IBV_QPS_RTR, path_mtu=mtu, dest_qp_num=0x100, rq_psn=1)
        attr.ah_attr.is_global, attr.ah_attr.port_num, attr.ah_attr.grh.sgid_index = is_global, port, 1
        with pytest.raises(RdmaError) as exc:
            end.qp.modify(attr, v.RTR_MASK, what)
        assert exc.value.errno == errno.EINVAL and exc.value.call == "ibv_modify_qp", what
        end.qp.to_rtr(0x100, v.ipv4_gid("10.201.0.2"), 1, end.gid_index)  # the same QP, right attributes
    finally:
        end.close()


def test_transitions_in_order_only(fabric: Fabric) -> None:
    end = make_end("fake", str(fabric.path), "rdma_fake0")
    try:
        with pytest.raises(RdmaError, match="to RTS"):
            end.qp.to_rts(1)  # INIT -> RTS skips RTR
    finally:
        end.close()


def test_receives_only_after_rts(fabric: Fabric) -> None:
    a = make_end("fake", str(fabric.path), "rdma_fake0")
    try:
        with pytest.raises(RdmaError, match="ibv_post_recv on rdma_fake0 failed: Invalid argument.*only once the "
                                            "queue pair is RTS") as exc:
            a.recv(1, 0, 4096)  # INIT
        a.qp.to_rtr(0x100, v.ipv4_gid("10.201.0.2"), 1, a.gid_index)
        with pytest.raises(RdmaError):
            a.recv(1, 0, 4096)  # RTR
        with pytest.raises(RdmaError, match="ibv_post_send"):
            a.send(1, 0, 64)
        a.qp.to_rts(1)
        a.recv(1, 0, 4096)
        assert exc.value.errno == errno.EINVAL
    finally:
        a.close()


@pytest.mark.parametrize("length", [100, 4095, 6000, 12288, 3 * 4096, 1 << 20])
def test_a_receive_covers_4k_times_a_power_of_two(ends: tuple[End, End], length: int) -> None:
    _, b = ends
    with pytest.raises(RdmaError) as exc:
        b.recv(1, 0, length)  # 1 MiB: beyond 4 KiB x 2^7
    assert exc.value.errno == errno.EINVAL
    for ok in (4096, 8192, 512 << 10):
        b.recv(2, 0, ok)


def test_macos_26_2_takes_only_4k_receives(tmp_path) -> None:
    """JACCL uses buffers above 4 KiB only on macOS 26.3+: max_frame_shift=0 is 26.2."""
    with fake_fabric(tmp_path / "f", max_frame_shift=0) as fab:
        a, b = pair(str(fab.path))
        try:
            b.recv(1, 0, 4096)
            with pytest.raises(RdmaError) as exc:
                b.recv(2, 0, 8192)
            assert exc.value.errno == errno.EINVAL
            a.send(3, 0, 4097)  # longer than any receive can be: the send completes with an error
            assert a.wait() == [(3, v.IBV_WC_LOC_LEN_ERR, v.IBV_WC_SEND, 4097, a.qp.qp_num)]
            assert a.device.query_port().max_msg_sz == 4096
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("recv_len, send_len, delivered", [
    (8192, 100, False),  # a short send fails the peer's receive (llama.cpp, TN3205)
    (8192, 4096, False), (8192, 4097, True), (8192, 8192, True), (4096, 4097, False), (4096, 0, True),
    (4096, 4096, True), (4096, 1, True)])
def test_a_send_and_its_receive_cover_the_same_frames(ends: tuple[End, End], recv_len: int, send_len: int,
                                                       delivered: bool) -> None:
    a, b = ends
    a.buffer[0:send_len] = b"\x5a" * send_len
    b.recv(1, 0, recv_len)
    a.send(2, 0, send_len)
    assert a.wait() == [(2, OK, v.IBV_WC_SEND, send_len, a.qp.qp_num)]  # the sender never learns
    [(wr_id, status, _, byte_len, _)] = b.wait()
    if delivered:
        assert (status, byte_len) == (OK, send_len) and bytes(b.buffer[:send_len]) == b"\x5a" * send_len
    else:
        assert (status, byte_len) == (v.IBV_WC_LOC_LEN_ERR, 0) and b.buffer[0] == 0


def test_a_send_without_a_posted_receive_is_silently_dropped(ends: tuple[End, End], fabric: Fabric) -> None:
    a, b = ends
    a.buffer[0] = 1
    a.send(1, 0, 64)
    assert a.wait() == [(1, OK, v.IBV_WC_SEND, 64, a.qp.qp_num)]
    assert fabric.dropped("rdma_fake0") == 1
    b.recv(2, 0, 4096)  # posted after the send: the dropped message does not land in it
    assert b.wait(1, 0.05) == []
    a.buffer[0] = 2
    a.send(3, 0, 64)
    assert [c[0] for c in b.wait()] == [2] and b.buffer[0] == 2


def test_no_receive_can_stall_the_sender_instead(tmp_path) -> None:
    """TN3205's credit-based flow control: the send waits for a receive (no completion meanwhile)."""
    with fake_fabric(tmp_path / "f", no_receive="stall") as fab:
        a, b = pair(str(fab.path))
        try:
            a.send(1, 0, 64)
            assert a.wait(1, 0.05) == []
            b.recv(2, 0, 4096)
            assert a.wait() == [(1, OK, v.IBV_WC_SEND, 64, a.qp.qp_num)]
            assert [c[:2] for c in b.wait()] == [(2, OK)] and fab.dropped("rdma_fake0") == 0
        finally:
            a.close()
            b.close()


def test_a_send_to_a_peer_not_yet_rts_is_dropped(fabric: Fabric) -> None:
    a = make_end("fake", str(fabric.path), "rdma_fake0")
    b = make_end("fake", str(fabric.path), "rdma_fake1")
    try:
        a.connect(b.info)
        b.qp.to_rtr(a.info["qpn"], a.gid, a.info["psn"], b.gid_index)  # RTR, no receive possible yet
        a.send(1, 0, 64)
        b.qp.to_rts(b.info["psn"])
        b.recv(2, 0, 4096)
        assert b.wait(1, 0.05) == [] and fabric.dropped("rdma_fake0") == 1
    finally:
        a.close()
        b.close()


def test_a_psn_mismatch_loses_every_message(fabric: Fabric) -> None:
    a = make_end("fake", str(fabric.path), "rdma_fake0")
    b = make_end("fake", str(fabric.path), "rdma_fake1")
    try:
        a.qp.to_rtr(b.info["qpn"], b.gid, b.info["psn"], a.gid_index)
        a.qp.to_rts(a.info["psn"] + 1)  # not what b expects
        b.connect(a.info)
        b.recv(1, 0, 4096)
        a.send(2, 0, 64)
        assert b.wait(1, 0.05) == [] and fabric.dropped("rdma_fake0") == 1
    finally:
        a.close()
        b.close()


def test_a_queue_pair_takes_only_its_connected_peer(fabric: Fabric) -> None:
    """UC: a third QP that RTRs towards b's QP is not b's peer; its sends are lost."""
    a, b = pair(str(fabric.path))
    c = make_end("fake", str(fabric.path), "rdma_fake0")
    try:
        c.connect(b.info)
        b.recv(1, 0, 4096)
        c.send(2, 0, 64)
        assert b.wait(1, 0.05) == []
        a.send(3, 0, 64)
        assert [x[0] for x in b.wait()] == [1]
    finally:
        for e in (a, b, c):
            e.close()


def test_about_ten_queue_pairs_per_device_across_processes(tmp_path) -> None:
    with fake_fabric(tmp_path / "f", max_qp=3) as fab:
        one, two = (load_verbs("fake", str(fab.path)) for _ in range(2))
        d1, d2 = one.open("rdma_fake0"), two.open("rdma_fake0")
        try:
            pd1, pd2 = d1.alloc_pd(), d2.alloc_pd()
            cq1, cq2 = d1.create_cq(8), d2.create_cq(8)
            qps = [pd1.create_qp(cq1, cq1, 4, 4), pd2.create_qp(cq2, cq2, 4, 4), pd2.create_qp(cq2, cq2, 4, 4)]
            with pytest.raises(RdmaError, match="ibv_create_qp on rdma_fake0 failed: Device or resource busy.*"
                                                "about 10 per device") as exc:
                pd1.create_qp(cq1, cq1, 4, 4)
            assert exc.value.errno == errno.EBUSY
            other = load_verbs("fake", str(fab.path))
            d3 = other.open("rdma_fake1")  # another device has its own
            d3.alloc_pd().create_qp(d3.create_cq(8), d3.create_cq(8), 4, 4)
            d3.close()
            other.close()
            qps[1].close()
            pd1.create_qp(cq1, cq1, 4, 4)
        finally:
            d1.close()
            d2.close()
            one.close()
            two.close()


def test_about_a_hundred_memory_regions_per_device(tmp_path) -> None:
    with fake_fabric(tmp_path / "f", max_mr=3) as fab:
        verbs = load_verbs("fake", str(fab.path))
        dev = verbs.open("rdma_fake0")
        try:
            pd = dev.alloc_pd()
            regions = [pd.reg_buffer(bytearray(4096)) for _ in range(3)]
            with pytest.raises(RdmaError, match="ibv_reg_mr on rdma_fake0 failed: Cannot allocate memory.*about "
                                                "100 per device"):
                pd.reg_buffer(bytearray(4096))
            regions[0].close()
            pd.reg_buffer(bytearray(4096))
            with pytest.raises(RdmaError) as exc:  # Apple refuses LOCAL_WRITE-only regions
                pd.reg_buffer(bytearray(4096), access=v.IBV_ACCESS_LOCAL_WRITE)
            assert exc.value.errno == errno.EINVAL
        finally:
            dev.close()
            verbs.close()


def test_queue_depth_limits(ends: tuple[End, End]) -> None:
    a, b = ends
    for i in range(16):
        b.recv(i, 4096 * i, 4096)
    with pytest.raises(RdmaError, match="ibv_post_recv.*Cannot allocate memory.*receive queue full"):
        b.recv(99, 0, 4096)
    for i in range(16):
        a.send(i, 0, 8, signaled=False)  # send-queue slots held until a signaled completion is polled
    with pytest.raises(RdmaError, match="ibv_post_send.*send queue full"):
        a.send(99, 0, 8)
    with pytest.raises(RdmaError) as exc:
        a.pd.create_qp(a.cq, a.cq, 33, 4)  # above max_qp_wr (32)
    assert exc.value.errno == errno.EINVAL


def test_a_completion_queue_overrun_fails_every_poll(fabric: Fabric) -> None:
    a = make_end("fake", str(fabric.path), "rdma_fake0", cq_entries=2)
    b = make_end("fake", str(fabric.path), "rdma_fake1")
    try:
        a.connect(b.info)
        b.connect(a.info)
        for i in range(3):
            a.send(i, 0, 8)
        with pytest.raises(RdmaError, match="poll_cq on rdma_fake0 failed: Value too large.*overrun") as exc:
            a.cq.poll()
        assert exc.value.errno == errno.EOVERFLOW
    finally:
        a.close()
        b.close()


def test_error_state_flushes_posted_receives(ends: tuple[End, End]) -> None:
    _, b = ends
    b.recv(1, 0, 4096)
    b.recv(2, 4096, 4096)
    attr = v.ibv_qp_attr(qp_state=v.IBV_QPS_ERR)
    b.qp.modify(attr, v.IBV_QP_STATE)
    assert [(c[0], c[1]) for c in b.wait(2)] == [(1, v.IBV_WC_WR_FLUSH_ERR), (2, v.IBV_WC_WR_FLUSH_ERR)]


# --- faults -------------------------------------------------------------------------------------------

def test_fault_dropped_frames(ends: tuple[End, End], fabric: Fabric) -> None:
    a, b = ends
    fabric.set_fault("rdma_fake0", "drop_next", 1)
    for i in range(3):
        b.recv(i, 4096 * i, 4096)
    for i in range(2):
        a.buffer[i] = 10 + i
        a.send(i, i, 1)
    assert [c[1] for c in a.wait(2)] == [OK, OK]  # both "sent"
    got = b.wait(1)
    assert [(c[0], c[3]) for c in got] == [(0, 1)] and b.buffer[0] == 11  # the first was lost
    fabric.set_fault("rdma_fake0", "drop_every", 2)
    for i in range(4):
        b.recv(10 + i, 0, 4096)
    for i in range(4):
        a.send(20 + i, 0, 8)
    assert len(b.wait(4, 0.2)) == 2 and fabric.dropped("rdma_fake0") == 3


@pytest.mark.parametrize("stalled", ["rdma_fake0", "rdma_fake1"])
def test_fault_stalled_peer_holds_messages_until_released(ends: tuple[End, End], fabric: Fabric,
                                                          stalled: str) -> None:
    a, b = ends
    b.recv(1, 0, 4096)
    fabric.set_fault(stalled, "stall", 1)
    a.send(2, 0, 64)
    assert a.wait(1, 0.05) == [] and b.wait(1, 0.05) == []  # neither delivered nor completed nor lost
    fabric.set_fault(stalled, "stall", 0)
    assert a.wait() == [(2, OK, v.IBV_WC_SEND, 64, a.qp.qp_num)]
    assert [c[0] for c in b.wait()] == [1] and fabric.dropped("rdma_fake0") == 0


@pytest.mark.parametrize("down", ["rdma_fake0", "rdma_fake1"])
def test_fault_port_down(ends: tuple[End, End], fabric: Fabric, down: str) -> None:
    a, b = ends
    fabric.set_fault(down, "port_up", 0)
    assert (a if down == "rdma_fake0" else b).device.query_port().state == v.IBV_PORT_DOWN
    b.recv(1, 0, 4096)
    a.send(2, 0, 64)
    assert a.wait() == [(2, OK, v.IBV_WC_SEND, 64, a.qp.qp_num)] and b.wait(1, 0.05) == []
    end = make_end("fake", str(fabric.path), down)
    with pytest.raises(RdmaError, match="Network is down.*port is down") as exc:
        end.qp.to_rtr(0x100, v.ipv4_gid("10.201.0.9"), 1, end.gid_index)
    assert exc.value.errno == errno.ENETDOWN
    end.close()
    fabric.set_fault(down, "port_up", 1)
    a.send(3, 0, 64)
    assert [c[0] for c in b.wait()] == [1]


def test_fault_device_disappears(ends: tuple[End, End], fabric: Fabric) -> None:
    a, b = ends
    b.recv(1, 0, 4096)
    fabric.set_fault("rdma_fake1", "present", 0)
    assert a.verbs.devices() == ["rdma_fake0"]
    a.send(2, 0, 64)  # to a vanished device: lost
    assert a.wait() == [(2, OK, v.IBV_WC_SEND, 64, a.qp.qp_num)]
    with pytest.raises(RdmaError, match="poll_cq on rdma_fake1 failed: No such device.*the RDMA device is gone"):
        b.cq.poll()
    with pytest.raises(RdmaError) as exc:
        b.recv(3, 0, 4096)
    assert (exc.value.call, exc.value.errno) == ("ibv_post_recv", errno.ENODEV)
    with pytest.raises(RdmaError, match="no RDMA device rdma_fake1 .found: rdma_fake0"):
        a.verbs.open("rdma_fake1")
    fabric.set_fault("rdma_fake1", "present", 1)  # plugged back: a new device, the old context stays dead
    with pytest.raises(RdmaError):
        b.cq.poll()
    fresh = make_end("fake", str(fabric.path), "rdma_fake1")
    fresh.close()


def test_fault_wedged_port_on_reconnect(ends: tuple[End, End], fabric: Fabric) -> None:
    a, b = ends
    fabric.set_fault("rdma_fake0", "wedge_on_reconnect", 1)
    fabric.set_fault("rdma_fake0", "hang_ms", 20)
    a.qp.close()  # the connection goes; set it up again
    qp = a.pd.create_qp(a.cq, a.cq, 4, 4)
    qp.to_init()
    with pytest.raises(RdmaError, match="ibv_modify_qp on rdma_fake0 failed: Connection timed out.*wedged.*reboot"):
        qp.to_rtr(b.info["qpn"], b.gid, b.info["psn"], a.gid_index)
    with pytest.raises(RdmaError) as exc:
        a.device.query_port()
    assert (exc.value.call, exc.value.errno) == ("ibv_query_port", errno.ETIMEDOUT)
    qp.close()
    qp = a.pd.create_qp(a.cq, a.cq, 4, 4)
    qp.to_init()
    with pytest.raises(RdmaError):  # stays wedged
        qp.to_rtr(b.info["qpn"], b.gid, b.info["psn"], a.gid_index)
    fabric.reboot("rdma_fake0")
    assert a.device.query_port().active
    qp.to_rtr(b.info["qpn"], b.gid, b.info["psn"], a.gid_index)


# --- completion channels ------------------------------------------------------------------------------

def test_completion_channel_wakes_a_sleeper(fabric: Fabric) -> None:
    a = make_end("fake", str(fabric.path), "rdma_fake0")
    b = make_end("fake", str(fabric.path), "rdma_fake1", channel=True)
    try:
        a.connect(b.info)
        b.connect(a.info)
        assert b.channel is not None
        b.recv(1, 0, 4096)
        b.cq.req_notify()
        assert b.cq.poll() == 0 and select.select([b.channel.fd], [], [], 0)[0] == []
        a.send(2, 0, 64)
        assert select.select([b.channel.fd], [], [], 5)[0] == [b.channel.fd]
        assert b.channel.get_event() == b.cq.cq
        b.cq.ack(1)
        assert [c[0] for c in b.cq.completions()] == [1]
        a.send(3, 0, 64)  # not armed: no event (the message is dropped anyway: no receive)
        assert select.select([b.channel.fd], [], [], 0.05)[0] == []
    finally:
        a.close()
        b.close()


def test_completion_channels_can_be_unsupported(tmp_path) -> None:
    with fake_fabric(tmp_path / "f", comp_channel=False) as fab:
        verbs = load_verbs("fake", str(fab.path))
        dev = verbs.open("rdma_fake0")
        try:
            with pytest.raises(RdmaError, match="ibv_create_comp_channel.*no completion channels: poll instead"):
                dev.create_comp_channel()
        finally:
            dev.close()
            verbs.close()


def test_closing_a_device_frees_its_queue_pairs_and_regions(tmp_path) -> None:
    with fake_fabric(tmp_path / "f", max_qp=1, max_mr=1) as fab:
        for _ in range(3):
            end = make_end("fake", str(fab.path), "rdma_fake0")
            end.close()
        assert list((fab.path / "rdma_fake0").glob("qp*")) == []
        assert list((fab.path / "rdma_fake0" / "mr").iterdir()) == []


def test_what_a_process_holds_and_what_its_binding_left_open(tmp_path) -> None:
    """`held_by` counts this process's objects while they exist; a provider closed with its device still
    open frees them for the binding and counts them in `left_open` (a Mac would keep them)."""
    import os

    nothing = {"qps": 0, "mrs": 0, "pds": 0, "contexts": 0, "cqs": 0, "channels": 0}
    with fake_fabric(tmp_path / "f") as fab:
        end = make_end("fake", str(fab.path), "rdma_fake0", channel=True)
        assert fab.held_by(os.getpid()) == dict.fromkeys(nothing, 1)
        assert fab.held_by(os.getpid() + 1) == nothing
        end.device.close()  # the binding destroys each object before the provider closes
        assert fab.held_by(os.getpid()) == nothing
        end.verbs.close()
        assert fab.left_open("rdma_fake0") == 0
        careless = make_end("fake", str(fab.path), "rdma_fake1")
        careless.verbs.close()  # without closing the device: the provider frees its QP, MR, CQ, PD, context
        assert fab.held_by(os.getpid()) == nothing
        assert (fab.left_open("rdma_fake1"), fab.left_open("rdma_fake0")) == (5, 0)


def test_no_verbs_library_is_a_clear_error() -> None:
    with pytest.raises(RdmaError, match="no verbs library could be loaded.*macOS 26.2"):
        v.NativeProvider(candidates=["libnot-a-verbs-library.so.9"])


def test_the_system_library_is_bound_where_installed() -> None:
    """On Linux with rdma-core the real library's symbols bind; without an RDMA kernel the device list
    fails with a clear reason instead of a crash."""
    try:
        verbs = load_verbs("system")
    except RdmaError as exc:
        pytest.skip(f"no system verbs library: {exc}")
    assert all(verbs.has(n) for n in v.REQUIRED_SYMBOLS)
    try:
        verbs.devices()
    except RdmaError as exc:
        assert exc.call == "ibv_get_device_list"
