"""The timed loop in one process (world size 1 over gloo): checking catches broken ops."""
import datetime
import io
import time

import pytest
import torch
import torch.distributed as dist

from torch_thunderbolt.bench import app, runner, spawn, spec
from torch_thunderbolt.bench.config import BackendSpec, BenchConfig, RankEnv


@pytest.fixture
def gloo_world_of_one():
    port = spawn.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield [dist.new_group(backend="gloo"), dist.new_group(backend="gloo")]
    finally:
        dist.destroy_process_group()


def _time(op, groups, fn, iters=3, step=lambda: None):
    lay = spec.layout(op, 4096 + 12, 4, 1)
    return runner.time_size(op, lay, groups, 0, 1, torch.float32, 1, iters, fn, step)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"])
def test_real_ops_are_right(gloo_world_of_one, op):
    steps = []
    result = _time(op, gloo_world_of_one, runner.OP_FUNCTIONS[op], step=lambda: steps.append(1))
    assert result.wrong == [0, 0]
    assert all(t > 0 for row in result.times_us for t in row) and len(result.times_us[0]) == 3
    reduced = runner.reduce_over_ranks(result, None)
    assert reduced.times_us == result.times_us and reduced.wrong == [0, 0]
    assert len(steps) == 1 + 3  # one progress step per iteration, warmup included


@pytest.mark.timeout(60)
def test_a_block_of_small_ops_starts_after_one_untimed_call(gloo_world_of_one, monkeypatch):
    """The first call after the control barrier absorbs the ranks' skew leaving it: in a block of calls it
    is not timed; a single call (a check iteration, or a large message) is timed as it is."""
    barrier = dist.barrier
    fresh = []

    def marking_barrier(*args, **kwargs):
        fresh.append(True)
        return barrier(*args, **kwargs)

    def slow_after_barrier(group, b, rank):
        if fresh:
            fresh.clear()
            time.sleep(0.02)
        dist.all_reduce(b.out, group=group)

    monkeypatch.setattr(runner.dist, "barrier", marking_barrier)
    times = _time("all_reduce", gloo_world_of_one, slow_after_barrier).times_us
    assert runner.block_size(4096 + 12) > 1
    for row in times:
        assert row[0] >= 20_000 and row[2] >= 20_000, row  # check iterations: one timed call each
        assert row[1] < 20_000 / runner.block_size(4096 + 12), row  # a block: the slow call was not timed


@pytest.mark.timeout(60)
def test_broken_op_is_caught(gloo_world_of_one):
    def off_by_one(group, b, rank):
        dist.all_reduce(b.out, group=group)
        b.out[7] += 1

    def does_nothing(group, b, rank):
        pass

    assert _time("all_reduce", gloo_world_of_one, off_by_one).wrong == [2, 2]  # one per check iteration
    assert _time("all_gather", gloo_world_of_one, does_nothing).wrong[0] > 0


@pytest.mark.timeout(60)
def test_raising_op_names_op_and_group(gloo_world_of_one):
    def boom(group, b, rank):
        raise RuntimeError("unsupported")

    with pytest.raises(runner.OpFailedError, match="all_reduce of 4108 B failed: unsupported") as info:
        _time("all_reduce", gloo_world_of_one, boom)
    assert info.value.group_index == 0


def test_check_iterations_and_own_time():
    assert runner.check_iterations(5, 20) == {5, 24}
    assert runner.check_iterations(0, 1) == {0}
    assert runner.own_time_us("sendrecv", 0, 10_000) == 5.0
    assert runner.own_time_us("sendrecv", 1, 10_000) == 0.0
    assert runner.own_time_us("all_reduce", 1, 10_000) == 10.0


@pytest.mark.timeout(60)
def test_run_rank_fails_the_run_on_wrong_results(monkeypatch):
    port = spawn.free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cfg = BenchConfig(backends=(BackendSpec("a", "gloo"), BackendSpec("b", "gloo")), baseline="a",
                      ops=("all_reduce",), sizes=(4096,), iters=2, warmup=0, progress=False)

    def wrong_on_group_b(group, b, rank):
        dist.all_reduce(b.out, group=group)
        if group is groups_seen[1]:
            b.out.zero_()

    groups_seen = []
    real_new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda **kw: groups_seen.append(real_new_group(**kw)) or groups_seen[-1])
    out, err = io.StringIO(), io.StringIO()
    code = app.run_rank(cfg, RankEnv(0, 1, 0, "127.0.0.1", port), out, err, {"all_reduce": wrong_on_group_b})
    assert code == 1
    assert "# Out of bounds values : 2048 FAILED" in out.getvalue()  # 1024 elements x 2 check iterations
    assert "# Out of bounds values : 0 OK" in out.getvalue()
    assert "1 result(s) had wrong values" in err.getvalue()
    assert not dist.is_initialized()
