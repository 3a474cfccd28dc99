"""What the ranks of a group settle together during set-up, besides their links: the settings that must be
the same on every rank, and leaving the set-up together.

- **Settings.** Each rank publishes the settings that change what goes on the wire or how results are
  computed (`config.job_settings`, `config.host_settings`, and this package's version) in one record,
  reads every rank's and compares: a difference is a `ConfigError` on every rank, naming the variable and
  each rank's value, before any link is made and any collective runs. (Without it, THUNDERBOLT_COMPRESSION
  fp16 on one rank and bf16 on another gave wrong sums with no error, and THUNDERBOLT_SMALL 1K against 64K
  showed up only as a confusing size mismatch between two identical calls.)
- **Leaving together.** The rendezvous store is served by one of the ranks (rank 0, for env:// and
  thunderbolt://): when it leaves the set-up and its process exits at once, a rank still reading its last
  keys from the store fails with a lost connection instead of finishing. So every rank marks that it has
  read everything it needs, and rank 0 leaves only once every rank has (`leave_together`).

Every record here is a set-up record of the group (records.py): with THUNDERBOLT_SECRET it carries a MAC, and
a rank that gives up announces why, which every rank waiting for one of its records raises.
"""
from __future__ import annotations

from typing import Sequence

from ..config import Config, host_settings, job_settings
from ..errors import ConfigError
from ..protocol.handshake import VERSION as PROTOCOL_VERSION
from ..transport.names import RankNames
from .records import Records

SETTINGS = "tb/settings/{rank}"
DONE = "tb/done/{rank}"
VERSION_KEY = "torch-thunderbolt version"


def my_settings(cfg: Config) -> dict[str, dict[str, str]]:
    """What this rank publishes: the job-wide and per-host settings, and the version of what it speaks."""
    from ..version import __version__

    job = dict(job_settings(cfg))
    job[VERSION_KEY] = f"{__version__} (protocol {PROTOCOL_VERSION})"
    return {"job": job, "host": host_settings(cfg)}


class Agreement:
    """Every rank's published settings (`settings[r]`), compared job-wide by `agree_settings` and per host
    by `check_hosts` once the hosts are known."""

    def __init__(self, records: Records, rank: int, world: int, settings: list[dict],
                 names: RankNames | None) -> None:
        self.records, self.rank, self.world, self.settings, self.names = records, rank, world, settings, names

    def check_hosts(self, hosts: "Sequence[str] | None", transport: str) -> None:
        """The per-host settings must agree among the ranks of each host. `hosts`: every rank's host identity
        (None when unknown: `transport` shm puts every rank on one host, tcp maps no memory)."""
        if hosts is None:
            if transport != "shm":
                return
            hosts = [""] * self.world
        for host in dict.fromkeys(hosts):
            ranks = [r for r in range(self.world) if hosts[r] == host]
            where = "" if len(set(hosts)) == 1 else f" on one host ({host.split('|')[0]})"
            self._compare([self.settings[r].get("host", {}) for r in ranks], ranks,
                          f"every rank sharing memory{where} needs the same value")

    def _compare(self, values: list[dict], ranks: list[int], need: str) -> None:
        diffs = differences(values, ranks)
        if not diffs:
            return
        err = ConfigError(f"rank {self.rank}: " + "; ".join(diffs) + f"; {need}")
        # Every rank compares the same records and raises the same error: but the store's host must not go
        # (and take the store with it) before every rank has read them.
        leave_together(self.records, self.rank, self.world)
        raise err if self.names is None else self.names.apply(err)


def differences(values: Sequence[dict], ranks: Sequence[int]) -> list[str]:
    """"VAR differs between ranks: rank 0 fp16, rank 1 bf16" for every variable whose value is not the same
    in all `values` (the settings of `ranks`, in order); none when they all agree. Pure."""
    out = []
    for var in dict.fromkeys(k for v in values for k in v):
        seen: dict[str, list[int]] = {}
        for r, v in zip(ranks, values):
            seen.setdefault(str(v.get(var, "(not set: an older version)")), []).append(r)
        if len(seen) > 1:
            each = ", ".join(f"rank {rs[0]} {val}" if len(rs) == 1 else f"ranks {rs} {val}"
                             for val, rs in seen.items())
            out.append(f"{var} differs between ranks: {each}")
    return out


def agree_settings(records: Records, rank: int, world: int, cfg: Config,
                   names: RankNames | None = None) -> Agreement:
    """Publish this rank's settings, read every rank's, and raise ConfigError (on every rank) if the
    job-wide ones differ. All ranks of the group call this together, before anything else of the set-up
    but joining the group (`records.join_group`)."""
    records.publish(SETTINGS.format(rank=rank), my_settings(cfg))
    settings = []
    for p in range(world):
        got = records.read(SETTINGS.format(rank=p), p, "its settings")
        if not isinstance(got, dict) or not isinstance(got.get("job"), dict):
            raise ConfigError(f"rank {rank}: rank {p}'s settings record is not one this version reads: does it "
                              f"run another version of torch-thunderbolt?")
        settings.append(got)
    agreement = Agreement(records, rank, world, settings, names)
    agreement._compare([s["job"] for s in settings], list(range(world)), "every rank of a job needs the same value")
    return agreement


def leave_together(records: Records, rank: int, world: int) -> None:
    """This rank has read all it needs from the store: say so; rank 0, which serves the store in env:// and
    thunderbolt:// jobs, then waits until every rank has said so (within the set-up deadline; a rank that
    gave up meanwhile is named with its reason), so that it cannot leave the set-up, exit and take the store
    with it while a peer still reads from it. The other ranks go on at once."""
    if world == 1:
        return
    records.publish(DONE.format(rank=rank), 1)
    if rank == 0:
        for p in range(1, world):
            records.read(DONE.format(rank=p), p, "that it finished its set-up")
