"""rendezvous.group.connect over a table of kinds: every pair gets the kind the table gives it, each kind is
set up once among the ranks that use it, a rank says which kind it refused and why, and a failing set-up
releases what the kinds before it had made. Thread ranks over a HashStore, with kinds that connect nothing."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from torch_thunderbolt.config import TRANSPORTS, Config
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.rendezvous import group
from torch_thunderbolt.rendezvous import hosts as host_ids
from torch_thunderbolt.rendezvous.kinds import KINDS
from torch_thunderbolt.rendezvous.setup import KindRow, SetUp
from torch_thunderbolt.testing.worlds import on_threads
from torch_thunderbolt.transport.base import LinkKind

pytestmark = pytest.mark.timeout(60)


class Recorded(LinkKind):
    """A kind that connected nothing: what its set-up was given, and whether it was released."""

    def __init__(self, name: str, setup: SetUp) -> None:
        self.name, self.setup, self.links, self.released = name, setup, {}, False

    def release(self) -> None:
        self.released = True


def _row(name: str, same_host: bool, networks: bool, refuse: "set[int]" = frozenset(), fail: bool = False,
         made: "list[Recorded] | None" = None, fallback: str = "") -> KindRow:
    def offer(cfg: Config) -> str | None:
        return "refused by the test" if cfg.extra.get("rank") in refuse else None

    def connect(setup: SetUp) -> Recorded:
        if fail:
            raise ConfigError(f"rank {setup.rank}: {name} failed")
        kind = Recorded(name, setup)
        if made is not None:
            made.append(kind)
        return kind
    return KindRow(name, f"the {name} kind", same_host, networks, offer, connect, fallback)


def _connect(world: int, table: "list[KindRow]", host_of, setting: str = "auto"):
    """connect() on `world` thread ranks; rank r claims host host_of(r)."""
    store = dist.HashStore()
    thread_rank: dict[int, int] = {}

    def rank(r: int) -> group.Connected:
        thread_rank[threading.get_ident()] = r
        cfg = replace(Config(transport=setting), extra={"rank": r})
        return group.connect(dist.PrefixStore("g/", store), r, world, cfg, 20, table=table)

    original = host_ids.host_identity
    host_ids.host_identity = lambda: host_of(thread_rank[threading.get_ident()])
    try:
        run = on_threads(world, rank, 30)
    finally:
        host_ids.host_identity = original
    assert not run.hung
    return run


def test_each_kind_is_set_up_among_the_ranks_that_use_it() -> None:
    table = [_row("near", True, False), _row("far", False, True)]
    run = _connect(5, table, lambda r: "ab"[r // 3])  # ranks 0-2 on host a, 3-4 on b
    assert not run.errors, run.errors
    for r, c in enumerate(run.results):
        setups = {k.name: k.setup for k in c.transport.kinds}
        assert setups["near"].peers == tuple(p for p in range(5) if p != r and p // 3 == r // 3)
        assert setups["near"].users == (0, 1, 2, 3, 4)
        assert setups["far"].peers == tuple(p for p in range(5) if p // 3 != r // 3)
        assert setups["far"].users == (0, 1, 2, 3, 4) and setups["far"].leader == 0
        assert c.transport.kind == "far+near"
        assert c.hosts == ["a", "a", "a", "b", "b"]
        assert c.nets is not None and len(c.nets) == 5  # a kind over IP networks: the cabling is exchanged


def test_a_rank_that_refuses_a_kind_says_so_and_gets_the_next(caplog) -> None:
    table = [_row("near", True, False, refuse={2}), _row("far", False, True)]
    with caplog.at_level(logging.WARNING, logger="torch_thunderbolt"):
        run = _connect(3, table, lambda r: "a")
    assert not run.errors, run.errors
    kinds = [{k.name: k.setup.peers for k in c.transport.kinds} for c in run.results]
    assert kinds[0] == {"near": (1,), "far": (2,)} and kinds[2] == {"far": (0, 1)}
    assert kinds[2]["far"] and run.results[2].transport.kind == "far"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["rank 2: not using the near kind with rank(s) [0, 1] (refused by the test): far instead, "
                    "which is slower"]


def test_without_a_kind_over_ip_networks_no_networks_are_looked_up() -> None:
    run = _connect(2, [_row("near", True, False)], lambda r: "a")
    assert not run.errors and all(c.nets is None for c in run.results)


def test_a_kind_that_joins_no_pair_is_not_set_up() -> None:
    run = _connect(3, [_row("near", True, False, refuse={0, 1}), _row("far", False, True)], lambda r: "a")
    assert not run.errors
    assert [[k.name for k in c.transport.kinds] for c in run.results] == [["far"]] * 3  # only rank 2 offers near


def test_the_leader_of_a_kind_is_its_lowest_user() -> None:
    # 0 and 1 share host a; 1 offers no "fast": 0-1 near, 0-2 fast, 1-2 far (rank 0 has no "far" links)
    table = [_row("near", True, False), _row("fast", False, True, refuse={1}), _row("far", False, True)]
    run = _connect(3, table, lambda r: "aab"[r])
    assert not run.errors, run.errors
    far = [[k.setup for k in c.transport.kinds if k.name == "far"] for c in run.results]
    assert far[0] == [] and far[1][0].users == (1, 2) and far[1][0].leader == far[2][0].leader == 1


def test_a_pair_no_kind_can_join_is_a_config_error_saying_why() -> None:
    table = [_row("near", True, False), _row("far", False, True, refuse={0})]
    run = _connect(2, table, lambda r: "ab"[r])
    assert set(run.errors) == {0, 1}
    assert "rank 0 and rank 1: near reaches only its own host; far: rank 0 refused by the test" in str(run.errors[1])


def test_a_failing_set_up_releases_the_kinds_made_before_it() -> None:
    made: list[Recorded] = []
    table = [_row("near", True, False, made=made), _row("far", False, True, fail=True)]
    run = _connect(2, table, lambda r: "ab"[r] if r < 2 else "b")
    assert set(run.errors) == {0, 1} and all("far failed" in str(e) for e in run.errors.values())
    assert made == []  # (different hosts: "near" joins nobody)
    table = [_row("near", True, False, made=made), _row("far", False, True, fail=True)]
    run = _connect(3, table, lambda r: "aab"[r])
    assert set(run.errors) == {0, 1, 2}
    assert len(made) == 2 and all(k.released for k in made)


def test_a_forced_kind_that_cannot_reach_a_peer_is_a_config_error() -> None:
    run = _connect(2, [_row("near", True, False), _row("far", False, True)], lambda r: "ab"[r], setting="near")
    assert all(isinstance(e, ConfigError) and "runs on another host" in str(e) for e in run.errors.values())
    assert set(run.errors) == {0, 1}


def test_the_runtime_table_prefers_shared_memory_then_rdma_then_tcp() -> None:
    assert [(row.name, row.same_host, row.networks, row.fallback) for row in KINDS] == [
        ("shm", True, False, "tcp"), ("rdma", False, True, ""), ("tcp", False, True, "")]
    assert {"auto", *(row.name for row in KINDS)} == set(TRANSPORTS)  # every kind can be forced, nothing else
