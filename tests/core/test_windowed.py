"""The shared-window collectives (algorithms/windowed.py) over the in-memory window: round geometry,
ranks drifting apart, mismatched ops, late and dead peers. The reference grid runs in test_algorithms.py
("window" variants) and, over real shared memory, in tests/shm."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms import windowed
from torch_thunderbolt.errors import CollectiveTimeout, MismatchError, PeerLostError
from torch_thunderbolt.transport.memory import MemoryWindowMemory

from torch_thunderbolt.testing.worlds import memory_world as run_world


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("cap", [1, 3, 64])
def test_rounds_cover_every_element_once_within_the_cap(world: int, cap: int) -> None:
    for count in [0, 1, world - 1, world, 7, world * cap, world * cap + 1, 1000]:
        rounds = windowed.all_reduce_rounds(count, world, cap)
        assert len(rounds) == max(1, -(-count // (world * cap)))
        seen = []
        for slices in rounds:
            assert len(slices) == world
            for start, length in slices:
                assert 0 <= length <= cap
                seen.extend(range(start, start + length))
        assert seen == list(range(count)), (count, world, cap)


@pytest.fixture
def jitter(monkeypatch):
    """Every post sleeps a random moment first: ranks drift apart by up to a round, so a buffer reused too
    early (before every peer is done with it) would corrupt results."""
    post = MemoryWindowMemory.publish
    rng = random.Random(7)
    lock = threading.Lock()

    def slow(self, value, k, word):
        with lock:
            pause = rng.random() * 2e-4
        time.sleep(pause)
        post(self, value, k, word)

    monkeypatch.setattr(MemoryWindowMemory, "publish", slow)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_drifting_ranks_get_exact_results(world: int, jitter) -> None:
    sizes = [0, 1, 5, 33, 64, 257]

    def body(comm):
        out = []
        for i, n in enumerate(sizes * 2):
            g = torch.Generator().manual_seed(i * 10 + comm.rank)
            x = torch.randint(-50, 50, (n,), generator=g, dtype=torch.int32)
            comm.all_reduce(x, "sum")
            y = torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64)
            comm.broadcast(y, i % comm.world)
            counts = [n + p % 2 for p in range(comm.world)]
            z = torch.randint(-50, 50, (sum(counts),), generator=g, dtype=torch.int16)
            rs = torch.empty(counts[comm.rank], dtype=torch.int16)
            comm.reduce_scatter(rs, z, counts, "max")
            ag = torch.empty(sum(counts), dtype=torch.int16)
            comm.all_gather(ag, z[: counts[comm.rank]], counts)
            out.append((x, y, rs, ag))
        return out

    got = run_world(world, body, window_bytes=64)
    for i, n in enumerate(sizes * 2):
        xs, ys, zs = [], [], []
        counts = [n + p % 2 for p in range(world)]
        for r in range(world):
            g = torch.Generator().manual_seed(i * 10 + r)
            xs.append(torch.randint(-50, 50, (n,), generator=g, dtype=torch.int32))
            ys.append(torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64))
            zs.append(torch.randint(-50, 50, (sum(counts),), generator=g, dtype=torch.int16))
        for r in range(world):
            assert torch.equal(got[r][i][0], ref.all_reduce(xs, "sum")[r]), (i, n, r)
            assert torch.equal(got[r][i][1], ys[i % world]), (i, n, r)
            assert torch.equal(got[r][i][2], ref.reduce_scatter(zs, "max", counts)[r]), (i, n, r)
            assert torch.equal(got[r][i][3], torch.cat([zs[p][: counts[p]] for p in range(world)])), (i, n, r)


def _outcomes(world: int, body, **kw) -> list[BaseException | None]:
    """Each rank's exception (None if it returned)."""
    def guarded(comm):
        try:
            body(comm)
        except Exception as exc:  # noqa: BLE001 - returned for the assertions
            return exc
        return None

    return run_world(world, guarded, window_bytes=4096, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["count", "dtype", "two_roots", "all_reduce_vs_broadcast", "blocks",
                                  "gather_blocks"])
def test_a_peer_in_another_op_is_a_mismatch_naming_both_ranks(case: str) -> None:
    def body(comm):
        r = comm.rank
        if case == "count":
            comm.all_reduce(torch.ones(10 + r))
        elif case == "dtype":
            comm.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64))
        elif case == "blocks":  # the same total, split differently
            counts = [4, 6] if r == 0 else [5, 5]
            comm.reduce_scatter(torch.empty(counts[r]), torch.ones(10), counts)
        elif case == "gather_blocks":  # all_gather of the same total, split differently
            counts = [4, 6] if r == 0 else [5, 5]
            comm.all_gather(torch.empty(10), torch.ones(counts[r]), counts)
        elif case == "two_roots":  # a root returns at once; its next op finds the peer was a root too
            comm.broadcast(torch.ones(10), r)
            comm.all_reduce(torch.ones(3))
        else:
            x = torch.ones(10)
            comm.all_reduce(x) if r == 0 else comm.broadcast(x, 0)

    errors = _outcomes(2, body, comm_timeout=10)
    mismatches = [e for e in errors if isinstance(e, MismatchError)]
    assert mismatches, errors
    for e in mismatches:
        assert "rank 0" in str(e) and "rank 1" in str(e), e
    assert all(e is not None for e in errors), errors  # nobody returns as if it had worked


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named_in_the_timeout() -> None:
    def body(comm):
        if comm.rank != 2:
            comm.all_reduce(torch.ones(100))

    errors = _outcomes(3, body, comm_timeout=0.5)
    assert isinstance(errors[0], CollectiveTimeout) and "did not arrive: [2]" in str(errors[0]), errors
    assert errors[2] is None


@pytest.mark.timeout(60)
def test_a_peer_dying_mid_op_fails_the_waiters() -> None:
    def body(comm):
        if comm.rank == 1:
            comm.t.link_kind("memory").hub.kill(1)
            return
        comm.broadcast(torch.ones(5000), 1)

    errors = _outcomes(2, body, comm_timeout=20)
    assert isinstance(errors[0], PeerLostError) and errors[0].peer == 1, errors


@pytest.mark.timeout(60)
def test_a_slow_receiver_is_never_overrun(monkeypatch) -> None:
    """The root may run ahead by as many rounds as there are buffers, never more: rank 1 pauses after each
    round arrives and before it reads it, so a buffer reused one round too early would corrupt its copy."""
    check = windowed._check_words

    def slow(win, peers, k, word):
        if win.rank == 1:
            time.sleep(0.002)
        check(win, peers, k, word)

    monkeypatch.setattr(windowed, "_check_words", slow)
    data = torch.arange(400, dtype=torch.int64)

    def body(comm):
        x = data.clone() if comm.rank == 0 else torch.zeros(400, dtype=torch.int64)
        comm.broadcast(x, 0)
        return x

    for got in run_world(3, body, window_bytes=64):
        assert torch.equal(got, data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_the_kept_one_shot_all_reduce_is_exact_over_every_buffer_and_after_an_unchecked_broadcast(
        world: int) -> None:
    """Small all_reduces keep their views and op word per size, dtype and reduce op: the same object runs
    on each buffer in turn, and after a broadcast whose root returned without checking its peers."""
    ops = (("sum", torch.int32), ("max", torch.float64), ("sum", torch.float64))

    def body(comm):
        out = []
        for i in range(3 * windowed.BUFFERS):
            op, dtype = ops[i % len(ops)]
            x = (torch.arange(7, dtype=dtype) * (comm.rank + 1) + i) % 11
            comm.all_reduce(x, op)
            y = torch.full((5,), float(comm.rank))
            comm.broadcast(y, i % comm.world)  # its root comes to the next all_reduce with a round to settle
            out.append((x, y))
        assert len(comm._small_ops) == len(ops), comm._small_ops.keys()
        return out

    got = run_world(world, body, window_bytes=256)
    for i in range(3 * windowed.BUFFERS):
        op, dtype = ops[i % len(ops)]
        xs = [(torch.arange(7, dtype=dtype) * (r + 1) + i) % 11 for r in range(world)]
        for r in range(world):
            assert torch.equal(got[r][i][0], ref.all_reduce(xs, op)[r]), (i, r)
            assert torch.equal(got[r][i][1], torch.full((5,), float(i % world))), (i, r)


def test_reached_looks_at_least_once_and_spins_no_longer_than_asked() -> None:
    from torch_thunderbolt.transport.shm_window import CTL_BYTES, ShmWindowMemory, area_bytes

    areas = {p: memoryview(bytearray(area_bytes(64))) for p in range(3)}
    mem = ShmWindowMemory([0, 1, 2], 0, areas, 64, wake=lambda: None)
    assert CTL_BYTES < area_bytes(64)
    areas[1][:8].cast("Q")[0] = 5
    areas[2][:8].cast("Q")[0] = 4
    assert mem.reached([1], 5, 0)  # one look even when asked for none
    assert not mem.reached([1, 2], 5, 1000)  # rank 2 is behind: every look fails
    areas[2][:8].cast("Q")[0] = 9
    assert mem.reached([1, 2], 5, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_on_a_window_moves_nothing_over_the_links(world: int) -> None:
    """A group that shares one window gathers through it, in rounds when the blocks exceed a buffer."""
    counts = [70 + 9 * p for p in range(world)]  # int64: 560+ bytes a block, over a 256-byte window

    def body(comm):
        before = comm.t.bytes_sent
        out = torch.empty(sum(counts), dtype=torch.int64)
        comm.all_gather(out, torch.arange(counts[comm.rank], dtype=torch.int64) * (comm.rank + 1), counts)
        return out, comm.t.bytes_sent - before

    want = torch.cat([torch.arange(c, dtype=torch.int64) * (p + 1) for p, c in enumerate(counts)])
    for out, sent in run_world(world, body, window_bytes=256):
        assert torch.equal(out, want)
        assert sent == 0


def test_a_timeout_blames_the_members_furthest_behind_not_those_waiting_for_them() -> None:
    """A healthy member that has posted a step more than a stopped one, and waits for it, is named apart and
    never blamed (the survivors would leave it out of their shrink)."""
    from types import SimpleNamespace

    from torch_thunderbolt.algorithms.window import Window

    counters = {0: 7, 1: 6, 2: 5, 3: 6}  # members' posted steps: 0 waits for step 7; 2 is furthest behind
    win = object.__new__(Window)
    win.members = [10, 11, 12, 13]  # group ranks by position
    win.memory = SimpleNamespace(counter=lambda p: counters[p])
    win.engine = SimpleNamespace(rank=10)
    exc = win._timeout(7, [1, 2, 3], "all_reduce (op #3)")
    assert isinstance(exc, CollectiveTimeout) and exc.ranks == [12], exc
    assert "did not arrive: [12]; ranks [11, 13] were further on" in str(exc), exc
    counters[2] = 6  # all three at the same step: all three blamed
    assert win._timeout(7, [1, 2, 3], "op").ranks == [11, 12, 13]
