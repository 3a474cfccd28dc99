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

Every record this module writes or reads goes through `publish` and `read_all`, so that one place can
authenticate them.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Sequence

from ..config import Config, host_settings, job_settings
from ..errors import ConfigError, PeerLostError
from ..protocol.handshake import VERSION as PROTOCOL_VERSION
from ..transport.names import RankNames

SETTINGS = "tb/settings/{rank}"
DONE = "tb/done/{rank}"
VERSION_KEY = "torch-thunderbolt version"


def publish(store: Any, name: str, value: Any) -> None:
    """Write set-up record `name` (JSON-able `value`) to the store."""
    store.set(name, json.dumps(value))


def read_all(store: Any, rank: int, names: Sequence[str], owners: Sequence[int], deadline: float,
             what: str) -> list[Any]:
    """The values of records `names` (published by ranks `owners`), waiting for them until `deadline`
    (time.monotonic()); a PeerLostError naming the ranks whose record never came."""
    wait_all(store, rank, names, owners, deadline, what)
    multi_get = getattr(store, "multi_get", None)
    raws = multi_get(list(names)) if multi_get is not None else [store.get(n) for n in names]
    return [json.loads(raw) for raw in raws]


def wait_all(store: Any, rank: int, names: Sequence[str], owners: Sequence[int], deadline: float,
             what: str) -> None:
    """Wait (one store call) until every record of `names` exists, or raise at `deadline`."""
    if not names:
        return
    left = max(0.001, deadline - time.monotonic())
    try:
        store.wait(list(names), timedelta(seconds=left))
    except RuntimeError as exc:  # torch's DistStoreError on a timeout; a lost store raises its own error
        if "timeout" not in str(exc).lower():
            raise
        missing = [o for n, o in zip(names, owners) if not store.check([n])]
        raise PeerLostError(
            f"rank {rank}: ranks {missing} did not {what} within {left:.0f} s of this rank (the set-up timeout: "
            f"the group's timeout or THUNDERBOLT_CONNECT_TIMEOUT, the smaller): did they start, and do they run "
            f"the same torch-thunderbolt version?", rank=rank, peer=missing[0] if missing else -1) from None


def my_settings(cfg: Config) -> dict[str, dict[str, str]]:
    """What this rank publishes: the job-wide and per-host settings, and the version of what it speaks."""
    from .. import __version__

    job = dict(job_settings(cfg))
    job[VERSION_KEY] = f"{__version__} (protocol {PROTOCOL_VERSION})"
    return {"job": job, "host": host_settings(cfg)}


class Agreement:
    """Every rank's published settings (`settings[r]`), compared job-wide by `agree_settings` and per host
    by `check_hosts` once the hosts are known."""

    def __init__(self, store: Any, rank: int, world: int, settings: list[dict], deadline: float,
                 names: RankNames | None) -> None:
        self.store, self.rank, self.world, self.settings = store, rank, world, settings
        self.deadline, self.names = deadline, names

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
            self._compare([self.settings[r]["host"] for r in ranks], ranks,
                          f"every rank sharing memory{where} needs the same value")

    def _compare(self, values: list[dict], ranks: list[int], need: str) -> None:
        diffs = differences(values, ranks)
        if not diffs:
            return
        err = ConfigError(f"rank {self.rank}: " + "; ".join(diffs) + f"; {need}")
        # Every rank compares the same records and raises the same error: but the store's host must not go
        # (and take the store with it) before every rank has read them.
        leave_together(self.store, self.rank, self.world, self.deadline)
        raise err if self.names is None else self.names.apply(err)


def differences(values: Sequence[dict], ranks: Sequence[int]) -> list[str]:
    """"VAR differs between ranks: rank 0 fp16, rank 1 bf16" for every variable whose value is not the same
    in all `values` (the settings of `ranks`, in order); none when they all agree. Pure."""
    out = []
    for var in dict.fromkeys(k for v in values for k in v):
        seen: dict[str, list[int]] = {}
        for r, v in zip(ranks, values):
            seen.setdefault(v.get(var, "(not set: an older version)"), []).append(r)
        if len(seen) > 1:
            each = ", ".join(f"rank {rs[0]} {val}" if len(rs) == 1 else f"ranks {rs} {val}"
                             for val, rs in seen.items())
            out.append(f"{var} differs between ranks: {each}")
    return out


def agree_settings(store: Any, rank: int, world: int, cfg: Config, deadline: float,
                   names: RankNames | None = None) -> Agreement:
    """Publish this rank's settings, read every rank's, and raise ConfigError (on every rank) if the
    job-wide ones differ. All ranks of the group call this together, before anything else of the set-up."""
    publish(store, SETTINGS.format(rank=rank), my_settings(cfg))
    ranks = list(range(world))
    settings = read_all(store, rank, [SETTINGS.format(rank=p) for p in ranks], ranks, deadline,
                        "publish their settings")
    agreement = Agreement(store, rank, world, settings, deadline, names)
    agreement._compare([s["job"] for s in settings], ranks, "every rank of a job needs the same value")
    return agreement


def leave_together(store: Any, rank: int, world: int, deadline: float) -> None:
    """This rank has read all it needs from the store: say so; rank 0, which serves the store in env:// and
    thunderbolt:// jobs, then waits until every rank has said so (one wait, until `deadline`), so that it
    cannot leave the set-up, exit and take the store with it while a peer still reads from it. The other
    ranks go on at once."""
    if world == 1:
        return
    publish(store, DONE.format(rank=rank), 1)
    if rank == 0:
        ranks = list(range(1, world))
        wait_all(store, rank, [DONE.format(rank=p) for p in ranks], ranks, deadline, "finish the set-up")
