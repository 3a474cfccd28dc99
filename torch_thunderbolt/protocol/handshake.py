"""Connection handshake: mutual authentication with a per-job secret, sans-IO.

    server -> client  CHALLENGE  magic, version, server rank, group hash, server nonce
    client -> server  HELLO      magic, version, client rank, stream, group hash, client nonce,
                                 the address the client dialled and its own address (IPv4 + port each),
                                 HMAC(key, "hello" | server nonce | client nonce | ranks | stream | group |
                                 both addresses)
    server -> client  ACCEPT     status, HMAC(key, "accept" | client nonce | server nonce | ranks | both
                                 addresses as the server sees them)
                   or REJECT     status (why), reason (fixed-size, so a client always knows how much to read)

The key never travels on these streams. With a private THUNDERBOLT_SECRET it is derived from that secret
and a per-group nonce (`derive_key`) and never travels at all; without one it is a random value the set-up
publishes in the rendezvous store, which anyone who reaches the store can read. Every message has a fixed
size, so no length field from an unauthenticated peer is ever trusted. A rejected connection is closed by
the server; the caller logs `HandshakeError`.

The addresses bind the MACs to the one TCP connection they travel on: a relay that accepts a rank's
connection and opens its own to the peer (after rewriting the peer's endpoint in the store) forwards a
HELLO whose addresses are not the ones the server's socket has (another port at least), so the server
refuses it (`why="relay"`) even though every byte is genuine; the ACCEPT is bound the same way the other
way round. (An on-path attacker who rewrites addresses in both directions, like a NAT, is beyond this: the
per-frame integrity mode is what stops it from changing data.) Both ends also derive a key of their own
for this connection (`session`), for the per-frame MACs of THUNDERBOLT_INTEGRITY=mac.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass

from ..errors import HandshakeError

MAGIC = b"TBOLT\x00"
VERSION = 3  # 2: ACK and RESYNC frames (cable failover); 3: addresses bound into the MACs
_CHALLENGE = struct.Struct("<6sHI8s16s")  # magic, version, server rank, group hash, nonce
_ADDRS = struct.Struct("<4sH4sH")  # dialled address, own address (IPv4, port each), as the client sees them
_HELLO = struct.Struct(f"<6sHIH8s16s{_ADDRS.size}s32s")  # magic, version, rank, stream, group hash, nonce, addrs, mac
_REPLY = struct.Struct("<B32s")  # status, mac (ACCEPT) or reason (the rest)
ACCEPT, REJECT, REJECT_MAC, REJECT_RELAY = 1, 0, 2, 3  # REJECT_*: why, so the client words its error
CHALLENGE_SIZE, HELLO_SIZE, REPLY_SIZE = _CHALLENGE.size, _HELLO.size, _REPLY.size


def group_hash(group_id: str) -> bytes:
    return hashlib.sha256(group_id.encode()).digest()[:8]


def derive_key(private: bytes, nonce: bytes, group_id: str) -> bytes:
    """The handshake key of one group when the job has a private secret (THUNDERBOLT_SECRET): the group's
    nonce and id travel through the unauthenticated rendezvous store, so a stranger who reads them still
    lacks `private`; a fresh nonce per group keeps the keys of different groups and jobs apart."""
    return _mac(private, b"torch-thunderbolt group key v1", nonce, group_id.encode())


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _ranks(client: int, server: int, stream: int) -> bytes:
    return struct.pack("<IIH", client, server, stream)


def _addrs(dialled: "tuple[str, int]", caller: "tuple[str, int]") -> bytes:
    """A connection as its client sees it: (the address it dialled, its own address)."""
    return _ADDRS.pack(socket.inet_aton(dialled[0]), dialled[1], socket.inet_aton(caller[0]), caller[1])


def _show(packed: bytes) -> tuple[str, str]:
    dip, dport, cip, cport = _ADDRS.unpack(packed)
    return f"{socket.inet_ntoa(dip)}:{dport}", f"{socket.inet_ntoa(cip)}:{cport}"


def session_key(secret: bytes, snonce: bytes, cnonce: bytes, ranks: bytes) -> bytes:
    """A key of this one connection (both nonces are fresh), for per-frame MACs."""
    return _mac(secret, b"frames", snonce, cnonce, ranks)


@dataclass(frozen=True)
class HandshakeResult:
    peer_rank: int
    stream: int
    session: bytes = b""  # this connection's own key (session_key)


class ServerHandshake:
    """The accepting side. `challenge()` first; then feed bytes until `receive()` returns a result."""

    def __init__(self, secret: bytes, rank: int, group_id: str, accept_rank: "callable", streams: int,
                 local: "tuple[str, int]" = ("0.0.0.0", 0), peer: "tuple[str, int]" = ("0.0.0.0", 0)) -> None:
        """`local`, `peer`: the accepted socket's getsockname() and getpeername()."""
        self._secret = secret
        self._rank = rank
        self._group = group_hash(group_id)
        self._nonce = os.urandom(16)
        self._accept_rank = accept_rank  # peer rank -> bool (expected and not yet connected on that stream)
        self._streams = streams
        self._local, self._peer = local, peer
        self._buf = b""
        self.reply = b""  # bytes to send back once receive() returned or raised
        self.claimed_rank: int | None = None  # the rank a well-formed HELLO of this group claimed to be

    def challenge(self) -> bytes:
        return _CHALLENGE.pack(MAGIC, VERSION, self._rank, self._group, self._nonce)

    def receive(self, data: bytes) -> HandshakeResult | None:
        self._buf += data
        if len(self._buf) < HELLO_SIZE:
            return None
        if len(self._buf) > HELLO_SIZE:
            self._reject("unexpected bytes after HELLO")
        magic, version, rank, stream, group, cnonce, claimed, mac = _HELLO.unpack(self._buf)
        if magic != MAGIC:
            self._reject(f"not a torch-thunderbolt peer (magic {magic!r})")
        if version != VERSION:
            self._reject(f"protocol version {version}, this rank speaks {VERSION}")
        if group != self._group:
            self._reject("connection belongs to another process group")
        if stream >= self._streams:
            self._reject(f"stream {stream} out of range (this group uses {self._streams})")
        self.claimed_rank = rank
        ranks = _ranks(rank, self._rank, stream)
        want = _mac(self._secret, b"hello", self._nonce, cnonce, ranks, self._group, claimed)
        if not hmac.compare_digest(mac, want):
            self._reject("wrong secret or group (bad MAC)", REJECT_MAC, "mac")
        seen = _addrs(self._local, self._peer)
        if claimed != seen:
            (dialled, caller), (here, there) = _show(claimed), _show(seen)
            self._reject("relayed: addresses differ", REJECT_RELAY, "relay",
                         f"rank {rank}'s stream {stream} was relayed: rank {rank} dialled {dialled} from {caller}, "
                         f"but the connection reached this rank at {here} from {there}: someone in the middle "
                         f"forwards it")
        if not self._accept_rank(rank, stream):
            self._reject(f"rank {rank} stream {stream} not expected here (duplicate or out of range)")
        reply_mac = _mac(self._secret, b"accept", cnonce, self._nonce, ranks, seen)
        self.reply = _REPLY.pack(ACCEPT, reply_mac)
        return HandshakeResult(peer_rank=rank, stream=stream,
                               session=session_key(self._secret, self._nonce, cnonce, ranks))

    def _reject(self, reason: str, status: int = REJECT, why: str = "", detail: str = "") -> None:
        self.reply = _REPLY.pack(status, reason.encode()[:32])
        raise HandshakeError(detail or reason, why=why)


class ClientHandshake:
    """The connecting side: feed the CHALLENGE, send `hello`, feed the reply, get True when accepted.
    `dialled`, `local`: the socket's getpeername() and getsockname() once connected."""

    def __init__(self, secret: bytes, rank: int, peer_rank: int, stream: int, group_id: str,
                 dialled: "tuple[str, int]" = ("0.0.0.0", 0), local: "tuple[str, int]" = ("0.0.0.0", 0)) -> None:
        self._secret = secret
        self._rank = rank
        self._peer = peer_rank
        self._stream = stream
        self._group = group_hash(group_id)
        self._nonce = os.urandom(16)
        self._snonce = b""
        self._addrs = _addrs(dialled, local)
        self.session = b""  # this connection's own key, once accepted

    def receive_challenge(self, data: bytes) -> bytes:
        """Validate the CHALLENGE (exactly CHALLENGE_SIZE bytes) and return the HELLO to send."""
        magic, version, srank, group, snonce = _CHALLENGE.unpack(data)
        if magic != MAGIC:
            raise HandshakeError(f"peer at rank {self._peer}'s address is not a torch-thunderbolt rank")
        if version != VERSION:
            raise HandshakeError(f"rank {self._peer} speaks protocol version {version}, we speak {VERSION}")
        if srank != self._peer:
            raise HandshakeError(f"expected rank {self._peer} at that address, found rank {srank}")
        if group != self._group:
            raise HandshakeError(f"rank {self._peer}'s listener belongs to another process group")
        self._snonce = snonce
        ranks = _ranks(self._rank, self._peer, self._stream)
        mac = _mac(self._secret, b"hello", snonce, self._nonce, ranks, self._group, self._addrs)
        return _HELLO.pack(MAGIC, VERSION, self._rank, self._stream, self._group, self._nonce, self._addrs, mac)

    def receive_reply(self, data: bytes) -> None:
        status, body = _REPLY.unpack(data)
        if status != ACCEPT:
            reason = body.rstrip(b"\x00").decode(errors="replace")
            why = {REJECT_MAC: "mac", REJECT_RELAY: "relay"}.get(status, "")
            raise HandshakeError(f"rank {self._peer} refused our connection: {reason}", why=why)
        ranks = _ranks(self._rank, self._peer, self._stream)
        want = _mac(self._secret, b"accept", self._nonce, self._snonce, ranks, self._addrs)
        if not hmac.compare_digest(body, want):
            raise HandshakeError(f"rank {self._peer} could not prove it knows the job secret (or the connection "
                                 f"was relayed)", why="mac")
        self.session = session_key(self._secret, self._snonce, self._nonce, ranks)
