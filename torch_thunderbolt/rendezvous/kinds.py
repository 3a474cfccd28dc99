"""Which kind of link joins each pair of ranks: one table, one row per kind.

Every rank publishes its host identity and which kinds it can offer (`KindRow.offer`: shared memory is
refused on a machine with no known full memory barrier). For every pair of ranks the first row, in the
table's order of preference, that both ends offer and that reaches from one to the other (shared memory
only within a host) is the kind of their link. `THUNDERBOLT_TRANSPORT=auto` lets the table choose; a kind
named there is used for every pair: an error where it cannot reach a peer, its `fallback` (with a warning)
or an error where a rank cannot offer it. Under `auto`, a kind that `gives_way` and whose set-up then fails
for a reason of its own on any rank is left out and the table chooses again, the same on every rank
(group.py): RDMA pairs fall back to TCP. Pure but for the table's set-up functions, which `group.connect`
calls.

Adding a kind of link: its transport file (transport/<kind>.py: a Link and a LinkKind), its set-up file
(rendezvous/<kind>.py: `offer` and `connect_<kind>_links(SetUp)`), and one row here.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from . import rdma, shm, tcp
from .setup import KindRow

#: The kinds, most preferred first. (Its order is also the order in which every rank sets them up.)
KINDS: tuple[KindRow, ...] = (
    KindRow("shm", "shared memory", same_host=True, networks=False, offer=shm.offer, connect=shm.connect_shm_links,
            fallback="tcp"),
    KindRow("rdma", "RDMA", same_host=False, networks=True, offer=rdma.offer, connect=rdma.connect_rdma_links,
            reach=rdma.reach, reaches=rdma.reaches, quiet=rdma.no_rdma_here, gives_way=True),
    KindRow("tcp", "TCP", same_host=False, networks=True, offer=tcp.offer, connect=tcp.connect_tcp_links),
)
Reach = Mapping[str, Any]  # kind name -> what a rank published about where it reaches (KindRow.reach)

Offers = Mapping[str, "str | None"]  # kind name -> None (this rank offers it) or why not


def why_not(offers: Offers, name: str) -> str | None:
    """None when `offers` (one rank's) offers kind `name`, else why not."""
    return offers[name] if name in offers else f"runs a version of torch-thunderbolt without {name!r} links"


def choose(table: Sequence[KindRow], setting: str, hosts: Sequence[str], offers: Sequence[Offers],
           reach: "Sequence[Reach] | None" = None) -> list[list[str]]:
    """The kind of link between every two ranks: `out[a][b] == out[b][a]` ("" for a == b). `hosts[r]`,
    `offers[r]` and `reach[r]`: what rank r published. Raises ConfigError where the forced kind cannot join a
    pair."""
    world = len(hosts)
    rows = {row.name: row for row in table}
    if setting == "auto":
        candidates = list(table)
    elif setting in rows:
        forced = rows[setting]
        candidates = [forced] + ([rows[forced.fallback]] if forced.fallback else [])
    else:
        raise ConfigError(f"THUNDERBOLT_TRANSPORT: no kind of link named {setting!r} (have: auto, "
                          f"{', '.join(rows)})")
    out = [[""] * world for _ in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            if setting != "auto" and candidates[0].same_host and hosts[a] != hosts[b]:
                raise ConfigError(f"THUNDERBOLT_TRANSPORT={setting}: rank {b} runs on another host ({hosts[b]}) "
                                  f"than rank {a} ({hosts[a]})")
            for row in candidates:
                if row.same_host and hosts[a] != hosts[b]:
                    continue
                if _apart(row, a, b, reach) is not None:
                    continue
                if why_not(offers[a], row.name) is None and why_not(offers[b], row.name) is None:
                    out[a][b] = out[b][a] = row.name
                    break
            else:
                raise ConfigError(f"THUNDERBOLT_TRANSPORT={setting}: no kind of link joins rank {a} and rank {b}: "
                                  + "; ".join(_why_not_pair(row, a, b, hosts, offers, reach) for row in candidates))
    return out


def _apart(row: KindRow, a: int, b: int, reach: "Sequence[Reach] | None") -> str | None:
    """Why ranks a and b, offering `row`, still cannot be joined by it (None: they can), as it says."""
    if row.reaches is None or reach is None or row.name not in reach[a] or row.name not in reach[b]:
        return None
    return row.reaches(reach[a][row.name], reach[b][row.name])


def _why_not_pair(row: KindRow, a: int, b: int, hosts: Sequence[str], offers: Sequence[Offers],
                  reach: "Sequence[Reach] | None" = None) -> str:
    if row.same_host and hosts[a] != hosts[b]:
        return f"{row.name} reaches only its own host"
    apart = _apart(row, a, b, reach)
    if apart is not None:
        return f"{row.name}: {apart}"
    return f"{row.name}: " + ", ".join(f"rank {r} {w}" for r in (a, b) if (w := why_not(offers[r], row.name)))


def refused(table: Sequence[KindRow], rank: int, hosts: Sequence[str], offers: Sequence[Offers],
            kinds: Sequence[Sequence[str]]) -> list[tuple[KindRow, list[int], str]]:
    """What this rank's own refusals cost: (kind it refused, the peers that got a less preferred kind for
    it, why), for the warning each rank logs about itself."""
    out = []
    for i, row in enumerate(table):
        why = why_not(offers[rank], row.name)
        if why is None:
            continue
        worse = {r.name for r in table[i + 1:]}
        peers = [p for p in range(len(hosts)) if p != rank and kinds[rank][p] in worse
                 and not (row.same_host and hosts[p] != hosts[rank])]
        if peers:
            out.append((row, peers, why))
    return out
