"""SpinGuard: when a waiting rank busy-polls, and how it backs off from a contended core (fake clock)."""
from __future__ import annotations

from torch_thunderbolt.transport.spin import CONTENDED_SPINS, FIRST_PAUSE, MAX_PAUSE, SLOW_YIELD, SpinGuard


class FakeCpu:
    """A clock that each yield advances by `step` (or by the next value of `slow`, when given)."""

    def __init__(self, step: float = 1e-6) -> None:
        self.now = 100.0
        self.step = step
        self.slow: list[float] = []
        self.yields = 0

    def clock(self) -> float:
        return self.now

    def yield_cpu(self) -> None:
        self.yields += 1
        self.now += self.slow.pop(0) if self.slow else self.step


def guard(cpu: FakeCpu) -> SpinGuard:
    return SpinGuard(clock=cpu.clock, yield_cpu=cpu.yield_cpu)


def test_returns_as_soon_as_poll_succeeds() -> None:
    cpu = FakeCpu()
    looks = iter([False, False, True])
    assert guard(cpu).spin(1.0, lambda: next(looks))
    assert cpu.yields == 3


def test_gives_up_after_the_spin_time() -> None:
    cpu = FakeCpu(step=10e-6)
    assert not guard(cpu).spin(100e-6, lambda: False)
    assert cpu.yields == 10


def test_no_spin_time_means_no_spinning() -> None:
    cpu = FakeCpu()
    assert not guard(cpu).spin(0.0, lambda: True)
    assert cpu.yields == 0


def contended_spin(g: SpinGuard, cpu: FakeCpu) -> None:
    cpu.slow = [SLOW_YIELD * 2]
    assert not g.spin(1.0, lambda: True)  # the slow yield ends the spin before the look


def wait_out_pause(g: SpinGuard, cpu: FakeCpu) -> float:
    start = cpu.now
    while g.paused():
        cpu.now += 1e-4
    return round(cpu.now - start, 3)


def test_one_slow_yield_ends_that_spin_but_does_not_pause_the_next() -> None:
    cpu = FakeCpu()
    g = guard(cpu)
    for _ in range(CONTENDED_SPINS - 1):
        contended_spin(g, cpu)
        assert not g.paused()
    assert g.spin(1.0, lambda: True)
    contended_spin(g, cpu)  # the clean spin in between reset the count
    assert not g.paused()


def test_spins_contended_in_a_row_pause_spinning() -> None:
    cpu = FakeCpu()
    g = guard(cpu)
    for _ in range(CONTENDED_SPINS):
        contended_spin(g, cpu)
    assert g.paused()
    yields = cpu.yields
    assert not g.spin(1.0, lambda: True)
    assert cpu.yields == yields  # paused: not even a yield
    assert wait_out_pause(g, cpu) == FIRST_PAUSE
    assert g.spin(1.0, lambda: True)


def test_pauses_double_while_contention_persists_and_reset_after_a_clean_spin() -> None:
    cpu = FakeCpu()
    g = guard(cpu)
    for _ in range(CONTENDED_SPINS - 1):
        contended_spin(g, cpu)
    pauses = []
    for _ in range(12):
        contended_spin(g, cpu)
        pauses.append(wait_out_pause(g, cpu))
    assert pauses[0] == FIRST_PAUSE and pauses[1] == 2 * FIRST_PAUSE
    assert max(pauses) <= MAX_PAUSE + 1e-3 and pauses[-1] >= MAX_PAUSE - 1e-3
    assert g.spin(1.0, lambda: True)  # a clean spin: contention has to build up again
    contended_spin(g, cpu)
    assert not g.paused()
    for _ in range(CONTENDED_SPINS - 1):
        contended_spin(g, cpu)
    assert wait_out_pause(g, cpu) == FIRST_PAUSE


def test_the_engine_lock_signals_only_when_someone_sleeps_and_wakes_a_sleeper() -> None:
    import threading
    import time

    from torch_thunderbolt.transport.base import CountedCondition

    lock = CountedCondition()
    with lock.mutex:
        lock.signal()  # nobody asleep: nothing to do, and no error
        assert lock.sleepers == 0
    woke = threading.Event()

    def sleeper() -> None:
        with lock:
            lock.sleep(30.0)
        woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    for _ in range(1000):
        with lock.mutex:
            if lock.sleepers:
                lock.signal()
                break
        time.sleep(0.001)
    assert woke.wait(10.0), "the sleeper was not woken by signal()"
    t.join(5.0)
    assert lock.sleepers == 0
