"""Every message's type is checked: calls that pair up with the same byte count but another dtype, element
count or packing are a MismatchError on both ranks, never bytes read as another dtype; a point-to-point
receive that does not match leaves its tensor untouched. Over TCP and shared memory; the in-memory tier is
in test_aliasing_and_signatures.py."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import typed_messages

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TRANSPORTS = ["tcp", "shm"]


def _run(tmp_path, transport: str, case: str, **env: str) -> list[dict]:
    results = run_ranks(typed_messages, 2, tmp_path, args=["typed"], timeout=90, expect_ok=False,
                        env={"THUNDERBOLT_TRANSPORT": transport, "TEST_CASE": case, **env})
    return [res.json() for res in results]


def _first_error(out: dict) -> dict:
    """The call's error, or (for a rank that only sent, which may finish first) its next call's."""
    return out if not out["ok"] else out["after"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n,early", [(2, False), (2, True), (1 << 20, False), (1 << 20, True)],
                         ids=["small", "small-early", "4MB", "4MB-early"])
def test_a_send_received_as_another_dtype_is_refused_on_both_ranks_with_the_tensor_untouched(
        transport, n, early, tmp_path) -> None:
    sender, receiver = _run(tmp_path, transport, "p2p_dtype", TEST_N=str(n), TEST_EARLY="1" if early else "0")
    assert receiver["ok"] is False and receiver["type"] == "MismatchError", receiver
    assert receiver["untouched"] is True, receiver
    # The receiver names both sides: what was sent and what it expected.
    assert f"send(float32) of {n} elements" in receiver["msg"] and f"send(int32) of {n} elements" in receiver["msg"]
    got = _first_error(sender)
    assert got["ok"] is False and got["type"] == "MismatchError", sender
    assert "float32" in got["msg"] and "int32" in got["msg"], sender
    assert receiver["after"]["ok"] is False  # the group is broken from then on


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receive_from_any_source_checks_the_type_too(transport, tmp_path) -> None:
    sender, receiver = _run(tmp_path, transport, "p2p_any_source")
    assert receiver["type"] == "MismatchError" and receiver["untouched"] is True, receiver
    assert _first_error(sender)["type"] == "MismatchError", sender


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_gather_coalesced_of_float32_beside_int32_is_a_mismatch(transport, tmp_path) -> None:
    for rank, out in enumerate(_run(tmp_path, transport, "coalesced_dtype", TEST_N="4")):
        assert out["ok"] is False and out["type"] == "MismatchError", (rank, out)
        assert out["untouched"] is True, (rank, out)  # the peer's block was never written


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["coalesced_layout", "sparse_shape"])
def test_packings_that_differ_are_a_mismatch(transport, case, tmp_path) -> None:
    for rank, out in enumerate(_run(tmp_path, transport, case, TEST_N="4")):
        assert out["ok"] is False and out["type"] == "MismatchError", (rank, out)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_compressed_all_reduce_of_float32_beside_float64_is_a_mismatch(transport, tmp_path) -> None:
    """Both are compressed to the same bytes (fp16 of as many elements): the signature says what they stand for."""
    outs = _run(tmp_path, transport, "compressed_dtype", TEST_N=str(1 << 16), THUNDERBOLT_COMPRESSION="fp16")
    for rank, out in enumerate(outs):
        assert out["ok"] is False and out["type"] == "MismatchError", (rank, out)
