"""Point-to-point and failure semantics of the shm transport in real processes: tags, any-source, early
messages, mismatches (on both ranks), kill -9 of a peer, timeouts, orderly close; nothing left behind."""
from __future__ import annotations

import pytest

from ..core.mp import PRELUDE, run_ranks
from .shm_harness import leftovers, run_shm

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

COMM = """
from torch_thunderbolt.algorithms.collectives import Communicator
comm = Communicator(t, Config(), timeout=float(os.environ.get("TB_TIMEOUT", "30")))
def arr(v, n=1000, dt=torch.int64):
    return torch.full((n,), v, dtype=dt)
def mv(x):
    return memoryview(x.numpy()).cast("B")  # keeps the tensor alive while the transport holds the view
"""


def test_p2p_tags_order_any_source_and_early_messages(tmp_path) -> None:
    script = COMM + """
out = {}
if r != 0:
    # tag 7 before tag 3, and a large message (many slots) sent before rank 0 posts anything
    reqs = [t.isend_p2p(0, 7, mv(arr(100 + r))), t.isend_p2p(0, 3, mv(arr(10 + r, n=50000))),
            t.isend_p2p(0, 3, mv(arr(20 + r, n=5)))]
    t.wait(reqs, time.monotonic() + 30)
    back = arr(0)
    t.wait([t.irecv_p2p(0, 9, mv(back))], time.monotonic() + 30)
    out["back"] = int(back[0])
else:
    time.sleep(0.5)  # everything above arrives early: buffered as unexpected p2p
    got3 = {}
    for p in range(1, w):
        a, b = arr(0, n=50000), arr(0, n=5)
        t.wait([t.irecv_p2p(p, 3, mv(a)), t.irecv_p2p(p, 3, mv(b))], time.monotonic() + 30)
        got3[p] = [int(a[0]), int(b[0]), bool((a == a[0]).all())]
    srcs = []
    for _ in range(1, w):
        x = arr(0)
        q = t.irecv_p2p(ANY_SOURCE, 7, mv(x))
        t.wait([q], time.monotonic() + 30)
        srcs.append([q.source, int(x[0])])
    t.wait([t.isend_p2p(p, 9, mv(arr(1000 + p))) for p in range(1, w)], time.monotonic() + 30)
    out = {"got3": got3, "srcs": sorted(srcs)}
comm.barrier()
t.close()
result(out)
"""
    results = run_shm(script, 3, tmp_path)
    o0 = results[0].json()
    assert o0["got3"] == {"1": [11, 21, True], "2": [12, 22, True]}
    assert o0["srcs"] == [[1, 101], [2, 102]]
    assert [res.json()["back"] for res in results[1:]] == [1001, 1002]


def test_any_source_posted_before_the_message_arrives(tmp_path) -> None:
    script = COMM + """
if r == 0:
    x = arr(0)
    q = t.irecv_p2p(ANY_SOURCE, 5, mv(x))
    t.wait([q], time.monotonic() + 30)
    out = {"source": q.source, "value": int(x[0])}
else:
    time.sleep(0.3)
    t.wait([t.isend_p2p(0, 5, mv(arr(42)))], time.monotonic() + 30)
    out = {}
t.close()
result(out)
"""
    assert run_shm(script, 2, tmp_path)[0].json() == {"source": 1, "value": 42}


@pytest.mark.parametrize("kind", ["size", "dtype", "op", "window_vs_ring", "window_vs_ring_receiver",
                                  "p2p_size"])
def test_mismatch_raises_on_both_ranks_and_breaks_the_group(kind: str, tmp_path) -> None:
    script = COMM + f"""
kind = "{kind}"
def op():
    if kind == "size":
        comm.all_reduce(torch.ones(10 + r))
    elif kind == "dtype":
        comm.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64))
    elif kind == "op":
        x = torch.ones(10)
        comm.all_reduce(x) if r == 0 else comm.broadcast(x, 0)
    elif kind == "window_vs_ring":  # a shared-window op on one rank, a slot-ring op on the other
        x = torch.ones(1 << 16)
        comm.all_reduce(x) if r == 0 else comm.all_gather(torch.empty(2 << 16), x)
    elif kind == "window_vs_ring_receiver":  # the ring op only receives: the gather's root
        x = torch.ones(1000)
        comm.gather(torch.empty(2000), x, 0, [1000, 1000]) if r == 0 else comm.all_reduce(x)
    else:
        if r == 0:
            t.wait([t.isend_p2p(1, 0, mv(arr(1, n=8)))], time.monotonic() + 10)
            comm.barrier()
        else:
            t.wait([t.irecv_p2p(0, 0, mv(arr(0, n=9)))], time.monotonic() + 10)
res = outcome(op)
res["after"] = outcome(lambda: comm.all_reduce(torch.ones(3)))
t.close()
result(res)
"""
    for res in run_shm(script, 2, tmp_path, env={"TB_TIMEOUT": "20"}):
        out = res.json()
        assert out["ok"] is False and out["type"] == "MismatchError", (res.rank, out)
        assert out["seconds"] < 5, out
        assert out["after"]["ok"] is False and out["after"]["seconds"] < 1


@pytest.mark.parametrize("size", [1 << 10, 4 << 20])
def test_kill_9_of_a_peer_gives_peer_lost_on_every_survivor(size: int, tmp_path) -> None:
    script = COMM + f"""
x = torch.ones({size} // 4)
def loop():
    for i in range(100000):
        if r == 2 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(x)
res = outcome(loop)
t.close()
result(res)
"""
    results = run_shm(script, 3, tmp_path, env={"THUNDERBOLT_SHM_SLOT": "64K"}, expect_ok=False)
    assert results[2].returncode == -9
    for res in results[:2]:
        out = res.json()
        assert out["type"] == "PeerLostError", out
        assert out["peer"] == 2 and "rank 2" in out["msg"], out
        assert out["seconds"] < 5, out
        assert res.returncode == 0


def test_kill_9_while_blocked_waiting_in_p2p(tmp_path) -> None:
    script = COMM + """
if r == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
res = outcome(lambda: t.wait([t.irecv_p2p(1, 0, mv(arr(0)))], time.monotonic() + 30))
t.close()
result(res)
"""
    results = run_shm(script, 2, tmp_path, expect_ok=False)
    out = results[0].json()
    assert out["type"] == "PeerLostError" and out["peer"] == 1 and out["seconds"] < 5, out


def test_stalled_rank_times_out_and_peers_learn_why(tmp_path) -> None:
    script = COMM + """
def op():
    if r == 2:
        time.sleep(4)
        comm.all_reduce(torch.ones(10))
        return
    comm.all_reduce(torch.ones(10))
res = outcome(op)
res["next"] = outcome(lambda: comm.all_reduce(torch.ones(10)))
t.close()
result(res)
"""
    results = run_shm(script, 3, tmp_path, env={"TB_TIMEOUT": "1.5"}, expect_ok=False)
    for res in results[:2]:
        out = res.json()
        assert out["type"] == "CollectiveTimeout" and "Timed out" in out["msg"], out
        assert "[2]" in out["msg"], out
    late = results[2].json()  # its first op may complete from data already sent; the next one cannot
    assert late["next"]["ok"] is False and late["next"]["seconds"] < 5, late
    assert late["next"]["type"] in ("CollectiveTimeout", "PeerLostError"), late


def test_orderly_close_and_peer_closing_while_expected(tmp_path) -> None:
    script = COMM + """
comm.all_reduce(torch.ones(100))
if r == 1:
    t.close()
    result({"closed": True})
else:
    res = outcome(lambda: t.wait([t.irecv_p2p(1, 0, mv(arr(0)))], time.monotonic() + 10))
    t.close()
    result(res)
"""
    results = run_shm(script, 2, tmp_path)
    out = results[0].json()
    assert out["ok"] is False and out["type"] == "PeerLostError" and out["seconds"] < 5, out


def test_ranks_with_different_window_settings_get_a_config_error(tmp_path) -> None:
    script = PRELUDE + """
from datetime import timedelta
from torch_thunderbolt.config import Config
from torch_thunderbolt.rendezvous.shm import ShmOptions, connect_shm
r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), w, r == 0, timeout=timedelta(seconds=30))
opts = ShmOptions(window_bytes=(2 << 20) if r == 0 else 0)  # as if THUNDERBOLT_SHM_WINDOW differed
result(outcome(lambda: connect_shm(store, r, w, Config(), 20, opts).close()))
"""
    before = leftovers()
    for res in run_ranks(script, 2, tmp_path, timeout=60, expect_ok=False):
        out = res.json()
        assert out["ok"] is False and out["type"] == "ConfigError", (res.rank, out)
        assert "THUNDERBOLT_SHM_" in out["msg"] and out["seconds"] < 10
    assert not leftovers() - before
