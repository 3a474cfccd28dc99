"""Failure semantics on real processes: dead peers, stalls, mismatched calls, clean teardown."""
from __future__ import annotations

import time

import pytest

from torch_thunderbolt.testing.ranks import run_ranks, start_ranks

from .programs import failures

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [1 << 10, 4 << 20])
def test_kill_9_mid_all_reduce_every_survivor_raises_peer_lost(size: int, transport: str, tmp_path) -> None:
    results = run_ranks(failures, 3, tmp_path, args=["kill_9"], timeout=60, expect_ok=False,
                        env={"THUNDERBOLT_TRANSPORT": transport, "TEST_SIZE": str(size)})
    assert results[2].returncode == -9
    for res in results[:2]:
        out = res.json()
        assert out["ok"] is False
        assert out["type"] == "PeerLostError", out
        assert "rank 2" in out["msg"], out
        assert out["peer"] == 2, out
        assert res.returncode == 0


def test_stalled_rank_gives_collective_timeout_naming_it(tmp_path) -> None:
    results = run_ranks(failures, 2, tmp_path, args=["stalled"], timeout=60, env={"TB_TIMEOUT": "2"},
                        expect_ok=False)
    out = results[0].json()
    assert out["type"] == "CollectiveTimeout" and "Timed out" in out["msg"], out
    assert "[1]" in out["msg"] and "all_reduce" in out["msg"], out
    assert 1.5 < out["seconds"] < 10, out


@pytest.mark.parametrize("transport, op", [
    ("tcp", "all_reduce"), ("shm", "all_reduce"),
    *(pytest.param(t, op, marks=pytest.mark.slow) for t in ("tcp", "shm") for op in ("broadcast", "send"))])
def test_a_rank_that_arrives_after_the_others_timed_out_gets_their_error(transport: str, op: str,
                                                                         tmp_path) -> None:
    """Its op finds what it needs already there (the others sent before they gave up) or only sends, and
    must not succeed: the group timed out."""
    results = run_ranks(failures, 3, tmp_path, args=["late"], timeout=60, expect_ok=False,
                        env={"TB_TIMEOUT": "2", "TEST_OP": op, "THUNDERBOLT_TRANSPORT": transport})
    waiting = [results[0]] if op == "send" else results[:2]  # (a send: only rank 0 waits for the late rank)
    for res in waiting:
        out = res.json()
        assert out["type"] == "CollectiveTimeout" and "Timed out" in out["msg"], (res.rank, out)
    out = results[2].json()
    assert not out["ok"], out
    assert out["type"] == "CollectiveTimeout" and "aborted the group" in out["msg"], out
    # (a send: rank 1, idle meanwhile, may time out first in the next all_reduce, waiting for ranks 0 and 2)
    assert "Timed out" in out["msg"] and (op == "send" or "did not arrive: [2]" in out["msg"]), out
    assert out["after"]["type"] == "CollectiveTimeout", out


def test_init_again_after_a_rank_died_during_init(tmp_path) -> None:
    """torch names the default group after a count that only destroy_process_group resets: a failed init
    that kept it raised would make the next one wait under another store prefix than a restarted rank's."""
    with start_ranks(failures, 2, tmp_path, args=["init_again"]) as ranks:
        deadline = time.time() + 60
        while not ranks[0].tagged("RETRY") and ranks[0].proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ranks[0].tagged("RETRY"), ranks[0].stderr()[-3000:]
        ranks.restart(1, {"TEST_LIFE": "2"})
        assert ranks.wait(time.time() + 50), "ranks hung"
        zero, _, one = ranks.results()
    first = zero.json()["first"]
    assert first["type"] == "PeerLostError" and "rank 1" in first["msg"], first
    for res in (zero, one):
        again = res.json()
        assert again["again"]["ok"] and again["sum"] == [2.0] * 4, (res.rank, again, res.stderr[-3000:])


@pytest.mark.parametrize("kind", ["size", "dtype", "op"])
def test_mismatched_calls_raise_on_every_rank(kind: str, tmp_path) -> None:
    results = run_ranks(failures, 2, tmp_path, args=["mismatched"], timeout=60,
                        env={"TB_TIMEOUT": "20", "TEST_KIND": kind}, expect_ok=False)
    for res in results:
        out = res.json()
        assert out["ok"] is False and out["type"] == "MismatchError", (res.rank, out)
        assert out["seconds"] < 5, out
        assert out["after"]["ok"] is False  # the group is BROKEN from then on, at once
        assert out["after"]["seconds"] < 1


def test_destroy_releases_sockets_and_threads(tmp_path) -> None:
    for res in run_ranks(failures, 2, tmp_path, args=["destroy"], timeout=60, env={"THUNDERBOLT_TRANSPORT": "tcp"}):
        out = res.json()
        assert out["conns_during"] >= 2
        assert out["conns_after"] == 0, out
        assert out["threads_after"] <= out["threads_before"], out
