"""Failure semantics on real processes: dead peers, stalls, mismatched calls, clean teardown."""
from __future__ import annotations

import pytest

from .mp import PRELUDE, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

INIT = PRELUDE + """
import datetime, signal
dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=float(os.environ.get("TB_TIMEOUT", "60"))))
r, w = dist.get_rank(), dist.get_world_size()
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [1 << 10, 4 << 20])
def test_kill_9_mid_all_reduce_every_survivor_raises_peer_lost(size: int, transport: str, tmp_path) -> None:
    script = INIT + f"""
x = torch.ones({size} // 4)
def loop():
    for i in range(100000):
        if r == 2 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
res = outcome(loop)
result(res)
"""
    results = run_ranks(script, 3, tmp_path, timeout=60, expect_ok=False, env={"THUNDERBOLT_TRANSPORT": transport})
    assert results[2].returncode == -9
    for res in results[:2]:
        out = res.json()
        assert out["ok"] is False
        assert out["type"] == "PeerLostError", out
        assert "rank 2" in out["msg"], out
        assert out["peer"] == 2, out
        assert res.returncode == 0


def test_stalled_rank_gives_collective_timeout_naming_it(tmp_path) -> None:
    script = INIT + """
def op():
    if r == 1:
        time.sleep(6)   # never arrives in time
        return
    dist.all_reduce(torch.ones(10))
res = outcome(op)
result(res)
"""
    results = run_ranks(script, 2, tmp_path, timeout=60, env={"TB_TIMEOUT": "2"}, expect_ok=False)
    out = results[0].json()
    assert out["type"] == "CollectiveTimeout" and "Timed out" in out["msg"], out
    assert "[1]" in out["msg"] and "all_reduce" in out["msg"], out
    assert 1.5 < out["seconds"] < 10, out


@pytest.mark.parametrize("kind", ["size", "dtype", "op"])
def test_mismatched_calls_raise_on_every_rank(kind: str, tmp_path) -> None:
    script = INIT + f"""
kind = "{kind}"
def op():
    if kind == "size":
        dist.all_reduce(torch.ones(10 + r))
    elif kind == "dtype":
        dist.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64))
    else:
        x = torch.ones(10)
        dist.all_reduce(x) if r == 0 else dist.broadcast(x, 0)
res = outcome(op)
res["after"] = outcome(lambda: dist.all_reduce(torch.ones(3)))
result(res)
"""
    results = run_ranks(script, 2, tmp_path, timeout=60, env={"TB_TIMEOUT": "20"}, expect_ok=False)
    for res in results:
        out = res.json()
        assert out["ok"] is False and out["type"] == "MismatchError", (res.rank, out)
        assert out["seconds"] < 5, out
        assert out["after"]["ok"] is False  # the group is BROKEN from then on, at once
        assert out["after"]["seconds"] < 1


def test_destroy_releases_sockets_and_threads(tmp_path) -> None:
    script = INIT + """
import threading, psutil
before = threading.active_count()
g = dist.new_group(backend="thunderbolt")
for _ in range(3):
    dist.all_reduce(torch.ones(1 << 20), group=g, async_op=True).wait()
conns_during = len([c for c in psutil.Process().net_connections() if c.status == "ESTABLISHED"])
dist.destroy_process_group()
# Background threads (torch's store, our keeper) close theirs moments later; under load that took > 0.2 s.
for waited in range(50):
    time.sleep(0.1)
    conns_after = [c for c in psutil.Process().net_connections() if c.status in ("ESTABLISHED", "LISTEN")]
    if not conns_after:
        break
result({"threads_before": before, "threads_after": threading.active_count(), "conns_during": conns_during,
        "conns_after": len(conns_after), "waited": waited})
"""
    for res in run_ranks(script, 2, tmp_path, timeout=60, env={"THUNDERBOLT_TRANSPORT": "tcp"}):
        out = res.json()
        assert out["conns_during"] >= 2
        assert out["conns_after"] == 0, out
        assert out["threads_after"] <= out["threads_before"], out
