"""Connecting one group: which links each rank gets, and the cluster shape the algorithms plan for.

`connect` is all the backend asks of the set-up: given the rendezvous store, this rank, the group size and
the Config, it returns a connected transport and the shape. `auto` picks shared memory when the whole group
shares one host, TCP between hosts, and both in one engine when hosts run several ranks each. Before any
link is made the ranks compare the settings that must agree, and rank 0 (the store's host) leaves only once
every rank has read what it needs from the store (agree.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..algorithms.shape import Shape, shape_from_networks
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
    shape: Shape | None  # None: derive it from the group size alone (one host, or nothing known)


def connect(store: Any, rank: int, world: int, cfg: Config, timeout: float,
            names: RankNames | None = None) -> Connected:
    """Connect this rank to every other rank of the group (all ranks call this together). `names`: how the
    transport's errors name the ranks of a subgroup (None when its ranks are the global ones). Every record
    read from the store is checked (records.py); a rank that gives up says why there, and every rank
    waiting for it raises that reason."""
    if world == 1:
        return Connected(Transport(rank, 1, [], names=names), None)
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
                                                                        records=records)], names=names), None)
    else:
        if kind == "hybrid" and hosts is not None:
            kinds, nets = connect_hybrid_links(store, rank, world, cfg, timeout, hosts, records, auth)
        else:
            tcp, nets = connect_tcp_links(store, rank, world, cfg, timeout, records=records, auth=auth)
            kinds = [tcp]
        transport = Transport(rank, world, kinds, names=names)
        if hosts is not None and 1 < len(set(hosts)) < len(hosts):  # several hosts, some with several ranks
            connected = Connected(transport, hosts_shape(nets, hosts))
        else:
            connected = Connected(transport, shape_from_networks(nets) if nets else None)
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


def hosts_shape(nets: list[list[str]] | None, hosts: list[str]) -> Shape | None:
    """The cluster shape when hosts run several ranks: derived from the hosts' networks (a 3-Mac chain
    stays a chain, however many ranks each Mac runs), each host's ranks next to each other in the
    ring/line order, so a ring crosses each cable once rather than once per rank. Pure."""
    if not nets:
        return None
    names = list(dict.fromkeys(hosts))  # hosts in the order of their lowest rank
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in names}
    host_nets = [sorted({n for r in members[h] for n in nets[r]}) for h in names]
    by_host = shape_from_networks(host_nets)
    order = [r for i in by_host.order for r in members[names[i]]]
    kind = "mesh" if by_host.kind in ("single", "pair") else by_host.kind  # 2 hosts: everyone reaches everyone
    groups = [members[names[i]] for i in by_host.order]
    return Shape(kind, order, shape_from_networks(nets).neighbours, groups)
