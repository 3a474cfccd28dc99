"""Short CI run of the protocol fuzzers (the ≥1e6-input runs: scripts/reliability/fuzz.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.testing.reliability import fuzzing

pytestmark = pytest.mark.timeout(120)


def test_structured_fuzz_short_run_only_protocol_errors_escape() -> None:
    counts = fuzzing.run(3000, seed=20261130)
    assert all(n > 300 for n in counts.values()), counts  # every target got its share


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=2 * hs.HELLO_SIZE))
def test_server_handshake_fuzz(data: bytes) -> None:
    fuzzing.server_target(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=hs.CHALLENGE_SIZE + hs.REPLY_SIZE))
def test_client_handshake_fuzz(data: bytes) -> None:
    fuzzing.client_target(data)


def test_the_targets_report_escapes() -> None:
    """The harness must fail when something other than ProtocolError escapes (else it proves nothing)."""
    def broken(data: bytes) -> None:
        raise IndexError("simulated decoder bug")

    with pytest.raises(AssertionError, match="IndexError"):
        fuzzing.run(50, seed=1, targets={**fuzzing.TARGETS, "decoder": broken})


def test_mutated_valid_input_reaches_the_accept_path() -> None:
    """A correct HELLO (with the server's nonce) is accepted by the same target code path."""
    server = hs.ServerHandshake(fuzzing.SECRET, 0, fuzzing.GROUP, lambda r, s: r == 1, 2)
    client = hs.ClientHandshake(fuzzing.SECRET, 1, 0, 0, fuzzing.GROUP)
    result = server.receive(client.receive_challenge(server.challenge()))
    assert result is not None and result.peer_rank == 1


def test_a_control_frame_with_a_large_byte_count_is_valid_input() -> None:
    """A RESYNC's `offset` is the bytes of a lost stream its sender consumed, not a part of a payload: the
    decoder target checks control frames for having no payload instead (the 1e6-input run with seed 1 drew
    this frame at input ~1e5)."""
    fuzzing.decoder_target(bytes.fromhex(
        "c1427405017f000000679b070000000000ffffffff00000000000020000000000000000000000000000000000000000000"))
