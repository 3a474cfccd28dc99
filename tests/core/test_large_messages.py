"""Messages over INT_MAX bytes between two real processes over TCP.

macOS fails any single send/recv over INT_MAX bytes (EINVAL), so the TCP transport caps each call at 1 GiB;
on Linux a bigger call would just move part of it. This proves the capped loop end to end: one stream per
peer (THUNDERBOLT_STREAMS=1, so no striping splits the message below INT_MAX), uint8 tensors.
"""
from __future__ import annotations

import pytest

from .mp import PRELUDE, run_ranks

SCRIPT = PRELUDE + """
INT_MAX = 2**31 - 1
N = INT_MAX + 1 + 4099   # bytes to the peer, in one message
SMALL = 3                # all_to_all: bytes each rank keeps for itself
dist.init_process_group("thunderbolt")
rank = dist.get_rank()
marks = [0, 1, (1 << 30) - 1, 1 << 30, INT_MAX, INT_MAX + 1, N - 1]
# all_to_all splits: rank 0 keeps its first SMALL bytes and sends the N after them; rank 1 sends its first N.
splits = [SMALL, N] if rank == 0 else [N, SMALL]
to_peer = slice(SMALL, SMALL + N) if rank == 0 else slice(0, N)
from_peer = slice(SMALL, SMALL + N) if rank == 0 else slice(0, N)
kept = slice(0, SMALL) if rank == 0 else slice(N, N + SMALL)
# Only the marked pages of the input are touched: the rest stays unallocated (zero pages).
inp = torch.empty(SMALL + N, dtype=torch.uint8)
inp[kept] = 7
for i, pos in enumerate(marks):
    inp[to_peer][pos] = 10 * rank + i + 1
out = torch.zeros(SMALL + N, dtype=torch.uint8)
t0 = time.monotonic()
if rank == 0:
    dist.send(inp[to_peer], dst=1)
else:
    dist.recv(out[from_peer], src=0)
p2p = [int(out[from_peer][p]) for p in marks] if rank == 1 else None
t1 = time.monotonic()
out[from_peer][torch.tensor(marks)] = 0
dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=splits)
a2a = [int(out[from_peer][p]) for p in marks]
kept = out[kept].tolist()
t2 = time.monotonic()
dist.destroy_process_group()
result({"p2p": p2p, "a2a": a2a, "kept": kept, "seconds": [t1 - t0, t2 - t1]})
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_send_recv_and_all_to_all_over_int_max_bytes_over_tcp(tmp_path) -> None:
    res = run_ranks(SCRIPT, 2, tmp_path, timeout=140,
                    env={"THUNDERBOLT_TRANSPORT": "tcp", "THUNDERBOLT_STREAMS": "1"})
    r0, r1 = (r.json() for r in res)
    n_marks = 7
    assert r1["p2p"] == [i + 1 for i in range(n_marks)]
    assert r1["a2a"] == [i + 1 for i in range(n_marks)]  # rank 0's marks, at rank 1
    assert r0["a2a"] == [10 + i + 1 for i in range(n_marks)]
    assert r0["kept"] == [7, 7, 7] and r1["kept"] == [7, 7, 7]
