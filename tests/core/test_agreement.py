"""The agreement on new groups (protocol/agreement.py): every interleaving of its messages, retries, timeouts,
deaths and closes explored for small worlds (testing/agreement_model.py), a mutant without call identity
that the exploration catches, and the ledger of group ids. Scenarios of more than 20,000 states (those of 3
ranks with faults, of 4 ranks: 70,000 to 520,000 states, 10 s to 80 s each) run in the slow selection."""
from __future__ import annotations

import dataclasses

import pytest

from torch_thunderbolt.protocol.agreement import Agreement, Disagree, Joined, decide, identity
from torch_thunderbolt.protocol.control import MAX_GID, Commit, Done, Propose
from torch_thunderbolt.testing.agreement_model import SCENARIOS, Scenario, Violation, explore

SMALL = {"2 ranks, two groups, retries, 1 fault", "2 ranks, two groups with closes, 1 fault",
         "3 ranks, a group then a group of 2", "3 ranks shrink to 2: rank 2 dead, news on its way, retries"}
FAST = [s for s in SCENARIOS if s.name in SMALL]
SLOW = [s for s in SCENARIOS if s.name not in SMALL]


@pytest.mark.parametrize("scenario", FAST, ids=[s.name for s in FAST])
def test_every_interleaving_keeps_the_promises(scenario: Scenario) -> None:
    report = explore(scenario)
    print(f"{scenario.name}: {report.states} states, {report.transitions} transitions, {report.finals} quiet")
    assert report.states > 100 and report.finals > 0  # it explored something


@pytest.mark.slow
@pytest.mark.timeout(900)  # (up to 100 s each on a quiet machine, several times that beside other work)
@pytest.mark.parametrize("scenario", SLOW, ids=[s.name for s in SLOW])
def test_every_interleaving_of_larger_worlds_keeps_the_promises(scenario: Scenario) -> None:
    report = explore(scenario)
    print(f"{scenario.name}: {report.states} states, {report.transitions} transitions, {report.finals} quiet")
    assert report.states > 100


class NoIdentity(Agreement):
    """A mutant that ties nothing to a call: a commit counts whatever call of this rank its view names, and the
    end of a peer's call changes nothing (what the agreement before nonces did)."""

    def _current(self, peer: int, msg: Commit) -> bool:
        return True

    def _unmade(self, peer: int, nonce: "int | None", view: tuple[int, ...]) -> bool:
        return False


def test_a_machine_without_call_identity_fails_the_exploration() -> None:
    with pytest.raises(Violation):
        explore(SCENARIOS[0], NoIdentity)


class ForgetsWhoJoined(Agreement):
    """A mutant that takes a member whose call ended for one that never joined (what the agreement did before
    calls remembered who joined them)."""

    def waiting_for(self) -> tuple[list[int], list[int], list[int]]:
        silent, unconfirmed, ended = super().waiting_for()
        return sorted(silent + ended), unconfirmed, []


def test_a_machine_that_forgets_who_joined_fails_the_exploration() -> None:
    """Both ranks time out, one a moment before the other (two faults): the second must not name the first."""
    scenario = dataclasses.replace(SCENARIOS[0], faults=2, calls=1)
    explore(scenario)
    with pytest.raises(Violation, match="as a member that did not join"):
        explore(scenario, ForgetsWhoJoined)


def test_the_same_proposals_give_the_same_id_and_identity() -> None:
    assert decide([0b1, 0b100]) == 1 and decide([0b11, 0b1]) == 2
    assert decide([(1 << (MAX_GID + 1)) - 1]) is None
    assert identity(3, (0, 1), (1, 2)) == identity(3, (0, 1), (1, 2)) != identity(3, (0, 1), (1, 3))


def _pair_made() -> tuple[Agreement, Agreement]:
    a, b = Agreement(0), Agreement(1)
    for m in (a, b):
        m.add(0, (0, 1))
    to_b, to_a = a.begin((0, 1)), b.begin((0, 1))
    for (peer, msg) in to_b:
        to_a += b.receive(0, msg)[0]
    for (peer, msg) in to_a:
        to_b = a.receive(1, msg)[0]
        for (_, m2) in to_b:
            b.receive(0, m2)
    assert isinstance(a.outcome(), Joined) and a.outcome() == b.outcome()
    return a, b


def test_a_stale_proposal_of_a_call_that_made_its_group_is_never_taken_again() -> None:
    """The bug the nonces fix: the proposal of a call that returned stays behind, and the next call of other
    members took it (a MismatchError, or a group of another id)."""
    a, b = _pair_made()
    rec_a, _ = a.finish()
    rec_b, _ = b.finish()
    assert rec_a == rec_b and rec_a.gid == 1
    sends = a.begin((0, 1))  # a's next call, before b proposes again: it waits for b's next proposal
    assert [type(m) for _, m in sends] == [Propose] and a.outcome() is None


def test_a_disagreement_ends_when_the_peer_retries() -> None:
    a = Agreement(0)
    a.add(0, (0, 1, 2))
    a.receive(1, Propose(1, (0, 1, 2)))
    a.begin((0, 1))
    assert a.disagreement() == Disagree(1, (0, 1, 2)) and a.outcome() is None  # the caller gives up on it, or
    a.receive(1, Done(1))  # rank 1's call is over (it learnt of rank 2's loss) and it retries
    assert a.disagreement() is None
    a.receive(1, Propose(2, (0, 1)))
    assert a.call is not None and a.call.commits  # it committed to rank 1's new proposal


def test_a_member_that_joined_and_gave_up_first_is_not_named_as_one_that_did_not_join() -> None:
    """Two survivors wait for a third that never comes; the one whose deadline comes first ends its call (DONE)
    a moment before the other's deadline. The other must name only the third: naming both made each survivor
    exclude the other on its retry, and each shrank to a group of itself."""
    a = Agreement(1)
    a.add(0, (0, 1, 2, 3))
    a.begin((1, 2, 3))
    a.receive(2, Propose(1, (1, 2, 3)))
    assert a.waiting_for() == ([3], [2], [])
    a.receive(2, Done(1))  # rank 2 timed out first
    assert a.waiting_for() == ([3], [], [2])
    b = Agreement(2)  # a proposal that came before the call began counts as joined too
    b.add(0, (0, 1, 2, 3))
    b.receive(1, Propose(1, (1, 2, 3)))
    b.begin((1, 2, 3))
    b.receive(1, Done(1))
    assert b.waiting_for() == ([3], [], [1])


def test_a_member_that_made_the_group_vouches_for_a_commit_that_has_not_come() -> None:
    """Rank 2 is stopped just after its COMMIT reached rank 0 but before it reached rank 1. Rank 0 makes the
    group and says so (DONE with the view): rank 1 makes it too instead of timing out, which broke rank 0's
    group and left the survivors in different groups."""
    a = Agreement(1)
    a.add(0, (0, 1, 2, 3))
    a.begin((0, 1, 2))
    a.receive(0, Propose(1, (0, 1, 2)))
    sends, _ = a.receive(2, Propose(1, (0, 1, 2)))
    commit = next(m for _, m in sends if isinstance(m, Commit))
    a.receive(0, Commit(1, (0, 1, 2), commit.view, commit.gid))
    assert a.outcome() is None  # rank 2's commit missing
    a.receive(0, Done(1, (1, 1, 9)))  # a DONE of another view vouches for nothing
    assert a.outcome() is None
    b = Agreement(1)
    b.add(0, (0, 1, 2, 3))
    b.begin((0, 1, 2))
    b.receive(0, Propose(1, (0, 1, 2)))
    b.receive(2, Propose(1, (0, 1, 2)))
    b.receive(0, Commit(1, (0, 1, 2), commit.view, commit.gid))
    b.receive(0, Done(1, commit.view))
    assert b.outcome() == Joined(commit.gid, (0, 1, 2), commit.view)


def test_ids_are_reused_once_every_member_left() -> None:
    a = Agreement(0)
    a.add(0, (0, 1))
    a.add(5, (0, 1), (3, 3))
    a.closed(5)
    assert a.used() == 0b100001 and a.fate(1, 5) == "drop"
    a.left(1, 5)
    assert a.used() == 0b1 and a.fate(1, 5) == "hold"


def test_a_group_made_from_a_call_the_peer_ended_without_it_is_broken() -> None:
    a = Agreement(0)
    a.add(0, (0, 1))
    a.add(2, (0, 1), (4, 7))
    _, broken = a.receive(1, Done(7))  # rank 1's call 7 ended without a group: it never made group 2
    assert broken == [2]
    a.add(3, (0, 1), (5, 8))
    _, broken = a.receive(1, Done(8, (5, 8)))  # rank 1's call 8 made group 3: it stands
    assert 3 not in broken


def test_scenarios_are_reproducible() -> None:
    """The same scenario explores the same states (no dependence on hash order)."""
    sc = dataclasses.replace(SCENARIOS[0])
    assert explore(sc) == explore(sc)
