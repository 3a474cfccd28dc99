"""What a result could reach at best: the bus-bandwidth bound each row is shown as a fraction of. Pure.

Three kinds, one per situation (`choose_bound`):
  - "cables": ranks on several hosts and `--cable-rate` given. Every cable is full duplex at the rate in
    each direction; nccl-tests' busbw factor normalises the ops so that, with one rank per host and
    every host equally cabled, busbw can at most reach `rate x the cables a rank has`. The lower bound on
    time is the bytes each host must send or receive over its own cables, the host that leaves the
    least setting it; all_reduce also by the bytes a reduction moves in all over all cables together
    (see `_all_reduce_bound`). sendrecv: `rate x the cables between rank 0 and rank 1`.
  - "tcp_link": one host, a TCP backend, `--link`: the raw TCP rate between rank 0 and rank 1 at the
    backend's stream count, both directions at once for the symmetric ops (the `eff` column).
  - "memcpy": one host, shared memory, `--memcpy`: single-core memcpy GB/s.

The cabling is what the job discovers, as the backend itself derives neighbours: each rank's networks
(one /30 per cable), two ranks on different hosts sharing N networks are joined by N cables, ranks on
one host (same host identity) by none.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import ConfigError

CABLES, TCP_LINK, MEMCPY = "cables", "tcp_link", "memcpy"
BOUND_KINDS = (CABLES, TCP_LINK, MEMCPY)
# Every rank sends and receives at once: the link's ceiling is its duplex rate (both directions busy).
SYMMETRIC_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})


@dataclass(frozen=True)
class Bound:
    gbps: float       # bus bandwidth in GB/s (1e9 bytes/s) a row's busbw is divided by
    kind: str         # one of BOUND_KINDS
    description: str  # one line, e.g. "2 cables x 1 Gbit/s per rank (ring of 3)"


# -- --cable-rate ----------------------------------------------------------------------------------------------
def parse_cable_rate(text: str | None) -> str | None:
    """'10gbit', '40Gbit/s', '500mbit' -> the normalised tc-style text ('10gbit'); None when not given.
    A bad value is a ConfigError naming --cable-rate."""
    if text is None:
        return None
    from ..lab.blueprint import parse_rate  # the lab's tc-style rates: one syntax for cables everywhere

    cleaned = str(text).strip().lower().removesuffix("/s")
    try:
        normalised, bits = parse_rate(cleaned) if cleaned not in ("", "none", "0") else (None, 0)
    except ConfigError:
        normalised, bits = None, 0
    if normalised is None or bits <= 0:
        raise ConfigError(f"bad --cable-rate {text!r}: expected a rate per cable and direction like 1gbit, "
                          "10gbit, 40gbit or 500mbit")
    return normalised


def rate_bits(text: str) -> int:
    """Bits per second of a rate accepted by parse_cable_rate."""
    from ..lab.blueprint import parse_rate

    return parse_rate(text)[1]


def format_rate(bits_per_second: float) -> str:
    """10e9 -> '10 Gbit/s', 2.5e9 -> '2.5 Gbit/s', 5e8 -> '500 Mbit/s'."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.4g} {unit}"
    return f"{bits_per_second:.4g} bit/s"


# -- the cabling ------------------------------------------------------------------------------------------------
def _cable_networks(nets: Sequence[str]) -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A rank's networks that can be a cable's: loopback never is, even if two hosts both report it."""
    parsed = {ipaddress.ip_network(n, strict=False) for n in nets}
    return {n for n in parsed if not n.is_loopback}


def _check_lengths(nets: Sequence[Sequence[str]], hosts: Sequence[str]) -> None:
    if len(nets) != len(hosts) or not nets:
        raise ValueError(f"expected one network list and one host identity per rank, got {len(nets)} and "
                         f"{len(hosts)}")


def cables_between(nets: Sequence[Sequence[str]], hosts: Sequence[str]) -> list[list[int]]:
    """`[r][q]`: cables joining rank r and rank q = networks they share, 0 on the same host."""
    _check_lengths(nets, hosts)
    parsed = [_cable_networks(ns) for ns in nets]
    n = len(nets)
    return [[0 if r == q or hosts[r] == hosts[q] else len(parsed[r] & parsed[q]) for q in range(n)]
            for r in range(n)]


@dataclass(frozen=True)
class HostCabling:
    """One host of the job: its ranks, and the cables it has (networks shared with another host)."""
    ranks: tuple[int, ...]
    cables: int


def host_cabling(nets: Sequence[Sequence[str]], hosts: Sequence[str]) -> list[HostCabling]:
    """Hosts in the order of their lowest rank. A host's cables are its networks that some rank of another
    host shares: a network shared with several hosts (a bridge or a LAN) is one interface, one cable."""
    _check_lengths(nets, hosts)
    parsed = [_cable_networks(ns) for ns in nets]
    names = list(dict.fromkeys(hosts))
    out = []
    for h in names:
        ranks = tuple(r for r, x in enumerate(hosts) if x == h)
        own = set().union(*(parsed[r] for r in ranks))
        others = set().union(*(parsed[r] for r, x in enumerate(hosts) if x != h))
        out.append(HostCabling(ranks, len(own & others)))
    return out


def cabling_kind(nets: Sequence[Sequence[str]], hosts: Sequence[str]) -> str:
    """The hosts' shape as the backend classifies it (pair, ring, chain, mesh, other, single)."""
    from ..algorithms.shape import shape_from_networks

    groups = host_cabling(nets, hosts)
    parsed = [_cable_networks(ns) for ns in nets]
    host_nets = [sorted(str(n) for r in g.ranks for n in parsed[r]) for g in groups]
    return shape_from_networks(host_nets).kind


def missing_cables(nets: Sequence[Sequence[str]], hosts: Sequence[str]) -> str | None:
    """Why there is no cable bound for this job (None: there is one, given a rate)."""
    groups = host_cabling(nets, hosts)
    if len(groups) < 2:
        return "all ranks run on one host: no cables between them"
    lonely = [g for g in groups if g.cables == 0]
    if lonely:
        return (f"rank {lonely[0].ranks[0]} shares no network with a rank on another host, so its cables are "
                "unknown (set THUNDERBOLT_IFNAME to the Thunderbolt interfaces)")
    return None


def _host_factor(op: str, n: int, h: int, k: int) -> float:
    """busbw per cable of a host running k of the n ranks, h hosts in all (1 when every host runs one rank).

    The bytes a host must move over its own cables, with nothing charged for traffic inside the host:
    all_gather receives the (n-k)/n of the output held elsewhere, reduce_scatter sends as much, all_to_all
    sends k(n-k)/n of a rank's input, broadcast receives (or sends) the whole buffer. busbw = algbw x
    nccl-tests' factor, hence the ratios. all_reduce is `_all_reduce_bound`'s."""
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / (n - k)
    if op == "all_to_all":
        return (n - 1) / (k * (n - k))
    if op == "broadcast":
        return 1.0
    raise ValueError(f"no cable bound for op {op!r}")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def cable_bound(op: str, nets: Sequence[Sequence[str]], hosts: Sequence[str], rate_bps: float) -> Bound | None:
    """The bus-bandwidth bound set by the cables (see the module), or None when the job has none: one
    host, a rank sharing no network with another host, or for sendrecv ranks 0 and 1 on one host or
    not directly cabled.

    `nets[r]`: rank r's networks as CIDR ("10.213.0.0/30"); `hosts[r]`: its host identity; `rate_bps`:
    bits per second per cable and direction."""
    if missing_cables(nets, hosts) is not None:
        return None
    per_cable = rate_bps / 8 / 1e9
    rate = format_rate(rate_bps)
    if op == "sendrecv":
        cables = cables_between(nets, hosts)[0][1]
        if cables == 0:
            return None
        return Bound(cables * per_cable, CABLES, f"{_plural(cables, 'cable')} x {rate} between rank 0 and rank 1")
    groups = host_cabling(nets, hosts)
    n, h = len(hosts), len(groups)
    kind = cabling_kind(nets, hosts)
    if op == "all_reduce":
        return _all_reduce_bound(groups, n, per_cable, rate, kind)
    # The host that leaves the least: fewest cables for the bytes it must move over them.
    worst = min(groups, key=lambda g: (g.cables * _host_factor(op, n, h, len(g.ranks)), g.ranks))
    gbps = per_cable * worst.cables * _host_factor(op, n, h, len(worst.ranks))
    return Bound(gbps, CABLES, _where(worst, groups, n, rate, kind))


def _where(worst: HostCabling, groups: Sequence[HostCabling], n: int, rate: str, kind: str) -> str:
    """'2 cables x 1 Gbit/s per rank (ring of 3)': the cables that set a bound, and whose they are."""
    if all(len(g.ranks) == 1 for g in groups):
        return f"{_plural(worst.cables, 'cable')} x {rate} per rank ({kind} of {n})"
    return f"{_plural(worst.cables, 'cable')} x {rate} on the host of {_ranks(worst)} ({_shape(groups, n, kind)})"


def _ranks(host: HostCabling) -> str:
    """'rank 2', 'ranks 0,1'."""
    return f"rank{'s' if len(host.ranks) > 1 else ''} {','.join(map(str, host.ranks))}"


def _shape(groups: Sequence[HostCabling], n: int, kind: str) -> str:
    return f"{kind} of {n}" if len(groups) == n else f"{kind} of {len(groups)} hosts, {n} ranks"


def _all_reduce_bound(groups: Sequence[HostCabling], n: int, per_cable: float, rate: str, kind: str) -> Bound:
    """all_reduce of S bytes between h hosts, the more restrictive of two lower bounds on its time:
      - every host must receive S (the others' share of every element) and send as much of its own, over
        its own cables: the least cabled host sets this one;
      - a reduction moves 2(h-1)/h x S into each host (reduce-scatter, then all-gather), 2(h-1) x S in
        all, over all the hosts' cables together.
    With every host equally cabled the second binds (both are equal between 2 hosts) and busbw reaches
    `rate x the cables of a host`, scaled by (n-1)/n x h/(h-1) where hosts run several ranks. Where hosts
    differ, the first can bind: a chain's two ends have one cable, but the hosts between them reduce for
    them, so a 3-host chain's bound is 4/3 x rate, not rate. busbw = S/t x 2(n-1)/n."""
    h = len(groups)
    least = min(groups, key=lambda g: (g.cables, g.ranks))
    total = sum(g.cables for g in groups)
    cables = min(least.cables, total / (2 * (h - 1)))  # S/t is at most this many cables' rate
    gbps = per_cable * cables * 2 * (n - 1) / n
    if all(g.cables == least.cables for g in groups):
        return Bound(gbps, CABLES, _where(least, groups, n, rate, kind))
    if cables < least.cables:
        return Bound(gbps, CABLES, f"{_plural(total, 'cable')} x {rate} in all for the 2(h-1)/h of the buffer a "
                                   f"reduction moves into each host ({_shape(groups, n, kind)})")
    return Bound(gbps, CABLES, f"{_plural(least.cables, 'cable')} x {rate} on the host of {_ranks(least)}, which "
                               f"must receive the whole result ({_shape(groups, n, kind)})")


# -- one host ------------------------------------------------------------------------------------------------
def link_rate(op: str, rec: Mapping) -> tuple[float, str] | None:
    """The raw TCP rate a backend's busbw is compared to, and its direction: duplex (per direction, both
    sending) for symmetric ops when measured, one-way otherwise."""
    duplex = op in SYMMETRIC_OPS and bool(rec.get("duplex_gbps"))
    gbps = rec["duplex_gbps"] if duplex else rec.get("gbps")
    if not gbps:
        return None
    return float(gbps), "duplex" if duplex else "one-way"


def link_bound(op: str, rec: Mapping | None, streams: int | None) -> Bound | None:
    """The `eff` yardstick as a bound: raw TCP between rank 0 and rank 1 at the backend's stream count."""
    if rec is None or streams is None:
        return None
    found = link_rate(op, rec)
    if found is None:
        return None
    gbps, direction = found
    both = "both directions at once" if direction == "duplex" else "one way"
    return Bound(gbps, TCP_LINK, f"raw TCP at {_plural(streams, 'stream')}, {both}")


def memcpy_bound(before: Mapping | None, after: Mapping | None) -> Bound | None:
    """Single-core memcpy, the mean of the figures measured before and after the collectives."""
    figures = [m["gbps"] for m in (before, after) if m and m.get("gbps")]
    if not figures:
        return None
    gbps = sum(figures) / len(figures)
    return Bound(gbps, MEMCPY, f"single-core memcpy (mean of {' and '.join(f'{g:.2f}' for g in figures)} GB/s)")


def choose_bound(transport: str, single_host: bool, cable: Bound | None, link: Bound | None,
                 memcpy: Bound | None) -> Bound | None:
    """Which bound a backend's row is measured against: the cables between hosts; on one host, memcpy for
    shared memory and the raw TCP link for TCP; none when what carries the bytes is unknown."""
    if not single_host:
        return cable
    if transport == "shm":
        return memcpy
    if transport == "tcp":
        return link
    return None
