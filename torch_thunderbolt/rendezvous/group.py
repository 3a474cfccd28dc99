"""Connecting one group: which links each rank gets, and what the algorithms need to know of the cluster.

`connect` is all the backend asks of the set-up: given the rendezvous store, this rank, the group size and
the Config, it returns a connected transport and every rank's networks and host (the backend derives the
cluster shape from them: algorithms/shape.py). Every rank publishes who it is (host identity) and which
kinds of link it can offer; the table in kinds.py gives every pair of ranks its kind (`auto`: shared memory
within a host, TCP between hosts); each kind is then set up among the ranks that use it, in the table's
order on every rank, and one engine holds them all. Before any link is made the ranks compare the
settings that must agree, and rank 0 (the store's host) leaves only once every rank has read what it needs
from the store (agree.py). Every record read from the store is checked (records.py); a rank that gives up
says why there, and every rank waiting for it raises that reason.

Under `auto`, the RDMA set-up failing for a reason of RDMA's own on any rank (a verbs call, a device gone, a
wedged port, a path that carries nothing: `KindRow.gives_way`) does not fail the job: every rank, whether
it uses RDMA or not, reads how each RDMA user's set-up ended, and if any gave up, all of the group's RDMA
pairs are chosen again without RDMA (TCP), with one warning per rank saying why. All ranks reach the same
kinds because they decide on the same records, and no rank guesses. A forced `rdma` fails at once instead.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..config import Config
from ..errors import HandshakeError
from ..transport.base import LinkKind
from ..transport.engine import Transport
from ..transport.names import RankNames
from . import hosts as host_ids
from .agree import agree_settings, leave_together
from .kinds import KINDS, choose, refused
from .records import GaveUp, GroupAuth, Records
from .setup import KindRow, SetUp
from .tcp import check_machine, local_networks

log = logging.getLogger("torch_thunderbolt")


@dataclass
class Connected:
    transport: Transport
    nets: "list[list[str]] | None"  # every rank's networks (CIDR), None where no link runs over IP networks
    hosts: "list[str] | None"  # every rank's host identity, where links were chosen by host (auto)


def connect(store: Any, rank: int, world: int, cfg: Config, timeout: float, names: RankNames | None = None,
            table: Sequence[KindRow] = KINDS) -> Connected:
    """Connect this rank to every other rank of the group (all ranks call this together). `names`: how the
    transport's errors name the ranks of a subgroup (None when its ranks are the global ones). `table`: the
    kinds of link to choose from (tests add kinds of their own)."""
    if world == 1:
        return Connected(Transport(rank, 1, [], names=names), None, None)
    records = Records(store, rank, cfg.secret, time.monotonic() + min(timeout, cfg.connect_timeout))
    try:
        auth = records.join_group()
        return _connect(store, rank, world, cfg, timeout, names, table, records, auth)
    except BaseException as exc:
        records.announce(exc)
        raise


def _connect(store: Any, rank: int, world: int, cfg: Config, timeout: float, names: RankNames | None,
             table: Sequence[KindRow], records: Records, auth: GroupAuth) -> Connected:
    # First of all: what this machine refuses of this rank's settings, whatever kinds of link it will use
    # (a THUNDERBOLT_IFNAME naming no interface here fails on a rank that only shares memory too), then the
    # settings that must agree (a transport that differs would make the steps below wait for records or
    # connections that never come).
    check_machine(cfg, rank)
    agreement = agree_settings(records, rank, world, cfg, names)
    offers = {row.name: row.offer(cfg) for row in table}
    reach = {row.name: row.reach(cfg) for row in table if row.reach is not None and offers[row.name] is None}
    # Looked up at call time (not imported by name): tests emulate hosts by patching it.
    records.publish(f"tb/rank/{rank}", {"host": host_ids.host_identity(), "offers": offers, "reach": reach})
    everyone = [records.read(f"tb/rank/{p}", p, "its host and kinds of link") for p in range(world)]
    try:
        hosts = [str(r["host"]) for r in everyone]
        every_offer = [dict(r["offers"]) for r in everyone]
        every_reach = [dict(r.get("reach", {})) for r in everyone]
    except (TypeError, KeyError, ValueError):
        raise HandshakeError(f"rank {rank}: a record tb/rank/<rank> in the rendezvous store holds no host and "
                             f"kinds of link", why="store") from None
    # (the per-host settings where ranks share memory: every host's under auto, the one host under shm)
    agreement.check_hosts(hosts if cfg.transport == "auto" else None, cfg.transport)
    kinds = choose(table, cfg.transport, hosts, every_offer, every_reach)
    for row, peers, why in refused(table, rank, hosts, every_offer, kinds):
        level = logging.INFO if row.quiet is not None and row.quiet(why) else logging.WARNING
        log.log(level, "rank %d: not using %s with rank(s) %s (%s): %s instead, which is slower", rank, row.title,
                peers, why, " and ".join(sorted({kinds[rank][p] for p in peers})))
    made: list[LinkKind] = []
    left_out: set[str] = set()  # kinds whose set-up gave way (auto): the table chooses without them
    try:
        for row in table:
            users = tuple(r for r in range(world) if row.name in kinds[r])
            gives_way = row.gives_way and cfg.transport == "auto" and bool(users)
            mine: LinkKind | None = None
            if rank in users:
                peers = tuple(p for p in range(world) if kinds[rank][p] == row.name)
                try:
                    mine = row.connect(SetUp(store, rank, world, cfg, timeout, peers, users, records, auth,
                                             tuple(hosts)))
                except BaseException:
                    if not (gives_way and records.gave_up(row.name)):
                        raise
                else:
                    made.append(mine)
                    if gives_way:
                        records.made(row.name)
            if not gives_way:
                continue
            # Every rank, users or not, learns how each user's set-up ended: the next kinds' users depend on it.
            gave_up = [g for u in users if (g := records.outcome(row.name, u)) is not None]
            if not gave_up:
                continue
            if mine is not None:  # made here, but not everywhere: a kind is used by the whole group or not at all
                made.remove(mine)
                _close(mine)
            left_out.add(row.name)
            before = kinds
            kinds = choose([r for r in table if r.name not in left_out], cfg.transport, hosts, every_offer,
                           every_reach)
            level, said = gave_way(rank, row, gave_up, before, kinds, {r.name: r.title for r in table})
            log.log(level, "%s", said)
        used = {name for line in kinds for name in line if name}
        nets = None
        if any(row.networks for row in table if row.name in used):  # the cabling the algorithms plan for
            records.publish(f"tb/nets/{rank}", local_networks(store, cfg, rank))
            nets = [list(records.read(f"tb/nets/{p}", p, "its networks")) for p in range(world)]
    except BaseException:
        for kind in made:  # what was set up before the failing kind
            _close(kind)
        raise
    connected = Connected(Transport(rank, world, made, names=names), nets, hosts if cfg.transport == "auto" else None)
    try:
        leave_together(records, rank, world)
    except BaseException:
        connected.transport.close()
        raise
    return connected


def _close(kind: LinkKind) -> None:
    """Close a kind's links and release what they share, before any engine holds them (nothing said to the
    peers: they close theirs too)."""
    for link in kind.links.values():
        link.close(bye=False)
    kind.release()


def gave_way(rank: int, row: KindRow, gave_up: Sequence[GaveUp], before: Sequence[Sequence[str]],
             after: Sequence[Sequence[str]], titles: Mapping[str, str]) -> tuple[int, str]:
    """(log level, line) with which `rank` says that the set-up of `row`'s kind failed and what its pairs use
    instead: a warning where this rank's own peers changed kind, else INFO. `gave_up`: every rank that gave
    it up (Records.outcome); the cause named is the lowest rank's that failed first-hand (its device or path),
    the same on every rank. `before`/`after`: the kinds chosen with and without it. Pure."""
    first = [g for g in gave_up if g.first_hand] or list(gave_up)
    cause = min(first, key=lambda g: (g.origin, g.rank))
    why = cause.message.removeprefix(f"rank {cause.origin}: ")
    where = f"rank {cause.origin}" + (f" ({cause.device})" if cause.device else "")
    line = f"rank {rank}: {row.title} set-up failed on {where}: {why}"
    changed = [p for p in range(len(before)) if p != rank and before[rank][p] == row.name]
    instead = " and ".join(titles.get(k, k) for k in sorted({after[rank][p] for p in changed}))
    gave = sorted(g.rank for g in gave_up)
    if not changed:
        return logging.INFO, (f"{line}; the group uses no {row.title} (rank(s) {gave} gave it up); this rank had "
                              f"no {row.title} peers")
    return logging.WARNING, (
        f"{line}; using {instead} instead with rank(s) {changed}, which is slower (every {row.title} pair of "
        f"the group falls back: rank(s) {gave} gave it up). `torch-thunderbolt doctor` on rank {cause.origin}'s "
        f"host tells what is wrong there")
