"""macOS's runtime behaviour under the darwin models of torch_thunderbolt.testing.darwin_runtime: fences
and the GIL, the scheduler's yield, fd counts, P-cores."""
from __future__ import annotations

import ctypes
import os
import time
from datetime import timedelta

import pytest

from torch_thunderbolt.backend.work import Work
from torch_thunderbolt.backend.worker import Worker
from torch_thunderbolt.platform import SYSCTL, Platform
from torch_thunderbolt.testing.darwin_runtime import (BASEPRI_DEFAULT, MAXPRI_THROTTLE, QUANTUM, XnuCore,
                                                      releases_gil, with_gil_handoff)
from torch_thunderbolt.transport import ordering, spin

DARWIN = Platform.for_system("darwin")


def darwin_fences() -> ordering.Fences:
    """The fences the darwin selection makes with the real libc lookup; glibc has no OSMemoryBarrier, so the
    lookup is asked for a libc function of the same shape (no argument, no result, no work)."""
    fences = ordering.fences(DARWIN, lambda name: ordering._libc_symbol("getpid" if name == "OSMemoryBarrier"
                                                                        else name))
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


def test_the_scheduler_model_charges_a_depressed_yield_a_quantum() -> None:
    now = [0.0]
    core = XnuCore(others=[MAXPRI_THROTTLE], advance=lambda s: now.__setitem__(0, now[0] + s))
    core.sched_yield()
    assert now[0] == QUANTUM  # depressed to 0: even a background thread goes first, for a quantum
    core.thread_switch(0, 0, 0)
    assert now[0] == QUANTUM  # without depression: nothing of lower priority goes first
    busy = XnuCore(others=[BASEPRI_DEFAULT], burst=0.001, advance=lambda s: now.__setitem__(0, now[0] + s))
    busy.thread_switch(0, 0, 0)
    assert round(now[0], 6) == QUANTUM + 0.001  # an equal-priority thread does go first: it is a yield
    assert XnuCore().lookup("sched_yield") is None


def test_the_yield_of_each_platform() -> None:
    core = XnuCore()
    assert spin.yield_for(Platform.for_system("linux"), core.lookup) is os.sched_yield
    darwin = spin.yield_for(DARWIN, core.lookup)
    darwin()
    assert core.yields == [("thread_switch", 0.0)]
    assert spin.yield_for(DARWIN, lambda name: None) is os.sched_yield  # a libSystem without it


def test_async_ops_are_not_held_back_a_quantum_by_the_workers_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core that a background thread keeps busy (Spotlight indexing, a niced build): the worker's yield
    before each op must not let it wait out a depressed quantum, or every async op is ~10 ms late."""
    core = XnuCore(others=[MAXPRI_THROTTLE])
    monkeypatch.setattr(os, "sched_yield", core.sched_yield)  # what os.sched_yield is on macOS
    worker = Worker("tb-worker-test", yield_cpu=spin.yield_for(DARWIN, core.lookup))
    latencies = []
    try:
        for i in range(10):
            work = Work(f"op {i}")
            start = time.monotonic()
            worker.submit(work, lambda: None)
            assert work.wait(timedelta(seconds=10))
            latencies.append(time.monotonic() - start)
    finally:
        worker.stop()
    assert len(core.yields) == 10
    assert sorted(latencies)[5] < QUANTUM / 2, f"median async op latency {sorted(latencies)[5] * 1e3:.1f} ms"


def test_the_leak_check_counts_descriptors_where_dev_fd_holds_no_symlinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS's /dev/fd entries are fdesc nodes: readlink fails on each (EINVAL). The count must not
    depend on it."""
    import errno
    import socket

    from torch_thunderbolt.testing.leftovers import holdings

    readlink = os.readlink

    def not_a_link(path: str, *args: object, **kwargs: object) -> str:
        if str(path).startswith("/dev/fd/"):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return readlink(path, *args, **kwargs)  # (psutil reads /proc on this Linux host)

    monkeypatch.setattr(os, "readlink", not_a_link)
    before = holdings(plat=DARWIN)
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        after = holdings(plat=DARWIN)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
    assert before["fds"] > 0 and after["fds"] == before["fds"] + 4
    assert sum(after["fd_kinds"].values()) == after["fds"]
    assert after["fd_kinds"].get("socket:", 0) == before["fd_kinds"].get("socket:", 0) + 2


M1_SYSCTL = {"hw.perflevel0.physicalcpu": "4\n", "hw.perflevel1.physicalcpu": "4\n", "hw.ncpu": "8\n"}


def fake_sysctl(values: dict[str, str]):
    """/usr/sbin/sysctl -n KEY of a Mac with `values` ("" for a key it lacks, as the tool's failure reads)."""
    def run(argv: list[str]) -> str:
        assert argv[:2] == [SYSCTL, "-n"], argv
        return values.get(argv[2], "")
    return run


def test_spin_decisions_count_performance_cores_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An M1 (4 performance + 4 efficiency cores, os.cpu_count() 8) with 6 local ranks: they outnumber the
    P-cores, so they must not spin, and the shared window takes its bigger size."""
    from torch_thunderbolt import platform
    from torch_thunderbolt.rendezvous.shm import default_window_bytes
    from torch_thunderbolt.transport.shm import default_spin

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS has no affinity mask
    monkeypatch.setattr(platform, "current", lambda: DARWIN)
    monkeypatch.setattr(platform, "run_tool", fake_sysctl(M1_SYSCTL))
    assert platform.spin_cores() == 4
    assert default_spin(4) > 0 and default_spin(6) == 0.0
    assert default_window_bytes(4) == 1 << 20 and default_window_bytes(6) == 4 << 20
    # An Intel Mac has no perflevels: every core counts.
    assert platform.spin_cores(DARWIN, fake_sysctl({"hw.ncpu": "8\n"})) == 8
    assert platform.spin_cores(Platform.for_system("linux"), lambda argv: pytest.fail("no sysctl on Linux")) == 8
