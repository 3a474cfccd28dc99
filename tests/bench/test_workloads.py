"""`bench --workload`: option parsing, the columns' arithmetic, the RDMA projection, the tables, and one
small end-to-end run per kind of workload."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_thunderbolt.bench import config as c
from torch_thunderbolt.bench.workloads import ddp, decode, table
from torch_thunderbolt.bench.workloads import spec as ws
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.testing.models import llama

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    parser = argparse.ArgumentParser()
    c.add_arguments(parser)
    return c.from_args(parser.parse_args(list(argv)))


def test_workload_defaults():
    vit = parse("--workload", "vit-ddp")
    assert (vit.device, vit.model, vit.batches, vit.ddp_hooks, vit.bucket_caps) == (
        "m2-ultra", "base", (32,), ("none",), (25.0,))
    assert (vit.iters, vit.warmup) == (ws.DEFAULT_ITERS, ws.DEFAULT_WARMUP)
    pp = parse("--workload", "llama-pp")
    assert (pp.model, pp.batches, pp.microbatches, pp.tokens) == ("llama8b", (1, 4), 1, 8)
    assert parse().workload is None and parse().iters == 20  # the collectives' defaults are untouched


def test_workload_options_parse_and_round_trip():
    cfg = parse("--workload", "vit-ddp", "--device", "cpu", "--ddp-hook", "none,int8,bf16", "--bucket-cap-mb",
                "25,100,2.5", "--batch", "16,64", "-n", "3", "-w", "0")
    assert cfg.ddp_hooks == ("none", "int8", "bf16") and cfg.bucket_caps == (25.0, 100.0, 2.5)
    assert cfg.batches == (16, 64) and (cfg.iters, cfg.warmup) == (3, 0)
    assert parse(*c.to_argv(cfg)) == cfg
    pp = parse("--workload", "llama-pp", "--batch", "4", "--microbatches", "2", "--tokens", "3", "--model", "tiny")
    assert parse(*c.to_argv(pp)) == pp
    assert parse("--workload", "llama-tp").tp_impl == "dtensor"
    tp = parse("--workload", "llama-tp", "--tp-impl", "manual", "--batch", "1")
    assert tp.tp_impl == "manual" and parse(*c.to_argv(tp)) == tp


@pytest.mark.parametrize("argv, message", [
    (["--ddp-hook", "int8"], "only apply with --workload"),
    (["--workload", "vit-ddp", "--sizes", "4K"], "--sizes do not apply"),
    (["--workload", "llama-pp", "--ops", "all_reduce"], "--ops do not apply"),
    (["--workload", "llama-tp", "--ddp-hook", "int8"], "--ddp-hook do not apply to --workload llama-tp"),
    (["--workload", "llama-tp", "--microbatches", "2"], "--microbatches do not apply"),
    (["--workload", "llama-pp", "--tp-impl", "manual"], "--tp-impl do not apply to --workload llama-pp"),
    (["--workload", "vit-ddp", "--tokens", "2"], "--tokens do not apply"),
    (["--workload", "vit-ddp", "--ddp-hook", "zip"], "unknown --ddp-hook 'zip'"),
    (["--workload", "vit-ddp", "--bucket-cap-mb", "25,0"], "bad --bucket-cap-mb entry '0'"),
    (["--workload", "llama-pp", "--batch", "6", "--microbatches", "4"], "--microbatches 4 does not divide"),
    (["--workload", "llama-pp", "--tokens", "0"], "--tokens 0"),
])
def test_bad_workload_flags_name_the_problem(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_tensor_parallel_world_must_divide_the_heads():
    c.validate_for_world(parse("--workload", "llama-tp"), 2)
    with pytest.raises(ConfigError, match="llama-tp over 3 ranks: .*kv_heads=8"):
        c.validate_for_world(parse("--workload", "llama-tp"), 3)


def test_shares():
    assert ws.exposed_share(step=1.0, compute=0.75) == pytest.approx(0.25)
    assert ws.exposed_share(step=0.9, compute=1.0) == 0.0  # noise: never negative
    assert ws.median_of_max([[1.0, 5.0, 2.0], [2.0, 1.0, 3.0]]) == 3.0  # max per iteration: 2, 5, 3


def test_ddp_summary_takes_the_slowest_rank_per_iteration():
    fast = ddp.Phases(compute=[0.10, 0.10, 0.10], step=[0.12, 0.12, 0.12], exchange=[0.08, 0.08, 0.08],
                      busy=[0.09] * 3)
    slow = ddp.Phases(compute=[0.10, 0.11, 0.10], step=[0.14, 0.15, 0.14], exchange=[0.08, 0.10, 0.08],
                      busy=[0.09] * 3)
    got = ddp.summarize([fast, slow], batch=8, world=2)
    assert got["step_s"] == pytest.approx(0.14) and got["compute_s"] == pytest.approx(0.10)
    assert got["exposed"] == pytest.approx(0.04 / 0.14)
    # per iteration 1 - (step - compute) / exchange: 0.5, 0.6, 0.5
    assert got["hidden"] == pytest.approx(0.5)
    assert got["images_per_s"] == pytest.approx(16 / 0.14)


def test_decode_summary_pipeline_sums_the_stages_tensor_parallel_does_not():
    a = decode.Phases(decode=[0.08, 0.08], compute=[0.03, 0.03], transfers=[0.01, 0.01], busy=[0.03, 0.03])
    b = decode.Phases(decode=[0.08, 0.09], compute=[0.04, 0.04], transfers=[0.01, 0.02], busy=[0.02, 0.02])
    case = decode.Case(batch=4, microbatches=1)
    pp = decode.summarize([a, b], "pp", case, tokens=4)
    assert pp["compute_ms_per_token"] == pytest.approx(70 / 4)
    assert pp["ms_per_token"] == pytest.approx(85 / 4)  # median of 0.08, 0.09
    assert pp["comm_ms_per_token"] == pytest.approx(15 / 4)
    assert pp["tokens_per_s"] == pytest.approx(4 * 4 / 0.085)
    assert pp["device_share"] == pytest.approx(0.05 / 0.07)
    assert decode.summarize([a, b], "tp", case, tokens=4)["compute_ms_per_token"] == pytest.approx(40 / 4)


def test_rdma_projection_arithmetic():
    # 2 ranks, 8 KB: 2 ring steps of 4 KB each at 15 Gbit/s, plus the latency per step, plus our CPU cost.
    per = ws.projected_rdma_op_us(8192, 2, cpu_us=40.0, latency_us=4.0, gbit=15.0)
    assert per == pytest.approx(40.0 + 2 * (4.0 + 4096 * 8 / 15e3))
    assert ws.projected_rdma_op_us(8192, 1) == 0.0
    traffic = ws.tp_traffic(layers=32, hidden=4096, batch=1, itemsize=2)
    assert (traffic.all_reduces, traffic.all_reduce_bytes, traffic.all_gathers) == (64, 8192, 1)
    ms = ws.projected_tp_comm_ms(traffic, 2, cpu_us=40.0)
    assert ms == pytest.approx((64 * ws.projected_rdma_op_us(8192, 2, 40.0)
                                + ws.projected_rdma_op_us(8, 2, 40.0)) / 1e3)


def test_speed_column_compares_each_case_with_the_baseline():
    rows = [{"backend": "thunderbolt", "batch": 1, "ms_per_token": 10.0},
            {"backend": "gloo", "batch": 1, "ms_per_token": 20.0},
            {"backend": "thunderbolt", "batch": 4, "ms_per_token": 30.0},
            {"backend": "rdma (projection)", "projection": True, "batch": 4, "ms_per_token": 15.0}]
    table.add_speed(rows, "gloo", "ms_per_token", ("batch",))
    assert rows[0]["speed"] == 2.0 and "speed" not in rows[1] and "speed" not in rows[2]
    assert "speed" not in rows[3]  # no gloo row at batch 4
    text = table.llama_table([dict(r, how="x", compute_ms_per_token=1.0, comm_ms_per_token=0.5, tokens_per_s=1.0)
                              for r in rows])
    assert "rdma (projection)" in text and "2.00x" in text


def test_tensor_parallel_shard_holds_its_share_of_every_layer():
    cfg = llama.make_config("tiny")
    whole = llama.build_stage(cfg, range(cfg.layers), True, True)
    half = llama.build_stage(cfg, range(cfg.layers), True, True, shards=2)
    layer = sum(p.numel() for p in whole.layers.parameters())
    norms = 2 * cfg.layers * cfg.hidden  # replicated on every shard
    assert sum(p.numel() for p in half.layers.parameters()) - norms == (layer - norms) // 2
    assert half.lm_head.out_features == cfg.vocab_size // 2
    calls = []
    for layer_ in half.layers:
        layer_.reduce = lambda x: calls.append(x.shape) or x
    out = half(torch.zeros((3, 1), dtype=torch.long), half.new_caches(3), 0)
    assert out.shape == (3, 1, cfg.vocab_size // 2) and calls == [(3, 1, cfg.hidden)] * (2 * cfg.layers)
    with pytest.raises(ValueError, match="kv_heads=2"):
        llama.check_shards(cfg, 4)


def bench(*argv, timeout=150):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "torch_thunderbolt", "bench", *argv, "--timeout", "120"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workload, device, extra", [
    ("vit-ddp", "fake", ["--ddp-hook", "none,bf16", "--batch", "2"]),
    ("llama-tp", "fake", ["--batch", "1", "--tokens", "2"]),
    ("llama-tp", "fake", ["--batch", "1", "--tokens", "2", "--tp-impl", "manual"]),
    ("llama-pp", "cpu", ["--batch", "2", "--microbatches", "2", "--tokens", "2"]),
])
def test_tiny_workload_on_two_ranks(tmp_path, workload, device, extra):
    out = tmp_path / "w.json"
    run = bench("--workload", workload, "--device", device, "--model", "tiny", "-n", "2", "-w", "1",
                "--json", str(out), *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert doc["meta"]["workload"] == workload and doc["meta"]["world_size"] == 2
    if workload == "llama-tp":
        impl = "manual" if "manual" in extra else "dtensor"
        assert doc["meta"]["model"]["tp_impl"] == impl and {r["tp_impl"] for r in doc["results"]} == {impl}
    measured = [r for r in rows if not r.get("projection")]
    assert {r["backend"] for r in measured} == {"thunderbolt", "gloo"}
    if workload == "vit-ddp":
        assert len(rows) == 4 and all(r["step_s"] > 0 and r["exchange_s"] > 0 for r in rows)
        assert {r["how"] for r in rows if r["hook"] == "none"} == {"device tensors", "host copy + gloo"}
    else:
        assert all(r["ms_per_token"] > 0 and r["comm_ms_per_token"] > 0 for r in measured)
        projected = [r for r in rows if r.get("projection")]
        assert len(projected) == (1 if workload == "llama-tp" else 0)
        assert "PROJECTED, NOT MEASURED" in run.stdout or not projected


def test_rows_paced_by_the_host_are_flagged():
    row = {"backend": "thunderbolt", "how": "device tensors", "batch": 1, "ms_per_token": 10.0,
           "compute_ms_per_token": 9.0, "comm_ms_per_token": 1.0, "tokens_per_s": 100.0,
           "device_busy_ms_per_token": 8.0, "device_share": 8.0 / 9.0}
    assert "HOST-BOUND" not in table.llama_table([row])
    slow_host = dict(row, device_busy_ms_per_token=1.0, device_share=1.0 / 9.0)
    assert "HOST-BOUND: in 1 row(s)" in table.llama_table([row, slow_host])
    assert "HOST-BOUND" not in table.llama_table([dict(row, device_busy_ms_per_token=0.0, device_share=0.0)])


def test_blocks_are_fused_only_in_timing_only_mode():
    from torch_thunderbolt.bench.workloads.device import Device

    marked = []

    def fuser(module):
        marked.append(module)
        return module

    lin = torch.nn.Linear(2, 2)
    timing = Device("m2-ultra", torch.device("cpu"), lambda: None, timed=True, timing_only=True, fuser=fuser)
    exact = Device("m2-ultra", torch.device("cpu"), lambda: None, timed=True, timing_only=False, fuser=fuser)
    assert timing.fuse(lin) is lin and marked == [lin]
    assert exact.fuse(lin) is lin and marked == [lin]  # exact mode: the module runs op by op
    cfg = llama.make_config("tiny")
    stage = llama.build_stage(cfg, range(cfg.layers), True, True, shards=2)
    marked.clear()
    decode._fuse(stage, timing, whole_layers=False)
    assert len(marked) == 3 + 4 * cfg.layers  # embed, norm, head; each layer's two norms and two halves
