"""The rdma kind of link between thread ranks over a fake verbs fabric (testing.worlds.rdma_world): every
size on both lanes, flow control by credits, parking, the quick receive, BYE and ABORT, and each injected
fault (a lost frame, a stalled peer, a port that goes down, a device that disappears, a port that wedges on
re-connect) ending in a named error on both ranks, never a hang or a wrong result."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import MismatchError, PeerLostError, RdmaError
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.rendezvous.agree import DONE
from torch_thunderbolt.rendezvous.rdma import connect_rdma
from torch_thunderbolt.testing.fake_verbs import fake_fabric
from torch_thunderbolt.testing.worlds import SetUpOnThreads, _threads_connected, on_threads, rdma_world
from torch_thunderbolt.transport.base import NOT_YET
from torch_thunderbolt.transport.rdma import RdmaLink

pytestmark = pytest.mark.timeout(120)

DEVICES = {"rdma_fake0": "10.201.0.1", "rdma_fake1": "10.201.0.2", "rdma_fake2": "10.201.0.3"}
# Around every boundary: one frame of each lane, the padded last bulk piece, many bulk frames.
SIZES = [0, 1, 4032, 8128, 8129, 40000, 65472, 65473, 130000, 1 << 20, (3 << 20) + 5]
SIG = 0x1234


def _data(n: int, seed: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 31 + seed).remainder(251).to(torch.uint8)


def _link(t, peer: int) -> RdmaLink:
    return t.link_kind("rdma").links[peer]


def _both_ways(ts, sizes, timeout: float = 60.0) -> None:
    """Every size from each rank to every other, p2p, all posted before any wait; bytes compared."""
    world = len(ts)

    def body(r: int) -> None:
        t = ts[r]
        reqs, outs = [], []
        for p in range(world):
            if p == r:
                continue
            for i, n in enumerate(sizes):
                reqs.append(t.isend_p2p(p, i, memoryview(_data(n, 10 * r + i).numpy())))
                out = torch.zeros(n, dtype=torch.uint8)
                outs.append((p, i, n, out))
                reqs.append(t.irecv_p2p(p, i, memoryview(out.numpy())))
        t.wait(reqs, time.monotonic() + timeout, "exchange")
        for p, i, n, out in outs:
            assert torch.equal(out, _data(n, 10 * p + i)), f"rank {r}: {n} bytes from {p}"

    run = on_threads(world, body, timeout + 10)
    assert not run.hung and not run.errors, run.errors


def test_every_size_both_ways_on_both_lanes(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(3, fab) as ts:
        assert [len(_link(ts[0], p).lanes) for p in (1, 2)] == [2, 2]  # a bulk lane each
        _both_ways(ts, SIZES)
        kind = ts[0].link_kind("rdma")
        assert kind.bytes_sent == kind.bytes_received == 2 * sum(SIZES)
        assert [fab.dropped(d) for d in DEVICES] == [0, 0, 0]  # never a send without a receive for it


def test_4k_receives_only_and_no_bulk_lane(tmp_path: Path) -> None:
    """macOS 26.2 takes 4 KiB receives only: one lane of 4 KiB frames carries everything."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES, max_frame_shift=0) as fab, rdma_world(2, fab) as ts:
        link = _link(ts[0], 1)
        assert [lane.size for lane in link.lanes] == [4096] and link.msg.min_send == 1
        _both_ways(ts, [0, 1, 4032, 4033, 100000])


def test_a_device_short_of_queue_pairs_gets_one_lane_per_peer(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES, max_qp=3) as fab, rdma_world(2, fab) as ts:
        assert len(_link(ts[0], 1).lanes) == 1
        _both_ways(ts, [8129, 200000])


def test_a_device_out_of_queue_pairs_costs_the_bulk_lane_or_moves_to_another_device(tmp_path: Path) -> None:
    """Other jobs hold queue pairs (about 10 per device on a Mac): a rank that finds none left for its bulk
    lane goes on with the message lane (and its peer with it); one whose device has none at all takes
    another device of the same network."""
    from .fabric_ends import make_end

    with fake_fabric(tmp_path / "fab", devices=DEVICES, max_qp=4) as fab:
        others = [make_end("fake", str(fab.path), "rdma_fake0") for _ in range(3)]  # 1 of 4 left on rdma_fake0
        try:
            with rdma_world(2, fab) as ts:
                assert [len(_link(ts[0], 1).lanes), len(_link(ts[1], 0).lanes)] == [1, 1]
                _both_ways(ts, [10, 300000])
            others.append(make_end("fake", str(fab.path), "rdma_fake0"))  # rdma_fake0 full
            with rdma_world(2, fab) as ts:
                assert _link(ts[0], 1).end.device.name == "rdma_fake1"  # the next device of the network
                _both_ways(ts, [10, 300000])
        finally:
            for end in others:
                end.close()


def test_credits_hold_a_sender_until_parked_frames_are_taken(tmp_path: Path) -> None:
    """40 collective messages for ops the receiver has not reached: its receive slots hold (park) what they
    can, the sender waits for credits (no frame is ever sent without a posted receive: none is lost), and
    everything arrives in order once the receives are posted."""
    count = 40
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab) as ts:

        def body(r: int) -> list[bytes]:
            t = ts[r]
            if r == 0:
                reqs = [t.isend(1, (Space.COLL, k, 0), memoryview(_data(100 + k, k).numpy()), SIG)
                        for k in range(1, count + 1)]
                reqs += [t.isend(1, (Space.COLL, 100 + k, 0), memoryview(_data(70000, k).numpy()), SIG)
                         for k in range(1, 12)]  # the bulk lane's credits too
                t.wait(reqs, time.monotonic() + 60)
                return []
            time.sleep(0.5)
            t.progress(0.01)  # takes what arrived: the receive slots hold it, the sender waits for credits
            held = t.held(0)
            parked = None if held is None else (0, held.sig)
            outs = [torch.zeros(100 + k, dtype=torch.uint8) for k in range(1, count + 1)]
            outs += [torch.zeros(70000, dtype=torch.uint8) for _ in range(1, 12)]
            keys = [(Space.COLL, k, 0) for k in range(1, count + 1)] + [(Space.COLL, 100 + k, 0) for k in range(1, 12)]
            reqs = [t.irecv(0, key, memoryview(o.numpy()), SIG) for key, o in zip(keys, outs)]
            t.wait(reqs, time.monotonic() + 60)
            assert parked == (0, SIG)
            return [bytes(o.numpy()) for o in outs]

        run = on_threads(2, body, 90)
        assert not run.hung and not run.errors, run.errors
        got = run.results[1]
        want = [_data(100 + k, k) for k in range(1, count + 1)] + [_data(70000, k) for k in range(1, 12)]
        assert got == [bytes(w.numpy()) for w in want]
        assert fab.dropped("rdma_fake0") == fab.dropped("rdma_fake1") == 0
        assert ts[1].link_kind("rdma").credit_frames > 0


def test_a_take_the_engine_gave_up_on_leaves_the_message_to_the_general_path(tmp_path: Path) -> None:
    """Transport.exchange may look for one peer's message with `take` and then receive from every peer the
    general way (another peer's link refused): the message must reach the posted receive, not the buffer
    of a look that is over."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab) as ts:
        key = (Space.COLL, 5, 0)
        dest = torch.zeros(64, dtype=torch.uint8)
        with ts[1]._lock:
            assert _link(ts[1], 0).take(key, SIG, memoryview(dest.numpy())) == NOT_YET

        def body(r: int) -> None:
            if r == 0:
                ts[0].wait([ts[0].isend(1, key, memoryview(_data(64, 7).numpy()), SIG)], time.monotonic() + 20)
            else:
                out = torch.zeros(64, dtype=torch.uint8)
                ts[1].wait([ts[1].irecv(0, key, memoryview(out.numpy()), SIG)], time.monotonic() + 20)
                assert torch.equal(out, _data(64, 7)) and not dest.any()

        run = on_threads(2, body, 40)
        assert not run.hung and not run.errors, run.errors


def _until_held(t, peer: int, seconds: float = 20.0) -> None:
    """Drive `t` until a message of `peer` is held back in a receive slot (it has no receive posted)."""
    end = time.monotonic() + seconds
    while _link(t, peer).held() is None:
        assert time.monotonic() < end, "the message was never held back"
        t.progress(0.01)


def test_a_message_held_back_before_its_op_is_taken(tmp_path: Path) -> None:
    """A peer a step ahead: its message arrives before this rank runs the op and waits in its receive slot;
    the op's exchange reads it from there (`take`, bytes intact, the slot posted again). One of
    another size held back the same way still fails the op as a mismatch (the general path's check)."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab) as ts:
        key = (Space.COLL, 3, 0)
        ts[0].wait([ts[0].isend(1, key, memoryview(_data(1000, 5).numpy()), SIG)], time.monotonic() + 20)
        _until_held(ts[1], 0)
        kind, link = ts[1].link_kind("rdma"), _link(ts[1], 0)
        quick, posted = kind.quick_messages, link.msg.posted
        out = torch.zeros(1000, dtype=torch.uint8)
        ts[1].exchange([], [(0, key, memoryview(out.numpy()))], SIG, time.monotonic() + 20)
        assert torch.equal(out, _data(1000, 5))
        assert kind.quick_messages == quick + 1 and link.msg.posted == posted + 1 and link.held() is None

        key = (Space.COLL, 4, 0)
        ts[0].wait([ts[0].isend(1, key, memoryview(_data(1000, 6).numpy()), SIG)], time.monotonic() + 20)
        _until_held(ts[1], 0)
        out = torch.zeros(999, dtype=torch.uint8)
        with pytest.raises(MismatchError, match="1000"):
            ts[1].exchange([], [(0, key, memoryview(out.numpy()))], SIG, time.monotonic() + 20)
        assert not out.any()


@pytest.mark.parametrize("channel", [True, False])
def test_sleeping_ranks_wake_with_and_without_completion_channels(tmp_path: Path, channel: bool) -> None:
    """Apple's provider may never signal a completion channel: with none, a rank polls with a bounded
    backoff; either way a message sent to a sleeping rank is received."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES, comp_channel=channel) as fab, \
            rdma_world(2, fab, Config(spin_us=0)) as ts:
        assert (_link(ts[1], 0).channel_fd >= 0) is channel

        def body(r: int) -> None:
            t = ts[r]
            for i in range(5):
                buf = torch.zeros(10, dtype=torch.uint8)
                if r == 0:
                    time.sleep(0.05)  # the peer is asleep by now
                    t.wait([t.isend_p2p(1, i, memoryview(_data(10, i).numpy()))], time.monotonic() + 10)
                else:
                    t.wait([t.irecv_p2p(0, i, memoryview(buf.numpy()))], time.monotonic() + 10)
                    assert torch.equal(buf, _data(10, i))

        run = on_threads(2, body, 30)
        assert not run.hung and not run.errors, run.errors


def test_bye_comes_after_the_data_sent_before_it(tmp_path: Path) -> None:
    """A rank that sends and leaves in order: what it sent still arrives (the BYE, on the control connection,
    says how many frames came first), and only a receive beyond that finds it gone."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab) as ts:

        def body(r: int) -> None:
            t = ts[r]
            if r == 0:
                sends = [t.isend_p2p(1, i, memoryview(_data(70000, i).numpy())) for i in range(3)]
                t.wait(sends, time.monotonic() + 10)
                t.close()
            else:
                time.sleep(0.3)
                for i in range(3):
                    buf = torch.zeros(70000, dtype=torch.uint8)
                    t.wait([t.irecv_p2p(0, i, memoryview(buf.numpy()))], time.monotonic() + 10)
                    assert torch.equal(buf, _data(70000, i))
                with pytest.raises(PeerLostError, match="shut down its process group"):
                    t.wait([t.irecv_p2p(0, 9, memoryview(bytearray(4)))], time.monotonic() + 10)

        run = on_threads(2, body, 40)
        assert not run.hung and not run.errors, run.errors


def test_an_abort_reaches_every_peer_with_its_reason(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(3, fab) as ts:

        def body(r: int) -> None:
            t = ts[r]
            if r == 0:
                time.sleep(0.2)
                t.abort(MismatchError("rank 0: the test's own mismatch"))
            else:
                with pytest.raises(MismatchError, match="the test's own mismatch"):
                    t.wait([t.irecv_p2p(0, 0, memoryview(bytearray(4)))], time.monotonic() + 20)

        run = on_threads(3, body, 40)
        assert not run.hung and not run.errors, run.errors


# --- faults -------------------------------------------------------------------------------------------------

FAST = Config(link_timeout_ms=600)  # probes after 0.2 s, frames overdue after 0.6 s


def _fault_run(ts, sender_waits: bool = True, timeout: float = 30.0):
    """Rank 0 sends two messages to rank 1 and then waits for an answer; rank 1 waits for both. Returns the
    ThreadRun: each rank's error (none may hang or get a wrong result)."""

    def body(r: int) -> None:
        t = ts[r]
        if r == 0:
            reqs = [t.isend_p2p(1, i, memoryview(_data(3000, i).numpy())) for i in range(2)]
            if sender_waits:
                reqs.append(t.irecv_p2p(1, 9, memoryview(bytearray(8))))
            t.wait(reqs, time.monotonic() + timeout)
        else:
            for i in range(2):
                buf = torch.zeros(3000, dtype=torch.uint8)
                t.wait([t.irecv_p2p(0, i, memoryview(buf.numpy()))], time.monotonic() + timeout)
                assert torch.equal(buf, _data(3000, i)), "a wrong result"
            t.wait([t.isend_p2p(0, 9, memoryview(bytearray(8)))], time.monotonic() + timeout)

    started = time.monotonic()
    run = on_threads(2, body, timeout + 15)
    return run, time.monotonic() - started


def test_a_lost_frame_fails_both_ranks_at_once(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab, FAST) as ts:
        fab.set_fault("rdma_fake0", "drop_next", 1)
        run, took = _fault_run(ts)
    assert not run.hung and set(run.errors) == {0, 1}
    for err in run.errors.values():
        assert isinstance(err, PeerLostError) and "was lost" in str(err) and "unreliable (UC)" in str(err), err
        assert "THUNDERBOLT_TRANSPORT=tcp" in str(err)
    assert took < 10


@pytest.mark.parametrize("fault, value, says", [("stall", 1, "frames were lost or the port stalls"),
                                                ("port_up", 0, "port 1 of rdma_fake1 is DOWN")])
def test_a_stalled_peer_or_a_port_down_fails_both_ranks_within_the_link_timeout(tmp_path: Path, fault: str,
                                                                                value: int, says: str) -> None:
    """Nothing arrives and no gap shows: the waiting rank's probe (over TCP) learns what the peer sent, and
    once that is overdue by THUNDERBOLT_LINK_TIMEOUT_MS both ranks fail, naming the port."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab, FAST) as ts:
        fab.set_fault("rdma_fake1", fault, value)
        run, took = _fault_run(ts)
        fab.set_fault("rdma_fake1", fault, 1 - value)  # (lets the transports close quickly)
    assert not run.hung and set(run.errors) == {0, 1}, run.errors
    for err in run.errors.values():
        assert isinstance(err, PeerLostError) and says in str(err), err
    assert took < 10


def test_a_device_that_disappears_fails_both_ranks(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab, rdma_world(2, fab, FAST) as ts:
        fab.set_fault("rdma_fake1", "present", 0)
        run, took = _fault_run(ts)
    assert not run.hung and set(run.errors) == {0, 1}, run.errors
    for err in run.errors.values():
        assert isinstance(err, PeerLostError) and "the RDMA device is gone" in str(err), err
    assert took < 10


def test_connect_rdma_leaves_the_set_up_together_as_connect_tcp_does(tmp_path: Path) -> None:
    """Rank 0 may serve the store (env://): like every kind alone (setup.connect_one_kind), connect_rdma
    returns only once every rank has said it read all it needs from the store (agree.leave_together)."""
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab:
        cfg = Config(verbs="fake", verbs_fabric=str(fab.path), transport="rdma")
        with SetUpOnThreads(2, connect_rdma, timeout=20) as world:
            world.start(0, cfg)
            world.start(1, cfg)
            world.join()
            assert not world.errors, world.errors
            assert world.view.check([DONE.format(rank=0), DONE.format(rank=1)])


def test_a_port_wedged_on_reconnect_fails_the_set_up_on_every_rank_and_a_reboot_cures_it(tmp_path: Path) -> None:
    with fake_fabric(tmp_path / "fab", devices=DEVICES) as fab:
        with rdma_world(2, fab):
            pass  # a job that ran and closed its queue pairs
        fab.set_fault("rdma_fake0", "wedge_on_reconnect", 1)
        fab.set_fault("rdma_fake0", "hang_ms", 50)
        cfg = Config(verbs="fake", verbs_fabric=str(fab.path), transport="rdma")
        errors: dict[int, BaseException] = {}

        def connect(store, r):
            try:
                return connect_rdma(store, r, 2, cfg, 20)
            except Exception as exc:  # noqa: BLE001 - recorded per rank
                errors[r] = exc
                raise

        with pytest.raises((RdmaError, PeerLostError)):
            with _threads_connected(2, connect, 20):
                pass
        assert isinstance(errors[0], RdmaError) and "wedged" in str(errors[0]) and "reboot" in str(errors[0])
        # (rank 0 gave up RDMA alone, published before it closed its control connection: rank 1 names it)
        assert isinstance(errors[1], RdmaError) and "rank 0 gave up setting up rdma links" in str(errors[1])
        assert "wedged" in str(errors[1]) and errors[1].rank == 0 and errors[1].device == "rdma_fake0"
        fab.reboot("rdma_fake0")
        with rdma_world(2, fab) as ts:
            _both_ways(ts, [10, 70000])
