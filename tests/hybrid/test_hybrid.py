"""The hybrid transport (shm within a host, TCP across) over real processes on one machine, with two
emulated hosts of two ranks each (see hybrid_harness): every collective exact (the large all_reduce,
all_gather and reduce_scatter hierarchical), same-host traffic never on TCP, kill -9 of a rank fails every
survivor with PeerLostError."""
from __future__ import annotations

import pytest

from torch_thunderbolt.algorithms.shape import shape_from_networks
from torch_thunderbolt.rendezvous.group import choose_transport as _choose_transport, hosts_shape

from ..core.collective_checks import EVERY_COLLECTIVE
from .hybrid_harness import run_hybrid

pytestmark = [pytest.mark.multiprocess]


def test_choose_transport() -> None:
    two_two = ["a", "a", "b", "b"]
    assert [_choose_transport("auto", r, two_two) for r in range(4)] == ["hybrid"] * 4
    assert [_choose_transport("auto", r, ["a", "a", "b"]) for r in range(3)] == ["hybrid", "hybrid", "tcp"]
    assert _choose_transport("auto", 0, ["a", "a"]) == "shm"
    assert _choose_transport("auto", 0, ["a", "b"]) == "tcp"
    assert _choose_transport("tcp", 0, None) == "tcp"
    assert _choose_transport("shm", 0, None) == "shm"


A, B, C = ["10.0.0.0/30"], ["10.0.0.0/30", "10.0.0.4/30"], ["10.0.0.4/30"]


def test_hosts_shape_keeps_the_chain_of_hosts_with_two_ranks_each() -> None:
    # ranks 0,3 on mac A, 1,4 on B (the middle), 2,5 on C: rank-level adjacency alone is no chain
    nets = [A, B, C, A, B, C]
    assert shape_from_networks(nets).kind != "chain"
    shape = hosts_shape(nets, ["a", "b", "c", "a", "b", "c"])
    assert shape.kind == "chain" and shape.order in ([0, 3, 1, 4, 2, 5], [2, 5, 1, 4, 0, 3])


def test_hosts_shape_groups_ranks_of_two_hosts() -> None:
    shape = hosts_shape([A] * 4, ["x", "y", "x", "y"])
    assert shape.kind == "mesh" and shape.order == [0, 2, 1, 3]


COLLECTIVES = """
dist.init_process_group("thunderbolt", init_method="env://")
pg = dist.group.WORLD
t = pg._comm.t
W = WORLD
""" + EVERY_COLLECTIVE + """
# Same-host pairs only: shm moves the bytes, TCP moves none.
tcp0 = (t.link_kind("tcp").bytes_sent, t.link_kind("tcp").bytes_received)
shm0 = (t.link_kind("shm").bytes_sent, t.link_kind("shm").bytes_received)
mate = RANK ^ 1
for n in (1000, (1 << 18) + 3):
    for first in (0, 1):
        if RANK % 2 == first:
            dist.send(data(n, RANK), dst=mate, tag=3)
        else:
            got = torch.zeros(n)
            dist.recv(got, src=mate, tag=3)
            check(f"same-host send/recv {mate}->{RANK} {n}", got, data(n, mate))
same_host = {"tcp": [t.link_kind("tcp").bytes_sent - tcp0[0], t.link_kind("tcp").bytes_received - tcp0[1]],
             "shm": [t.link_kind("shm").bytes_sent - shm0[0], t.link_kind("shm").bytes_received - shm0[1]]}

every_collective()

# Receive from any source: one message from a same-host and one from another-host rank.
if RANK == 0:
    seen = []
    for _ in range(2):
        x = torch.zeros(10)
        src = dist.recv(x, tag=9)
        check(f"any-source from {src}", x, data(10, src))
        seen.append(src)
    if sorted(seen) != [1, 2]:
        bad.append(f"any-source senders {seen}")
elif RANK in (1, 2):
    dist.send(data(10, RANK), dst=0, tag=9)

check_barrier(0.3)
plans = [(key[0], p[0] if isinstance(p, tuple) else p) for key, p in pg._comm._plans.items()]
hier = sorted({op for op, p in plans if p.algo == "hier"})
result({"kind": t.kind, "order": pg._comm.shape.order, "bad": bad, "same_host": same_host,
        "tcp": [t.link_kind("tcp").bytes_sent, t.link_kind("tcp").bytes_received], "shm": [t.link_kind("shm").bytes_sent, t.link_kind("shm").bytes_received],
        "hier": hier})
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_every_collective_is_exact_and_same_host_bytes_stay_off_tcp(tmp_path) -> None:
    runs = run_hybrid(COLLECTIVES, 4, tmp_path, timeout=100)
    for run in runs:
        got = run.json()
        assert got["kind"] == "shm+tcp", got
        assert got["bad"] == [], (run.rank, got["bad"])
        assert got["same_host"]["tcp"] == [0, 0], (run.rank, got)
        one_each = 4 * (1000 + (1 << 18) + 3)  # one message of each size sent and one received
        assert got["same_host"]["shm"] == [one_each, one_each], (run.rank, got)
        assert min(got["tcp"]) > 0 and min(got["shm"]) > 0, (run.rank, got)
        assert got["order"] in ([0, 1, 2, 3], [2, 3, 0, 1], [1, 0, 3, 2], [3, 2, 1, 0]), got["order"]
        # the large all_reduce, all_gather, broadcast and reduce_scatter above ran hierarchically (and were
        # exact)
        assert got["hier"] == ["ag", "ar", "bc", "rs"], (run.rank, got["hier"])


KILL = """
dist.init_process_group("thunderbolt", init_method="env://")
x = torch.ones(SIZE)
def loop():
    for i in range(100000):
        if RANK == VICTIM and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
res = outcome(loop)
result(res)
os._exit(0)  # the group is broken; skip the orderly shutdown
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [256, 1 << 20])
def test_kill_9_gives_peer_lost_on_every_survivor(size: int, tmp_path) -> None:
    victim = 1  # shares emulated host 0 with rank 0; ranks 2 and 3 learn it over TCP
    script = KILL.replace("SIZE", str(size)).replace("VICTIM", str(victim))
    runs = run_hybrid(script, 4, tmp_path, timeout=100, expect_ok=False)
    assert runs[victim].returncode == -9
    for run in runs:
        if run.rank == victim:
            continue
        out = run.json()
        assert out["type"] == "PeerLostError", (run.rank, out)
        assert out["peer"] == victim, (run.rank, out)
        assert out["seconds"] < 10, (run.rank, out)


FORCED = """
dist.init_process_group("thunderbolt", init_method="env://")
x = torch.full((5,), float(RANK))
dist.all_reduce(x)
result({"kind": dist.group.WORLD._comm.t.kind, "sum": x.tolist()})
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_transport_tcp_forces_tcp_between_same_host_ranks_too(tmp_path) -> None:
    runs = run_hybrid(FORCED, 4, tmp_path, timeout=50, env={"THUNDERBOLT_TRANSPORT": "tcp"})
    for run in runs:
        assert run.json() == {"kind": "tcp", "sum": [6.0] * 5}, (run.rank, run.json())


@pytest.mark.timeout(60)
def test_a_rank_alone_on_its_host_uses_tcp_and_talks_to_hybrid_ranks(tmp_path) -> None:
    runs = run_hybrid(FORCED, 3, tmp_path, timeout=50)  # ranks 0, 1 share a host; rank 2 is alone
    kinds = [run.json()["kind"] for run in runs]
    assert kinds == ["shm+tcp", "shm+tcp", "tcp"], kinds
    assert all(run.json()["sum"] == [3.0] * 5 for run in runs)


STALL = """
from datetime import timedelta
dist.init_process_group("thunderbolt", init_method="env://", timeout=timedelta(seconds=2))
def op():
    if RANK == 3:
        time.sleep(5)
    dist.all_reduce(torch.ones(10))
res = outcome(op)
res["next"] = outcome(lambda: dist.all_reduce(torch.ones(10)))
result(res)
os._exit(0)
"""


@pytest.mark.timeout(60)
def test_stalled_rank_times_out_everywhere_and_the_group_stays_broken(tmp_path) -> None:
    runs = run_hybrid(STALL, 4, tmp_path, timeout=50, expect_ok=False)
    for run in runs[:3]:  # rank 1 shares a host with rank 0 only; rank 2 shares one with the stalled rank
        out = run.json()
        assert out["type"] == "CollectiveTimeout" and "did not arrive: [3]" in out["msg"], (run.rank, out)
        assert out["next"]["ok"] is False and out["next"]["seconds"] < 1, (run.rank, out)
    late = runs[3].json()
    assert late["next"]["ok"] is False and late["next"]["seconds"] < 5, late
