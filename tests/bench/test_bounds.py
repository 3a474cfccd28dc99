"""Every figure as a fraction of its bound, small ops against torch's own floor: the cable bound (pure),
the x floor and bound columns, the --floor and --cable-rate flags, the null backend, and a real run."""
import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torch_thunderbolt.bench import bounds, config, metrics, report, runner, spawn, spec, table
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GBIT = 10**9
PER_GBIT = GBIT / 8 / 1e9  # GB/s of one 1 Gbit/s cable in one direction
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def net(i: int) -> str:
    """The i-th cable's /30, as the lab (and tools that drop the Thunderbolt bridge) number them."""
    return f"10.213.0.{4 * i}/30"


def one_rank_per_host(nets):
    return nets, [f"mac{r}" for r in range(len(nets))]


RING3 = one_rank_per_host([[net(0), net(2)], [net(0), net(1)], [net(1), net(2)]])
CHAIN3 = one_rank_per_host([[net(0)], [net(0), net(1)], [net(1)]])
MESH4_EDGES = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
MESH4 = one_rank_per_host([[net(i) for i, e in enumerate(MESH4_EDGES) if r in e] for r in range(4)])
PAIR2 = one_rank_per_host([[net(0), net(1)], [net(0), net(1)]])
# Two ranks on mac0, one on mac1, one cable; every rank also reports loopback, which is no cable.
MIXED = ([[net(0), "127.0.0.0/8"], [net(0), "127.0.0.0/8"], [net(0), "127.0.0.0/8"]], ["mac0", "mac0", "mac1"])


# -- the cable bound -------------------------------------------------------------------------------------------
EQUAL_HOSTS = [
    (RING3, 2 * PER_GBIT, "2 cables x 1 Gbit/s per rank (ring of 3)"),
    (CHAIN3, 1 * PER_GBIT, "1 cable x 1 Gbit/s per rank (chain of 3)"),  # the ends set it
    (MESH4, 3 * PER_GBIT, "3 cables x 1 Gbit/s per rank (mesh of 4)"),
    (PAIR2, 2 * PER_GBIT, "2 cables x 1 Gbit/s per rank (pair of 2)"),
]


@pytest.mark.parametrize("cabling, gbps, text, op", [
    (*row, op) for row in EQUAL_HOSTS for op in COLLECTIVES
    if not (row[0] is CHAIN3 and op == "all_reduce")])  # test_chain_all_reduce_bound_... below
def test_cable_bound_one_rank_per_host_is_rate_times_least_cables(cabling, gbps, text, op):
    # nccl-tests' busbw factor makes every collective's bound the same: rate x the cables of a rank
    bound = bounds.cable_bound(op, *cabling, GBIT)
    assert bound == bounds.Bound(pytest.approx(gbps), bounds.CABLES, text)


CHAIN4 = one_rank_per_host([[net(0)], [net(0), net(1)], [net(1), net(2)], [net(2)]])


@pytest.mark.parametrize("cabling, n", [(CHAIN3, 3), (CHAIN4, 4)])
def test_chain_all_reduce_bound_is_set_by_the_ends_receiving_the_whole_result(cabling, n):
    # The ends have one cable each and must receive all of S over it: t >= S / rate, busbw = 2(n-1)/n x S/t.
    # The reduction's bytes over all cables (2(n-1) cables for 2(n-1) x S) give the same t here.
    # The per-rank bound of the equally cabled shapes (rate x 1 cable) is lower: a chain all_reduce that
    # lets the middle ranks reduce for the ends beats it (measured: 1.21 of it on a 1 Gbit/s lab chain).
    bound = bounds.cable_bound("all_reduce", *cabling, GBIT)
    assert bound.gbps == pytest.approx(PER_GBIT * 2 * (n - 1) / n)
    assert bound.description == f"1 cable x 1 Gbit/s on the host of rank 0, which must receive the whole result (chain of {n})"


def test_all_reduce_bound_of_unequal_hosts_where_the_reduction_binds():
    # Ring of 3 plus a fourth host hanging off rank 0: cables per host 3, 2, 2, 1. The end host must receive
    # S over 1 cable (t >= S/r); the reduction moves 6 S over 8 cables (t >= 3/4 S/r): the end binds.
    nets, _ = RING3
    star = one_rank_per_host([nets[0] + [net(3)], nets[1], nets[2], [net(3)]])
    assert [g.cables for g in bounds.host_cabling(*star)] == [3, 2, 2, 1]
    assert bounds.cable_bound("all_reduce", *star, GBIT).gbps == pytest.approx(PER_GBIT * 3 / 2)
    # Two such rings (hosts with 3 cables and 2) joined: 3, 3, 2, 2 -> 10 cables for 6 S: 5/3 < 2 binds.
    two = one_rank_per_host([[net(0), net(1), net(2)], [net(0), net(3), net(4)], [net(1), net(3)], [net(2), net(4)]])
    assert [g.cables for g in bounds.host_cabling(*two)] == [3, 3, 2, 2]
    ar = bounds.cable_bound("all_reduce", *two, GBIT)
    assert ar.gbps == pytest.approx(PER_GBIT * 10 / 6 * 3 / 2)
    assert ar.description.startswith("10 cables x 1 Gbit/s in all for the 2(h-1)/h of the buffer")


@pytest.mark.parametrize("cabling, cables", [(RING3, 1), (CHAIN3, 1), (MESH4, 1), (PAIR2, 2)])
def test_sendrecv_bound_is_the_cables_between_rank_0_and_1(cabling, cables):
    bound = bounds.cable_bound("sendrecv", *cabling, 10 * GBIT)
    assert bound.gbps == pytest.approx(cables * 10 * PER_GBIT)
    assert bound.description == (f"{cables} cable{'s' if cables > 1 else ''} x 10 Gbit/s between rank 0 and "
                                 "rank 1")


def test_sendrecv_without_a_direct_cable_has_no_bound():
    nets, hosts = CHAIN3
    reordered = ([nets[0], nets[2], nets[1]], hosts)  # rank 0 and rank 1 are the chain's two ends
    assert bounds.cable_bound("sendrecv", *reordered, GBIT) is None
    assert bounds.cable_bound("all_gather", *reordered, GBIT).gbps == pytest.approx(PER_GBIT)


def test_cables_between_counts_shared_networks_and_ignores_the_same_host_and_loopback():
    assert bounds.cables_between(*PAIR2) == [[0, 2], [2, 0]]
    assert bounds.cables_between(*RING3) == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    assert bounds.cables_between(*MIXED) == [[0, 0, 1], [0, 0, 1], [1, 1, 0]]
    assert [(g.ranks, g.cables) for g in bounds.host_cabling(*MIXED)] == [((0, 1), 1), ((2,), 1)]
    assert [g.cables for g in bounds.host_cabling(*CHAIN3)] == [1, 2, 1]


def test_mixed_hosts_share_their_cables_and_move_nothing_between_their_own_ranks():
    per = 10 * PER_GBIT
    ar = bounds.cable_bound("all_reduce", *MIXED, 10 * GBIT)
    # 2 hosts: each must send and receive the whole buffer once over its cable; busbw = algbw x 2(n-1)/n
    assert ar.gbps == pytest.approx(per * 4 / 3)
    assert ar.description == "1 cable x 10 Gbit/s on the host of ranks 0,1 (pair of 2 hosts, 3 ranks)"
    ag = bounds.cable_bound("all_gather", *MIXED, 10 * GBIT)
    # mac1 receives the 2/3 of the output that mac0 holds: algbw <= rate x 3/2, busbw x 2/3 -> rate
    assert ag.gbps == pytest.approx(per) and "host of rank 2 " in ag.description
    assert bounds.cable_bound("reduce_scatter", *MIXED, 10 * GBIT).gbps == pytest.approx(per)
    assert bounds.cable_bound("all_to_all", *MIXED, 10 * GBIT).gbps == pytest.approx(per)
    assert bounds.cable_bound("broadcast", *MIXED, 10 * GBIT).gbps == pytest.approx(per)
    assert bounds.cable_bound("sendrecv", *MIXED, 10 * GBIT) is None  # ranks 0 and 1 share a host


def test_mixed_hosts_with_one_rank_each_reduce_to_the_per_rank_bound():
    nets, _ = RING3
    two_each = ([nets[0], nets[0], nets[1], nets[1], nets[2], nets[2]], ["a", "a", "b", "b", "c", "c"])
    # 6 ranks on 3 hosts: busbw x (n-1)/n x h/(h-1) = 5/6 x 3/2 = 5/4 of the per-host cables
    assert bounds.cable_bound("all_reduce", *two_each, GBIT).gbps == pytest.approx(2 * PER_GBIT * 5 / 4)
    assert "ring of 3 hosts, 6 ranks" in bounds.cable_bound("all_reduce", *two_each, GBIT).description


def test_no_cable_bound_on_one_host_or_for_a_rank_without_cables():
    one_host = ([["127.0.0.0/8"], ["127.0.0.0/8"]], ["vm", "vm"])
    assert bounds.cable_bound("all_reduce", *one_host, GBIT) is None
    assert "one host" in bounds.missing_cables(*one_host)
    lonely = ([[net(0)], [net(0)], ["192.168.7.0/24"]], ["a", "b", "c"])
    assert bounds.cable_bound("all_reduce", *lonely, GBIT) is None
    assert bounds.missing_cables(*lonely).startswith("rank 2 shares no network")
    assert bounds.missing_cables(*RING3) is None


def test_a_network_shared_by_several_hosts_is_one_cable_each():
    lan = ([["192.168.1.0/24"]] * 3, ["a", "b", "c"])
    assert [g.cables for g in bounds.host_cabling(*lan)] == [1, 1, 1]
    assert bounds.cable_bound("all_reduce", *lan, GBIT).gbps == pytest.approx(PER_GBIT)


def test_cable_bound_inputs_must_match():
    with pytest.raises(ValueError, match="one network list and one host identity per rank"):
        bounds.cable_bound("all_reduce", [[net(0)]], ["a", "b"], GBIT)


# -- the one-host bounds and which bound a row gets ----------------------------------------------------------------
def test_link_and_memcpy_bounds():
    rec = {"streams": 4, "gbps": 3.0, "duplex_gbps": 2.0}
    assert bounds.link_bound("all_reduce", rec, 4) == bounds.Bound(
        2.0, bounds.TCP_LINK, "raw TCP at 4 streams, both directions at once")
    assert bounds.link_bound("sendrecv", rec, 4) == bounds.Bound(3.0, bounds.TCP_LINK, "raw TCP at 4 streams, one way")
    assert bounds.link_bound("all_reduce", {"gbps": 3.0}, 1).description == "raw TCP at 1 stream, one way"
    assert bounds.link_bound("all_reduce", None, 4) is None and bounds.link_bound("all_reduce", rec, None) is None
    m = bounds.memcpy_bound({"gbps": 40.0}, {"gbps": 44.0})
    assert m.gbps == pytest.approx(42.0) and m.kind == bounds.MEMCPY and "40.00 and 44.00 GB/s" in m.description
    assert bounds.memcpy_bound(None, None) is None


def test_choose_bound():
    cable, link, mem = (bounds.Bound(1.0, k, k) for k in bounds.BOUND_KINDS)
    assert bounds.choose_bound("tcp", False, cable, link, mem) is cable
    assert bounds.choose_bound("shm+tcp", False, cable, link, mem) is cable
    assert bounds.choose_bound("tcp", False, None, link, mem) is None  # between hosts only the cables bound
    assert bounds.choose_bound("tcp", True, cable, link, mem) is link
    assert bounds.choose_bound("shm", True, cable, link, mem) is mem
    assert bounds.choose_bound("auto", True, cable, link, mem) is None


@pytest.mark.parametrize("text, normalised", [("1gbit", "1gbit"), ("10Gbit/s", "10gbit"), (" 40GBIT ", "40gbit"),
                                              ("500mbit", "500mbit"), ("2.5gbit", "2.5gbit")])
def test_parse_cable_rate(text, normalised):
    assert bounds.parse_cable_rate(text) == normalised
    assert bounds.parse_cable_rate(None) is None


@pytest.mark.parametrize("text", ["fast", "10gb", "10", "0", "none", "", "-1gbit", "0gbit"])
def test_bad_cable_rate_is_a_config_error_naming_the_flag(text):
    with pytest.raises(ConfigError, match="bad --cable-rate .*expected a rate per cable and direction"):
        bounds.parse_cable_rate(text)


def test_format_rate():
    assert bounds.format_rate(10 * GBIT) == "10 Gbit/s"
    assert bounds.format_rate(2.5 * GBIT) == "2.5 Gbit/s"
    assert bounds.format_rate(5 * 10**8) == "500 Mbit/s"
    assert bounds.rate_bits("40gbit") == 40 * GBIT


# -- result rows: x floor and bound -------------------------------------------------------------------------------
def _result(backend="gloo", op="all_reduce", nbytes=4096, times=(100.0,), n=2, wrong=0, kind=None, transport="tcp"):
    lay = spec.layout(op, nbytes, 4, n)
    return metrics.make_result(backend, kind or backend.split("#")[0], op, lay, n, "float32", transport, list(times),
                               wrong)


def _floor(nbytes=4096, times=(4.0,), op="all_reduce"):
    return _result(spec.FLOOR_LABEL, op=op, nbytes=nbytes, times=times, kind=spec.NULL_BACKEND, transport="none")


def test_add_floor_divides_by_the_floor_at_the_same_op_and_size():
    gl, tb, fl = _result("gloo", times=[100.0]), _result("thunderbolt", times=[20.0]), _floor()
    big, broken = _result("gloo", nbytes=1 << 20, times=[1000.0]), _result("thunderbolt", times=[1.0], wrong=2)
    rows = [gl, tb, fl, big, broken, _floor(nbytes=1 << 20, times=[10.0])]
    metrics.add_floor(rows, spec.FLOOR_LABEL)
    assert (gl.floor_us, gl.x_floor) == (4.0, pytest.approx(25.0))
    assert tb.x_floor == pytest.approx(5.0) and big.x_floor == pytest.approx(100.0)
    assert fl.floor_us == 4.0 and fl.x_floor is None  # the floor is not a multiple of itself
    assert broken.floor_us == 4.0 and broken.x_floor is None  # a wrong result is not a number to compare


def test_the_floor_gets_no_ratio_unless_it_is_the_baseline():
    gl, fl = _result("gloo", times=[100.0]), _floor()
    metrics.add_ratios([gl, fl], "gloo")
    assert fl.ratio is None
    metrics.add_ratios([gl, fl], spec.FLOOR_LABEL)
    assert gl.ratio == pytest.approx(0.04)


def test_add_bounds_names_the_bound_and_the_fraction_reached():
    gl, broken, fl = _result("gloo", times=[1.0]), _result("thunderbolt", times=[1.0], wrong=1), _floor()
    bound = bounds.Bound(8.192, bounds.CABLES, "2 cables x 1 Gbit/s per rank (ring of 3)")
    metrics.add_bounds([gl, broken, fl], {"gloo": bound, "thunderbolt": bound})
    assert gl.bound_fraction == pytest.approx(gl.busbw_gbps / 8.192) and gl.bound_kind == "cables"
    assert broken.bound_kind == "cables" and broken.bound_fraction is None
    assert fl.bound_kind is None
    rec = gl.record()
    for key in ("floor_us", "x_floor", "bound_gbps", "bound_fraction", "bound_kind"):
        assert key in rec
    assert rec["bound_gbps"] == 8.192 and rec["bound_desc"].startswith("2 cables")


@pytest.mark.parametrize("x, text", [(None, "-"), (1.234, "1.23"), (42.42, "42.4"), (1234.5, "1234")])
def test_format_multiple(x, text):
    assert table.format_multiple(x) == text


def test_table_x_floor_and_bound_columns():
    rows = [_result("gloo", times=[100.0]), _result("gloo", nbytes=1 << 20, times=[1000.0])]
    floors = [_floor(), _floor(nbytes=1 << 20, times=[10.0])]
    metrics.add_floor(rows + floors, spec.FLOOR_LABEL)
    bound = bounds.Bound(0.25, bounds.CABLES, "2 cables x 1 Gbit/s per rank (ring of 3)")
    metrics.add_bounds(rows, {"gloo": bound})
    lines = table.format_table(rows, None, "tcp").splitlines()
    assert "x floor = time / the floor's" in lines[0]
    assert lines[0].endswith("; bound = busbw / 0.25 GB/s: 2 cables x 1 Gbit/s per rank (ring of 3)")
    assert lines[1].endswith("#wrong  x floor    bound")
    assert lines[2].rstrip().endswith("(time) (cables)")
    small, big = lines[3].split(), lines[4].split()
    assert small[-2:] == ["25.0", f"{rows[0].busbw_gbps / 0.25:.2f}"]
    assert big[-2] == "100"
    assert all(len(line) == len(lines[1]) for line in lines[3:5])  # rows line up with the header


def test_bound_from_the_link_replaces_the_eff_column():
    r = _result("gloo", times=[10.0])
    metrics.add_efficiency([r], {1: {"gbps": 2.0, "duplex_gbps": 1.0}}, {"gloo": 1})
    metrics.add_bounds([r], {"gloo": bounds.link_bound("all_reduce", {"gbps": 2.0, "duplex_gbps": 1.0}, 1)})
    text = table.format_table([r], None, "tcp")
    header = text.splitlines()[1]
    assert "bound" in header and "eff" not in header and "eff =" not in text
    assert "bound = busbw / 1 GB/s: raw TCP at 1 stream, both directions at once" in text
    assert r.bound_fraction == pytest.approx(r.efficiency)
    # a bound of another kind leaves the eff column where it was
    metrics.add_bounds([r], {"gloo": bounds.Bound(40.0, bounds.MEMCPY, "single-core memcpy")})
    assert "eff" in table.format_table([r], None, "tcp").splitlines()[1]


def test_floor_table_moves_nothing_and_checks_nothing():
    fl = _floor()
    text = table.format_table([fl], "gloo", "none")
    lines = text.splitlines()
    assert "the dispatch floor" in lines[0] and "ratio" not in lines[1] and "x floor" not in lines[1]
    assert lines[3].split()[-3:] == ["-", "-", "-"]  # no algbw, busbw, #wrong
    assert "not checked" in text and "Avg bus bandwidth" not in text
    assert "base" in table.format_table([fl], spec.FLOOR_LABEL, "none")  # asked for as the baseline


# -- flags ---------------------------------------------------------------------------------------------------------
def parse(*argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(list(argv)))


def test_floor_and_cable_rate_flags():
    cfg = parse()
    assert (cfg.floor, cfg.cable_rate) == (False, None)
    assert [b.label for b in config.measured_backends(cfg)] == ["thunderbolt", "gloo"]
    cfg = parse("--floor", "--cable-rate", "40Gbit/s", "--backends", "gloo")
    assert (cfg.floor, cfg.cable_rate, cfg.baseline) == (True, "40gbit", None)  # the floor is no default baseline
    assert config.measured_backends(cfg)[-1] == config.BackendSpec("floor", spec.NULL_BACKEND)
    assert parse(*config.to_argv(cfg)) == cfg
    assert parse("--floor", "--baseline", "floor").baseline == "floor"


@pytest.mark.parametrize("argv, message", [
    (["--cable-rate", "fast"], "bad --cable-rate 'fast'"),
    (["--backends", f"x={spec.NULL_BACKEND}"], "measured with --floor"),
    (["--floor", "--backends", "floor=gloo,gloo"], "label 'floor' is taken by --floor"),
    (["--baseline", "floor"], "--baseline 'floor' is not one of the measured backends"),
])
def test_bad_new_flags_name_the_problem(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_help_mentions_the_new_flags():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    text = parser.format_help()
    assert "--floor" in text and "--cable-rate RATE" in text and "x floor" in text


# -- the null backend in a world of one ------------------------------------------------------------------------------
@pytest.fixture
def null_world_of_one():
    from torch_thunderbolt.bench import null

    null.register()
    null.register()  # idempotent
    port = spawn.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.new_group(backend=spec.NULL_BACKEND)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_null_backend_does_nothing_and_is_not_checked(null_world_of_one):
    group = null_world_of_one
    assert group.name() == spec.NULL_BACKEND
    t = torch.full((4,), 3.0)
    work = dist.all_reduce(t, group=group, async_op=True)
    assert work.is_completed() and work.wait() and torch.equal(t, torch.full((4,), 3.0))
    assert work.get_future().wait() == [t]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        lay = spec.layout(op, 4096, 4, 1)
        fn = runner.OP_FUNCTIONS[op]
        quiet = runner.time_size(op, lay, [group], 0, 1, torch.float32, 1, 3, fn, checked=[False])
        assert quiet.wrong == [0] and all(t > 0 for t in quiet.times_us[0])
    # checked like a backend, it is caught computing nothing: the bench must never check it
    lay = spec.layout("all_gather", 4096, 4, 1)
    assert runner.time_size("all_gather", lay, [group], 0, 1, torch.float32, 0, 2,
                            runner.OP_FUNCTIONS["all_gather"]).wrong[0] > 0


# -- a real run --------------------------------------------------------------------------------------------------------
def bench(*argv, timeout=110):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)  # we are the spawner here, not a rank of someone else's job
    return subprocess.run([sys.executable, "-m", "torch_thunderbolt", "bench", *argv, "--timeout", "90"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_with_floor_link_and_memcpy(tmp_path):
    import torch_thunderbolt  # noqa: F401 - registers the backend when the core is present

    if "thunderbolt" not in dist.Backend.backend_list:
        pytest.skip("the thunderbolt backend is not registered (core not installed)")
    out = tmp_path / "bench.json"
    run = bench("--nproc", "2", "--floor", "--link", "--memcpy", "--ops", "all_reduce,sendrecv", "--sizes", "4K,1M",
                "-n", "3", "-w", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "with the dispatch floor (floor)" in text
    for op in ("all_reduce", "sendrecv"):
        assert f"# {op} on floor ({spec.NULL_BACKEND})" in text
    assert text.count("# Out of bounds values : 0 OK") == 4  # thunderbolt and gloo; the floor is not checked
    assert text.count("x floor = time / the floor's") == 4
    assert text.count("; bound = busbw / ") == 4
    assert "x floor" in text and "bound" in text
    doc = json.loads(out.read_text())
    assert report.validate_document(doc) == []
    results = [r for r in doc["results"] if r["op"] != "link_tcp"]
    assert len(results) == 12
    floors = {(r["op"], r["bytes"]): r["time_us"] for r in results if r["backend"] == "floor"}
    assert len(floors) == 4 and all(t > 0 for t in floors.values())
    for r in results:
        if r["backend"] == "floor":
            assert r["x_floor"] is None and r["bound_kind"] is None and r["ratio"] is None
            continue
        assert r["wrong"] == 0
        assert r["floor_us"] == floors[(r["op"], r["bytes"])]
        assert r["x_floor"] == pytest.approx(r["time_us"] / r["floor_us"]) and r["x_floor"] > 0
        # one host: shared memory against memcpy, TCP against the raw link
        assert r["bound_kind"] == ("memcpy" if r["transport"] == "shm" else "tcp_link"), r
        assert r["bound_gbps"] > 0 and 0 < r["bound_fraction"] < 10
        assert r["bound_fraction"] == pytest.approx(r["busbw_gbps"] / r["bound_gbps"])
    gloo = [r for r in results if r["backend"] == "gloo"]
    assert all(r["bound_fraction"] == pytest.approx(r["efficiency"]) for r in gloo)
    memcpy = doc["meta"]["memcpy"]
    mean = (memcpy["before"]["gbps"] + memcpy["after"]["gbps"]) / 2
    assert all(r["bound_gbps"] == pytest.approx(mean) for r in results if r["bound_kind"] == "memcpy")
    assert doc["meta"]["cabling"]["host_index"] == [0, 0]


# -- which bound each backend's rows get in a session (the cabling set as if discovered) -------------------------
def _session(cabling, *argv):
    import io

    from torch_thunderbolt.bench import app

    cfg = parse(*argv)
    n = len(cabling[0])
    env = config.RankEnv(0, n, 0, "127.0.0.1", 1)
    out = io.StringIO()
    session = app._Session(cfg, env, Config(streams=4), [None] * len(config.measured_backends(cfg)), out,
                           io.StringIO(), None)
    session.nets, session.host_ids = cabling
    return session, out


def test_session_bounds_between_hosts_are_the_cables_for_every_backend():
    session, out = _session(RING3, "--floor", "--cable-rate", "10gbit", "--backends", "thunderbolt,gloo")
    found = session._bound_of("all_reduce", {1: {"gbps": 1.0, "duplex_gbps": 1.0}})
    assert set(found) == {"thunderbolt", "gloo"}  # none for the floor
    assert all(b.kind == bounds.CABLES and b.gbps == pytest.approx(2 * 10 * PER_GBIT) for b in found.values())
    session._say_cabling()
    assert out.getvalue() == "# cabling: ring of 3 hosts, cables per host [2, 2, 2] at 10 Gbit/s per direction\n"


def test_session_bounds_on_one_host_follow_the_transport():
    one_host = ([["127.0.0.0/8"], ["127.0.0.0/8"]], ["vm", "vm"])
    session, out = _session(one_host, "--cable-rate", "10gbit", "--backends", "gloo")
    found = session._bound_of("all_reduce", {1: {"gbps": 2.0, "duplex_gbps": 1.5}})
    assert found["gloo"] == bounds.Bound(1.5, bounds.TCP_LINK, "raw TCP at 1 stream, both directions at once")
    session._say_cabling()
    assert "no cable bound, all ranks run on one host" in out.getvalue()
    session.transports["gloo"] = "shm"
    assert session._bound_of("all_reduce", {})["gloo"] is None  # no --memcpy figures yet
    session.memcpy_bound = bounds.memcpy_bound({"gbps": 10.0}, {"gbps": 12.0})
    assert session._bound_of("all_reduce", {})["gloo"].gbps == pytest.approx(11.0)
