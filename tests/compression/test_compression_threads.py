"""compressed_all_reduce with W ranks played by threads (fast; the real-process tests are in _ranks)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.compression import compressed_all_reduce
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.testing.worlds import exchange_world

from .cmp_reference import check_within_bound


def _reduce_on_threads(inputs, mode, block, **kw):
    world = inputs.shape[0]

    def rank_fn(exchange):
        t = inputs[exchange.rank].clone()
        return compressed_all_reduce(t, mode, block_size=block, exchange=exchange, **kw)

    return exchange_world(world, rank_fn)


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 4),
    numel=st.integers(0, 1100),
    mode=st.sampled_from(["int8", "fp16", "bf16"]),
    block=st.sampled_from([1, 7, 64, 256]),
    seed=st.integers(0, 2**31),
)
def test_result_is_within_the_documented_bound_and_identical_on_all_ranks(world, numel, mode, block, seed):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes inside blocks make int8 lose small values: the bound must still hold.
    inputs = torch.randn(world, numel, generator=g) * torch.rand(world, numel, generator=g).pow(4) * 100
    results = _reduce_on_threads(inputs, mode, block)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    if world == 1:
        assert torch.equal(results[0], inputs[0])  # nothing to reduce: untouched
    else:
        check_within_bound(results[0], inputs, mode, block)


def test_average_divides_by_world_size():
    inputs = torch.arange(3 * 10, dtype=torch.float32).view(3, 10)
    results = _reduce_on_threads(inputs, "fp16", 256, average=True)
    assert torch.allclose(results[0], inputs.mean(dim=0), rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes_and_non_contiguous_tensors_are_reduced_in_place(dtype):
    base = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(3)).to(dtype)

    def rank_fn(exchange):
        t = base[exchange.rank].clone().t()  # non-contiguous view
        out = compressed_all_reduce(t, "int8", exchange=exchange)
        assert out is t and t.dtype == dtype
        return t.contiguous()

    results = exchange_world(2, rank_fn)
    exact = base.double().sum(dim=0).t()
    assert torch.allclose(results[0].double(), exact, atol=0.1)


def test_non_float_tensor_is_a_config_error():
    with pytest.raises(ConfigError, match="floating-point"):
        compressed_all_reduce(torch.ones(4, dtype=torch.int32), "int8", exchange=None)


def test_fp16_overflow_is_visible_as_inf():
    inputs = torch.full((2, 4), 40000.0)
    results = _reduce_on_threads(inputs, "fp16", 256)
    assert torch.isinf(results[0]).all()


def test_strided_one_dimensional_tensor():
    base = torch.arange(2 * 20, dtype=torch.float32).view(2, 20)

    def rank_fn(exchange):
        t = base[exchange.rank].clone()[::2]  # 1-D, stride 2
        compressed_all_reduce(t, "bf16", exchange=exchange)
        return t

    results = exchange_world(2, rank_fn)
    assert torch.allclose(results[0], base.sum(dim=0)[::2], rtol=1e-2)
