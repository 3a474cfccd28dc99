"""Hybrid transport for jobs spanning hosts with several ranks per host: shared memory to the peers on this
host, TCP to the others, one Transport to the algorithms.

Both engines keep global rank numbers and are rewired at construction to share this transport's Matcher
and condition (lock): a receive from any source is posted once and matched by whichever engine delivers
first, a failure in either engine fails every pending receive, and sends on the other engine are failed
when the hybrid propagates the error to it (which also tells that engine's peers the root cause).

Waiting: the waiting thread pumps both engines without blocking, spins briefly (like shm), then blocks in
one poll() over both engines' file descriptors (TCP streams, shm doorbells, both wake-up socketpairs),
with the shm "sleeping" flag set so same-host peers ring the bell. No alternating between engines.
"""
from __future__ import annotations

import select
from typing import Any, Callable, Iterable

from . import shm_ring as ring
from .base import ANY_SOURCE, DrivenTransport, Request
from .matching import Matcher
from .shm import BLOCK_CAP, QUIET_CAP, ShmTransport, default_spin
from .spin import SpinGuard
from .tcp import TcpTransport


class HybridTransport(DrivenTransport):
    def __init__(self, rank: int, world: int, shm: ShmTransport, tcp: TcpTransport, local: Iterable[int]) -> None:
        super().__init__(rank, world)
        self.local = frozenset(local) - {rank}  # peers reached over shared memory
        self.shm, self.tcp = shm, tcp
        self.matcher = Matcher(rank)
        for sub in (shm, tcp):  # one matcher and one lock for both engines (see module docstring)
            sub.matcher = self.matcher
            sub._cv = self._cv
        self.networks = getattr(tcp, "networks", None)
        self._quiet = False
        self._spinner = SpinGuard()

    def _sub(self, peer: int) -> ShmTransport | TcpTransport:
        return self.shm if peer in self.local else self.tcp

    def peer_address(self, peer: int) -> str:
        return self._sub(peer).peer_address(peer)

    # Byte counters: the sum of both engines (the base class's initial assignments are ignored).
    @property
    def bytes_sent(self) -> int:
        return self.shm.bytes_sent + self.tcp.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, _value: int) -> None:
        pass

    @property
    def bytes_received(self) -> int:
        return self.shm.bytes_received + self.tcp.bytes_received

    @bytes_received.setter
    def bytes_received(self, _value: int) -> None:
        pass

    # -- posting ----------------------------------------------------------------------------------
    def _post_send(self, req: Request) -> None:
        with self._cv:
            self._propagate()
            self._check_usable()
            self._sub(req.peer)._post_send(req)
            self._quiet = False

    def _post_recv(self, req: Request) -> None:
        with self._cv:
            self._propagate()
            self._check_usable()
            # From any source: posted once in the shared matcher (through shm, which also reads its rings);
            # TCP never parks point-to-point frames, so nothing there waits for this post.
            (self.shm if req.peer == ANY_SOURCE else self._sub(req.peer))._post_recv(req)
            self._quiet = False

    # -- progress (DrivenTransport._progress calls _drive from one thread at a time) -----------------
    def _pump(self) -> bool:
        """Move what either engine can move without blocking; True if anything moved (or broke)."""
        moved = self.shm._pump()
        moved = self.tcp._pump() or moved
        return self._propagate() or moved

    def _propagate(self) -> bool:
        """An error in either engine breaks the other (telling its peers) and the hybrid; True if broken."""
        err = self.broken or self.shm.broken or self.tcp.broken
        if err is None:
            return False
        for sub in (self.shm, self.tcp):
            if sub.broken is None:
                sub.abort(err)
        if self.broken is None:
            self.broken = err
            self._cv.notify_all()
        return True

    def _drive(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        with self._cv:
            if self._pump() or timeout <= 0:
                self._quiet = False
                return
        if self._spin(timeout):
            return
        shm = self.shm
        with self._cv:
            shm._my_flag[0] = 1
            ring.fence()  # the flag store must be visible before we look at the rings one last time
            if self._pump():
                shm._my_flag[0] = 0
                return
            poller = self._poll_set()
            shm._polling = self.tcp._polling = True
        try:
            events = poller.poll(min(timeout, QUIET_CAP if self._quiet else BLOCK_CAP) * 1000.0)
        finally:
            shm._polling = self.tcp._polling = False
            shm._my_flag[0] = 0
        for sub in (shm, self.tcp):
            shm._drain(sub._wake_r)
        with self._cv:
            shm._read_doorbells(events)
            self._quiet = not self._pump() and not events

    def _spin(self, timeout: float) -> bool:
        """Busy-poll briefly (yielding the CPU) while traffic flows; True if something moved."""
        return not self._quiet and self._spinner.spin(min(self.shm.spin, timeout), self._pump_locked)

    def _pump_locked(self) -> bool:
        with self._cv:
            return self._pump()

    def _poll_set(self) -> "select.poll":
        """One poll set over both engines: shm doorbells and TCP streams, plus both wake-up sockets."""
        poller = select.poll()
        for sub in (self.shm, self.tcp):
            poller.register(sub._wake_r, select.POLLIN)
        for pe in self.shm._list:
            if not pe.eof:
                poller.register(pe.sock, select.POLLIN)
        for c in self.tcp._all:
            if c.dead:  # a stream that lost its cable (failover): never read again
                continue
            ev = (select.POLLIN if c.parked is None and not c.bye else 0) | (select.POLLOUT if c.sendq else 0)
            if ev:
                poller.register(c.fd, ev)
        return poller

    # -- life cycle -------------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        with self._cv:
            if self.broken is None:
                self.broken = error
            self._propagate()

    def retire(self, tag: int) -> None:
        with self._cv:
            self.shm.retire(tag)
            self.tcp.retire(tag)  # raises if a stray frame for a finished op broke it
            if self._propagate():
                raise self.broken

    def _shutdown(self) -> None:
        with self._cv:
            for sub in (self.shm, self.tcp):
                sub.close()
            if self.broken is None:
                self.broken = self.shm.broken or self.tcp.broken
            for s in (self._wake_r, self._wake_w):  # DrivenTransport's doorbell (the engines have their own)
                s.close()
            self._cv.notify_all()


def connect_hybrid(store: Any, rank: int, world: int, cfg: Any, timeout: float,
                   hosts: list[str]) -> HybridTransport:
    """Shared memory among the ranks whose host identity (`hosts[r]`, see shm_connect.host_map) equals
    ours, TCP for the rest. Every rank of the group must call this together."""
    from .bootstrap import connect_tcp
    from .shm_connect import ShmOptions, connect_shm

    local = [p for p in range(world) if p != rank and hosts[p] == hosts[rank]]
    opts = ShmOptions.from_config(cfg)
    # TCP first: every rank takes part in it, so the shm set-up below cannot wait on a rank stuck in TCP's.
    remote = [p for p in range(world) if p != rank and p not in local]
    tcp = connect_tcp(store, rank, world, cfg, timeout, peers=remote)
    try:
        shm = connect_shm(store, rank, world, cfg, timeout, opts, peers=local)
    except BaseException:
        tcp.close()
        raise
    if opts.spin_us is None:  # spin by how many ranks share this host, not by the whole group
        shm.spin = default_spin(len(local) + 1)
    return HybridTransport(rank, world, shm, tcp, local)
