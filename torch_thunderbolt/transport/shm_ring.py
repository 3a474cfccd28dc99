"""Layout of one rank's shared-memory segment and the single-producer/single-consumer slot rings in it.

Rank r's segment holds r's *inbound* rings, one per sender, plus a header with r's "sleeping" flag:

    [0, 4096)            header: magic, world, rank, slot bytes, slots; flag at byte 64 (own cache line)
    per sender s != r    a ring: control block (head at byte 0, tail at byte 128, padded to 4096),
                         then `slots` slots of (64-byte frame header + slot bytes of payload)
    then                 the group's shared window, if it has one (see shm_window)

The sender owns `head` (slots published), the receiver owns `tail` (slots consumed); each keeps its own
copy and only reads the other's. A message of n bytes takes ceil(n / slot bytes) slots (at least one),
each carrying its part's offset, so the receiver copies every part straight into the posted buffer.
Head and tail sit on cache lines of their own (128 bytes: Apple silicon's line; 64 on x86), so the
sender's stores to one never invalidate the receiver's line of the other.
Ordering (`ordering.py` argues each fence): the writer stores a slot, then `release`, then `head`; the
reader loads `head`, then `acquire` (once for every slot that load showed), then the slots; it reads a
slot's payload, then `release`, then stores `tail`; the writer that finds the ring full loads `tail`, then
`acquire`, before it writes into the freed slots.
"""
from __future__ import annotations

import struct

from . import ordering

MAGIC = 0x54425348_4D303032  # "TBSHM002" (002: tail moved to byte 128; a 001 peer's layout differs)
CACHE_LINE = 128  # Apple silicon's; twice x86's, so it separates on both
HEAD_OFFSET = 0  # in a ring's control block: slots published (written by the sender)
TAIL_OFFSET = CACHE_LINE  # slots consumed (written by the receiver)
_HEAD, _TAIL = HEAD_OFFSET // 8, TAIL_OFFSET // 8  # as u64 indices
HEADER_BYTES = 4096
CTL_BYTES = 4096
SLOT_HDR = 64
_HDR = struct.Struct("<QQQQQQ")  # magic, world, rank, slot_bytes, slots, window area bytes
FLAG_OFFSET = 64
OPBOARD_OFFSET = 128  # two u64: tag, then signature, of the owner's latest collective op (see op_board)
# space, kind, sig (low 32 bits), tag, seq, sig (high 32 bits), offset, length, total
_SLOT = struct.Struct("<BBxxIqIIQQQ")


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return CTL_BYTES + slots * (SLOT_HDR + slot_bytes)


def rings_end(world: int, slots: int, slot_bytes: int) -> int:
    """Where the rings end: the shared window (if any) starts here."""
    return HEADER_BYTES + (world - 1) * ring_bytes(slots, slot_bytes)


def segment_bytes(world: int, slots: int, slot_bytes: int, window_area: int = 0) -> int:
    return rings_end(world, slots, slot_bytes) + window_area


def ring_offset(owner: int, sender: int, slots: int, slot_bytes: int) -> int:
    """Where the ring carrying sender -> owner starts inside owner's segment."""
    index = sender if sender < owner else sender - 1
    return HEADER_BYTES + index * ring_bytes(slots, slot_bytes)


def write_header(mv: memoryview, world: int, rank: int, slots: int, slot_bytes: int, window_area: int = 0) -> None:
    _HDR.pack_into(mv, 0, MAGIC, world, rank, slot_bytes, slots, window_area)


def check_header(mv: memoryview, world: int, rank: int, slots: int, slot_bytes: int, window_area: int = 0) -> bool:
    return _HDR.unpack_from(mv, 0) == (MAGIC, world, rank, slot_bytes, slots, window_area)


def flag_view(mv: memoryview) -> memoryview:
    """The segment owner's sleeping flag as a one-element u64 view (1 = blocked in poll, ring its bell)."""
    return mv[FLAG_OFFSET : FLAG_OFFSET + 8].cast("Q")


def op_board(mv: memoryview) -> memoryview:
    """The segment owner's [tag, signature] of the collective op it last posted messages for, as a u64 view.
    A rank that waits for a peer's data reads it: the same tag with another signature means the two ran
    that op differently (another root, say) and neither will ever send the other anything for it."""
    return mv[OPBOARD_OFFSET : OPBOARD_OFFSET + 16].cast("Q")


class RingWriter:
    """Sender side of one ring (lives in the receiver's segment)."""

    def __init__(self, mv: memoryview, slots: int, slot_bytes: int) -> None:
        self.mv, self.slots, self.slot_bytes = mv, slots, slot_bytes
        self.ctl = mv[:CTL_BYTES].cast("Q")
        self.head = self.ctl[_HEAD]
        self.tail_seen = self.ctl[_TAIL]
        self.stride = SLOT_HDR + slot_bytes

    def free(self) -> int:
        """Free slots; re-reads the receiver's tail only when the cached value says the ring is full."""
        free = self.slots - (self.head - self.tail_seen)
        if free <= 0:
            self.tail_seen = self.ctl[_TAIL]
            free = self.slots - (self.head - self.tail_seen)
            if free > 0:
                ordering.acquire()  # the reader's loads of a freed slot before our stores into it
        return free

    def put(self, space: int, kind: int, sig: int, tag: int, seq: int, offset: int, payload: memoryview,
            total: int) -> None:
        """Write one part into the next slot and publish it (caller checked `free()`)."""
        base = CTL_BYTES + (self.head % self.slots) * self.stride
        n = payload.nbytes
        _SLOT.pack_into(self.mv, base, space, kind, sig & 0xFFFFFFFF, tag, seq & 0xFFFFFFFF, (sig >> 32) & 0xFFFFFFFF,
                        offset, n, total)
        if n:
            self.mv[base + SLOT_HDR : base + SLOT_HDR + n] = payload
        ordering.release()  # the slot before the head that publishes it
        self.head += 1
        self.ctl[_HEAD] = self.head

    def release(self) -> None:
        self.ctl.release()


class RingReader:
    """Receiver side of one ring (lives in this rank's own segment)."""

    def __init__(self, mv: memoryview, slots: int, slot_bytes: int) -> None:
        self.mv, self.slots, self.slot_bytes = mv, slots, slot_bytes
        self.ctl = mv[:CTL_BYTES].cast("Q")
        self.tail = self.ctl[_TAIL]
        self.acquired = self.tail  # slots below this were seen published before an acquire fence
        self.stride = SLOT_HDR + slot_bytes

    def pending(self) -> bool:
        """A look (no ordering: `peek` orders what it reads)."""
        return self.ctl[_HEAD] != self.tail

    def peek(self) -> tuple[int, int, int, int, int, int, int, int]:
        """(space, kind, sig, tag, seq, offset, length, total) of the oldest unconsumed slot (the caller saw
        `pending()`)."""
        if self.tail >= self.acquired:
            self.acquired = self.ctl[_HEAD]
            ordering.acquire()  # the head load before the loads of every slot it published
        space, kind, lo, tag, seq, hi, off, length, total = _SLOT.unpack_from(
            self.mv, CTL_BYTES + (self.tail % self.slots) * self.stride)
        return space, kind, (hi << 32) | lo, tag, seq, off, length, total

    def payload(self, length: int) -> memoryview:
        base = CTL_BYTES + (self.tail % self.slots) * self.stride + SLOT_HDR
        return self.mv[base : base + length]

    def pop(self) -> None:
        ordering.release()  # our payload loads before the store that hands the slot back
        self.tail += 1
        self.ctl[_TAIL] = self.tail

    def release(self) -> None:
        self.ctl.release()
