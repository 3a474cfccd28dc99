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
Ordering: the payload is written before `head` is stored and read after `head` is loaded; on x86 (TSO)
that is enough, on arm64 `publish_fence` orders it (see `fence`). Where no full memory barrier is known
(`full_barrier` returns None) shared memory is refused (`shm_refusal`) and the group uses TCP.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Callable

from ..platform import Platform, current

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


def _lock_fence() -> Callable[[], None]:
    lock = threading.Lock()

    def fence() -> None:
        lock.acquire()
        lock.release()

    return fence


def _libc_symbol(name: str) -> "Callable[[], None] | None":
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype = None
    return fn


def full_barrier(plat: Platform | None = None,
                 lookup: "Callable[[str], Callable[[], None] | None]" = _libc_symbol) -> "Callable[[], None] | None":
    """A full memory barrier on `plat`, for the sleep/wake handshake (a store then a load on both sides) and
    the arm64 payload ordering; None where none is known (then `shm_refusal` refuses shared memory).

    CPython has no fence primitive; a lock acquire/release is a locked read-modify-write on x86 (a full
    barrier). On arm64 macOS, libSystem's OSMemoryBarrier is a `dmb ish`. arm64 Linux keeps the lock, as
    before (no libc symbol offers a barrier there). `lookup` finds a libc function by name, for tests."""
    plat = plat or current()
    if plat.is_x86:
        return _lock_fence()
    if plat.is_arm64 and plat.name == "darwin":
        return lookup("OSMemoryBarrier")
    if plat.is_arm64 and plat.name == "linux":
        return _lock_fence()
    return None


def shm_refusal(plat: Platform | None = None,
                lookup: "Callable[[str], Callable[[], None] | None]" = _libc_symbol) -> str | None:
    """Why shared memory must not be used on `plat` (None: it may): without a full memory barrier a ring
    reader could see `head` before the payload it publishes."""
    plat = plat or current()
    if full_barrier(plat, lookup) is not None:
        return None
    what = "OSMemoryBarrier was not found in libSystem" if plat.name == "darwin" else "no full memory barrier is known"
    return f"{what} on {plat.name}/{plat.machine}"


# Unknown platforms get the lock, but never use it: shm_refusal keeps their groups on TCP.
fence: Callable[[], None] = full_barrier() or _lock_fence()
publish_fence: Callable[[], None] = fence if current().is_arm64 else (lambda: None)


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
        publish_fence()
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
        self.stride = SLOT_HDR + slot_bytes

    def pending(self) -> bool:
        return self.ctl[_HEAD] != self.tail

    def peek(self) -> tuple[int, int, int, int, int, int, int, int]:
        """(space, kind, sig, tag, seq, offset, length, total) of the oldest unconsumed slot."""
        publish_fence()
        space, kind, lo, tag, seq, hi, off, length, total = _SLOT.unpack_from(
            self.mv, CTL_BYTES + (self.tail % self.slots) * self.stride)
        return space, kind, (hi << 32) | lo, tag, seq, off, length, total

    def payload(self, length: int) -> memoryview:
        base = CTL_BYTES + (self.tail % self.slots) * self.stride + SLOT_HDR
        return self.mv[base : base + length]

    def pop(self) -> None:
        publish_fence()  # our payload loads complete before the slot is handed back (arm64 reorders)
        self.tail += 1
        self.ctl[_TAIL] = self.tail

    def release(self) -> None:
        self.ctl.release()
