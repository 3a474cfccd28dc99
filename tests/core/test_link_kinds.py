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
from torch_thunderbolt.errors import ConfigError, RdmaError
from torch_thunderbolt.rendezvous import group
from torch_thunderbolt.rendezvous import hosts as host_ids
from torch_thunderbolt.rendezvous.kinds import KINDS
from torch_thunderbolt.rendezvous.records import GaveUp
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
         made: "list[Recorded] | None" = None, fallback: str = "", give_up: "set[int]" = frozenset(),
         fail_on: "set[int]" = frozenset()) -> KindRow:
    """A kind whose set-up connects nothing. `give_up`: ranks whose set-up fails for a reason of the kind's own
    (the kind then `gives_way` under auto), `fail_on`: ranks where it fails otherwise (as `fail` on all)."""
    def offer(cfg: Config) -> str | None:
        return "refused by the test" if cfg.extra.get("rank") in refuse else None

    def connect(setup: SetUp) -> Recorded:
        if setup.rank in give_up:
            exc = RdmaError(f"rank {setup.rank}: the {name} device failed", device=f"dev{setup.rank}")
            setup.records.give_up(name, exc)
            raise exc
        if fail or setup.rank in fail_on:
            raise ConfigError(f"rank {setup.rank}: {name} failed")
        kind = Recorded(name, setup)
        if made is not None:
            made.append(kind)
        return kind
    return KindRow(name, f"the {name} kind", same_host, networks, offer, connect, fallback,
                   gives_way=bool(give_up or fail_on))


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


# --- a kind that gives way under auto (RDMA whose set-up fails) ------------------------------------------------

def test_under_auto_a_kind_given_up_on_one_rank_gives_all_its_pairs_to_the_next_kind(caplog) -> None:
    """Hosts a (ranks 0, 1) and b (2, 3); "fast" joins the hosts but rank 1's set-up of it gives up: every
    rank closes what it made of "fast" and sets "far" up for those pairs instead, saying why once."""
    made: list[Recorded] = []
    table = [_row("near", True, False), _row("fast", False, True, give_up={1}, made=made), _row("far", False, True)]
    with caplog.at_level(logging.INFO, logger="torch_thunderbolt"):
        run = _connect(4, table, lambda r: "aabb"[r])
    assert not run.errors, run.errors
    for r, c in enumerate(run.results):
        setups = {k.name: k.setup for k in c.transport.kinds}
        assert set(setups) == {"near", "far"}, setups
        assert setups["far"].peers == tuple(p for p in range(4) if p // 2 != r // 2)
        assert setups["far"].users == (0, 1, 2, 3)
    assert len(made) == 3 and all(k.released for k in made)  # ranks 0, 2, 3 made it: none keeps it
    said = sorted(r.getMessage() for r in caplog.records if "set-up failed" in r.getMessage())
    assert len(said) == 4 and all(r.levelno == logging.WARNING for r in caplog.records if "set-up failed" in
                                  r.getMessage())
    assert said[0].startswith("rank 0: the fast kind set-up failed on rank 1 (dev1): the fast device failed; "
                              "using the far kind instead with rank(s) [2, 3]"), said[0]


def test_ranks_that_do_not_use_the_kind_learn_that_it_gave_way_before_the_next_kind(caplog) -> None:
    """Rank 0 refuses "fast", so only ranks 1 and 2 use it; rank 2 gives it up: rank 0 sets "far" up with
    both of them (the users of "far" changed), and says so at INFO (none of its pairs changed)."""
    table = [_row("near", True, False), _row("fast", False, True, refuse={0}, give_up={2}), _row("far", False, True)]
    with caplog.at_level(logging.INFO, logger="torch_thunderbolt"):
        run = _connect(3, table, lambda r: "aab"[r])
    assert not run.errors, run.errors
    far = [next(k.setup for k in c.transport.kinds if k.name == "far") for c in run.results]
    assert [s.users for s in far] == [(0, 1, 2)] * 3 and far[0].peers == (2,) and far[1].peers == (2,)
    mine = [r for r in caplog.records if r.getMessage().startswith("rank 0: the fast kind set-up failed")]
    assert len(mine) == 1 and mine[0].levelno == logging.INFO


def test_a_failure_that_is_not_the_kinds_own_still_fails_the_group() -> None:
    run = _connect(4, [_row("near", True, False), _row("fast", False, True, fail_on={1}), _row("far", False, True)],
                   lambda r: "aabb"[r])
    assert set(run.errors) == {0, 1, 2, 3}, run.errors
    assert all("rank 1: fast failed" in str(e) for e in run.errors.values()), run.errors


def test_a_forced_kind_does_not_give_way() -> None:
    """(The kinds here connect nothing, so only the rank that failed and rank 0, which waits for every rank
    before leaving, see it; with real links every peer does: tests/rdma.)"""
    table = [_row("fast", False, True, give_up={1}), _row("far", False, True)]
    run = _connect(2, table, lambda r: "ab"[r], setting="fast")
    assert set(run.errors) == {0, 1} and all("the fast device failed" in str(e) for e in run.errors.values())


def _gave_up(rank: int, origin: int, device: str = "rdma_en2") -> GaveUp:
    return GaveUp(rank, origin, "RdmaError", device, f"rank {rank}: ibv_modify_qp on {device} failed"
                  if rank == origin else f"rank {rank}: rank {origin} gave up setting up rdma links: ...")


def test_the_warning_names_the_lowest_first_hand_failure_and_this_ranks_changed_peers() -> None:
    rdma = next(row for row in KINDS if row.name == "rdma")
    before = [["", "shm", "rdma", "rdma"], ["shm", "", "rdma", "rdma"], ["rdma", "rdma", "", "shm"],
              ["rdma", "rdma", "shm", ""]]
    after = [[{"rdma": "tcp"}.get(k, k) for k in line] for line in before]
    titles = {row.name: row.title for row in KINDS}
    gave = [_gave_up(0, 3), _gave_up(1, 1, "rdma_en5"), _gave_up(3, 3, "rdma_en7")]  # 0 learned it from 3
    level, line = group.gave_way(2, rdma, gave, before, after, titles)
    assert level == logging.WARNING
    assert line.startswith("rank 2: RDMA set-up failed on rank 1 (rdma_en5): ibv_modify_qp on rdma_en5 failed; "
                           "using TCP instead with rank(s) [0, 1], which is slower"), line
    assert "rank(s) [0, 1, 3] gave it up" in line and "`torch-thunderbolt doctor` on rank 1's host" in line
    # Only second-hand reports (their first-hand ones were lost): the lowest origin is named.
    level, line = group.gave_way(2, rdma, [_gave_up(3, 1, "")], before, after, titles)
    assert line.startswith("rank 2: RDMA set-up failed on rank 1: rank 3: rank 1 gave up setting up rdma links")
    # A rank with no RDMA peer of its own: the same cause, at INFO.
    shm_only = [["", "shm"], ["shm", ""]]
    level, line = group.gave_way(0, rdma, gave, shm_only, shm_only, titles)
    assert level == logging.INFO and "this rank had no RDMA peers" in line


def test_only_rdma_gives_way_under_auto() -> None:
    assert [(row.name, row.gives_way) for row in KINDS] == [("shm", False), ("rdma", True), ("tcp", False)]
