"""Who gets blamed when the news of a lost rank travels through another rank.

Rank 2 learns that some rank died and tells rank 0 with an ABORT frame. Rank 0 fails too and closes its
sockets. Rank 1, waiting for data from rank 0, must still learn the root cause (the dead rank), not "rank 0
closed the connection". Found by scripts/reliability/kill_trials.py (about 1 trial in 7 on 3–4 ranks).
"""
from __future__ import annotations

import threading
import time

import pytest

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.protocol import control
from torch_thunderbolt.protocol.framing import AbortInfo, Space
from torch_thunderbolt.testing.worlds import tcp_world

pytestmark = pytest.mark.timeout(60)


def _relay(worlds) -> PeerLostError:
    t0, t1, t2 = worlds
    # rank 1 waits for data from rank 0 (as in a ring step)
    waiting = t1.irecv(0, (Space.COLL, 1, 0), memoryview(bytearray(64)))
    news = PeerLostError("rank 2: lost the connection to rank 3 at 10.0.0.4:1234 (stream 0): reset", rank=2, peer=3)
    t2.link_kind("tcp").stream(0, 0).sock.send(control.framed(control.Abort(AbortInfo.of(news))))  # only rank 0 hears it directly
    with pytest.raises(PeerLostError) as first:
        t0.wait([t0.irecv(2, (Space.COLL, 1, 0), memoryview(bytearray(64)))], time.monotonic() + 10)
    assert first.value.peer == 3  # rank 0 names the dead rank
    with pytest.raises(PeerLostError) as second:
        t1.wait([waiting], time.monotonic() + 10)
    return second.value


def test_the_third_rank_names_the_dead_rank_not_the_messenger() -> None:
    with tcp_world(3) as worlds:
        err = _relay(worlds)
    assert err.peer == 3, str(err)


def test_the_third_rank_still_fails_fast_with_peer_lost() -> None:
    with tcp_world(3) as worlds:
        t_start = time.monotonic()
        err = _relay(worlds)
    assert isinstance(err, PeerLostError) and time.monotonic() - t_start < 5


def _wait_in_thread(t, reqs) -> "tuple[threading.Thread, list[BaseException]]":
    caught: list[BaseException] = []

    def run() -> None:
        try:
            t.wait(reqs, time.monotonic() + 20)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            caught.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, caught


def test_an_abort_behind_a_frame_in_flight_still_reaches_the_peer() -> None:
    """Rank 0 is half-way through writing a 32 MB frame to rank 1 when it learns that rank 2 died. The ABORT
    cannot go in the middle of the frame: rank 0 finishes the frame, then sends the ABORT. Were it skipped
    and the socket closed, rank 1 would blame rank 0 ("lost the connection to rank 0"): the case kill -9
    trials at 64 MB on 3 ranks run into."""
    n = 32 << 20
    with tcp_world(3) as (t0, t1, t2):
        big = t0.isend(1, (Space.COLL, 1, 0), memoryview(bytearray(n)))
        out0 = t0.link_kind("tcp").stream(1, 0).sendq
        assert out0 and out0[0].sent, "the frame should be partly written (socket buffers are smaller)"
        reqs = [t1.irecv(0, (Space.COLL, 1, 0), memoryview(bytearray(n))),
                t1.irecv(0, (Space.COLL, 2, 0), memoryview(bytearray(64)))]  # the next step: never comes
        th, caught = _wait_in_thread(t1, reqs)
        time.sleep(0.2)  # rank 1 reads what fits; rank 0 nobody drives: still mid-frame
        assert not big.done
        t0.abort(PeerLostError("rank 0: lost the connection to rank 2 at 10.0.0.3:1 (stream 0): reset",
                               rank=0, peer=2))
        th.join(20)
    assert caught and isinstance(caught[0], PeerLostError), caught
    assert caught[0].peer == 2, str(caught[0])


def test_an_abort_to_a_peer_that_is_still_sending_is_not_lost_in_a_reset() -> None:
    """Rank 0 fails while rank 1 is writing a large message to it that rank 0 never reads: closing a socket
    with unread bytes resets the connection, which throws away the ABORT still queued behind it."""
    n = 32 << 20
    with tcp_world(3) as (t0, t1, t2):
        reqs = [t1.isend(0, (Space.COLL, 1, 0), memoryview(bytearray(n))),
                t1.irecv(0, (Space.COLL, 1, 0), memoryview(bytearray(n))),
                t1.irecv(0, (Space.COLL, 2, 0), memoryview(bytearray(64)))]  # the next step: never comes
        t0.isend(1, (Space.COLL, 1, 0), memoryview(bytearray(n)))  # rank 0 mid-frame too
        th, caught = _wait_in_thread(t1, reqs)
        time.sleep(0.2)
        t0.abort(PeerLostError("rank 0: lost the connection to rank 2 at 10.0.0.3:1 (stream 0): reset",
                               rank=0, peer=2))
        th.join(20)
    assert caught and isinstance(caught[0], PeerLostError), caught
    assert caught[0].peer == 2, str(caught[0])
