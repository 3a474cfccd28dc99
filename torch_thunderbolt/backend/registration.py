"""Registering the "thunderbolt" backend and the thunderbolt:// rendezvous scheme with torch.distributed.

Kept import-light: the autoload hook runs at the end of `import torch`, so nothing here may import the
rest of the package until a group is actually created.

The store probe (rendezvous/store_probe.py) must run inside torch's env:// and tcp:// rendezvous handlers,
before they connect the TCPStore, and only when the group being created is a thunderbolt one: a gloo or
nccl job keeps torch's behaviour, and our settings are never checked for it. torch tells a handler nothing
about the backend: init_process_group resolves `backend` and then calls `rendezvous(init_method, rank,
world_size, timeout=timeout)` (torch 2.13 and 2.14), the handler gets the URL and the timeout, our creator
(the backend plugin, with its `_DistributedBackendOptions`) runs only once the store exists, and no
environment variable carries the backend. So init_process_group itself is wrapped, thinly: the wrapper binds
the call's arguments to torch's own signature, keeps the backend they ask for in a ContextVar for the
duration of the call, and calls torch's function with the arguments unchanged; the probing handler reads
that ContextVar. The wrapper has torch's name, module, docstring and (through `__wrapped__`) signature, and
returns or raises what torch does. It replaces the function where torch defines it (distributed_c10d) and
where torch re-exports it (`torch.distributed`), so `dist.init_process_group` and `from
torch.distributed import init_process_group` after `import torch` both reach it. A binding taken earlier
(autoload off and torch_thunderbolt imported after that import) keeps torch's function: no probe, torch's
behaviour, as on a torch whose init_process_group has no `backend` parameter, where nothing is wrapped.
Each wrapper marks itself (`MARK`, `ours`), `install_probe` is idempotent and `remove_probe` puts torch's
objects back.

`dist.shrink_group` calls our group's `shrink` and wraps what it returns in a ProcessGroup of torch's own,
which only takes a C++ backend: `install_shrink` lets `_create_shrunk_process_group` take our group as it
is (as torch's `_new_process_group_helper` takes what a Python backend's creator returns), and has
`_finalize_shrunk_group` register the global ranks our group has (`_shrunk_ranks_as_ours` says why torch's
are wrong). A torch without shrink_group has nothing to wrap, and `shrink` can still be called on the group
itself.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Callable, NamedTuple
from urllib.parse import urlencode, urlparse, parse_qsl

BACKEND = "thunderbolt"
DEVICES = ["cpu", "cuda", "mps"]


def create_process_group(dist_opts: Any, backend_opts: Any = None) -> Any:
    """The creator torch calls for every group using our backend (extended API). `backend_opts`: the group's
    `pg_options`; a `Config` there replaces the one parsed from the environment (bench measures with the
    settings it was given that way). A subgroup (`new_group`, a DeviceMesh dimension) of the default group
    runs over the default group's links when every member can (`_split_from_default`), else it is set up
    on its own."""
    from ..config import Config
    from ..rendezvous.group import connect
    from ..transport.names import RankNames
    from .keep_awake import KeepAwake
    from .process_group import ThunderboltProcessGroup

    cfg = backend_opts if isinstance(backend_opts, Config) else Config.from_env()
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout.total_seconds() if isinstance(dist_opts.timeout, timedelta) else 1800.0
    global_ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or []) or None
    name = str(getattr(dist_opts, "group_id", "") or "?")
    if global_ranks and not isinstance(backend_opts, Config):
        child = _split_from_default(dist_opts.store, rank, global_ranks, timeout, name)
        if child is not None:
            child._set_group_desc(name)
            return child
    # In a subgroup, "rank 0" in an error is a group rank: name the global one too. torch gives an extended
    # backend's creator the group's global ranks (none for the default group, whose ranks are global).
    names = RankNames.for_group(global_ranks, size, name)
    # The Mac stays awake from here (the set-up may wait long for the other ranks) until the last group
    # sharing this assertion is destroyed; a group set up on its own beside a default group of ours shares
    # that group's.
    awake = _default_group_awake() if global_ranks else None
    if awake is None:
        awake = KeepAwake(cfg.keep_awake).hold()
    try:
        group = connect(dist_opts.store, rank, size, cfg, timeout, names=names)
        description = str(getattr(dist_opts, "group_id", ""))
        return ThunderboltProcessGroup(group.transport, cfg, timeout, description=description,
                                       nets=group.nets, hosts=group.hosts, global_ranks=global_ranks, awake=awake)
    except BaseException:
        awake.release()
        raise


def _default_group_awake() -> Any:
    """Another share of the default group's power assertion, if the default group is ours and holds one."""
    import torch.distributed as dist

    from .process_group import ThunderboltProcessGroup

    parent = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    return parent.awake_hold() if isinstance(parent, ThunderboltProcessGroup) else None


SPLIT_KEY = "thunderbolt-split/"  # in the new group's store: whether each member can split it off


def _split_from_default(store: Any, rank: int, global_ranks: list[int], timeout: float, name: str) -> Any:
    """The new group of `global_ranks` as a split of the default group, if that is a thunderbolt group that
    spans them and every member can split it (each says so in the new group's store and reads the others:
    all split, or none does), else None. One store round instead of a set-up's connections and handshakes.
    A default group that was itself made over the links (shrunk) is split with no store round: its store
    may have died with a rank it lost (the one serving it), and every member's default group is that one."""
    import torch.distributed as dist

    from .process_group import ThunderboltProcessGroup

    parent = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    spans = isinstance(parent, ThunderboltProcessGroup) and all(0 <= g < parent.size() for g in global_ranks)
    if spans and parent.transport.view:
        return parent.split(sorted(global_ranks), timedelta(seconds=timeout), name)
    able = spans and parent.usable
    store.set(f"{SPLIT_KEY}{rank}", b"1" if able else b"0")
    everyone = [store.get(f"{SPLIT_KEY}{r}") for r in range(len(global_ranks))]
    if not able or any(v != b"1" for v in everyone):
        return None
    return parent.split(sorted(global_ranks), timedelta(seconds=timeout), name)


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
MARK = "thunderbolt_probe"  # on what install_probe puts in torch's place: the object itself (see `ours`)

# The backend asked of the init_process_group running in this context, for the rendezvous handler it calls.
# A ContextVar, not a module global: set and reset by each call, so concurrent threads or tasks never see
# another's request.
_REQUESTED: ContextVar[str | None] = ContextVar("thunderbolt_requested_backend", default=None)


class TorchPlaces(NamedTuple):
    """Where torch keeps what install_probe wraps: the module defining init_process_group, the modules that
    re-export it, and the rendezvous handler table."""
    c10d: Any
    reexports: tuple[Any, ...]
    handlers: dict[str, Any]

    @classmethod
    def of_torch(cls) -> "TorchPlaces":
        """torch's own: distributed_c10d, re-exported by `torch.distributed` (`from .distributed_c10d import
        *`), and rendezvous.py's `_rendezvous_handlers`."""
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        handlers = getattr(rdzv, "_rendezvous_handlers", None)
        return cls(importlib.import_module("torch.distributed.distributed_c10d"),
                   (importlib.import_module("torch.distributed"),), handlers if isinstance(handlers, dict) else {})


def ours(obj: Any) -> bool:
    """Whether `obj` is a wrapper install_probe made. Its mark is the object itself, so a wrapper someone else
    puts around ours (functools.wraps copies the mark) is not taken for ours."""
    return obj is not None and getattr(obj, MARK, None) is obj


def names_thunderbolt(backend: str | None) -> bool:
    """Whether a backend string of init_process_group makes a thunderbolt group: `thunderbolt`, or one
    device's part of `cpu:thunderbolt,cuda:nccl`. Pure."""
    parts = str(backend or "").lower().split(",")
    return any(part.rpartition(":")[2].strip() == BACKEND for part in parts)


def requested_backend(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The backend a call of init_process_group asks for, as torch resolves it before its rendezvous: the
    `backend` argument, or for `device_id=torch.device(...)` without one the device's default backend. None
    when the arguments do not fit (torch's call then raises its own error)."""
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    backend, device = arguments.get("backend"), arguments.get("device_id")
    if backend is None and isinstance(getattr(device, "type", None), str):
        import torch.distributed as dist

        backend = dist.Backend.default_device_backend_map.get(device.type)
    return None if backend is None else str(backend)


def _recording(init: Callable[..., Any], c10d: Any) -> Callable[..., Any] | None:
    """torch's init_process_group, recording the backend it was asked for while it runs; None when `init` has
    no `backend` parameter to read (a torch whose API differs: then nothing is wrapped and nothing probed).
    A thunderbolt init that fails gives back the group number it took (`restore_group_count`)."""
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):
        return None
    if "backend" not in signature.parameters:
        return None

    @functools.wraps(init)  # torch's name, module and docs; inspect.signature follows __wrapped__ to torch's
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        requested = requested_backend(signature, args, kwargs)
        token = _REQUESTED.set(requested)
        count = group_count(c10d)
        try:
            return init(*args, **kwargs)
        except BaseException:
            if names_thunderbolt(requested):
                restore_group_count(c10d, count)
            raise
        finally:
            _REQUESTED.reset(token)

    setattr(init_process_group, MARK, init_process_group)
    return init_process_group


def _probing_handler(torch_handler: Any) -> Any:
    """torch's env:// or tcp:// handler, preceded by a probe of the store (rendezvous/store_probe.py) when the
    init_process_group that calls it was asked for our backend. Otherwise torch's handler alone."""
    @functools.wraps(torch_handler)
    def handler(url: str, **kwargs: Any) -> Any:
        if names_thunderbolt(_REQUESTED.get()):
            from ..rendezvous.store_probe import probe_url

            probe_url(url, kwargs.get("timeout"))
        return torch_handler(url, **kwargs)

    setattr(handler, MARK, handler)
    return handler


def group_count(c10d: Any) -> int | None:
    """torch's count of unnamed groups made in this process (`_world.group_count`), None where it has none."""
    count = getattr(getattr(c10d, "_world", None), "group_count", None)
    return count if isinstance(count, int) else None


def restore_group_count(c10d: Any, before: int | None) -> None:
    """After an init_process_group that failed: torch's group count back to `before`, where the failed call
    took exactly one number and made no default group. torch names the default group after that count and
    keys its set-up in the store under that name, and only destroy_process_group, which needs a default
    group, resets it: without this, the next init in this process would use the next number ("1/") while
    a restarted peer uses "0/", each waiting for the other until the timeout."""
    after = group_count(c10d)
    if before is None or after != before + 1 or c10d.is_initialized():
        return
    c10d._world.group_count = before


def install_probe(places: TorchPlaces) -> bool:
    """Wraps init_process_group (where it is defined and where it is re-exported) to record the backend asked
    for, and the handlers of PROBED_SCHEMES to probe the store when that is ours. Idempotent. False, with
    nothing changed, when init_process_group has no `backend` to read."""
    current = getattr(places.c10d, "init_process_group", None)
    hooked = current if ours(current) else _recording(current, places.c10d) if callable(current) else None
    if hooked is None:
        return False
    for module in (places.c10d, *places.reexports):
        if getattr(module, "init_process_group", None) in (hooked.__wrapped__, hooked):
            module.init_process_group = hooked
    for scheme in PROBED_SCHEMES:  # into torch's table: register_rendezvous_handler refuses to replace one
        if scheme in places.handlers and not ours(places.handlers[scheme]):
            places.handlers[scheme] = _probing_handler(places.handlers[scheme])
    return True


def remove_probe(places: TorchPlaces | None = None) -> None:
    """Puts back what install_probe replaced (by default in torch): thunderbolt groups are then created with
    torch's rendezvous alone, as every other backend's are. `register()` installs the probe again."""
    places = places or TorchPlaces.of_torch()
    for module in (places.c10d, *places.reexports):
        init = getattr(module, "init_process_group", None)
        if ours(init):
            module.init_process_group = init.__wrapped__
    for scheme, handler in list(places.handlers.items()):
        if ours(handler):
            places.handlers[scheme] = handler.__wrapped__
    for name in SHRINK_STEPS:
        step = getattr(places.c10d, name, None)
        if ours(step):
            setattr(places.c10d, name, step.__wrapped__)


def _shrunk_as_it_is(create: Callable[..., Any]) -> Callable[..., Any]:
    """torch's `_create_shrunk_process_group`, taking a Python process group (ours) as the new group itself,
    as torch's `_new_process_group_helper` takes what a Python backend's creator returns: torch would wrap
    the backend `shrink` returned in a ProcessGroup of its own, which only a C++ backend can be registered
    in (a Python ProcessGroup is refused there)."""
    import torch.distributed as dist

    @functools.wraps(create)
    def _create_shrunk_process_group(new_backend: Any, remaining_ranks: list[int], metadata: dict,
                                     is_default_group: bool) -> Any:
        if not isinstance(new_backend, dist.ProcessGroup):
            return create(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend._set_group_name(metadata["new_group_name"])
        new_backend._set_group_desc("default:shrunken" if is_default_group
                                    else f"{metadata['original_group_name']}:shrunk")
        if metadata.get("bound_device_id") is not None:
            new_backend.bound_device_id = metadata["bound_device_id"]
        return new_backend

    setattr(_create_shrunk_process_group, MARK, _create_shrunk_process_group)
    return _create_shrunk_process_group


def _shrunk_ranks_as_ours(finalize: Callable[..., Any], c10d: Any) -> Callable[..., Any]:
    """torch's `_finalize_shrunk_group`, then the new group's global ranks registered as our group has them.

    torch registers as the new group's global ranks the old group's global ranks less `excluded_ranks_set`,
    which holds ranks *of the old group* (0..size-1): right only where the two numberings agree. Shrinking
    `new_group([1, 2, 3])` by its rank 0 (global rank 1) would leave it registered as global ranks [1, 2, 3]
    with size 2, so `src=2` would name the process of global rank 3; a DeviceMesh dimension and a group
    shrunk before are the same case. Our group knows its global ranks (`global_ranks`: its parent's, less the
    excluded). A shrunk default group replaces the default group, and torch numbers global ranks by the
    default group (`get_rank()` is its rank; `get_global_rank` of it is the identity), so its ranks become
    the global ones, where torch would register the old numbers (world 4 less rank 1: [0, 2, 3], while
    `get_rank()` says 0, 1, 2 and `new_group` takes ranks below 3)."""
    @functools.wraps(finalize)
    def _finalize_shrunk_group(group_info: dict, excluded_ranks_set: set, new_backend: Any) -> Any:
        from .process_group import ThunderboltProcessGroup

        new_pg = finalize(group_info, excluded_ranks_set, new_backend)
        if isinstance(new_pg, ThunderboltProcessGroup):
            if group_info.get("is_default_group"):
                new_pg._become_default()
            c10d._world.pg_group_ranks[new_pg] = {g: r for r, g in enumerate(new_pg.global_ranks)}
        return new_pg

    setattr(_finalize_shrunk_group, MARK, _finalize_shrunk_group)
    return _finalize_shrunk_group


SHRINK_STEPS = ("_create_shrunk_process_group", "_finalize_shrunk_group")  # what install_shrink wraps


def install_shrink(places: TorchPlaces) -> bool:
    """Lets `dist.shrink_group` take the group our `shrink` returns (`_shrunk_as_it_is`) with the global ranks
    it has (`_shrunk_ranks_as_ours`). Idempotent; False, with nothing changed, on a torch without shrink_group's
    steps (it has nothing to call then)."""
    create, finalize = (getattr(places.c10d, name, None) for name in SHRINK_STEPS)
    if not callable(create) or not callable(finalize):
        return False
    if not ours(create):
        places.c10d._create_shrunk_process_group = _shrunk_as_it_is(create)
    if not ours(finalize):
        places.c10d._finalize_shrunk_group = _shrunk_ranks_as_ours(finalize, places.c10d)
    return True


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
    places = TorchPlaces.of_torch()
    install_probe(places)
    install_shrink(places)
