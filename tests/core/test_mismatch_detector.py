"""The one mismatch detector (transport/mismatch.py), fed facts as the kinds deliver them, without I/O."""
from __future__ import annotations

import pytest

from torch_thunderbolt.errors import MismatchError
from torch_thunderbolt.protocol.control import Op
from torch_thunderbolt.protocol.framing import Space
from torch_thunderbolt.transport.base import ANY_SOURCE, Request
from torch_thunderbolt.transport.matching import Matcher
from torch_thunderbolt.transport.mismatch import OPS_REMEMBERED, MismatchDetector

SIG, OTHER = 0x1111_2222_3333_4444, 0x5555_6666_7777_8888


def detector(*waits: tuple[int, int, int]) -> MismatchDetector:
    """Rank 0 with a posted collective receive for each (peer, tag, sig)."""
    m = Matcher(0)
    for peer, tag, sig in waits:
        m.post(Request(peer, (Space.COLL, tag, 0), sig, memoryview(bytearray(4)), is_send=False))
    return MismatchDetector(0, m)


def test_a_ping_for_an_op_this_rank_ran_otherwise_is_a_mismatch_naming_both() -> None:
    d = detector()
    d.note_post((Space.COLL, 7, 0), SIG)
    assert d.peer_waits_for(2, Op(Space.COLL, 7, SIG)) is None  # same op: nothing to say
    with pytest.raises(MismatchError, match=r"rank 0: mismatched operation with rank 2 \(op #7\)"):
        d.peer_waits_for(2, Op(Space.COLL, 7, OTHER))
    assert d.peer_waits_for(2, Op(Space.COLL, 8, OTHER)) is None  # an op this rank has not posted


def test_old_ops_are_forgotten() -> None:
    d = detector()
    d.note_post((Space.COLL, 1, 0), SIG)
    d.note_post((Space.COLL, 1 + OPS_REMEMBERED, 0), SIG)
    assert 1 not in d.op_sigs and d.peer_waits_for(2, Op(Space.COLL, 1, OTHER)) is None


def test_the_answer_names_the_end_of_the_chain() -> None:
    d = detector((1, 5, SIG), (3, 5, SIG))
    assert d.peer_waits_for(2, Op(Space.COLL, 5, SIG)) == 1  # this rank waits on rank 1 (lowest) in op 5
    d.peer_waits_on(1, Op(Space.COLL, 5, SIG, waits_on=3))  # and rank 1 said it waits on rank 3
    assert d.peer_waits_for(2, Op(Space.COLL, 5, SIG)) == 3
    assert d.waits_on(1, {5}) == 3 and d.waits_on(1, {6}) is None
    d.peer_waits_on(3, Op(Space.COLL, 5, SIG, waits_on=-1))  # an answer that names nobody changes nothing
    assert d.waits_on(3, {5}) is None


def test_a_ping_for_an_op_this_rank_waits_in_with_another_signature_is_a_mismatch() -> None:
    """A receive this rank posted is noted as its op too: a peer waiting for that op run otherwise is found."""
    d = detector()
    d.note_post((Space.COLL, 9, 0), SIG)  # (what the engine does for every receive it posts)
    with pytest.raises(MismatchError, match=r"rank 2 waits for rank 0's part of"):
        d.peer_waits_for(2, Op(Space.COLL, 9, OTHER))


def test_probes_name_the_op_waited_for_each_peer() -> None:
    d = detector((1, 4, SIG))
    assert d.probes([1, 2]) == {1: Op(Space.COLL, 4, SIG)}
    d.matcher.post(Request(ANY_SOURCE, (Space.P2P, 3, -1), 0, memoryview(bytearray(4)), is_send=False))
    assert d.probes([1, 2]) == {1: Op(Space.COLL, 4, SIG), 2: Op()}
