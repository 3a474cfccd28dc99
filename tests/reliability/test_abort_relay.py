"""Who gets blamed when the news of a lost rank travels through another rank.

Rank 2 learns that some rank died and tells rank 0 with an ABORT frame. Rank 0 fails too and closes its
sockets. Rank 1, waiting for data from rank 0, must still learn the root cause (the dead rank), not "rank 0
closed the connection". Found by scripts/reliability/kill_trials.py (about 1 trial in 7 on 3–4 ranks).
"""
from __future__ import annotations

import time

import pytest

from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.protocol.framing import Space, encode_abort

from .inproc import tcp_world

pytestmark = pytest.mark.timeout(60)


def _relay(worlds) -> PeerLostError:
    t0, t1, t2 = worlds
    # rank 1 waits for data from rank 0 (as in a ring step)
    waiting = t1.irecv(0, (Space.COLL, 1, 0), memoryview(bytearray(64)))
    news = PeerLostError("rank 2: lost the connection to rank 3 at 10.0.0.4:1234 (stream 0): reset", rank=2, peer=3)
    t2.conns[0][0].sock.send(encode_abort(news))  # only rank 0 hears it directly
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
