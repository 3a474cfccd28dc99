"""Fuzz targets for the wire protocol: the frame decoder and both sides of the handshake.

Each target takes arbitrary bytes and drives the sans-IO code the way the TCP shell does. The contract: only
ProtocolError (HandshakeError is one) may escape. `inputs(rng)` yields structure-aware inputs (valid frames
and HELLOs with mutated fields, truncations, extreme lengths, plus pure noise); atheris (if installed)
can drive the same targets with coverage guidance (scripts/reliability/fuzz.py --atheris).
"""
from __future__ import annotations

import random
import struct
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from torch_thunderbolt.errors import HandshakeError, ProtocolError
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.protocol.framing import (FRAME_HEADER_SIZE, MAX_ABORT_PAYLOAD, FrameDecoder, Kind, Space,
                                                encode_frame_header)

SECRET, GROUP = b"s" * 32, "fuzz-group"
_FIELDS = ((0, "<H"), (2, "<B"), (3, "<B"), (4, "<I"), (8, "<q"), (16, "<I"), (20, "<I"), (24, "<Q"),
           (32, "<Q"), (40, "<Q"))  # offsets of the header fields (see framing._HEADER)
_EXTREMES = (0, 1, 2, 3, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 40, (1 << 63) - 1, (1 << 64) - 1)


def _chunks(data: bytes, seed: int) -> Iterator[bytes]:
    """`data` cut at pseudo-random points (the shell sees whatever recv() returns)."""
    rng = random.Random(seed)
    i = 0
    while i < len(data):
        k = rng.choice((1, 7, 48, 64, 1 << 16))
        yield data[i : i + k]
        i += k


def decoder_target(data: bytes) -> None:
    """Feed `data` to a FrameDecoder in chunks, consuming payloads as the shell would."""
    if not data:
        return
    dec = FrameDecoder(max_message=1 << 30)
    seed, body = data[0], data[1:]
    try:
        for part in _chunks(body, seed):
            dec.feed(part)
            while True:
                if dec.payload_remaining:
                    if not dec.take_buffered(dec.payload_remaining):
                        break
                    continue
                frame = dec.next_frame()
                if frame is None:
                    break
                if frame.kind in (Kind.ACK, Kind.RESYNC):  # `offset` is a byte count, no payload
                    assert frame.length == frame.total == 0
                else:
                    assert frame.offset + frame.length <= frame.total <= 1 << 30
    except ProtocolError:
        pass


def server_target(data: bytes) -> None:
    """A listening rank's side of the handshake fed a client's bytes (in chunks)."""
    if not data:
        return
    server = hs.ServerHandshake(SECRET, 0, GROUP, lambda r, s: r == 1 and s == 0, 2)
    server.challenge()
    try:
        for part in _chunks(data[1:], data[0]):
            if server.receive(part) is not None:
                return
    except HandshakeError:
        assert len(server.reply) == hs.REPLY_SIZE  # a refusal always has a fixed-size reason


def client_target(data: bytes) -> None:
    """The connecting side fed a (possibly hostile) listener's CHALLENGE and reply, exact sizes as read."""
    client = hs.ClientHandshake(SECRET, 1, 0, 0, GROUP)
    ch = data[: hs.CHALLENGE_SIZE].ljust(hs.CHALLENGE_SIZE, b"\0")
    reply = data[hs.CHALLENGE_SIZE : hs.CHALLENGE_SIZE + hs.REPLY_SIZE].ljust(hs.REPLY_SIZE, b"\0")
    try:
        client.receive_challenge(ch)
        client.receive_reply(reply)
    except HandshakeError:
        pass


Target = Callable[[bytes], None]
TARGETS: Mapping[str, Target] = MappingProxyType({"decoder": decoder_target, "server": server_target,
                                                  "client": client_target})


def dispatch(data: bytes) -> None:
    """One entry point for coverage-guided fuzzers: the first byte picks the target."""
    if data:
        targets = list(TARGETS.values())
        targets[data[0] % len(targets)](data[1:])


# -- structure-aware input generation ------------------------------------------------------------------------
def _valid_frames(rng: random.Random) -> bytes:
    out = b""
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice((Kind.DATA, Kind.DATA, Kind.CONTROL))
        n = rng.choice((0, 1, 5, 100, MAX_ABORT_PAYLOAD))
        out += encode_frame_header(kind, rng.choice(list(Space)), rng.getrandbits(32), rng.randrange(1 << 20),
                                   rng.randrange(1 << 10), 0, n, n) + rng.randbytes(min(n, 64))
        out += b"\0" * max(0, n - 64)
    return out


def _mutate(buf: bytes, rng: random.Random) -> bytes:
    b = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.3 and len(b) >= FRAME_HEADER_SIZE:  # an extreme value in one header field
            off, fmt = rng.choice(_FIELDS)
            val = rng.choice(_EXTREMES) & ((1 << (8 * struct.calcsize(fmt))) - 1)
            if fmt == "<q" and val >= 1 << 63:
                val -= 1 << 64
            struct.pack_into(fmt, b, off, val)
        elif choice < 0.55 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif choice < 0.7 and b:
            del b[rng.randrange(len(b)):]  # truncate
        elif choice < 0.85:
            b += rng.randbytes(rng.randint(1, 64))
        elif b:
            i = rng.randrange(len(b))
            b[i:i] = b[i : i + rng.randint(1, 48)]  # duplicate a slice
    return bytes(b)


def _valid_hello(rng: random.Random) -> bytes:
    """A HELLO that is right in every way except the (unknowable) server nonce; mutated below."""
    client = hs.ClientHandshake(SECRET, rng.choice((1, 1, 2, 0, 99)), 0, rng.choice((0, 1, 5)), GROUP)
    challenge = hs._CHALLENGE.pack(hs.MAGIC, hs.VERSION, 0, hs.group_hash(GROUP), rng.randbytes(16))
    return client.receive_challenge(challenge)


def inputs(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """An endless stream of (target name, input)."""
    while True:
        roll = rng.random()
        seed = bytes([rng.randrange(256)])
        if roll < 0.15:
            yield rng.choice(list(TARGETS)), seed + rng.randbytes(rng.randint(0, 300))
        elif roll < 0.6:
            yield "decoder", seed + _mutate(_valid_frames(rng), rng)
        elif roll < 0.85:
            yield "server", seed + _mutate(_valid_hello(rng), rng)
        else:
            challenge = hs._CHALLENGE.pack(hs.MAGIC, hs.VERSION, 0, hs.group_hash(GROUP), rng.randbytes(16))
            yield "client", _mutate(challenge + rng.randbytes(hs.REPLY_SIZE), rng)


def run(count: int, seed: int, targets: Mapping[str, Target] = TARGETS) -> dict[str, int]:
    """Run `count` generated inputs; returns how many went to each target. Raises on any other exception.
    `targets` replaces targets by name (a test proves the harness reports what escapes)."""
    rng = random.Random(seed)
    counts = dict.fromkeys(targets, 0)
    gen = inputs(rng)
    for _ in range(count):
        name, data = next(gen)
        try:
            targets[name](data)
        except Exception as exc:
            raise AssertionError(f"{name} target let {type(exc).__name__} escape on input {data.hex()}") from exc
        counts[name] += 1
    return counts
