"""The hybrid transport (shm within a host, TCP across) over real processes on one machine, with two
emulated hosts of two ranks each (the HYBRID setup of torch_thunderbolt.testing.ranks): every collective
exact (the large all_reduce, all_gather and reduce_scatter hierarchical), same-host traffic never on TCP,
kill -9 of a rank fails every survivor with PeerLostError. The ranks run programs/hybrid.py."""
from __future__ import annotations

import pytest

from torch_thunderbolt.algorithms.shape import hosts_shape, shape_from_networks
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.rendezvous.kinds import KINDS, choose
from torch_thunderbolt.testing.ranks import HYBRID, run_ranks

from .programs import hybrid

pytestmark = [pytest.mark.multiprocess]


OK = {"shm": None, "tcp": None}


def _kinds(setting: str, hosts: list[str], offers: "list[dict] | None" = None) -> list[list[str]]:
    return choose(KINDS, setting, hosts, offers or [OK] * len(hosts))


def test_the_table_gives_every_pair_its_kind() -> None:
    assert _kinds("auto", ["a", "a", "b", "b"]) == [["", "shm", "tcp", "tcp"], ["shm", "", "tcp", "tcp"],
                                                    ["tcp", "tcp", "", "shm"], ["tcp", "tcp", "shm", ""]]
    assert _kinds("auto", ["a", "a", "b"])[2] == ["tcp", "tcp", ""]
    assert _kinds("auto", ["a", "a"]) == [["", "shm"], ["shm", ""]]
    assert _kinds("auto", ["a", "b"])[0][1] == "tcp"
    assert _kinds("tcp", ["a", "a"])[0][1] == "tcp"
    assert _kinds("shm", ["a", "a", "a"])[1] == ["shm", "", "shm"]
    with pytest.raises(ConfigError, match="THUNDERBOLT_TRANSPORT=shm: rank 1 runs on another host"):
        _kinds("shm", ["a", "b"])


def test_a_rank_that_cannot_offer_a_kind_gets_the_next_one() -> None:
    refusing = {"shm": "no full memory barrier", "tcp": None}
    assert _kinds("auto", ["a", "a", "a"], [OK, OK, refusing]) == [["", "shm", "tcp"], ["shm", "", "tcp"],
                                                                  ["tcp", "tcp", ""]]
    assert _kinds("shm", ["a", "a"], [refusing, OK])[0][1] == "tcp"  # forced, with a fallback
    old = {"shm": None}  # a peer that does not know a kind cannot use it
    with pytest.raises(ConfigError, match="tcp: rank 1 runs a version of torch-thunderbolt without 'tcp' links"):
        _kinds("tcp", ["a", "b"], [OK, old])


A, B, C = ["10.0.0.0/30"], ["10.0.0.0/30", "10.0.0.4/30"], ["10.0.0.4/30"]


def test_hosts_shape_keeps_the_chain_of_hosts_with_two_ranks_each() -> None:
    # ranks 0,3 on mac A, 1,4 on B (the middle), 2,5 on C: rank-level adjacency alone is no chain
    nets = [A, B, C, A, B, C]
    assert shape_from_networks(nets).kind != "chain"
    shape = hosts_shape(nets, ["a", "b", "c", "a", "b", "c"])
    assert shape.kind == "chain" and shape.order in ([0, 3, 1, 4, 2, 5], [2, 5, 1, 4, 0, 3])


def test_hosts_shape_groups_ranks_of_two_hosts() -> None:
    shape = hosts_shape([A] * 4, ["x", "y", "x", "y"])
    assert shape.kind == "mesh" and shape.order == [0, 2, 1, 3]


@pytest.mark.timeout(120)
def test_every_collective_is_exact_and_same_host_bytes_stay_off_tcp(tmp_path) -> None:
    runs = run_ranks(hybrid, 4, tmp_path, args=["collectives"], setup=HYBRID, timeout=100)
    for run in runs:
        got = run.json()
        assert got["kind"] == "shm+tcp", got
        assert got["bad"] == [], (run.rank, got["bad"])
        # No rank sent a byte over TCP while it exchanged with its same-host mate. (What it received there
        # may count a rank of the other host that went on to the next op: its small message is read ahead.)
        assert got["same_host"]["tcp"][0] == 0, (run.rank, got)
        one_each = 4 * (1000 + (1 << 18) + 3)  # one message of each size sent and one received
        assert got["same_host"]["shm"] == [one_each, one_each], (run.rank, got)
        assert min(got["tcp"]) > 0 and min(got["shm"]) > 0, (run.rank, got)
        assert got["order"] in ([0, 1, 2, 3], [2, 3, 0, 1], [1, 0, 3, 2], [3, 2, 1, 0]), got["order"]
        # the large all_reduce, all_gather, broadcast and reduce_scatter above ran hierarchically (and were
        # exact)
        assert got["hier"] == ["ag", "ar", "bc", "rs"], (run.rank, got["hier"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [256, 1 << 20])
def test_kill_9_gives_peer_lost_on_every_survivor(size: int, tmp_path) -> None:
    victim = 1  # shares emulated host 0 with rank 0; ranks 2 and 3 learn it over TCP
    runs = run_ranks(hybrid, 4, tmp_path, args=["kill"], setup=HYBRID, timeout=100, expect_ok=False,
                     env={"TEST_SIZE": str(size), "TEST_VICTIM": str(victim)})
    assert runs[victim].returncode == -9
    for run in runs:
        if run.rank == victim:
            continue
        out = run.json()
        assert out["type"] == "PeerLostError", (run.rank, out)
        assert out["peer"] == victim, (run.rank, out)
        assert out["seconds"] < 10, (run.rank, out)


@pytest.mark.timeout(60)
def test_transport_tcp_forces_tcp_between_same_host_ranks_too(tmp_path) -> None:
    runs = run_ranks(hybrid, 4, tmp_path, args=["forced"], setup=HYBRID, timeout=50,
                     env={"THUNDERBOLT_TRANSPORT": "tcp"})
    for run in runs:
        assert run.json() == {"kind": "tcp", "sum": [6.0] * 5}, (run.rank, run.json())


@pytest.mark.timeout(60)
def test_a_rank_alone_on_its_host_uses_tcp_and_talks_to_hybrid_ranks(tmp_path) -> None:
    # ranks 0, 1 share a host; rank 2 is alone
    runs = run_ranks(hybrid, 3, tmp_path, args=["forced"], setup=HYBRID, timeout=50)
    kinds = [run.json()["kind"] for run in runs]
    assert kinds == ["shm+tcp", "shm+tcp", "tcp"], kinds
    assert all(run.json()["sum"] == [3.0] * 5 for run in runs)


@pytest.mark.timeout(60)
def test_stalled_rank_times_out_everywhere_and_the_group_stays_broken(tmp_path) -> None:
    runs = run_ranks(hybrid, 4, tmp_path, args=["stall"], setup=HYBRID, timeout=50, expect_ok=False)
    for run in runs[:3]:  # rank 1 shares a host with rank 0 only; rank 2 shares one with the stalled rank
        out = run.json()
        assert out["type"] == "CollectiveTimeout" and "did not arrive: [3]" in out["msg"], (run.rank, out)
        assert out["next"]["ok"] is False and out["next"]["seconds"] < 1, (run.rank, out)
    late = runs[3].json()
    assert late["next"]["ok"] is False and late["next"]["seconds"] < 5, late
