"""Registering the "thunderbolt" backend and the thunderbolt:// rendezvous scheme with torch.distributed.

Kept import-light: the autoload hook runs at the end of `import torch`, so nothing here may import the
rest of the package until a group is actually created.
"""
from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode, urlparse, parse_qsl

BACKEND = "thunderbolt"
DEVICES = ["cpu", "cuda", "mps"]


def create_process_group(dist_opts: Any, backend_opts: Any = None) -> Any:
    """The creator torch calls for every group using our backend (extended API). `backend_opts`: the group's
    `pg_options`; a `Config` there replaces the one parsed from the environment (bench measures with the
    settings it was given that way)."""
    from ..algorithms.shape import cluster_shape
    from ..config import Config
    from ..rendezvous.group import connect
    from ..transport.names import RankNames
    from .process_group import ThunderboltProcessGroup

    cfg = backend_opts if isinstance(backend_opts, Config) else Config.from_env()
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout.total_seconds() if isinstance(dist_opts.timeout, timedelta) else 1800.0
    # In a subgroup, "rank 0" in an error is a group rank: name the global one too. torch gives an extended
    # backend's creator the group's global ranks (none for the default group, whose ranks are global).
    names = RankNames.for_group(getattr(dist_opts, "global_ranks_in_group", None), size,
                                str(getattr(dist_opts, "group_id", "") or "?"))
    group = connect(dist_opts.store, rank, size, cfg, timeout, names=names)
    return ThunderboltProcessGroup(group.transport, cfg, timeout, description=str(getattr(dist_opts, "group_id", "")),
                                   shape=cluster_shape(group.nets, group.hosts))


def _thunderbolt_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    """thunderbolt://HOST:PORT — a TCPStore on HOST:PORT that rank 0 serves; rank and world size from the URL
    or environment. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) HOST:PORT is torchrun's own store when
    PORT is its --master-port (MASTER_PORT), as with tcp://; any other PORT is served by rank 0, as outside
    torchrun. (torch's tcp:// makes every rank a client there, of a store nobody serves: it hangs.)"""
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    query.setdefault("rank", os.environ.get("RANK", ""))
    query.setdefault("world_size", os.environ.get("WORLD_SIZE", ""))
    if not query["rank"] or not query["world_size"]:
        raise ValueError("thunderbolt:// rendezvous needs rank and world_size (arguments, or RANK and WORLD_SIZE "
                         "in the environment)")
    host = parsed.hostname or os.environ.get("MASTER_ADDR", "")
    port = parsed.port or int(os.environ.get("MASTER_PORT", "0") or 0)
    if not host or not port:
        raise ValueError(f"thunderbolt:// rendezvous needs HOST:PORT, got {url!r}")
    if agent_store_elsewhere(port, os.environ):
        return _rank_0_serves(host, port, int(query["rank"]), int(query["world_size"]), timeout)
    tcp_url = f"tcp://{host}:{port}?{urlencode(query)}"
    from ..rendezvous.store_probe import probe_url

    probe_url(tcp_url, timeout)  # a blocked first connection: our error and fix, not torch's long wait
    return rdzv._tcp_rendezvous_handler(tcp_url, timeout=timeout, **kwargs)


PROBED_SCHEMES = ("env", "tcp")  # torch's rendezvous handlers that connect a TCPStore client


def _probing_handler(torch_handler: Any) -> Any:
    """torch's env:// or tcp:// handler, preceded in a thunderbolt job by a probe of the store (see
    rendezvous/store_probe.py). Other backends' jobs get torch's handler unchanged."""
    def handler(url: str, **kwargs: Any) -> Any:
        if _creating_a_thunderbolt_group():
            from ..rendezvous.store_probe import probe_url

            probe_url(url, kwargs.get("timeout"))
        return torch_handler(url, **kwargs)

    handler.thunderbolt_probe = True  # type: ignore[attr-defined]
    handler.__wrapped__ = torch_handler  # type: ignore[attr-defined]
    return handler


def _creating_a_thunderbolt_group() -> bool:
    """Whether the rendezvous running now was asked for by init_process_group with our backend.
    torch hands a rendezvous handler no backend, so this reads init_process_group's own `backend` from its
    frame; when it cannot be found (another caller, another torch), the answer is no: torch's behaviour."""
    import sys

    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return False
        if (frame.f_code.co_name == "init_process_group"
                and frame.f_globals.get("__name__") == "torch.distributed.distributed_c10d"):
            return BACKEND in str(frame.f_locals.get("backend", "")).lower()
        frame = frame.f_back
    return False

def agent_store_elsewhere(port: int, env: "dict[str, str] | os._Environ[str]") -> bool:
    """Whether torchrun's agent serves the job's store (every rank would be a client of HOST:PORT) but PORT
    is not that store's port: then nobody would serve HOST:PORT unless rank 0 does. Pure."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    return str(port) != env.get("MASTER_PORT", "")


def _rank_0_serves(host: str, port: int, rank: int, world: int, timeout: timedelta):
    """The rendezvous of a thunderbolt:// URL that names a store of our own under torchrun: rank 0 serves it
    (binding PORT; an error there names the port), the others connect to it."""
    import torch.distributed as dist

    from ..errors import ConfigError

    try:
        store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, multi_tenant=True)
    except RuntimeError as exc:
        if rank != 0:
            raise
        raise ConfigError(
            f"thunderbolt://{host}:{port} under torchrun: rank 0 cannot serve the rendezvous store on port {port} "
            f"({str(exc).splitlines()[0]}); use torchrun's own store (thunderbolt://{host}:"
            f"{os.environ.get('MASTER_PORT', '')}, its --master-port) or a free port") from exc
    yield (store, rank, world)
    raise RuntimeError("Unable to perform re-rendezvous using thunderbolt:// method")


def register() -> None:
    """Idempotent: safe from both the autoload hook and `import torch_thunderbolt`."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create_process_group, extended_api=True, devices=DEVICES)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    if "thunderbolt" not in getattr(rdzv, "_rendezvous_handlers", {}):
        rdzv.register_rendezvous_handler("thunderbolt", _thunderbolt_rendezvous)
    handlers = getattr(rdzv, "_rendezvous_handlers", None)  # register_rendezvous_handler refuses to replace
    for scheme in PROBED_SCHEMES if isinstance(handlers, dict) else ():
        if scheme in handlers and not getattr(handlers[scheme], "thunderbolt_probe", False):
            handlers[scheme] = _probing_handler(handlers[scheme])
