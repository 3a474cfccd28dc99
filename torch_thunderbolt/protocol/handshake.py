"""Connection handshake: mutual authentication with a per-job secret, sans-IO.

    server -> client  CHALLENGE  magic, version, server rank, group hash, server nonce
    client -> server  HELLO      magic, version, client rank, stream, group hash, client nonce,
                                 HMAC(secret, "hello" | server nonce | client nonce | ranks | stream | group)
    server -> client  ACCEPT     status, HMAC(secret, "accept" | client nonce | server nonce | ...)
                   or REJECT     status, reason (fixed-size, so a client always knows how much to read)

The key never travels on these streams. With a private THUNDERBOLT_SECRET it is derived from that secret
and a per-group nonce (`derive_key`) and never travels at all; without one it is a random value the set-up
publishes in the rendezvous store, which anyone who reaches the store can read. Every message has a fixed
size, so no length field from an unauthenticated peer is ever trusted. A rejected connection is closed by
the server; the caller logs `HandshakeError`.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from ..errors import HandshakeError

MAGIC = b"TBOLT\x00"
VERSION = 2  # 2: ACK and RESYNC frames (cable failover)
_CHALLENGE = struct.Struct("<6sHI8s16s")  # magic, version, server rank, group hash, nonce
_HELLO = struct.Struct("<6sHIH8s16s32s")  # magic, version, rank, stream, group hash, nonce, mac
_REPLY = struct.Struct("<B32s")  # status (1 accept / 0 reject), mac or reason
ACCEPT, REJECT = 1, 0
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


@dataclass(frozen=True)
class HandshakeResult:
    peer_rank: int
    stream: int


class ServerHandshake:
    """The accepting side. `challenge()` first; then feed bytes until `receive()` returns a result."""

    def __init__(self, secret: bytes, rank: int, group_id: str, accept_rank: "callable", streams: int) -> None:
        self._secret = secret
        self._rank = rank
        self._group = group_hash(group_id)
        self._nonce = os.urandom(16)
        self._accept_rank = accept_rank  # peer rank -> bool (expected and not yet connected on that stream)
        self._streams = streams
        self._buf = b""
        self.reply = b""  # bytes to send back once receive() returned or raised

    def challenge(self) -> bytes:
        return _CHALLENGE.pack(MAGIC, VERSION, self._rank, self._group, self._nonce)

    def receive(self, data: bytes) -> HandshakeResult | None:
        self._buf += data
        if len(self._buf) < HELLO_SIZE:
            return None
        if len(self._buf) > HELLO_SIZE:
            self._reject("unexpected bytes after HELLO")
        magic, version, rank, stream, group, cnonce, mac = _HELLO.unpack(self._buf)
        if magic != MAGIC:
            self._reject(f"not a torch-thunderbolt peer (magic {magic!r})")
        if version != VERSION:
            self._reject(f"protocol version {version}, this rank speaks {VERSION}")
        want = _mac(self._secret, b"hello", self._nonce, cnonce, _ranks(rank, self._rank, stream), self._group)
        if not hmac.compare_digest(mac, want):
            self._reject("wrong secret or group (bad MAC)")  # the reply carries 32 bytes of reason
        if group != self._group:
            self._reject("connection belongs to another process group")
        if stream >= self._streams:
            self._reject(f"stream {stream} out of range (this group uses {self._streams})")
        if not self._accept_rank(rank, stream):
            self._reject(f"rank {rank} stream {stream} not expected here (duplicate or out of range)")
        reply_mac = _mac(self._secret, b"accept", cnonce, self._nonce, _ranks(rank, self._rank, stream))
        self.reply = _REPLY.pack(ACCEPT, reply_mac)
        return HandshakeResult(peer_rank=rank, stream=stream)

    def _reject(self, reason: str) -> None:
        self.reply = _REPLY.pack(REJECT, reason.encode()[:32])
        raise HandshakeError(reason)


class ClientHandshake:
    """The connecting side: feed the CHALLENGE, send `hello`, feed the reply, get True when accepted."""

    def __init__(self, secret: bytes, rank: int, peer_rank: int, stream: int, group_id: str) -> None:
        self._secret = secret
        self._rank = rank
        self._peer = peer_rank
        self._stream = stream
        self._group = group_hash(group_id)
        self._nonce = os.urandom(16)
        self._snonce = b""

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
        mac = _mac(self._secret, b"hello", snonce, self._nonce, ranks, self._group)
        return _HELLO.pack(MAGIC, VERSION, self._rank, self._stream, self._group, self._nonce, mac)

    def receive_reply(self, data: bytes) -> None:
        status, body = _REPLY.unpack(data)
        if status != ACCEPT:
            reason = body.rstrip(b"\x00").decode(errors="replace")
            raise HandshakeError(f"rank {self._peer} refused our connection: {reason}")
        want = _mac(self._secret, b"accept", self._nonce, self._snonce, _ranks(self._rank, self._peer, self._stream))
        if not hmac.compare_digest(body, want):
            raise HandshakeError(f"rank {self._peer} could not prove it knows the job secret")
