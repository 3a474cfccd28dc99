"""Per-frame integrity for TCP streams (THUNDERBOLT_INTEGRITY=mac), sans-IO.

A sealed frame is the usual 48-byte header, then two 16-byte keyed BLAKE2b tags, then the payload:

    header | htag = MAC(seq | header | ptag) | ptag = MAC(payload) | payload

with a key per stream and direction (`stream_keys`: derived from that connection's own handshake key, so no
two streams, groups or jobs share one) and `seq` the frame's number on its stream in that direction. The
receiver checks `htag` before it acts on the header (so a changed header is an IntegrityError, never a
mismatch or a misplaced payload), and `ptag` once the payload is in, before the message counts as
received. A frame changed, replayed, reordered, dropped or injected on the way fails one of the two. What
it does not do: encrypt (anyone on the cable still reads the tensors), or help once the MAC has failed
(the group fails; a receive's buffer may already hold some of the bad payload by then).

The order of frames on a stream is the order of their first byte on the wire, so a frame is sealed only
when it is about to be written (transport/tcp.py), and unsealed (`unseal`) if it is then passed over.
"""
from __future__ import annotations

import hashlib
import hmac

from ..errors import IntegrityError
from .framing import FRAME_HEADER_SIZE, FrameDecoder, Frame, _parse

TAG_SIZE = 16
SEALED_HEADER_SIZE = FRAME_HEADER_SIZE + 2 * TAG_SIZE
_HEADER_PERSON, _PAYLOAD_PERSON = b"tb-frame-header", b"tb-frame-payload"


def stream_keys(session: bytes, me: int, peer: int) -> tuple[bytes, bytes]:
    """(key of what this rank sends, key of what it receives) on one stream, from its handshake key."""
    def key(src: int, dst: int) -> bytes:
        return hashlib.blake2b(b"frames from rank %d to rank %d" % (src, dst), key=session, digest_size=32).digest()
    return key(me, peer), key(peer, me)


def _payload_tag(key: bytes, payload: "bytes | memoryview") -> bytes:
    return hashlib.blake2b(payload, key=key, digest_size=TAG_SIZE, person=_PAYLOAD_PERSON).digest()


def _header_tag(key: bytes, seq: int, header: "bytes | memoryview", ptag: bytes) -> bytes:
    h = hashlib.blake2b(seq.to_bytes(8, "little"), key=key, digest_size=TAG_SIZE, person=_HEADER_PERSON)
    h.update(header)
    h.update(ptag)
    return h.digest()


class Sealer:
    """The sending half of one stream: seals frames in the order they go on the wire."""

    __slots__ = ("key", "seq")

    def __init__(self, key: bytes) -> None:
        self.key, self.seq = key, 0

    def seal(self, header: bytes, payload: "bytes | memoryview") -> bytes:
        """The sealed header (header, htag, ptag) of the next frame on the stream."""
        ptag = _payload_tag(self.key, payload)
        htag = _header_tag(self.key, self.seq, header, ptag)
        self.seq += 1
        return header + htag + ptag

    def unseal(self, sealed: bytes) -> bytes:
        """Give back the number of the last frame sealed, which was not written after all (another frame goes
        first, or the stream died): its plain header, to be sealed again where it is written."""
        self.seq -= 1
        return sealed[:FRAME_HEADER_SIZE]


class Opener:
    """The receiving half of one stream. `where`: how errors name it ("rank 0: a frame from rank 1 on ...")."""

    __slots__ = ("key", "seq", "ptag", "where")

    def __init__(self, key: bytes, where: str) -> None:
        self.key, self.seq, self.ptag, self.where = key, 0, b"", where

    def open(self, sealed: bytes) -> None:
        """Check a sealed header (SEALED_HEADER_SIZE bytes) as the stream's next frame; keep its payload tag."""
        header, htag, ptag = sealed[:FRAME_HEADER_SIZE], sealed[FRAME_HEADER_SIZE:-TAG_SIZE], sealed[-TAG_SIZE:]
        if not hmac.compare_digest(htag, _header_tag(self.key, self.seq, header, ptag)):
            raise IntegrityError(f"{self.where}: frame {self.seq} failed its MAC (its header): it was changed, "
                                 f"replayed, reordered or dropped on the way, or the stream was injected into "
                                 f"(THUNDERBOLT_INTEGRITY=mac)")
        self.seq += 1
        self.ptag = ptag

    def check(self, payload: "bytes | memoryview") -> None:
        """Check the payload of the frame last opened (all of it, once it is in)."""
        if not hmac.compare_digest(self.ptag, _payload_tag(self.key, payload)):
            raise IntegrityError(f"{self.where}: the payload of frame {self.seq - 1} ({len(payload)} bytes) failed "
                                 f"its MAC: it was changed on the way (THUNDERBOLT_INTEGRITY=mac); the receive's "
                                 f"buffer may hold some of those bytes")


class SealedFrameDecoder(FrameDecoder):
    """A FrameDecoder for sealed frames: each header is checked by `opener` before it is parsed; a frame
    with no payload is checked whole at once, one with a payload by the I/O shell (`opener.check`) once
    its payload is in."""

    header_size = SEALED_HEADER_SIZE

    def __init__(self, opener: Opener, max_message: int) -> None:
        super().__init__(max_message)
        self.opener = opener

    def next_frame(self) -> Frame | None:
        if self.payload_remaining:
            return super().next_frame()  # raises: the previous payload is unread
        if self.buffered < SEALED_HEADER_SIZE:
            return None
        sealed = bytes(self._buf[self._pos : self._pos + SEALED_HEADER_SIZE])
        self.opener.open(sealed)
        frame = _parse(sealed[:FRAME_HEADER_SIZE], self._max_message)
        self._pos += SEALED_HEADER_SIZE
        self.payload_remaining = frame.length
        if not frame.length:
            self.opener.check(b"")
        return frame
