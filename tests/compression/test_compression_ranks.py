"""Real processes over loopback, on gloo and on thunderbolt: the compressed all-reduce and the DDP hooks.

One set of 3 ranks per backend runs every experiment (module fixture); each test checks one behaviour.
The int8/fp16/bf16 error bounds are asserted inside the ranks, element by element.
"""
import json

import pytest
import torch

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import suite

pytestmark = pytest.mark.multiprocess

WORLD = 3
SIZES = [0, 1, 2, 7, 255, 256, 257, 3 * 256 + 5, 5000]
CASES = [(mode, n, 256) for mode in ("int8", "fp16", "bf16") for n in SIZES]
CASES += [("int8", 1000, 1), ("int8", 1000, 100), ("none", 100, 256)]
HOOK_STEPS, EF_STEPS = 5, 30


def _backend_available(name: str) -> bool:
    import torch.distributed as dist

    if name == "thunderbolt":
        try:
            import torch_thunderbolt  # noqa: F401  (registers the backend)
        except Exception:  # noqa: BLE001 - any import failure means: not available here
            return False
    return name in dist.Backend.backend_list


@pytest.fixture(scope="module", params=["gloo", "thunderbolt"])
def runs(request, tmp_path_factory):
    if not _backend_available(request.param):
        pytest.skip(f"backend {request.param!r} is not registered in this environment")
    env = {"TEST_BACKEND": request.param, "TEST_CASES": json.dumps(CASES), "TEST_HOOK_STEPS": str(HOOK_STEPS),
           "TEST_EF_STEPS": str(EF_STEPS)}
    return [res.saved() for res in run_ranks(suite, WORLD, tmp_path_factory.mktemp(request.param), env=env,
                                             timeout=100)]


@pytest.mark.timeout(120)
def test_compressed_all_reduce_is_within_bound_and_identical_on_all_ranks(runs):
    per_rank = [r["allreduce"] for r in runs]
    for case, *results in zip(CASES, *per_rank):
        assert results[0].shape == (case[1],)
        assert all(torch.equal(results[0], r) for r in results[1:]), f"ranks disagree on {case}"


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.timeout(120)
def test_ddp_hooks_track_uncompressed_ddp(runs):
    hooks = [r["hooks"] for r in runs]
    assert _max_diff(hooks[0]["int8"], hooks[-1]["int8"]) == 0, "DDP replicas diverged"
    run = hooks[0]
    moved = _max_diff(run["reference"], run["start"])
    assert moved > 1e-3
    for name, tol in [("int8", 0.05), ("int8-noef", 0.05), ("fp16", 0.002), ("bf16", 0.02)]:
        diff = _max_diff(run[name], run["reference"])
        assert diff <= tol * moved, f"{name}: params off by {diff:.3g} (training moved them {moved:.3g})"
    # The hooks really ran: int8 rounding leaves a trace in the parameters.
    assert _max_diff(run["int8"], run["reference"]) > 0


@pytest.mark.timeout(120)
def test_error_feedback_keeps_the_accumulated_update_on_track(runs):
    drift = runs[0]["drift"]
    # Without EF the small entries are lost every step: drift = steps * 0.003.
    assert drift[False] == pytest.approx(EF_STEPS * 0.003, rel=0.05)
    # With EF the loss is repaid: drift stays within about one int8 step of the largest value.
    assert drift[True] < 2 * (1.0 / 127), drift
    assert drift["residuals-True"] == 1 and drift["residuals-False"] == 0


@pytest.mark.timeout(120)
def test_async_failure_reaches_the_waiter_and_does_not_block_later_reductions(runs):
    for r in runs:
        assert "broken codec" in r["async"]["error"]
        assert torch.equal(r["async"]["after"], torch.full((600,), float(WORLD)))
