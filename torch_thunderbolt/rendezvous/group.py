"""Connecting one group: which links each rank gets, and what the algorithms need to know of the cluster.

`connect` is all the backend asks of the set-up: given the rendezvous store, this rank, the group size and
the Config, it returns a connected transport and every rank's networks and host (the backend derives the
cluster shape from them: algorithms/shape.py). `auto` picks shared memory when the whole group
shares one host, TCP between hosts, and both in one engine when hosts run several ranks each. Before any
link is made the ranks compare the settings that must agree, and rank 0 (the store's host) leaves only once
every rank has read what it needs from the store (agree.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..transport import shm_ring
from ..transport.engine import Transport
from ..transport.base import LinkKind
from ..transport.names import RankNames
from .agree import agree_settings, leave_together
from .hosts import host_map
from .records import GroupAuth, Records
from .shm import ShmOptions, connect_shm_links
from .tcp import connect_tcp_links

log = logging.getLogger("torch_thunderbolt")


@dataclass
class Connected:
    transport: Transport
    nets: "list[list[str]] | None"  # every rank's networks (CIDR), None where no link runs over IP networks
    hosts: "list[str] | None"  # every rank's host identity, where links were chosen by host (auto)


def connect(store: Any, rank: int, world: int, cfg: Config, timeout: float,
            names: RankNames | None = None) -> Connected:
    """Connect this rank to every other rank of the group (all ranks call this together). `names`: how the
    transport's errors name the ranks of a subgroup (None when its ranks are the global ones). Every record
    read from the store is checked (records.py); a rank that gives up says why there, and every rank
    waiting for it raises that reason."""
    if world == 1:
        return Connected(Transport(rank, 1, [], names=names), None, None)
    records = Records(store, rank, cfg.secret, time.monotonic() + min(timeout, cfg.connect_timeout))
    try:
        auth = records.join_group()
        return _connect(store, rank, world, cfg, timeout, names, records, auth)
    except BaseException as exc:
        records.announce(exc)
        raise


def _connect(store: Any, rank: int, world: int, cfg: Config, timeout: float, names: RankNames | None,
             records: Records, auth: GroupAuth) -> Connected:
    # First of all: the settings that must agree (a transport that differs would make the steps below
    # wait for records or connections that never come).
    agreement = agree_settings(records, rank, world, cfg, names)
    hosts = None if cfg.transport != "auto" else host_map(records, rank, world)
    agreement.check_hosts(hosts, cfg.transport)
    kind = choose_transport(cfg.transport, rank, hosts)
    if kind in ("shm", "hybrid"):
        kind = shm_or_tcp(kind, rank)
    if kind == "shm":
        connected = Connected(Transport(rank, world, [connect_shm_links(store, rank, world, cfg, timeout,
                                                                        records=records)], names=names), None, hosts)
    else:
        if kind == "hybrid" and hosts is not None:
            kinds, nets = connect_hybrid_links(store, rank, world, cfg, timeout, hosts, records, auth)
        else:
            tcp, nets = connect_tcp_links(store, rank, world, cfg, timeout, records=records, auth=auth)
            kinds = [tcp]
        connected = Connected(Transport(rank, world, kinds, names=names), nets, hosts)
    try:
        leave_together(records, rank, world)
    except BaseException:
        connected.transport.close()
        raise
    return connected


def connect_hybrid_links(store: Any, rank: int, world: int, cfg: Config, timeout: float,
                         hosts: list[str], records: Records | None = None,
                         auth: GroupAuth | None = None) -> "tuple[list[LinkKind], list[list[str]]]":
    """Shared memory among the ranks whose host identity (`hosts[r]`) equals ours, TCP for the rest: the
    two kinds of links of one engine, and every rank's networks. Every rank of the group must call this
    together."""
    local = [p for p in range(world) if p != rank and hosts[p] == hosts[rank]]
    opts = ShmOptions.from_config(cfg)
    # TCP first: every rank takes part in it, so the shm set-up below cannot wait on a rank stuck in TCP's.
    remote = [p for p in range(world) if p != rank and p not in local]
    tcp, networks = connect_tcp_links(store, rank, world, cfg, timeout, peers=remote, records=records, auth=auth)
    try:
        shm = connect_shm_links(store, rank, world, cfg, timeout, opts, peers=local, records=records)
    except BaseException:
        for link in tcp.links.values():
            link.close(bye=False)
        raise
    return [shm, tcp], networks


def choose_transport(setting: str, rank: int, hosts: list[str] | None) -> str:
    """tcp, shm or hybrid for this rank. `auto`: shm when the whole group shares one host; shm to this
    host's peers plus TCP to the others when both exist; TCP for a rank alone on its host (its peers
    reach it over TCP whatever they chose)."""
    if setting != "auto" or hosts is None:
        return setting if setting in ("tcp", "shm") else "tcp"
    if len(set(hosts)) == 1:
        return "shm"
    return "hybrid" if hosts.count(hosts[rank]) > 1 else "tcp"


def shm_or_tcp(kind: str, rank: int, plat: Any = None, lookup: Any = None) -> str:
    """`kind`, or "tcp" with a warning where shared memory is unsafe (no full memory barrier is known; see
    shm_ring.shm_refusal). Every rank of a host decides alike, and other hosts reach it over TCP anyway."""
    why = shm_ring.shm_refusal(plat) if lookup is None else shm_ring.shm_refusal(plat, lookup)
    if why is None:
        return kind
    log.warning("rank %d: not using shared memory (%s): TCP over loopback instead, which is slower", rank, why)
    return "tcp"
