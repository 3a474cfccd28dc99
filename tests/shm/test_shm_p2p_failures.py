"""Point-to-point and failure semantics of the shm transport in real processes: tags, any-source, early
messages, mismatches (on both ranks), kill -9 of a peer, timeouts, orderly close; nothing left behind."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.leftovers import segments_and_doorbells
from torch_thunderbolt.testing.ranks import SHM, run_ranks

from .programs import p2p_failures

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_p2p_tags_order_any_source_and_early_messages(tmp_path) -> None:
    results = run_ranks(p2p_failures, 3, tmp_path, args=["tags_order"], setup=SHM, timeout=90)
    o0 = results[0].json()
    assert o0["got3"] == {"1": [11, 21, True], "2": [12, 22, True]}
    assert o0["srcs"] == [[1, 101], [2, 102]]
    assert [res.json()["back"] for res in results[1:]] == [1001, 1002]


def test_any_source_posted_before_the_message_arrives(tmp_path) -> None:
    results = run_ranks(p2p_failures, 2, tmp_path, args=["any_source_early"], setup=SHM, timeout=90)
    assert results[0].json() == {"source": 1, "value": 42}


@pytest.mark.parametrize("kind", ["size", "dtype", "op", "window_vs_ring", "window_vs_ring_receiver",
                                  "p2p_size"])
def test_mismatch_raises_on_both_ranks_and_breaks_the_group(kind: str, tmp_path) -> None:
    for res in run_ranks(p2p_failures, 2, tmp_path, args=["mismatch"], setup=SHM, timeout=90,
                         env={"TB_TIMEOUT": "20", "TEST_KIND": kind}):
        out = res.json()
        assert out["ok"] is False and out["type"] == "MismatchError", (res.rank, out)
        assert out["seconds"] < 5, out
        assert out["after"]["ok"] is False and out["after"]["seconds"] < 1


@pytest.mark.parametrize("size", [1 << 10, 4 << 20])
def test_kill_9_of_a_peer_gives_peer_lost_on_every_survivor(size: int, tmp_path) -> None:
    results = run_ranks(p2p_failures, 3, tmp_path, args=["kill_9"], setup=SHM, timeout=90,
                        env={"THUNDERBOLT_SHM_SLOT": "64K", "TEST_SIZE": str(size)}, expect_ok=False)
    assert results[2].returncode == -9
    for res in results[:2]:
        out = res.json()
        assert out["type"] == "PeerLostError", out
        assert out["peer"] == 2 and "rank 2" in out["msg"], out
        assert out["seconds"] < 5, out
        assert res.returncode == 0


def test_kill_9_while_blocked_waiting_in_p2p(tmp_path) -> None:
    results = run_ranks(p2p_failures, 2, tmp_path, args=["kill_9_in_p2p"], setup=SHM, timeout=90, expect_ok=False)
    out = results[0].json()
    assert out["type"] == "PeerLostError" and out["peer"] == 1 and out["seconds"] < 5, out


def test_stalled_rank_times_out_and_peers_learn_why(tmp_path) -> None:
    results = run_ranks(p2p_failures, 3, tmp_path, args=["stalled"], setup=SHM, timeout=90,
                        env={"TB_TIMEOUT": "1.5"}, expect_ok=False)
    for res in results[:2]:
        out = res.json()
        assert out["type"] == "CollectiveTimeout" and "Timed out" in out["msg"], out
        assert "[2]" in out["msg"], out
    late = results[2].json()  # its first op may complete from data already sent; the next one cannot
    assert late["next"]["ok"] is False and late["next"]["seconds"] < 5, late
    assert late["next"]["type"] in ("CollectiveTimeout", "PeerLostError"), late


def test_orderly_close_and_peer_closing_while_expected(tmp_path) -> None:
    results = run_ranks(p2p_failures, 2, tmp_path, args=["orderly_close"], setup=SHM, timeout=90)
    out = results[0].json()
    assert out["ok"] is False and out["type"] == "PeerLostError" and out["seconds"] < 5, out


def test_ranks_with_different_window_settings_get_a_config_error(tmp_path) -> None:
    before = segments_and_doorbells()
    for res in run_ranks(p2p_failures, 2, tmp_path, args=["window_settings"], timeout=60, expect_ok=False):
        out = res.json()
        assert out["ok"] is False and out["type"] == "ConfigError", (res.rank, out)
        assert "THUNDERBOLT_SHM_" in out["msg"] and out["seconds"] < 10
    assert not segments_and_doorbells() - before
