"""macOS's runtime behaviour under the darwin models of torch_thunderbolt.testing.darwin_runtime: fences
and the GIL, the scheduler's yield, fd counts, P-cores."""
from __future__ import annotations

import ctypes
import time

from torch_thunderbolt.platform import Platform
from torch_thunderbolt.testing.darwin_runtime import releases_gil, with_gil_handoff
from torch_thunderbolt.transport import ordering

DARWIN = Platform.for_system("darwin")


def darwin_fences() -> ordering.Fences:
    """The fences the darwin selection makes with the real libc lookup; glibc has no OSMemoryBarrier, so the
    lookup is asked for a libc function of the same shape (no argument, no result, no work)."""
    fences = ordering.fences(DARWIN, lambda name: ordering._libc_symbol("getpid" if name == "OSMemoryBarrier" else name))
    assert fences is not None
    return fences


def test_the_gil_model_follows_ctypes_flags() -> None:
    cdll, pydll = ctypes.CDLL(None).getpid, ctypes.PyDLL(None).getpid
    assert releases_gil(cdll) and not releases_gil(pydll) and not releases_gil(ctypes.pythonapi.Py_IsInitialized)
    assert not releases_gil(lambda: None)
    cdll.restype = None
    slow = with_gil_handoff(cdll, switch_interval=0.002)
    start = time.monotonic()
    slow()
    assert time.monotonic() - start >= 0.002  # a call that drops the GIL waits out the busy thread's turn
    assert with_gil_handoff(pydll) is pydll and with_gil_handoff(cdll, busy_thread=False) is cdll


def test_macos_fences_keep_the_gil() -> None:
    fences = darwin_fences()
    for fence in (fences.acquire, fences.release, fences.full):
        assert fence._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
        assert not releases_gil(fence)


def test_shm_steps_beside_a_busy_python_thread_do_not_wait_for_the_gil() -> None:
    """Twenty fences, a few 4 KB all_reduces' worth on the window, beside a Python thread that never blocks
    (the worst case of the GIL model): well under the switch interval each that fences dropping the GIL
    would wait out."""
    fences = darwin_fences()
    steps = [with_gil_handoff(f) for f in (fences.acquire, fences.release, fences.full)] * 7
    start = time.monotonic()
    for step in steps[:20]:
        step()
    assert time.monotonic() - start < 10 * 0.005  # (a fence that dropped it: 20 × 5 ms)
