"""The first connection between two Macs: the rendezvous store, checked before torch connects to it.

`init_process_group` connects to the store (torch's TCPStore at MASTER_ADDR:MASTER_PORT, served by rank 0,
or by torchrun's agent on the first node) before our backend runs. When that first connection is blocked,
torch's client retries until the group's timeout (30 minutes by default), logging a C++ stack per try:
a macOS firewall dropping it, a Local Network privacy denial (EHOSTUNREACH/EPERM at once, every time), a
MASTER_ADDR that is not rank 0's address all look like a hang. So a rank that is a store client first
makes plain TCP connections to the store's address, as our own connections do to peers, and stops with
the same kind of error and fix:

- Local Network privacy (macOS): EHOSTUNREACH/EPERM `LOCAL_NETWORK_TRIES` times in a row: ConfigError
  naming the setting (retrying cannot help);
- no route to MASTER_ADDR at all (ENETUNREACH), a name that does not resolve: ConfigError at once;
- refused or unanswered connections (rank 0 not started yet, a firewall, a wrong address): retried until
  THUNDERBOLT_CONNECT_TIMEOUT (or the group's timeout, if shorter), then PeerLostError saying what was
  seen and what to check.

The probe connection is closed before a byte is sent; the store's server drops it like any client that
leaves. Rank 0 also warns when torchrun may restart the job but keeps one store for every restart (torch's
default; `restarts_share_the_store`), which a restarted group's set-up cannot tell from the last one's.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Callable, Mapping
from urllib.parse import parse_qsl, urlparse

from ..config import Config
from ..errors import ConfigError, PeerLostError, peer_lost
from ..platform import LOCAL_NETWORK_SETTING, Platform, current
from .tcp import LOCAL_NETWORK_ERRNOS, LOCAL_NETWORK_TRIES, check_machine

SHARED_STORE_WARNING = (
    "rank 0: torchrun may restart this job (--max-restarts %s) but keeps one rendezvous store for every restart, "
    "where a restarted group can read the previous attempt's records and fail to start; set "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of every torchrun (see docs/fault-tolerance.md)")
log = logging.getLogger("torch_thunderbolt")
PROBE_TIMEOUT = 2.0  # seconds per connection attempt: long enough for a busy Mac, short enough to retry
RETRY_EVERY = 0.1
DOCTOR_HINT = "`MASTER_ADDR={host} MASTER_PORT={port} torch-thunderbolt doctor` on this Mac probes it"

Connect = Callable[[tuple[str, int], float], socket.socket]


def _connect(target: tuple[str, int], timeout: float) -> socket.socket:
    return socket.create_connection(target, timeout=timeout)


def store_is_client(rank: int, env: Mapping[str, str]) -> bool:
    """Whether this rank's TCPStore is a client (the store is served elsewhere): every rank but 0, and under
    torchrun (TORCHELASTIC_USE_AGENT_STORE) every rank, since the agent serves it."""
    return rank != 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restarts_share_the_store(env: Mapping[str, str]) -> bool:
    """Whether torchrun may restart this job (--max-restarts above 0) and keeps one store for every restart:
    torch 2.13's c10d rendezvous does unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and its workers key their
    records the same way in every round, so a restarted group may read the previous round's records (ours
    and gloo's set-ups then fail, and each failure uses up a restart)."""
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    return restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def probe_url(url: str, timeout: "timedelta | float | None" = None, env: Mapping[str, str] | None = None) -> None:
    """The checks before an env://, tcp:// or thunderbolt:// rendezvous URL (as torch hands it to a handler,
    rank in its query): on every rank, the job's settings (ConfigError naming the rank and the setting); on
    ranks whose store is a client, the probe of the store. Anything missing is left to torch's handler, which
    names it."""
    env = os.environ if env is None else env
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    who = query.get("rank") or env.get("RANK", "")
    # The settings first, on every rank, rank 0 included: a rank whose settings the backend would refuse must
    # say so before the store exists. Otherwise rank 0 serves the store and waits, in torch's C++, for every
    # rank to join it (for the group's whole timeout, 30 minutes by default) and then reports only how many
    # joined, while the refused rank has long stopped.
    try:
        cfg = Config.from_env(env)
    except ConfigError as exc:
        raise ConfigError(f"rank {who}: {exc}" if who else str(exc)) from None
    check_machine(cfg, who)
    try:
        rank = int(who)
        host = parsed.hostname or env.get("MASTER_ADDR", "")
        port = parsed.port or int(env.get("MASTER_PORT", ""))
    except ValueError:
        return
    if rank == 0 and restarts_share_the_store(env):
        log.warning(SHARED_STORE_WARNING, env.get("TORCHELASTIC_MAX_RESTARTS"))
    if not host or not store_is_client(rank, env):
        return
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    probe_store(host, port, rank, cfg, seconds)


def probe_store(host: str, port: int, rank: int, cfg: Config, timeout: float | None = None, *,
                plat: Platform | None = None, connect: Connect = _connect,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once a TCP connection to the store at `host`:`port` succeeds; raise the error a user can act
    on otherwise. `timeout`: the group's rendezvous timeout in seconds (the wait is the shorter of it and
    THUNDERBOLT_CONNECT_TIMEOUT)."""
    plat = plat or current()
    where = f"the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT)"
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"rank {rank}: cannot resolve MASTER_ADDR={host} ({exc}); use rank 0's Thunderbolt "
                          f"address (the hostfile `topo` writes lists each Mac's)") from None
    loopback = address.startswith("127.")
    wait = cfg.connect_timeout if timeout is None else min(timeout, cfg.connect_timeout)
    started = clock()
    deadline = started + wait
    denied = 0
    seen: dict[str, int] = {}  # what the attempts ran into -> how often
    last: OSError | None = None
    while True:
        try:
            sock = connect((address, port), max(0.05, min(PROBE_TIMEOUT, deadline - clock())))
        except OSError as exc:
            last = exc
            if exc.errno == errno.ENETUNREACH:
                raise ConfigError(f"rank {rank}: no route from this Mac to {where}: {exc}. MASTER_ADDR must be an "
                                  f"address of rank 0's Mac on a network this Mac is on: with one subnet per cable, "
                                  f"the address of a cable that joins the two (the hostfile `topo` writes lists "
                                  f"them); {DOCTOR_HINT.format(host=host, port=port)}") from exc
            if plat.local_network_privacy and not loopback and exc.errno in LOCAL_NETWORK_ERRNOS:
                denied += 1
                if denied >= LOCAL_NETWORK_TRIES:
                    raise local_network_denied_store(rank, host, port, exc) from exc
            else:
                denied = 0
            kind = _kind(exc)
            seen[kind] = seen.get(kind, 0) + 1
            if clock() >= deadline:
                raise _unreachable(rank, host, port, loopback, clock() - started, seen, last) from last
            sleep(RETRY_EVERY)
            continue
        sock.close()
        return


def _kind(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused (nothing listens on that port of that host: rank 0 not started yet, or another port)"
    if isinstance(exc, (socket.timeout, TimeoutError)) or exc.errno == errno.ETIMEDOUT:
        return "unanswered (a firewall dropping them, or no host at that address)"
    if exc.errno == errno.EHOSTUNREACH:
        return "host unreachable (no host answers at that address: a cable, or the address)"
    return f"{exc.strerror or exc}"


def _unreachable(rank: int, host: str, port: int, loopback: bool, waited: float, seen: dict[str, int],
                 last: OSError | None) -> PeerLostError:
    what = "; ".join(f"{n} attempt(s) {k}" for k, n in seen.items()) or f"{last}"
    across = "" if loopback else (
        f"; that {host} is rank 0's address on a network this Mac is on (ping {host}); that the firewall of "
        f"rank 0's Mac lets its python accept incoming connections (`torch-thunderbolt doctor --firewall-command` "
        f"there prints how); and "
        f"that the app this python runs under has the Local Network permission ({LOCAL_NETWORK_SETTING})")
    return peer_lost(
        rank, 0, f"could not connect to the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT, "
        f"served by rank 0, or by torchrun on the first node) within {waited:.0f}s: {what}. Check that rank 0 "
        f"is running and has reached init_process_group, with the same MASTER_ADDR and MASTER_PORT{across}. "
        f"{DOCTOR_HINT.format(host=host, port=port)}; THUNDERBOLT_CONNECT_TIMEOUT sets this wait",
        address=f"{host}:{port}")


def local_network_denied_store(rank: int, host: str, port: int, exc: OSError) -> ConfigError:
    return ConfigError(
        f"rank {rank}: macOS refused the connection to the rendezvous store at {host}:{port} "
        f"(MASTER_ADDR:MASTER_PORT; {errno.errorcode.get(exc.errno or 0, exc.errno)}, {LOCAL_NETWORK_TRIES} "
        f"times): the app this python runs under (Terminal, iTerm, VS Code, tmux's terminal, a notebook app) "
        f"most likely lacks the Local Network permission. Allow it in {LOCAL_NETWORK_SETTING} and restart that "
        f"app (an ssh session is not affected); if it is allowed, check the cable and that {host} is rank 0's "
        f"address ({DOCTOR_HINT.format(host=host, port=port)})")
