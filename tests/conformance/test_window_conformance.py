"""Every implementation of window memory passes the checks of torch_thunderbolt.testing.window_conformance,
with two and three members, and the checks catch window memory broken on purpose.

MemoryWindowMemory runs on thread ranks (a MemoryHub with a window); ShmWindowMemory in real rank processes
set up as a job sets them up (THUNDERBOLT_TRANSPORT=shm, a group all on one host, the window at its default
size). Each implementation and size runs the whole suite once (a module fixture); each check is its own test."""
from __future__ import annotations

from typing import Callable

import pytest

from torch_thunderbolt.testing import window_conformance
from torch_thunderbolt.testing.conformance import Outcome, run_in_processes, run_on_threads
from torch_thunderbolt.testing.ranks import SHM
from torch_thunderbolt.testing.window_conformance import CHECKS, WINDOW

pytestmark = pytest.mark.timeout(600)

WINDOW_BYTES = 1 << 20  # the threads' buffers (the shm window's default, for a host with enough cores)
MULTIPROCESS = [pytest.mark.multiprocess, pytest.mark.slow]


def _memory(world: int):
    from torch_thunderbolt.transport.memory import MemoryHub

    hub = MemoryHub(world, window_bytes=WINDOW_BYTES)
    return hub.transports, hub.kill


IMPLEMENTATIONS = {
    "memory": lambda world, tmp, **kw: run_on_threads(_memory, world, suite=WINDOW, **kw),
    "shm": lambda world, tmp, **kw: run_in_processes("shm", world, tmp, setup=SHM, suite=WINDOW, **kw),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], dict[str, Outcome]]:
    """The outcomes of the whole suite over an implementation and a number of members, run once each."""
    done: dict[tuple[str, int], dict[str, Outcome]] = {}

    def outcomes(impl: str, world: int) -> dict[str, Outcome]:
        if (impl, world) not in done:
            done[(impl, world)] = IMPLEMENTATIONS[impl](world, tmp_path_factory.mktemp(f"window-{impl}-{world}"))
        return done[(impl, world)]
    return outcomes


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("impl", ["memory", pytest.param("shm", marks=MULTIPROCESS)])
def test_every_window_memory_passes_every_check(impl: str, world: int, check: str, suite) -> None:
    outcome = suite(impl, world)[check]
    assert outcome.ok, str(outcome)


# Which checks each mutant must fail; a short wait, yet well above WAKE (a sleeper that nobody wakes must
# not be woken by a waiting rank giving up first).
CAUGHT_BY = {"word_late": ["data"], "silent": ["wake"], "counter_back": ["counter"], "none_stores_word": ["words"],
             "private_buffers": ["data"], "reached_any": ["reached"], "wrong_me": ["positions"],
             "keeps_mapping": ["release"]}
ON_THREADS = sorted(set(window_conformance.MUTANTS) - {"keeps_mapping"})  # (plain memory has nothing to unmap)


def test_every_mutant_is_tried() -> None:
    assert set(CAUGHT_BY) == set(window_conformance.MUTANTS)


def _caught(impl: str, mutant: str, tmp) -> None:
    outcomes = IMPLEMENTATIONS[impl](3, tmp, checks=CAUGHT_BY[mutant], mutant=mutant,
                                     wait=3 * window_conformance.WAKE)
    passed = [name for name, o in outcomes.items() if o.ok]
    assert not passed, f"the {mutant} mutant passed {passed} over {impl}"


@pytest.mark.parametrize("mutant", ON_THREADS)
def test_the_checks_catch_a_broken_window_memory(mutant: str, tmp_path) -> None:
    _caught("memory", mutant, tmp_path)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["keeps_mapping", "silent", "word_late"])
def test_the_checks_catch_a_broken_shm_window(mutant: str, tmp_path) -> None:
    """Over shared memory too: a window that keeps the segments mapped; a publish that rings no bell (the
    sleepers' short polls would hide it, were they not lifted); a word stored after the counter."""
    _caught("shm", mutant, tmp_path)
