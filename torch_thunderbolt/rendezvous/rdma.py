"""Setting up the RDMA links of one group: devices, queue pair numbers and control connections through the
rendezvous store, then two barriers and a hello over every queue pair.

1. Every rank probes its RDMA devices (transport/rdma.probe_devices: port active, IPv4-mapped GID, a
   protection domain) and publishes the usable ones with the network each sits in, its host and a
   listening endpoint for the control connections (record `tbrdma/dev/<rank>`).
2. Each pair of ranks uses a network both have a device in (a Thunderbolt cable is a network of its own);
   each rank takes its device there. On a fake fabric (THUNDERBOLT_VERBS=fake:...) every device reaches
   every other, and the ranks of one host take one device each in turn (`rdma_fake<local rank>`): a
   device has about 10 queue pairs, so ranks must not share one. Real Macs have one device per Thunderbolt
   interface (`rdma_en2` for `en2`).
3. Every rank creates its queue pairs, moves them to INIT and publishes their numbers, a random PSN and its
   GID (record `tbrdma/qp/<rank>`), reads its peers', and moves to RTR and RTS; receives are posted then.
4. Control connections: a TCP stream per pair, authenticated with the same handshake as TCP links
   (protocol/handshake.py, a key from THUNDERBOLT_SECRET and this set-up's nonce). A barrier over them
   (both ends RTS with receives posted: a UC send before that is lost), then a hello frame on every queue
   pair, which must arrive (the RDMA path works end to end; it also shows whether the completion channel
   signals), then a last barrier, after which a peer may send data.

Records go through the group's set-up records (records.py: signed with the job's key where there is
THUNDERBOLT_SECRET), and the control connections use the group's handshake key; without a secret each rank
warns, as for TCP links. A rank that gives up says why there, and every rank waiting for it raises that.
A failure that is RDMA's own (an RdmaError: a verbs call failed, a device vanished, a wedged port, a path
that carries no hello, or a peer that gave up for such a reason) is published as giving up RDMA alone
(Records.give_up), before this rank closes its sockets: every wait on a peer here (its records, the control
connections, the barriers, the hellos) looks for that too and stops at once, and under
THUNDERBOLT_TRANSPORT=auto the group then joins those pairs over TCP instead (group.py); any other failure
fails the whole set-up (Records.announce).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ..config import Config
from ..errors import ConfigError, HandshakeError, RdmaError, peer_lost
from ..platform import Platform, current, spin_cores
from ..transport.engine import Transport
from ..transport.netif import network_of
from .hosts import recv_exact
from .records import Records
from .setup import SetUp, connect_one_kind
from .tcp import NO_SECRET_WARNING, _Acceptor, _connect, _listen, local_addresses, security_log

if TYPE_CHECKING:
    from ..transport import verbs as v
    from ..transport.rdma import DeviceState, RdmaEnd, RdmaLinks

# The verbs binding and the rdma kind are imported where used, not here: every job's set-up imports this
# module (the table of kinds), and on a machine without RDMA nothing of them is needed.

log = logging.getLogger("torch_thunderbolt.bootstrap")

PREFIX = "tbrdma"
KIND = "rdma"  # the kind's name in the table (its records of giving up: records.kind_name)
FAKE_NET = "fake fabric"  # every device of a fake fabric reaches every other
HELLO_TIMEOUT = 10.0  # seconds for the hellos, once both ends are RTS: they take microseconds
LOOK_EVERY = 0.1  # seconds between looks at the store for a peer that gave up, while waiting on sockets or hellos
CHANNEL_WAIT = 0.1  # how long a hello that arrived may take to raise its channel event
READY, HELLOED = b"R", b"H"


NO_RDMA = "no RDMA on this machine"


def _usable_devices(cfg: Config, plat: Platform | None = None) -> "tuple[list[DeviceState], str | None]":
    """The devices that work end to end short of a peer, or why none does. Quick where there is no RDMA:
    no device in the kernel's list (Linux), a library that does not load, or no device listed."""
    plat = plat or current()
    if cfg.verbs == "system" and plat.rdma_sysfs is not None and not os.path.isdir(plat.rdma_sysfs):
        return [], f"{NO_RDMA} (no {plat.rdma_sysfs})"
    from ..transport.providers import verbs_from_config
    from ..transport.rdma import probe_devices

    try:
        verbs = verbs_from_config(cfg)
    except RdmaError as exc:
        return [], f"{NO_RDMA} ({exc})"
    try:
        states = probe_devices(verbs)
    except RdmaError as exc:
        return [], f"{NO_RDMA} ({exc})"
    finally:
        verbs.close()
    if not states:
        return [], f"{NO_RDMA} ({verbs.provider.name} lists no device)"
    usable = [s for s in states if s.usable]
    return usable, None if usable else "; ".join(s.problem for s in states)


def offer(cfg: Config) -> str | None:
    """None when this rank can use RDMA links (a device has an active port, an IPv4-mapped GID and gives a
    protection domain), else why not."""
    return _usable_devices(cfg)[1]


def reach(cfg: Config) -> list[str]:
    """The networks this rank's usable RDMA devices sit in (one per Thunderbolt cable; one for a whole fake
    fabric): two ranks join over RDMA where they have one in common."""
    return sorted({d["net"] for d in device_networks(_usable_devices(cfg)[0], cfg.verbs == "fake")})


def reaches(a: list[str], b: list[str]) -> str | None:
    """None when two ranks' RDMA networks (`reach`) meet, else why not."""
    if set(a) & set(b):
        return None
    return (f"no Thunderbolt cable with RDMA between them (RDMA networks {', '.join(a) or 'none'} and "
            f"{', '.join(b) or 'none'})")


def no_rdma_here(why: str) -> bool:
    """A refusal that is no news: the machine has no RDMA at all (most do not)."""
    return why.startswith(NO_RDMA)


# --- choosing devices -----------------------------------------------------------------------------------

def device_networks(states: "Sequence[DeviceState]", fake: bool) -> list[dict[str, Any]]:
    """The usable devices as this rank publishes them: name, address, network (a cable's subnet; one
    network for a whole fake fabric), frame limit and queue pair budget."""
    out = []
    for s in states:
        if s.usable:
            net = FAKE_NET if fake else network_of(s.ipv4)
            out.append({"name": s.name, "ipv4": s.ipv4, "net": net, "limit": s.frame_limit, "max_qp": s.max_qp})
    return out


class Choice(NamedTuple):
    """How this rank reaches one peer: its device (and the others on the same network, to try when it has
    no queue pair left), the lane sizes both ends use."""
    device: str
    msg_size: int
    bulk_size: int
    others: tuple[str, ...] = ()


def choose_devices(rank: int, peers: Sequence[int], records: dict[int, dict[str, Any]],
                   local: Sequence[int]) -> dict[int, Choice]:
    """Per peer: a network both ranks have a usable device in (the first, by name, when there are several
    cables), this rank's device in it (the ranks of a host take the devices of a network in turn) and the
    lane sizes both ends' devices there allow; a bulk lane only where the device keeps half its queue pairs
    free for other groups and jobs. `local`: the group's ranks on this host. Pure: every rank computes the same
    from the same records. ConfigError for a peer with no common network."""
    mine = records[rank]
    index = sorted(local).index(rank)
    out: dict[int, tuple[dict[str, Any], int, int]] = {}
    for p in peers:
        theirs = records[p]
        common = sorted({d["net"] for d in mine["devices"]} & {d["net"] for d in theirs["devices"]})
        if not common:
            raise ConfigError(
                f"rank {rank}: no RDMA path to rank {p}: rank {rank}'s usable RDMA devices are "
                f"{_describe(mine['devices'])}, rank {p}'s {_describe(theirs['devices'])}; RDMA needs a "
                f"Thunderbolt 5 cable between the two Macs, both interfaces with IPv4 addresses in one subnet "
                f"(`torch-thunderbolt doctor` on each); THUNDERBOLT_TRANSPORT=auto uses TCP for such pairs")
        net = common[0]
        candidates = sorted((d for d in mine["devices"] if d["net"] == net), key=lambda d: d["name"])
        first = index % len(candidates)
        limit = min(d["limit"] for d in mine["devices"] + theirs["devices"] if d["net"] == net)
        msg, bulk = _lane_sizes(limit)
        out[p] = (candidates[first:] + candidates[:first], msg, bulk)
    choices = {}
    for p, (devs, msg, bulk) in out.items():
        dev = devs[0]
        peers_here = sum(1 for d, _, _ in out.values() if d[0]["name"] == dev["name"])
        n = len(devs)
        sharers = sum(1 for i in range(len(local)) if i % n == index % n)  # this host's ranks on this device
        if bulk and 2 * peers_here * sharers > dev["max_qp"] // 2:
            bulk = 0  # one queue pair per peer leaves room for the job's other groups
        choices[p] = Choice(dev["name"], msg, bulk, tuple(d["name"] for d in devs[1:]))
    return choices


def _describe(devices: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{d['name']} ({d['ipv4']}, {d['net']})" for d in devices) or "none"


# --- the set-up ---------------------------------------------------------------------------------------

def connect_rdma(store: Any, rank: int, world: int, cfg: Config, timeout: float) -> Transport:
    """A transport over RDMA alone, to every other rank of the group, every rank on this host (threads or
    processes of one machine over a fake fabric: tests and tools). Rank 0 returns only once every rank has
    read what it needs from the store (which rank 0 may serve: agree.leave_together)."""
    return connect_one_kind(store, rank, world, cfg, timeout, connect_rdma_links)


def _lane_sizes(limit: int) -> tuple[int, int]:
    from ..transport.rdma import lane_sizes

    return lane_sizes(limit, limit)


def connect_rdma_links(setup: SetUp) -> "RdmaLinks":
    """This rank's RDMA links to `setup.peers` (all of `setup.users` run this together)."""
    from ..transport import verbs as v
    from ..transport.providers import verbs_from_config
    from ..transport.rdma import RdmaEnd, RdmaLinks, probe_devices

    store, rank, world, cfg, timeout = setup.store, setup.rank, setup.world, setup.cfg, setup.timeout
    records, key, group_id = setup.records, setup.auth.key, setup.auth.group_id
    members = sorted(set(setup.peers) - {rank})
    deadline = time.monotonic() + min(timeout, cfg.connect_timeout)
    verbs: v.Verbs | None = None
    devices: dict[str, v.Device] = {}
    pds: dict[str, v.ProtectionDomain] = {}
    ends: dict[int, RdmaEnd] = {}
    socks: dict[int, socket.socket] = {}
    acceptor: _Acceptor | None = None
    listener: socket.socket | None = None
    try:
        verbs = verbs_from_config(cfg)
        if not cfg.secret and members:
            security_log.warning(NO_SECRET_WARNING, rank)
        fake = cfg.verbs == "fake"
        states = probe_devices(verbs)
        usable = device_networks(states, fake)
        if not usable:
            why = "; ".join(s.problem for s in states) or f"{verbs.provider.name} lists no RDMA device"
            raise RdmaError(f"rank {rank}: no usable RDMA device: {why}", call="", device="")
        address = local_addresses(store, cfg, rank)[0]
        listener = _listen(address, dataclasses.replace(cfg, port=0, listen_all=False), rank)
        mine = {"endpoint": [address, listener.getsockname()[1]], "devices": usable}
        records.publish(f"{PREFIX}/dev/{rank}", mine)
        # Control connections: accept the higher ranks' (from the address each published), connect to the
        # lower ones, as TCP links do.
        higher = {p for p in members if p > rank}
        acceptor = _Acceptor([listener], rank, world, 1, key, group_id,
                             lambda p: {_endpoint(records.read(f"{PREFIX}/dev/{p}", p, "its RDMA devices",
                                                               KIND))[0]},
                             cfg, deadline, higher)
        acceptor.start()
        found = {rank: mine}
        for p in members:
            found[p] = records.read(f"{PREFIX}/dev/{p}", p, "its RDMA devices", KIND)
        for p in members:
            if p < rank:
                socks[p] = _connect(rank, p, 0, _endpoint(found[p]), address, key, group_id, cfg, deadline,
                                    records=records, kind=KIND)
        # Queue pairs.
        local = [r for r in range(world) if not setup.hosts or setup.hosts[r] == setup.hosts[rank]]
        choices = choose_devices(rank, members, found, local)
        for p in members:
            c = choices[p]
            busy: RdmaError | None = None
            for name in (c.device, *c.others):  # another device of the network where one is out of queue pairs
                if name not in devices:
                    devices[name] = verbs.open(name)
                    pds[name] = devices[name].alloc_pd()
                dev = devices[name]
                found = dev.ipv4_gid_index(1)
                if found is None:
                    raise RdmaError(f"{name} lost its IPv4-mapped GID during the set-up", call="ibv_query_gid",
                                    device=name)
                max_wr = dev.query_device().max_qp_wr if verbs.has("ibv_query_device") else 32
                try:
                    ends[p] = RdmaEnd(dev, pds[name], found[0], found[1], c.msg_size, c.bulk_size,
                                      max_wr=max_wr or 32)
                    break
                except RdmaError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    busy = busy or exc
            else:
                assert busy is not None
                raise busy
        records.publish(f"{PREFIX}/qp/{rank}", {str(p): e.info() for p, e in ends.items()})
        for p in members:
            theirs = records.read(f"{PREFIX}/qp/{p}", p, "its queue pairs", KIND)
            if not isinstance(theirs, dict) or str(rank) not in theirs:
                raise HandshakeError(f"rank {rank}: rank {p}'s record {PREFIX}/qp/{p} holds no queue pairs for "
                                     f"this rank", why="store")
            ends[p].connect(theirs[str(rank)])
        _await_control(records, acceptor, rank, higher, deadline)
        for (p, _), sock in acceptor.conns.items():
            socks[p] = sock
        for e in ends.values():
            if e.channel is not None:
                e.arm()
        _barrier(records, socks, READY, rank, deadline)  # every end RTS with its receives posted
        for e in ends.values():
            e.send_hello()
        _await_hellos(rank, ends, min(deadline, time.monotonic() + HELLO_TIMEOUT), records)
        _barrier(records, socks, HELLOED, rank, deadline)  # from here a peer may send data
        spin = cfg.spin_us if setup.local_ranks() <= spin_cores() else 0
        kind = RdmaLinks(verbs, list(devices.values()), ends, socks, spin_us=spin,
                         link_timeout=cfg.link_timeout_ms / 1000)
        for p, e in ends.items():
            log.debug("rank %d: RDMA link to rank %d on %s: lanes of %s bytes, %s", rank, p, e.device.name,
                      [lane.size for lane in e.lanes],
                      "completion events" if e.channel_works else "polling with bounded backoff")
        return kind
    except BaseException as exc:
        # Before the sockets close: a peer that finds them closed reads why.
        if isinstance(exc, RdmaError):
            records.give_up(KIND, exc)  # RDMA's own failure: the group may go on without RDMA (auto)
        else:
            records.announce(exc)
        for s in socks.values():
            s.close()
        if acceptor is not None:
            for s in acceptor.conns.values():
                if s is not None:
                    s.close()
        for dev in devices.values():
            try:
                dev.close()
            except RdmaError:
                pass
        for e in ends.values():
            e.release()
        if verbs is not None:
            verbs.close()
        raise
    finally:
        if acceptor is not None:
            acceptor.stop()
        if listener is not None:
            listener.close()


def _endpoint(record: Any) -> tuple[str, int]:
    try:
        host, port = record["endpoint"]
        return str(host), int(port)
    except (TypeError, KeyError, ValueError):
        raise HandshakeError("an RDMA set-up record holds no control endpoint", why="store") from None


def _await_control(records: Records, acceptor: _Acceptor, rank: int, higher: set[int], deadline: float) -> None:
    """Every higher rank's control connection, or the reason one never comes: a connection that failed its
    check (`acceptor.fatal`), a rank still missing that gave up (the whole set-up or RDMA alone: looked for
    every LOOK_EVERY, not at the deadline only), or the deadline."""
    while not acceptor.done.wait(max(0.0, min(LOOK_EVERY, deadline - time.monotonic()))):
        records.raise_failure(sorted(p for p in higher if acceptor.conns.get((p, 0)) is None), KIND)
        if time.monotonic() >= deadline:
            break
    if acceptor.fatal is not None:
        raise acceptor.fatal
    missing = sorted(p for p in higher if acceptor.conns.get((p, 0)) is None)
    if missing:
        raise peer_lost(rank, missing[0], f"timed out waiting for ranks {missing} to open their RDMA control "
                        f"connections")


def _barrier(records: Records, socks: dict[int, socket.socket], byte: bytes, rank: int, deadline: float) -> None:
    """One byte to every peer, then one from each: every peer reached this step. A peer whose connection
    breaks meanwhile is named with the reason it published (it gave up the set-up, or RDMA alone)."""
    for p, s in socks.items():
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.sendall(byte)
        except OSError as exc:
            raise _left(records, rank, p, exc) from exc
    for p, s in socks.items():
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            got = recv_exact(s, 1)
        except OSError as exc:
            raise _left(records, rank, p, exc) from exc
        if got != byte:
            raise HandshakeError(f"rank {rank}: rank {p} sent {got!r} on its RDMA control connection during the "
                                 f"set-up, expected {byte!r}")


def _left(records: Records, rank: int, peer: int, exc: OSError) -> BaseException:
    """What to raise when `peer`'s control connection broke during the set-up: the reason it published, or
    PeerLostError (it died)."""
    failed = records.failure(peer, KIND)
    if failed is None:  # (a peer that died may not have said why: look once more)
        time.sleep(0.2)
        failed = records.failure(peer, KIND)
    if failed is not None:
        return failed
    return peer_lost(rank, peer, f"rank {peer} left the RDMA set-up ({exc})")


def _await_hellos(rank: int, ends: "dict[int, RdmaEnd]", deadline: float, records: Records) -> None:
    """Every peer's hello on every lane, or RdmaError naming the peers whose path delivers nothing (or the
    reason a peer still waited for published: it gave up, looked for every LOOK_EVERY). Also tells, per
    end, whether the completion channel signalled (an event within CHANNEL_WAIT of the hello)."""
    waiting = set(ends)
    pause = 0.0002
    look = time.monotonic() + LOOK_EVERY
    while waiting:
        for p in sorted(waiting):
            if ends[p].take_hello():
                waiting.discard(p)
        if not waiting:
            break
        now = time.monotonic()
        if now >= look:
            look = now + LOOK_EVERY
            records.raise_failure(sorted(waiting), KIND)
        if now > deadline:
            detail = "; ".join(f"rank {p} via {ends[p].device.name} ({_port(ends[p].device)})" for p in sorted(waiting))
            raise RdmaError(f"rank {rank}: nothing arrived over RDMA from {detail} although both ends were "
                            f"ready: the Thunderbolt port or cable does not carry RDMA (port down, a wedged "
                            f"port after a failed set-up: reboot; `torch-thunderbolt doctor`)",
                            device=ends[min(waiting)].device.name)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    for e in ends.values():
        if e.channel is not None:
            e.channel_works = bool(select.select([e.channel.fd], [], [], CHANNEL_WAIT)[0])
            e.channel_events()


def _port(dev: "v.Device") -> str:
    try:
        return f"port {dev.query_port(1).state_name}"
    except RdmaError as exc:
        return f"port state unknown: {exc}"
