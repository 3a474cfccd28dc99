"""Every kind of link passes the conformance checks of torch_thunderbolt.testing.conformance, and the checks
catch a kind broken on purpose (a dropped message, two sent out of order, a swallowed ABORT).

The in-memory kind runs on thread ranks; tcp (plain, and sealed: THUNDERBOLT_INTEGRITY=mac, every frame
carrying MACs), shm, rdma (over a fake verbs fabric, a device per rank) and sock (the example kind of
testing/kinds, added to the table as any kind is) on real rank processes set up as a job sets them up (every
pair forced onto the kind). Each kind runs the whole suite once (a module fixture); each check is its own
test."""
from __future__ import annotations

import secrets
from typing import Callable

import pytest

from torch_thunderbolt.testing import conformance
from torch_thunderbolt.testing.conformance import CHECKS, Outcome, run_in_processes, run_on_threads
from torch_thunderbolt.testing.ranks import SHM

pytestmark = pytest.mark.timeout(600)

WORLD = 3


def _rdma(tmp) -> dict[str, Outcome]:
    from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric

    devices = {f"rdma_fake{i}": f"10.201.0.{i + 1}" for i in range(WORLD)}
    with fake_fabric(tmp / "fabric", devices=devices) as fabric:
        return run_in_processes("rdma", WORLD, tmp / "run", env=fabric_env(fabric))


def _memory(world: int):
    from torch_thunderbolt.transport.memory import MemoryHub

    hub = MemoryHub(world)
    return hub.transports, hub.kill


KINDS = {
    "memory": lambda tmp: run_on_threads(_memory, WORLD),
    "tcp": lambda tmp: run_in_processes("tcp", WORLD, tmp),
    # on the darwin socket model (testing/darwin.py): macOS's option names, accept without the listener's
    # timeouts, silent buffer clamping (each check fails unless every stream is the model's)
    "tcp-darwin": lambda tmp: run_in_processes("tcp", WORLD, tmp, env={"XNU_MODEL": "1"}),
    # (each check fails unless the links really are the sealed ones)
    "tcp-sealed": lambda tmp: run_in_processes("tcp", WORLD, tmp, env={
        "THUNDERBOLT_INTEGRITY": "mac", "THUNDERBOLT_SECRET": secrets.token_hex(32),
        "TB_CONFORMANCE_LINK": "SealedTcpLink"}),
    # small rings (4K slots, two per pair): every large message laps them many times
    "shm": lambda tmp: run_in_processes("shm", WORLD, tmp, setup=SHM),
    "sock": lambda tmp: run_in_processes("sock", WORLD, tmp),
    "rdma": _rdma,
}
MULTIPROCESS = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Outcome]]:
    """The outcomes of the whole suite over a kind, run once per kind when a test first asks."""
    done: dict[str, dict[str, Outcome]] = {}

    def outcomes(kind: str) -> dict[str, Outcome]:
        if kind not in done:
            done[kind] = KINDS[kind](tmp_path_factory.mktemp(f"conformance-{kind}"))
        return done[kind]
    return outcomes


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", ["memory", pytest.param("tcp", marks=MULTIPROCESS),
                                  pytest.param("tcp-darwin", marks=MULTIPROCESS),
                                  pytest.param("tcp-sealed", marks=MULTIPROCESS),
                                  pytest.param("shm", marks=MULTIPROCESS), pytest.param("sock", marks=MULTIPROCESS),
                                  pytest.param("rdma", marks=MULTIPROCESS)])
def test_every_kind_passes_every_check(kind: str, check: str, suite) -> None:
    outcome = suite(kind)[check]
    assert outcome.ok, str(outcome)


# The checks the default selection runs on the darwin model (the whole suite runs there with -m slow): one
# set-up per check, so each costs a group; these cover ordering, partial I/O, a peer that stops reading, an
# ABORT and a rank that dies.
DARWIN_CORE = ["order", "partial", "stops_reading", "abort_lost", "peer_dies"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tcp_on_the_darwin_model_passes_the_core_checks(tmp_path) -> None:
    outcomes = run_in_processes("tcp", WORLD, tmp_path, checks=DARWIN_CORE, env={"XNU_MODEL": "1"})
    failed = [str(o) for o in outcomes.values() if not o.ok]
    assert not failed, failed


# Which checks each mutant must fail (a short wait: a lost message is found when a wait runs out).
CAUGHT_BY = {"drop": ["order", "sizes", "counters"], "reorder": ["order"],
             "swallow_abort": ["abort_lost", "abort_timeout", "abort_in_flight", "mismatch"]}


@pytest.mark.parametrize("mutant", sorted(conformance.MUTANTS))
def test_the_checks_catch_a_broken_kind(mutant: str) -> None:
    outcomes = run_on_threads(_memory, WORLD, checks=CAUGHT_BY[mutant], mutant=mutant, wait=2.0)
    passed = [name for name, o in outcomes.items() if o.ok]
    assert not passed, f"the {mutant} mutant passed {passed}"


@pytest.mark.multiprocess
def test_a_kind_that_parks_and_reorders_deadlocks_one_by_one(tmp_path) -> None:
    """Over TCP, which holds back a large message whose receive is not posted, two messages sent out of order
    leave the receiver waiting forever for the one behind: the check fails (at its wait), where the in-memory
    kind, which never holds a message back, would not notice."""
    outcome = run_in_processes("tcp", 2, tmp_path, checks=["one_by_one"], mutant="reorder", wait=5.0)["one_by_one"]
    assert not outcome.ok and "Timed out" in str(outcome), str(outcome)
