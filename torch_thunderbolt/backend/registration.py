"""Registering the "thunderbolt" backend and the thunderbolt:// rendezvous scheme with torch.distributed.

Kept import-light: the autoload hook runs at the end of `import torch`, so nothing here may import the
rest of the package until a group is actually created.
"""
from __future__ import annotations

import atexit
import importlib
import os
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode, urlparse, parse_qsl

BACKEND = "thunderbolt"
DEVICES = ["cpu", "cuda", "mps"]


def create_process_group(dist_opts: Any, backend_opts: Any = None) -> Any:
    """The creator torch calls for every group using our backend (extended API)."""
    from ..algorithms.shape import shape_from_networks
    from ..config import Config
    from ..transport.memory import MemoryHub
    from ..transport.names import RankNames
    from .process_group import ThunderboltProcessGroup

    cfg = Config.from_env()
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout.total_seconds() if isinstance(dist_opts.timeout, timedelta) else 1800.0
    hosts = None if size == 1 or cfg.transport != "auto" else _host_map(dist_opts.store, rank, size)
    kind = _choose_transport(cfg.transport, rank, hosts)
    if kind in ("shm", "hybrid"):
        kind = _shm_or_tcp(kind, rank)
    if size == 1:
        transport = MemoryHub(1).transports[0]
    elif kind == "shm":
        from ..transport.shm import connect_shm

        transport = connect_shm(dist_opts.store, rank, size, cfg, timeout)
    elif kind == "hybrid":
        from ..transport.hybrid import connect_hybrid

        transport = connect_hybrid(dist_opts.store, rank, size, cfg, timeout, hosts)
    else:
        from ..transport.bootstrap import connect_tcp

        transport = connect_tcp(dist_opts.store, rank, size, cfg, timeout)
    # In a subgroup, "rank 0" in an error is a group rank: name the global one too. torch gives an extended
    # backend's creator the group's global ranks (none for the default group, whose ranks are global).
    names = RankNames.for_group(getattr(dist_opts, "global_ranks_in_group", None), size,
                                str(getattr(dist_opts, "group_id", "") or "?"))
    if names is not None:
        for t in (transport, getattr(transport, "shm", None), getattr(transport, "tcp", None)):
            if t is not None:
                t.names = names
    nets = getattr(transport, "networks", None)
    if nets and hosts is not None and len(set(hosts)) < len(hosts) and len(set(hosts)) > 1:
        shape = hosts_shape(nets, hosts)
    else:
        shape = shape_from_networks(nets) if nets else None
    return ThunderboltProcessGroup(transport, cfg, timeout, description=str(getattr(dist_opts, "group_id", "")),
                                   shape=shape)


def _host_map(store: Any, rank: int, size: int) -> list[str]:
    """Every rank's host identity (same hostname, boot and network namespace = same host)."""
    from ..transport.shm_connect import host_map

    return host_map(store, rank, size)


def _choose_transport(setting: str, rank: int, hosts: list[str] | None) -> str:
    """tcp, shm or hybrid for this rank. `auto`: shm when the whole group shares one host; shm to this
    host's peers plus TCP to the others when both exist; TCP for a rank alone on its host (its peers
    reach it over TCP whatever they chose)."""
    if setting != "auto" or hosts is None:
        return setting if setting in ("tcp", "shm") else "tcp"
    if len(set(hosts)) == 1:
        return "shm"
    return "hybrid" if hosts.count(hosts[rank]) > 1 else "tcp"


def _shm_or_tcp(kind: str, rank: int, plat: Any = None, lookup: Any = None) -> str:
    """`kind`, or "tcp" with a warning where shared memory is unsafe (no full memory barrier is known; see
    shm_ring.shm_refusal). Every rank of a host decides alike, and other hosts reach it over TCP anyway."""
    from ..transport import shm_ring

    why = shm_ring.shm_refusal(plat) if lookup is None else shm_ring.shm_refusal(plat, lookup)
    if why is None:
        return kind
    import logging

    logging.getLogger("torch_thunderbolt").warning(
        "rank %d: not using shared memory (%s): TCP over loopback instead, which is slower", rank, why)
    return "tcp"


def hosts_shape(nets: list[list[str]], hosts: list[str]) -> Any:
    """The cluster shape when hosts run several ranks: derived from the hosts' networks (a 3-Mac chain
    stays a chain, however many ranks each Mac runs), each host's ranks next to each other in the
    ring/line order, so a ring crosses each cable once rather than once per rank. Pure."""
    from ..algorithms.shape import Shape, shape_from_networks

    names = list(dict.fromkeys(hosts))  # hosts in the order of their lowest rank
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in names}
    host_nets = [sorted({n for r in members[h] for n in nets[r]}) for h in names]
    by_host = shape_from_networks(host_nets)
    order = [r for i in by_host.order for r in members[names[i]]]
    kind = "mesh" if by_host.kind in ("single", "pair") else by_host.kind  # 2 hosts: everyone reaches everyone
    groups = [members[names[i]] for i in by_host.order]
    return Shape(kind, order, shape_from_networks(nets).neighbours, groups)


def _thunderbolt_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    """thunderbolt://HOST:PORT — a TCPStore on HOST:PORT; rank and world size from the URL or environment."""
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
    tcp_url = f"tcp://{host}:{port}?{urlencode(query)}"
    return rdzv._tcp_rendezvous_handler(tcp_url, timeout=timeout, **kwargs)


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
    _install_exit_hook()


_exit_hook_installed: list[bool] = []  # a one-element latch; registration is per interpreter by nature


def _install_exit_hook() -> None:
    if _exit_hook_installed:
        return
    _exit_hook_installed.append(True)

    def _close_groups() -> None:
        from .process_group import shutdown_all

        shutdown_all()

    atexit.register(_close_groups)
