"""The Llama-style decoder split by PyTorch's tensor parallelism (`llama.parallelize`, DTensor's
ColwiseParallel / RowwiseParallel over a 1-D DeviceMesh) on 2 ranks computes the whole model's logits:
a prompt and three decoded tokens through the KV cache, on the timed Apple-silicon GPU in exact mode, over
our backend, and over gloo through host copies (the bench's `gloo_staged` group, what the workload's gloo
rows use). Without the row-parallel all_reduces each rank's logits would be those of partial sums.

Emulated: the GPU (testing.apple_gpu, exact mode: every op computed as on the CPU)."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import tp_decoder

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("backend", ["thunderbolt", "gloo_staged"])
def test_dtensor_split_decoder_computes_the_whole_models_logits(tmp_path, backend):
    results = run_ranks(tp_decoder, 2, tmp_path, args=["logits_match"], env={"TP_BACKEND": backend}, timeout=150)
    for res in results:
        out = res.json()
        assert out["weight_type"] == "DTensor" and out["cache_kv_heads"] == 1  # tiny: 2 key/value heads over 2
        assert [s["shape"] for s in out["steps"]] == [[2, 5, 256]] + [[2, 1, 256]] * 3
        for step in out["steps"]:
            assert step["shape"] == step["want_shape"] and step["local_vocab"] == 128
            # Row-parallel sums add the two halves' products in another order: equal to float rounding.
            assert step["max_abs_diff"] <= 1e-5 * max(1.0, step["max_abs"]), step
            assert step["same_tokens"], step
