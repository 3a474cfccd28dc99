"""Each example runs end to end on 2 gloo ranks in a tiny configuration (correctness, not speed)."""
from __future__ import annotations

import math

import pytest

from .helpers import run_example, run_json

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(90)
def test_seed_example_under_torchrun():
    res = run_example(["-m", "torch.distributed.run", "--nproc-per-node", "2", "seed_example.py",
                       "--backend", "gloo"], timeout=80)
    assert res.returncode == 0, res.stderr
    assert "Output shape: torch.Size([32, 512])" in res.stdout
    assert "max |split - whole model| = 0" in res.stdout


@pytest.mark.timeout(90)
def test_pipeline_tokens_equal_single_process(tmp_path):
    out = run_json(["pipeline_inference.py", "--backend", "gloo", "--nproc", "2", "--preset", "tiny",
                    "--tokens", "10", "--batch", "1", "3", "--pingpong", "3"], tmp_path / "p.json", 80)
    runs = {(r["mode"], r["batch"]): r for r in out["runs"]}
    assert set(runs) == {("1-process", 1), ("pipeline", 1), ("1-process", 3), ("pipeline", 3)}
    for batch in (1, 3):
        ref, pipe = runs["1-process", batch], runs["pipeline", batch]
        assert len(ref["tokens"]) == batch and all(len(t) == 10 for t in ref["tokens"])
        assert pipe["tokens"] == ref["tokens"] and pipe["tokens_equal"] is True
        assert len(pipe["comm_share_per_rank"]) == 2
        assert all(0 <= s <= 1 for s in pipe["comm_share_per_rank"])
    assert out["layers_per_stage"] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_pipeline_three_stages_with_microbatches(tmp_path):
    out = run_json(["pipeline_inference.py", "--backend", "gloo", "--nproc", "3", "--preset", "tiny",
                    "--layers", "5", "--tokens", "6", "--batch", "2", "--microbatches", "2",
                    "--pingpong", "0"], tmp_path / "p.json", 80)
    ref, pipe = out["runs"]
    assert pipe["stages"] == 3 and pipe["microbatches"] == 2
    assert pipe["tokens"] == ref["tokens"]
    assert out["layers_per_stage"] == [2, 2, 1]


@pytest.mark.timeout(90)
def test_vit_ddp_loss_is_finite_and_decreases(tmp_path):
    out = run_json(["train_vit.py", "--backend", "gloo", "--nproc", "2", "--preset", "tiny",
                    "--steps", "7", "--nosync-steps", "1", "--seed", "0"], tmp_path / "v.json", 80)
    losses = out["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
    assert out["world_size"] == 2 and out["params"] == 150346
    assert 0 <= out["comm_busy_share"] <= 1 and out["step_ms_median"] > 0


@pytest.mark.timeout(60)
def test_allreduce_only_mode(tmp_path):
    out = run_json(["train_vit.py", "--backend", "gloo", "--nproc", "2", "--allreduce-only",
                    "--numel", "300000", "--steps", "2"], tmp_path / "a.json", 50)
    assert out["mode"] == "allreduce-only" and out["bytes"] == 1_200_000
    assert len(out["ms"]) == 2 and out["busbw_GBps"] > 0


@pytest.mark.timeout(30)
def test_bad_arguments_exit_2_with_one_clear_line():
    res = run_example(["pipeline_inference.py", "--backend", "gloo", "--batch", "2", "--microbatches", "3"],
                      timeout=25)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --microbatches 3 exceeds the smallest --batch 2"


def thunderbolt_registered() -> bool:
    try:
        import torch.distributed as dist  # noqa: PLC0415

        import torch_thunderbolt  # noqa: F401, PLC0415
    except ImportError:
        return False
    return "thunderbolt" in dist.Backend.backend_list


needs_thunderbolt = pytest.mark.skipif(not thunderbolt_registered(),
                                       reason="torch_thunderbolt is not importable or registers no backend")


@needs_thunderbolt
@pytest.mark.timeout(90)
def test_pipeline_on_thunderbolt_matches_single_process(tmp_path):
    out = run_json(["pipeline_inference.py", "--backend", "thunderbolt", "--nproc", "2", "--preset", "tiny",
                    "--tokens", "6", "--batch", "2", "--microbatches", "2", "--pingpong", "2"],
                   tmp_path / "p.json", 80)
    ref, pipe = out["runs"]
    assert out["backend"] == "thunderbolt" and pipe["tokens"] == ref["tokens"]


@needs_thunderbolt
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_vit_ddp_on_thunderbolt_learns(tmp_path):
    out = run_json(["train_vit.py", "--backend", "thunderbolt", "--nproc", "2", "--preset", "tiny",
                    "--steps", "5", "--nosync-steps", "0"], tmp_path / "v.json", 80)
    losses = out["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@needs_thunderbolt
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_vit_ddp_on_the_fake_mps_device_trains_as_on_the_cpu(tmp_path):
    """`--device mps` on a machine without one, through the fake accelerator that stands in for it: the same
    losses as on the CPU, up to the attention kernel (torch runs SDPA's math path on any non-CPU device)."""
    common = ["train_vit.py", "--backend", "thunderbolt", "--nproc", "2", "--preset", "tiny", "--steps", "4",
              "--nosync-steps", "0", "--seed", "0"]
    cpu = run_json([*common, "--device", "cpu"], tmp_path / "cpu.json", 90)
    dev = run_json([*common, "--device", "mps", "--fake-mps"], tmp_path / "dev.json", 90)
    assert cpu["device"] == "cpu" and dev["device"] == "tbfake"
    assert dev["losses"] == pytest.approx(cpu["losses"], rel=1e-5)
    assert dev["losses"][-1] < dev["losses"][0]
