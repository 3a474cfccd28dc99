"""What every kind of link's set-up is given, and what the table of kinds says about a kind.

A kind of link has one set-up function, `connect(setup: SetUp) -> LinkKind`, that connects this rank to
`setup.peers` through the rendezvous store (all of `setup.users` run it together) and returns the kind's
links, ready for the engine; and one row in the table (`kinds.KINDS`), a `KindRow`. `connect_one_kind` makes a
transport of one kind alone from its set-up (tests and tools: connect_tcp, connect_shm, connect_rdma).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..config import Config
from ..transport.base import LinkKind
from ..transport.engine import Transport
from .agree import leave_together
from .records import GroupAuth, Records


@dataclass(frozen=True)
class SetUp:
    """One rank's part in setting up one kind of link for a group."""

    store: Any  # the group's rendezvous store (keys are the group's own: torch prefixes them)
    rank: int
    world: int
    cfg: Config
    timeout: float  # seconds for the whole set-up (capped by THUNDERBOLT_CONNECT_TIMEOUT)
    peers: tuple[int, ...]  # the ranks this rank connects to with this kind (group ranks)
    users: tuple[int, ...]  # every rank of the group that sets this kind up (this one included)
    records: Records  # the group's set-up records: publish and read through them (checked with the job's key)
    auth: GroupAuth  # the group's handshake key and id, for authenticating what the kind connects
    hosts: tuple[str, ...] = ()  # every rank's host identity (hosts.host_identity); () when not known

    @classmethod
    def everyone(cls, store: Any, rank: int, world: int, cfg: Config, timeout: float) -> "SetUp":
        """One kind to every other rank, this rank joining the group itself (a transport of one kind, for
        tests and tools: every rank of the group must call this instead of group.connect)."""
        records = Records(store, rank, cfg.secret, time.monotonic() + min(timeout, cfg.connect_timeout))
        try:
            auth = records.join_group()
        except BaseException as exc:
            records.announce(exc)
            raise
        everyone = tuple(range(world))
        return cls(store, rank, world, cfg, timeout, tuple(p for p in everyone if p != rank), everyone, records, auth)

    @property
    def leader(self) -> int:
        """The lowest rank setting this kind up: the one that publishes what its users share."""
        return min(self.users)

    def local_ranks(self) -> int:
        """Ranks of the group on this host (the whole group when hosts are not known)."""
        return self.hosts.count(self.hosts[self.rank]) if self.hosts else self.world


def connect_one_kind(store: Any, rank: int, world: int, cfg: Config, timeout: float,
                     connect_links: Callable[[SetUp], LinkKind]) -> Transport:
    """A transport over one kind of link alone, to every other rank of the group, this rank joining the group
    itself (every rank calls this instead of group.connect; tests and tools). `connect_links` is the kind's
    set-up. A rank that fails says why in the store first, for its peers to name (Records.announce). Rank 0
    returns only once every rank has read what it needs from the store (which rank 0 may serve:
    agree.leave_together)."""
    setup = SetUp.everyone(store, rank, world, cfg, timeout)
    records = setup.records
    try:
        transport = Transport(rank, world, [connect_links(setup)])
    except BaseException as exc:
        records.announce(exc)
        raise
    try:
        leave_together(records, rank, world)
    except BaseException as exc:
        records.announce(exc)
        transport.close()
        raise
    return transport


@dataclass(frozen=True)
class KindRow:
    """One kind of link in the table that picks the kind for every pair of ranks (`kinds.choose`)."""

    name: str  # as THUNDERBOLT_TRANSPORT names it, and Transport.kind reports it
    title: str  # as log lines name it ("shared memory")
    same_host: bool  # reaches only ranks on this host
    networks: bool  # reaches its peers over IP networks: the group exchanges every rank's networks
    offer: Callable[[Config], "str | None"]  # None when this rank can use the kind, else why not
    connect: Callable[[SetUp], LinkKind]  # the set-up
    fallback: str = ""  # where forcing this kind finds it unusable: the kind used instead ("" = an error)
    # Kinds that reach some peers only (RDMA: over a cable both ends have a device on): what a rank that
    # offers the kind publishes about where it reaches (JSON), and whether two ranks' say they join (None:
    # they do, else why not). None: the kind reaches every rank `same_host` allows.
    reach: "Callable[[Config], Any] | None" = None
    reaches: "Callable[[Any, Any], str | None] | None" = None
    # Refusals that are no news (the hardware most machines lack): logged at INFO, not as a warning.
    quiet: "Callable[[str], bool] | None" = None
    # Under THUNDERBOLT_TRANSPORT=auto, a set-up that fails for a reason of the kind's own (RDMA: its device,
    # driver or path; the set-up says so with Records.give_up) gives the kind's pairs to the next kind instead
    # of failing the group. Every rank then learns how each user's set-up of the kind ended (Records.made,
    # Records.outcome) before the next kind is set up, so all reach the same kinds.
    gives_way: bool = False
