"""Setting up the shared-memory links of one group through the rendezvous store.

Every rank creates its inbound segment and a Unix-socket listener, publishes both (plus its host identity)
under `tbshm/<rank>` (a set-up record, checked with the job's key when there is one: records.py), connects
a doorbell socket to every lower rank (authenticated with a per-group token from the store) and accepts one
from every higher rank, maps every peer's segment, and waits until all ranks have mapped theirs. Then each unlinks its segment and listener path: from here on a crash, even
kill -9, leaves nothing behind. Options come from the Config (THUNDERBOLT_SHM_SLOT, _SLOTS, _WINDOW and
_DIR, parsed and checked in config.py): slot payload bytes (default 1M), slots per directed pair (default 8),
bytes per buffer of the shared window the shared-memory collectives use (default 1M, or 4M when ranks
outnumber cores; 0 = none, the collectives then run over the rings) and where file-backed segments live;
the spin before blocking is no setting (Config.shm_spin_us: 100 µs, or 0 when ranks outnumber cores).
"""
from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import Config
from ..errors import ConfigError, HandshakeError, peer_lost
from ..platform import spin_cores
from ..transport import ordering
from ..transport import shm_ring as ring
from ..transport import shm_segment as segs
from ..transport.engine import Transport
from ..transport.shm import ShmLinks
from ..transport.shm_window import area_bytes
from . import hosts
from .hosts import recv_exact
from .records import Records
from .setup import SetUp, connect_one_kind

_HELLO = struct.Struct("<I16s")


@dataclass(frozen=True)
class ShmOptions:
    """The ring and window sizes of one shm transport; `from_config` takes them from the job's Config."""

    slot_bytes: int = 1 << 20
    slots: int = 8
    spin_us: float | None = None  # None: automatic (see shm.default_spin)
    window_bytes: int | None = None  # None: automatic (see default_window_bytes)

    @classmethod
    def from_config(cls, cfg: Config) -> "ShmOptions":
        return cls(slot_bytes=cfg.shm_slot_bytes, slots=cfg.shm_slots, spin_us=cfg.shm_spin_us,
                   window_bytes=cfg.shm_window_bytes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ShmOptions":
        """The options a job would use under `env` (the whole Config is parsed: one parser for everything)."""
        return cls.from_config(Config.from_env(env))


def default_window_bytes(local_ranks: int) -> int:
    """Bytes per window buffer (a round): 1 MB keeps rounds in cache; with more ranks than cores every
    wait is a scheduler wake-up, so 4 MB quarters their number (4 ranks on 2 cores, 64 MB, interleaved:
    all_reduce 38.8 against 41.9 ms with 2 MB, 39.8 against 42.7; 8 MB was faster still for all_reduce but
    slower for broadcast). The host's cores (`spin_cores`), not the affinity mask, so every rank on the
    host picks the same size (the segment layouts must agree)."""
    return (4 << 20) if local_ranks > spin_cores() else (1 << 20)


def _listen() -> tuple[socket.socket, str]:
    d = segs.marker_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = str(d / f"{segs.new_name()}.sock")
    if len(path) > 100:  # sun_path is 104 bytes on macOS
        path = f"/tmp/{segs.new_name()}.sock"
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(128)
    return lst, path


def _connect(rank: int, peer: int, path: str, token: bytes, deadline: float) -> socket.socket:
    last: Exception | None = None
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect(path)
            sock.sendall(_HELLO.pack(rank, token))
            if recv_exact(sock, 1) != b"\x01":
                raise HandshakeError(f"rank {peer} refused our shm doorbell connection")
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            last = exc
            time.sleep(0.05)
        except BaseException:
            sock.close()
            raise
    raise peer_lost(rank, peer, f"could not connect to rank {peer}'s shm doorbell at {path}: {last}", address=path)


def _accept(lst: socket.socket, rank: int, higher: set[int], token: bytes, deadline: float,
            records: Records | None = None) -> dict[int, socket.socket]:
    got: dict[int, socket.socket] = {}
    while len(got) < len(higher):
        left = deadline - time.monotonic()
        missing = sorted(higher - set(got))
        if left <= 0:
            raise peer_lost(rank, missing[0], f"timed out waiting for ranks {missing} to attach over shared memory")
        lst.settimeout(min(left, 0.25))
        try:
            sock, _ = lst.accept()
        except socket.timeout:
            for p in missing if records is not None else ():  # one that gave up says why: raise it now
                failed = records.failure(p)
                if failed is not None:
                    raise failed from None
            continue
        try:
            sock.settimeout(5.0)
            peer, their = _HELLO.unpack(recv_exact(sock, _HELLO.size))
            if not secrets.compare_digest(their, token) or peer not in higher or peer in got:
                raise HandshakeError(f"bad shm hello (rank {peer})")
            sock.sendall(b"\x01")
        except (OSError, HandshakeError, struct.error):
            sock.close()
            continue
        got[peer] = sock
    return got


def offer(cfg: Config) -> str | None:
    """None where shared memory is safe on this machine, else why not (no full memory barrier is known:
    see ordering.shm_refusal). Every rank of a host decides alike."""
    return ordering.shm_refusal()


def connect_shm(store: Any, rank: int, world: int, cfg: Config, timeout: float,
                opts: ShmOptions | None = None) -> Transport:
    """A transport over shared memory alone: every rank of the group on this host, joining the group itself
    (every rank calls this instead of group.connect). `opts`: sizes overriding the Config's (benchmarks,
    tests). Rank 0 returns only once every rank has read what it needs from the store (which rank 0 may
    serve: agree.leave_together)."""
    return connect_one_kind(store, rank, world, cfg, timeout, lambda setup: connect_shm_links(setup, opts))


def connect_shm_links(setup: SetUp, opts: ShmOptions | None = None) -> ShmLinks:
    """This rank's shared-memory links to `setup.peers` (all on this host), e.g. every other rank, or a
    host's share of a multi-host job. `opts`: sizes overriding the Config's."""
    rank, world, cfg, timeout, records = setup.rank, setup.world, setup.cfg, setup.timeout, setup.records
    why = ordering.shm_refusal()
    if why is not None:
        raise ConfigError(f"rank {rank}: shared memory is not safe on this machine ({why}); set "
                          f"THUNDERBOLT_TRANSPORT=tcp (auto chooses TCP here by itself)")
    opts = opts or ShmOptions.from_config(cfg)
    members = sorted(set(setup.peers) - {rank})
    deadline = time.monotonic() + min(timeout, cfg.connect_timeout)
    try:
        segs.cleanup_stale_segments()  # a janitor pass: leftovers of crashed jobs on this host
    except OSError:
        pass
    # One token per set of ranks sharing memory, made by its lowest rank (several hosts may do this at once).
    # It sits in the unauthenticated store, yet a stranger on another host who reads it gains nothing: it only
    # opens the doorbell, a Unix socket on this host, and the segments are this host's memory. (A local
    # attacker is out of scope, as for gloo; no THUNDERBOLT_SECRET is needed here, so shm-only groups don't warn.)
    first = min(members + [rank])
    token_key = f"tbshm/token/{first}"
    if rank == first:
        token_hex = secrets.token_hex(16)
        records.publish(token_key, token_hex)
    else:
        try:
            token_hex = records.read(token_key, first, "the shared-memory token")
        except BaseException as exc:
            records.announce(exc)
            raise
    token = bytes.fromhex(token_hex)
    # This host's ranks share a window: the whole group's, or a multi-host job's per-host phases run on it.
    window = default_window_bytes(len(members) + 1) if opts.window_bytes is None else opts.window_bytes
    area = area_bytes(window)
    size = ring.segment_bytes(world, opts.slots, opts.slot_bytes, area)
    own = segs.create(size, cfg.shm_dir)
    lst, path = _listen()
    socks: dict[int, socket.socket] = {}
    attached: list[segs.Segment] = []
    try:
        own_mv = memoryview(own.mm)
        ring.write_header(own_mv, world, rank, opts.slots, opts.slot_bytes, area)
        own_mv.release()
        me = {"name": own.name, "path": str(own.path) if own.path else None, "sock": path, "pid": os.getpid(),
              "host": hosts.host_identity()}
        records.publish(f"tbshm/{rank}", me)
        infos = {p: records.read(f"tbshm/{p}", p, "its shared-memory segment") for p in members}
        for p, info in infos.items():
            if info["host"] != me["host"]:
                raise ConfigError(f"THUNDERBOLT_TRANSPORT=shm: rank {p} runs on another host ({info['host']}) "
                                  f"than rank {rank} ({me['host']})")
        for p in members:
            if p < rank:
                socks[p] = _connect(rank, p, infos[p]["sock"], token, deadline)
        socks.update(_accept(lst, rank, {p for p in members if p > rank}, token, deadline, records))
        peers = {}
        for p, info in infos.items():
            layout = ConfigError(f"rank {p}'s shared-memory segment has a different layout (set the same "
                                 f"THUNDERBOLT_SHM_* on every rank)")
            try:
                seg = segs.attach(info["name"], size, info["path"])
            except segs.SizeMismatch:
                raise layout from None
            except FileNotFoundError:
                failed = records.failure(p)  # it gave up and removed its segment: say why
                if failed is not None:
                    raise failed from None
                raise
            attached.append(seg)
            mv = memoryview(seg.mm)
            ok = ring.check_header(mv, world, p, opts.slots, opts.slot_bytes, area)
            mv.release()
            if not ok:
                raise layout
            peers[p] = (socks[p], info["pid"], seg)
        records.publish(f"tbshm/ready/{rank}", 1)
        for p in infos:
            records.read(f"tbshm/ready/{p}", p, "its readiness")
        own.unlink()  # every peer has it mapped
        spin = None if opts.spin_us is None else opts.spin_us * 1e-6
        return ShmLinks(rank, world, own, peers, slots=opts.slots, slot_bytes=opts.slot_bytes, spin=spin,
                        window_bytes=window)
    except BaseException as exc:
        # Before our segment disappears: a peer that can't attach it any more learns why from the store.
        records.announce(exc)
        own.unlink()
        own.close()
        for seg in attached:
            seg.close()
        for s in socks.values():
            s.close()
        raise
    finally:
        lst.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

