"""Flags -> BenchConfig -> argv, backend naming, and the launcher environment."""
import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.bench import config as c
from torch_thunderbolt.errors import ConfigError


def parse(*argv):
    parser = argparse.ArgumentParser()
    c.add_arguments(parser)
    return c.from_args(parser.parse_args(list(argv)))


def test_defaults():
    cfg = parse()
    assert [b.label for b in cfg.backends] == ["thunderbolt", "gloo"]
    assert cfg.baseline == "gloo"
    assert cfg.ops == ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
    assert cfg.sizes == (4096, 65536, 1 << 20, 16 << 20, 64 << 20)
    assert (cfg.dtype, cfg.iters, cfg.warmup, cfg.nproc, cfg.link) == ("float32", 20, 5, 2, False)


def test_nccl_tests_flags():
    cfg = parse("-b", "8", "-e", "128M", "-f", "16", "-n", "7", "-w", "0", "-d", "half")
    assert cfg.sizes == (8, 128, 2048, 32768, 524288, 8388608, 134217728)
    assert (cfg.iters, cfg.warmup, cfg.dtype) == (7, 0, "float16")
    assert parse("-b", "1M").sizes == (1 << 20,)


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "4K", "-b", "8"], "either --sizes or -b/-e/-f"),
    (["--iters", "0"], "--iters 0"),
    (["--warmup", "-1"], "--warmup -1"),
    (["--backends", "gloo", "--baseline", "thunderbolt"], "--baseline 'thunderbolt'"),
    (["--backends", "a=gloo,a=gloo"], "duplicate backend label 'a'"),
    (["--backends", "gl oo"], "bad --backends entry"),
    (["--ops", "all_reduce,bogus"], "unknown op 'bogus'"),
    (["--dtype", "float8"], "unknown --dtype"),
    (["--timeout", "0"], "--timeout"),
    (["--link-streams", "1,0"], "link-streams"),
])
def test_bad_flags_name_the_problem(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_backend_labels():
    assert [(b.label, b.kind) for b in c.parse_backends("gloo,gloo,gloo")] == [
        ("gloo", "gloo"), ("gloo#2", "gloo"), ("gloo#3", "gloo")]
    assert [(b.label, b.kind) for b in c.parse_backends("a=gloo, b=Gloo")] == [("a", "gloo"), ("b", "gloo")]
    assert c.default_baseline(c.parse_backends("thunderbolt,gloo")) == "gloo"
    assert c.default_baseline(c.parse_backends("gloo,gloo")) == "gloo"
    assert c.default_baseline(c.parse_backends("gloo")) is None
    assert c.default_baseline(c.parse_backends("thunderbolt,mpi")) is None


def test_to_argv_round_trips_a_full_config():
    cfg = parse("--backends", "x=thunderbolt,gloo,gloo", "--baseline", "gloo#2", "--ops", "sendrecv,all_reduce",
                "--sizes", "4K,1M", "--iters", "3", "--warmup", "1", "--dtype", "bf16", "--link",
                "--link-streams", "1,8", "--link-bytes", "16M", "--link-repeats", "2", "--transport", "shm", "--memcpy",
                "--json", "out file.json", "--plot", "p.png", "--timeout", "12.5", "--no-progress", "--nproc", "3")
    assert cfg.memcpy and parse(*c.to_argv(cfg)) == cfg


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 1 << 34), min_size=1, max_size=5), iters=st.integers(1, 1000),
       warmup=st.integers(0, 50), streams=st.lists(st.integers(1, 64), min_size=1, max_size=4),
       link=st.booleans(), progress=st.booleans())
def test_to_argv_round_trips(sizes, iters, warmup, streams, link, progress):
    argv = ["--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--warmup", str(warmup),
            "--link-streams", ",".join(map(str, streams))]
    argv += ["--link"] if link else []
    argv += [] if progress else ["--no-progress"]
    cfg = parse(*argv)
    assert parse(*c.to_argv(cfg)) == cfg


def test_rank_env():
    assert c.rank_env({}) is None
    env = c.rank_env({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                      "LOCAL_RANK": "0"})
    assert env == c.RankEnv(1, 4, 0, "10.0.0.1", 29500)
    assert c.rank_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}).local_rank == 2


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "0"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "bad RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside WORLD_SIZE=2"),
])
def test_rank_env_errors(environ, message):
    with pytest.raises(ConfigError, match=message):
        c.rank_env(environ)


def test_the_backend_config_is_parsed_by_config_py_with_the_transport_flag_on_top():
    from torch_thunderbolt.config import Config

    assert c.backend_config(parse(), {}) == Config()  # the backend's own defaults
    assert c.backend_config(parse(), {"THUNDERBOLT_STREAMS": " 8 "}).streams == 8
    ours = c.backend_config(parse("--transport", "shm"), {"THUNDERBOLT_TRANSPORT": "tcp",
                                                           "THUNDERBOLT_LINK_TIMEOUT_MS": "5000"})
    assert (ours.transport, ours.link_timeout_ms) == ("shm", 5000)
    for bad in ("0", "four", "65"):  # the backend's own limits (1-64), not bench's
        with pytest.raises(ConfigError, match="THUNDERBOLT_STREAMS"):
            c.backend_config(parse(), {"THUNDERBOLT_STREAMS": bad})
    with pytest.raises(ConfigError, match="THUNDERBOLT_SHM_SLOT"):
        c.backend_config(parse(), {"THUNDERBOLT_SHM_SLOT": "3K"})


def test_validate_for_world():
    c.validate_for_world(parse("--ops", "all_reduce"), 1)
    with pytest.raises(ConfigError, match="sendrecv needs at least 2 ranks"):
        c.validate_for_world(parse(), 1)
    with pytest.raises(ConfigError, match="--link needs at least 2 ranks"):
        c.validate_for_world(parse("--ops", "all_reduce", "--link"), 1)
