"""Messages over INT_MAX bytes between two real processes over TCP.

macOS fails any single send/recv over INT_MAX bytes (EINVAL), so the TCP transport caps each call at 1 GiB;
on Linux a bigger call would just move part of it. This proves the capped loop end to end: one stream per
peer (THUNDERBOLT_STREAMS=1, so no striping splits the message below INT_MAX), uint8 tensors.
"""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import large_messages


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_send_recv_and_all_to_all_over_int_max_bytes_over_tcp(tmp_path) -> None:
    res = run_ranks(large_messages, 2, tmp_path, timeout=140,
                    env={"THUNDERBOLT_TRANSPORT": "tcp", "THUNDERBOLT_STREAMS": "1"})
    r0, r1 = (r.json() for r in res)
    n_marks = 7
    assert r1["p2p"] == [i + 1 for i in range(n_marks)]
    assert r1["a2a"] == [i + 1 for i in range(n_marks)]  # rank 0's marks, at rank 1
    assert r0["a2a"] == [10 + i + 1 for i in range(n_marks)]
    assert r0["kept"] == [7, 7, 7] and r1["kept"] == [7, 7, 7]
