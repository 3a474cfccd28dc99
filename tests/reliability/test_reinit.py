"""Abort and re-init leave nothing behind: in one process, cycles of init_process_group -> ops checked exact
-> destroy_process_group, torch's _abort_process_group or the group's own abort(); in some cycles a peer is
killed, every survivor gets a PeerLostError naming it, ends its group and starts the next cycle with a
replacement process. After a warm-up of two cycles no process may hold more file descriptors, threads,
shared memory or objects of this package than after the warm-up, nor anything on the fake verbs fabric
after any cycle (testing/reliability/reinit.py). The 100-cycle runs: the slow test below and
scripts/reliability/reinit_cycles.py (figures in RELIABILITY.md)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.lab import skip_unless_lab
from torch_thunderbolt.testing.reliability.reinit import KINDS, Process, ReinitRun, plan, run_cycles

pytestmark = [pytest.mark.multiprocess]


def _assert_clean(run: ReinitRun, replacements_measured: bool) -> None:
    assert not run.problems(), "\n".join(run.problems())
    assert not run.growth(), "\n".join(run.growth())
    measured = list(run.survivors(3))
    assert any(p.first == 0 and len(p.cycles) == len(run.plan) for p in measured), "no process lived through all"
    if replacements_measured:
        assert any(p.first > 0 for p in measured), "no replacement process lived long enough to be measured"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", KINDS)
def test_cycles_of_init_ops_and_end_leave_nothing_behind(kind: str, tmp_path) -> None:
    """Five cycles, one of them with a rank killed (cycle 2; its replacement joins from cycle 3), ending
    by destroy, abort and the group's abort in turn."""
    _assert_clean(run_cycles(kind, 5, tmp_path, kill_every=3, timeout=360), replacements_measured=False)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind", KINDS)
def test_a_hundred_cycles_with_ten_kills_leave_nothing_behind(kind: str, tmp_path) -> None:
    _assert_clean(run_cycles(kind, 100, tmp_path, kill_every=10, timeout=3300), replacements_measured=True)


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cycles_on_3_emulated_macs_leave_nothing_behind(tmp_path) -> None:
    """The same on 3 emulated Macs in a ring (one rank each, its own namespace), 6 cycles, a kill in two."""
    skip_unless_lab()
    _assert_clean(run_cycles("lab", 6, tmp_path, kill_every=3, timeout=500), replacements_measured=False)


def _process(first: int, counts: list[int], fabric: list[int] | None = None, rank: int = 0) -> Process:
    fabric = fabric or [0] * len(counts)
    cycles = [{"cycle": first + i, "bad": [], "kind": "tcp", "lost": None,
               "held": {"fds": n, "threads": 3, "shm": 0, "shm_maps": 0, "objects": 40, "fd_kinds": {},
                        "py_threads": [], "fabric": {"qps": q}}} for i, (n, q) in enumerate(zip(counts, fabric))]
    return Process(rank, first, 0, cycles, {}, [], "")


def test_the_checks_see_growth_a_held_queue_pair_and_a_missed_cycle() -> None:
    """The run's checks on made-up records: they must fail where a real leak would show."""
    steps = plan("tcp", 4, 0)
    clean = ReinitRun("tcp", steps, [_process(0, [5, 4, 4, 4], rank=r) for r in range(3)])
    assert clean.growth() == [] and clean.problems() == []
    leak = ReinitRun("tcp", steps, [_process(0, [4, 4, 5, 6], rank=r) for r in range(3)])
    assert len(leak.growth()) == 6 and "fds 4 after cycle 1, 5 after cycle 2" in leak.growth()[0]
    held = ReinitRun("tcp", steps, [_process(0, [4] * 4, [0, 0, 1, 0], rank=r) for r in range(3)])
    assert "still holds {'qps': 1}" in held.growth()[0]
    missed = ReinitRun("tcp", steps, [_process(0, [4] * 4, rank=r) for r in range(2)])
    assert missed.problems()[0] == "cycle 0: finished by ranks [0, 1], expected [0, 1, 2]"


def test_the_plan_kills_in_turn_and_ends_every_way() -> None:
    steps = plan("hierarchical", 12, 4)
    assert [s["victim"] for s in steps] == [None] * 3 + [3] + [None] * 3 + [1] + [None] * 3 + [3]
    assert {s["end"] for s in steps} == {"destroy", "abort", "group_abort"}
