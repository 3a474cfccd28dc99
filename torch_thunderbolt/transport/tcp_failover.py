"""The TCP transport's side of cable failover (bookkeeping in failover.py): what to do when one stream
of a peer dies, ACK/RESYNC handling, the keeper thread that answers while nobody waits, and PING probes
that give a waiting rank unacknowledged data so a dead link times out for it too. A mixin of TcpTransport:
it uses the transport's connections, matcher, lock and queues."""
from __future__ import annotations

import errno
import logging
import threading
import time

from ..errors import MismatchError, ProtocolError
from ..protocol.framing import Frame, Kind, Space, encode_control, encode_frame_header
from ..protocol.signature import describe_sig
from .base import ANY_SOURCE
from .failover import RxCount, StreamLog, is_link_failure
from .tcp_conn import ABORT_PAYLOAD, Stream, Outgoing

log = logging.getLogger("torch_thunderbolt.tcp")
OPS_REMEMBERED = 256  # a PING names an op the peer waits for now: one this far behind us is long settled


class StreamFailover:
    def _init_failover(self, probe_after: float) -> None:
        """After the streams exist: logs for peers reached over two or more cables, PING timing, keeper."""
        self.lost_streams = 0
        self.resent_bytes = 0  # payload sent again after a lost stream
        self.no_park: set[int] = set()  # peers whose early frames are buffered, not parked
        for peer, cs in self.conns.items():
            # Streams over two or more cables (address pairs; the set looks the same from both ends).
            if len({(c.local, c.addr.rpartition(":")[0]) for c in cs}) > 1:
                for c in cs:
                    c.log, c.rx = StreamLog(), RxCount()
                # A parked frame stops its stream, and a RESYNC behind it could wait for data that only
                # the RESYNC brings back: with failover, early frames are buffered instead.
                self.no_park.add(peer)
        # A rank that only waits to receive has no unacknowledged data, so the kernel's link timeout never
        # fires for it; after this long without traffic it sends a PING to the peers it waits on.
        self.probe_after = probe_after
        self._last_traffic = self._last_probe = time.monotonic()
        self.probes_sent = 0
        # The signature of each recent collective op this rank posted messages for (tag -> sig), to answer
        # the op a peer's PING says it waits for.
        self.op_sigs: dict[int, int] = {}
        # peer -> (op tag, rank it waits on), from the peers' answers to our probes: a timeout then blames the
        # rank at the end of the chain of waiting ranks, not the first rank in it.
        self.peer_waits: dict[int, tuple[int, int]] = {}
        self._keeper: threading.Thread | None = None
        if self.no_park:
            self._keeper = threading.Thread(target=self._keep_going, name=f"tb-failover-r{self.rank}",
                                            daemon=True)
            self._keeper.start()

    def _keep_going(self) -> None:
        """With failover on, acknowledge and answer RESYNCs even while no thread waits on this transport:
        a peer may be waiting for data that only our answer brings back."""
        while self.broken is None:
            time.sleep(0.05)
            if self._progress_lock.acquire(blocking=False):
                try:
                    with self._cv:
                        if self.broken is None:
                            self._pump()
                finally:
                    self._progress_lock.release()
                    with self._cv:  # a waiter that found the engine taken sleeps until notified
                        self._cv.notify_all()

    def _probe_if_quiet(self) -> None:
        now = time.monotonic()
        if now - max(self._last_traffic, self._last_probe) < self.probe_after:
            return
        self._last_probe = now
        pending = self.matcher.pending()
        peers = set(self.conns) if any(r.peer == ANY_SOURCE for r in pending) else {r.peer for r in pending}
        # Each PING names the collective op we wait for from that peer (tag and signature): a peer that ran
        # that op differently (another root, another collective) answers nothing, since it sends us nothing,
        # and would otherwise only be found by the group timeout. The peer compares and fails the group.
        waiting = {r.peer: r for r in pending if not r.is_send and r.key[0] == Space.COLL and r.sig}
        for p in peers & set(self.conns):
            live = [c for c in self.conns[p] if not c.dead and not c.bye]
            if live:
                self.probes_sent += 1
                req = waiting.get(p)
                hdr = (encode_frame_header(Kind.PING, Space.COLL, req.sig, req.key[1], 0, 0, 0, 0) if req is not None
                       else encode_control(Kind.PING, 0))
                self._enqueue(live[0], Outgoing(hdr, memoryview(b""), None))

    def _note_op(self, key: tuple[int, int, int], sig: int) -> None:
        if key[0] == Space.COLL and sig:
            tag = key[1]
            if tag not in self.op_sigs:
                self.op_sigs[tag] = sig
                self.op_sigs.pop(tag - OPS_REMEMBERED, None)

    def _check_probe(self, c: "Stream", frame: Frame) -> None:
        """A peer waits for our part of collective op `frame.tag` with signature `frame.sig`: if we ran that
        op with another signature, neither of us will ever send the other anything for it."""
        mine = self.op_sigs.get(frame.tag) if frame.sig else None
        if mine is not None and mine != frame.sig:
            raise MismatchError(
                f"rank {self.rank}: mismatched operation with rank {c.peer} (op #{frame.tag}): rank {c.peer} waits "
                f"for rank {self.rank}'s part of {describe_sig(frame.sig)}, but rank {self.rank} ran "
                f"{describe_sig(mine)} (different roots, collectives or order)")
        if frame.seq:  # an answer to our probe: the peer waits on rank seq - 1 in that op itself
            self.peer_waits[c.peer] = (frame.tag, frame.seq - 1)
        elif frame.sig:  # a probe: if we wait on another rank in that op ourselves, say on whom
            behind = self._waiting_on(frame.tag, c.peer)
            if behind is not None:
                hdr = encode_frame_header(Kind.PING, Space.COLL, frame.sig, frame.tag, behind + 1, 0, 0, 0)
                self._enqueue(c, Outgoing(hdr, memoryview(b""), None), front=True)

    def _waiting_on(self, tag: int, asker: int) -> int | None:
        """The rank this rank waits on in collective op `tag` (other than `asker`), or the one that rank
        said it waits on: the end of the chain as far as we know it."""
        waiting = [r for r in self.matcher.pending() if not r.is_send and not r.done and r.key[0] == Space.COLL
                   and r.peer not in (asker, ANY_SOURCE)]
        peers = sorted({r.peer for r in waiting if r.key[1] == tag})
        if not peers:  # still stuck in an earlier op, so not in the asker's yet: whoever holds us up there
            peers = sorted({r.peer for r in waiting if r.key[1] < tag})
        for p in peers:
            far = self._waits_on(p, {tag})
            if far is not None and far not in (self.rank, asker, p):
                return far
        return peers[0] if peers else None

    def _waits_on(self, peer: int, tags: "set[int]") -> int | None:
        known = self.peer_waits.get(peer)
        return known[1] if known is not None and known[0] in tags else None

    def _conn_error(self, c: Stream, exc: BaseException) -> None:
        if c.log is not None and is_link_failure(exc) and self.broken is None:
            self._kill_stream(c, exc)  # fails the transport itself when no other stream is left
        else:
            self._fail(c, exc)

    def _survivors(self, c: Stream) -> list[Stream]:
        """The peer's other live streams, those on other cables first."""
        live = [x for x in self.conns[c.peer] if x is not c and not x.dead]
        return sorted(live, key=lambda x: x.local == c.local)

    def _kill_stream(self, c: Stream, exc: BaseException) -> None:
        """Stop using stream `c`; tell the peer how much of it we consumed (it resends the rest)."""
        if c.dead:
            return
        survivors = self._survivors(c)
        if not survivors:
            self._fail(c, exc)
            return
        c.dead = True
        self.lost_streams += 1
        self.no_park.add(c.peer)
        log.warning("rank %d: lost stream %d to rank %d (%s -> %s): %s; continuing on %s", self.rank, c.stream,
                    c.peer, c.local, c.addr, exc, ", ".join(f"stream {x.stream} ({x.local})" for x in survivors))
        if c.inbound is not None:  # payload bytes already in place count: the resend starts after them
            dest, target, frame, got = c.inbound
            if target is not ABORT_PAYLOAD and got and self.matcher.part_done(c.peer, frame.key, target, got):
                self._cv.notify_all()
        c.inbound, c.parked = None, None
        unstarted = [o for o in c.sendq if o.entry is None and o.fields is not None]
        c.sendq.clear()  # started frames are in the log and go again when the peer's RESYNC says from where
        self._enqueue(survivors[0], Outgoing(encode_control(Kind.RESYNC, c.rx.consumed, c.stream), memoryview(b""),
                                         None), front=True)
        for i, out in enumerate(unstarted):
            self._enqueue(survivors[i % len(survivors)], out)
        for x in survivors:  # frames parked there may wait for data that will now come after them
            if x.parked is not None:
                self._read(x)

    def _control(self, c: Stream, frame: Frame) -> None:
        if c.log is None:
            raise ProtocolError(f"rank {c.peer} sent {frame.kind.name} on a stream without failover")
        if frame.kind is Kind.ACK:
            c.log.ack(frame.offset)
            return
        streams = self.conns[c.peer]
        if not 0 <= frame.tag < len(streams) or streams[frame.tag] is c:
            raise ProtocolError(f"rank {c.peer} sent RESYNC for stream {frame.tag} on stream {c.stream}")
        lost = streams[frame.tag]
        self._kill_stream(lost, ConnectionAbortedError(errno.ECONNABORTED, f"rank {c.peer} lost this stream"))
        survivors = self._survivors(lost)
        parts = lost.log.replay(frame.offset)
        for i, part in reversed(list(enumerate(parts))):  # each goes to the front: oldest first in the end
            owner = part.owner
            out = Outgoing(self._header(part.fields), memoryview(part.payload), owner.req if owner else None,
                       part.fields)
            self.resent_bytes += len(out.payload)
            self._enqueue(survivors[i % len(survivors)], out, front=True)
