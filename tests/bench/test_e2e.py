"""The real command: spawned ranks over loopback, gloo only (the thunderbolt core is measured elsewhere)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.bench import report
from torch_thunderbolt.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def bench(*argv, timeout=100, **extra_env):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra_env)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)  # we are the spawner here, not a rank of someone else's job
    return subprocess.run([sys.executable, "-m", "torch_thunderbolt", "bench", *argv, "--timeout", "80"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_gloo_all_ops(tmp_path):
    out = tmp_path / "bench.json"
    run = bench("--nproc", "2", "--backends", "gloo", "--ops", "all", "--sizes", "4K,64K", "--iters", "3",
                "--warmup", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "sendrecv"):
        assert f"# {op} on gloo (gloo), world_size 2" in run.stdout
    assert run.stdout.count("# Out of bounds values : 0 OK") == 6
    doc = json.loads(out.read_text())
    assert report.validate_document(doc) == []
    results = doc["results"]
    assert len(results) == 12 and all(r["wrong"] == 0 and r["time_us"] > 0 for r in results)
    assert {r["bytes"] for r in results} == {4096, 65536}
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["iters"] == 3


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_interleaved_gloo_pair_with_link(tmp_path):
    out = tmp_path / "bench.json"
    run = bench("--nproc", "2", "--backends", "gloo,gloo", "--ops", "all_reduce,sendrecv", "--sizes", "4K",
                "--iters", "2", "--warmup", "0", "--link", "--link-bytes", "8M", "--link-streams", "1,2",
                "--link-repeats", "1", "--transport", "tcp", "--memcpy", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "# memcpy, 1 thread, 4096 B:" in run.stdout
    assert "# all_reduce on gloo#2 (gloo)" in run.stdout and "vs gloo" in run.stdout
    assert "raw TCP link rank 0 -> rank 1 at 127.0.0.1" in run.stdout
    doc = json.loads(out.read_text())
    assert report.validate_document(doc) == []
    links = [r for r in doc["results"] if r["op"] == "link_tcp"]
    assert [r["streams"] for r in links] == [1, 2] and all(r["gbps"] > 0 and r["latency_us"] > 0 for r in links)
    second = [r for r in doc["results"] if r["backend"] == "gloo#2"]
    assert len(second) == 2 and all(r["ratio"] is not None and r["efficiency"] is not None for r in second)
    assert doc["meta"]["transport"] == "tcp"
    assert doc["meta"]["memcpy"]["before"]["gbps"] > 0 and doc["meta"]["memcpy"]["after"]["gbps"] > 0


def test_unknown_backend_is_one_clean_error_before_spawning(capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["bench", "--nproc", "2", "--backends", "nosuch", "--ops", "all_reduce", "--sizes", "4K"]) == 2
    err = capsys.readouterr().err
    assert err.count("backend 'nosuch' is not registered with torch.distributed") == 1


def test_bad_flag_is_one_line_error(capsys):
    assert main(["bench", "--sizes", "4Q"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("torch-thunderbolt bench: error: bad size '4Q': expected a byte count like 4096, "
                           "4K, 64K, 1M, 256M or 1G")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_thunderbolt_side_by_side_with_gloo(tmp_path):
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - registers the backend when the core is present

    if "thunderbolt" not in dist.Backend.backend_list:
        pytest.skip("the thunderbolt backend is not registered (core not installed)")
    out = tmp_path / "bench.json"
    run = bench("--nproc", "2", "--backends", "thunderbolt,gloo", "--ops", "all", "--sizes", "4K,64K",
                "--iters", "2", "--warmup", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    ours = [r for r in results if r["backend"] == "thunderbolt"]
    assert len(ours) == 12 and all(r["wrong"] == 0 and r["ratio"] is not None for r in ours)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_backend_runs_with_the_settings_bench_hands_it(tmp_path):
    """--transport reaches the measured groups as their options (a Config), not through the environment: it
    wins over THUNDERBOLT_TRANSPORT, which the rest of the run's settings still come from."""
    import torch_thunderbolt  # noqa: F401 - registers the backend

    out = tmp_path / "bench.json"
    run = bench("--nproc", "2", "--backends", "thunderbolt", "--ops", "all_reduce", "--sizes", "4K", "--iters", "1",
                "--warmup", "0", "--transport", "tcp", "--json", str(out), THUNDERBOLT_TRANSPORT="shm",
                THUNDERBOLT_STREAMS="3")
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert {r["transport"] for r in doc["results"]} == {"tcp"}  # what the group's engine holds
    assert doc["meta"]["transport"] == "tcp" and doc["meta"]["thunderbolt_streams"] == 3
    bad = bench("--nproc", "2", "--backends", "thunderbolt", "--ops", "all_reduce", "--sizes", "4K",
                THUNDERBOLT_STREAMS="0")
    assert bad.returncode != 0 and bad.stderr.count("THUNDERBOLT_STREAMS") == 1  # once, before any rank starts
