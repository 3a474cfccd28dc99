"""Memory ordering for the memory that the ranks of one host share: the fences this platform has, chosen
once, and the argument for where the shared-memory code places them.

Three fences, named as C11's `atomic_thread_fence`:

- `acquire`: loads before it are ordered before every load and store after it;
- `release`: loads and stores before it are ordered before every store after it;
- `full`: everything before it is ordered before everything after it, a store before a later load too.

What each step of the shared-memory protocols needs, and so the one fence the code places there:

- ring put (`shm_ring.RingWriter.put`): slot header and payload stores, then the `head` store: `release`
  before the head store, once per slot.
- ring read (`RingReader.peek`): the `head` load, then slot header and payload loads: `acquire` after a head
  load that showed unread slots, once for all the slots it showed (`pending` is a look and fences nothing).
- ring pop (`RingReader.pop`): payload loads, then the `tail` store that lets the writer reuse the slot:
  `release` before the tail store.
- ring space (`RingWriter.free`): the `tail` load, then stores into the freed slots: `acquire`, only when
  the cached tail said the ring was full.
- window publish (`shm_window.ShmWindowMemory.publish`): buffer and op word stores, then the counter store:
  `release` before the counter store.
- window wait (`ShmWindowMemory.reached`): counter loads, then buffer and word loads: one `acquire` per
  completed wait, none per look; a wait for a value already seen and acquired (counters only grow) loads
  and fences nothing (`counter` is a look and fences nothing).
- window checks (`algorithms/window.py` `check_skipped`, `_check_stray`): a counter load then a ring load,
  or the reverse: the memory's `fence` (an `acquire`) between them.
- sleep handshake (`ShmLinks.before_sleep` against `after_pump` and `wake_sleepers`): the sleeper stores
  its flag, then loads heads and counters; the waker stores a head, tail or counter, then loads the flag. A
  store then a load on both sides (Dekker's pattern): `full` on both, or each may miss the other and the
  sleeper sleeps out its cap (2 ms, 20 ms once idle).

The platforms (`fences`):

- x86-64 is TSO: loads are not reordered with loads, stores not with stores, a load not with a later
  store; only a store may pass a later load. So `acquire` and `release` are `nothing`, and only the sleep
  handshake pays: `full` is a lock acquire/release, a LOCK-prefixed read-modify-write, which x86 orders
  against every load and store (CPython has no fence of its own). The interpreter is the compiler fence:
  every memoryview access is an opaque C call, never reordered with the next.
- arm64 macOS: libSystem's `OSMemoryBarrier` (a `dmb ish`) for all three. It is the only barrier libSystem
  exports as a function, and a function is all ctypes can call (`atomic_thread_fence` and `os_atomic_*`
  are inline in headers; a `dmb ishld` acquire, or `ldar`/`stlr`, would need compiled code). Each fence is
  a ctypes call, 0.1-0.5 us on the busy two-core x86 VM it was measured on (`scripts/count_barriers.py`),
  so the code places only the fences above: a 4 KB all_reduce on the window makes 5 to 6 per op with 2
  or 4 ranks (2 of them the handshake's `full`), where a fence after every counter look made 7 to 22 with
  2 ranks and 16 to 21 with 4, more the longer the waits.
- arm64 Linux keeps the lock for all three, which the architecture does not promise to be a fence: the
  lock's acquire keeps later accesses after it and its release keeps earlier ones before it, but an access
  before the lock and one after it may still both move inside and swap. No libc there exports a barrier.
- Anything else: no fence is known, and shared memory is refused (`shm_refusal`): the group uses TCP.

Each fence is a call through `ctypes.PyDLL`, which keeps the GIL, never `ctypes.CDLL`, which drops it for the
call and takes it back after (CPython's `_ctypes/callproc.c` releases it unless the function carries
`_FUNCFLAG_PYTHONAPI`). A `dmb` takes nanoseconds: dropping the GIL around it only hands another Python thread
(the caller's training loop, a data loader, the worker of another group) a chance to take it, and that thread
keeps it until the next switch interval (5 ms) asks for it back; each ring or window step would be such a
chance. Measured on the busy two-core x86 VM (`python -m torch_thunderbolt.testing.darwin_runtime`, a libc call that does no work;
medians of interleaved repeats, four runs as the VM's load varied): alone, a CDLL call cost 272-1155 ns and a
PyDLL call 240-921 ns, the PyDLL call the cheaper in every run (an empty Python call: 30 ns), so keeping the
GIL costs nothing; beside one Python thread that never blocks, the same loop made 186k-249k CDLL calls a
second against 269k-463k PyDLL calls, and spent 81-97 % of its time in steps that waited over 1 ms for the GIL
against 61-72 % (a PyDLL loop still yields at the interpreter's own switch points). glibc lets the thread that
dropped the GIL usually take it straight back; how often macOS's mutexes hand it to the waiter instead is not
measured.

An atomics library would make each fence a C call of ~20-35 ns and allow real acquire loads and release
stores. On PyPI: `atomics` and its fork `atomics2` are GPLv3 (this package is BSD-3-Clause) and go through
cffi; `atomicx` keeps its atomics in its own storage, not in a shared buffer; `cengal-memory-barriers` has
a full barrier only and pulls in the `cengal-light` framework; `atomicshm` (MIT, abi3 wheels for macOS
arm64 and CPython >= 3.11; acquire/release loads, stores and fences over any buffer; `fence(ACQUIRE)` 20 ns
and `fence(SEQ_CST)` 35 ns measured on the x86 VM) fits best, but it is a single release (0.1.0) by a
single maintainer and has no wheel for Python 3.10, which this package supports. So none is a dependency:
with the fences cut to those above, what one could save on a Mac is a few ctypes calls per op (0.5-2.5 us
of a 4 KB all_reduce at the call costs measured here). This module is the one place to switch if a
measurement on Apple silicon shows that this matters and such a library has a record by then.

The code looks these functions up on this module at each call (`ordering.release()`), so that a test can
trace where it calls them: `tests/shm/test_ordering.py` model-checks every protocol above from traces of
the code itself, under an ARM-like weak model with the arm64 selection and under TSO with the x86 one.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Callable

from ..platform import Platform, current

Fence = Callable[[], None]
Lookup = Callable[[str], "Fence | None"]


def nothing() -> None:
    """No fence: the platform keeps this order by itself (x86's acquire and release)."""


def _lock_fence() -> Fence:
    lock = threading.Lock()

    def fence() -> None:
        lock.acquire()
        lock.release()

    return fence


def _libc_symbol(name: str) -> Fence | None:
    try:
        fn = getattr(ctypes.PyDLL(None), name)  # keeps the GIL (see the module docstring)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, []
    return fn


@dataclass(frozen=True)
class Fences:
    acquire: Fence
    release: Fence
    full: Fence


def fences(plat: Platform | None = None, lookup: Lookup = _libc_symbol) -> Fences | None:
    """The fences of `plat` (see the module docstring); None where no full barrier is known. `lookup` finds
    a libc function by name, for tests."""
    plat = plat or current()
    if plat.is_x86:
        return Fences(nothing, nothing, _lock_fence())
    if plat.is_arm64 and plat.name == "darwin":
        barrier = lookup("OSMemoryBarrier")
        return None if barrier is None else Fences(barrier, barrier, barrier)
    if plat.is_arm64 and plat.name == "linux":
        lock = _lock_fence()
        return Fences(lock, lock, lock)
    return None


def shm_refusal(plat: Platform | None = None, lookup: Lookup = _libc_symbol) -> str | None:
    """Why shared memory must not be used on `plat` (None: it may): without a full memory barrier a ring
    reader could see `head` before the payload it publishes, and a sleeper could miss its wake-up."""
    plat = plat or current()
    if fences(plat, lookup) is not None:
        return None
    what = "OSMemoryBarrier was not found in libSystem" if plat.name == "darwin" else "no full memory barrier is known"
    return f"{what} on {plat.name}/{plat.machine}"


# Chosen once. Unknown platforms get the lock, but never use it: shm_refusal keeps their groups on TCP.
_CHOSEN = fences() or Fences(*(_lock_fence(),) * 3)
acquire: Fence = _CHOSEN.acquire
release: Fence = _CHOSEN.release
full: Fence = _CHOSEN.full
