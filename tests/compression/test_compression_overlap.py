"""The pipelined compressed all-reduce: issue orders, piece cuts, results and failures (threads as ranks)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.compression import compressed_all_reduce
from torch_thunderbolt.compression.scheme import pipeline_pieces
from torch_thunderbolt.compression.overlap import exchange_order
from torch_thunderbolt.testing.worlds import exchange_world

from .cmp_reference import check_within_bound


@pytest.mark.parametrize("pieces", [1, 2, 3, 6])
def test_exchange_order_issues_every_exchange_once_and_each_gather_after_its_scatter(pieces):
    order = exchange_order(pieces)
    assert sorted(order) == sorted([("a2a", k) for k in range(pieces)] + [("ag", k) for k in range(pieces)])
    for k in range(pieces):
        assert order.index(("a2a", k)) < order.index(("ag", k))
        if k + 1 < pieces:  # the next scatter is on the wire before this gather waits for its reduce
            assert order.index(("a2a", k + 1)) < order.index(("ag", k))


@pytest.mark.parametrize("numel,piece,count", [(0, 4, 1), (7, 4, 1), (8, 4, 2), (11, 4, 2), (100, 7, 14)])
def test_pipeline_pieces_cover_numel_with_near_equal_pieces(numel, piece, count):
    bounds = pipeline_pieces(numel, piece)
    assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert numel < piece or min(sizes) >= piece


def _reduce(inputs, mode, block, piece, **kw):
    def rank_fn(exchange):
        t = inputs[exchange.rank].clone()
        return compressed_all_reduce(t, mode, block_size=block, exchange=exchange, piece_elements=piece, **kw)

    return exchange_world(inputs.shape[0], rank_fn)


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(2, 4),
    numel=st.integers(0, 1200),
    piece=st.sampled_from([1, 5, 64, 300]),
    mode=st.sampled_from(["int8", "fp16", "bf16"]),
    block=st.sampled_from([7, 64]),
    seed=st.integers(0, 2**31),
)
def test_pipelined_result_is_within_the_bound_and_identical_on_all_ranks(world, numel, piece, mode, block, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(world, numel, generator=g) * torch.rand(world, numel, generator=g).pow(4) * 100
    results = _reduce(inputs, mode, block, piece)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    for a, b in pipeline_pieces(numel, piece):  # blocks and shards are cut per piece
        check_within_bound(results[0][a:b], inputs[:, a:b], mode, block)


def test_pipelined_equals_one_unpipelined_all_reduce_per_piece():
    inputs = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5))
    piped = _reduce(inputs, "int8", 64, 100)[0]
    expected = torch.cat([_reduce(inputs[:, a:b].contiguous(), "int8", 64, 10**9)[0]
                          for a, b in pipeline_pieces(1000, 100)])
    assert torch.equal(piped, expected)


def test_average_and_non_fp32_tensors_go_through_the_pipeline():
    inputs = torch.randn(2, 999, generator=torch.Generator().manual_seed(6)).double()
    results = _reduce(inputs, "fp16", 64, 100, average=True)
    assert results[0].dtype == torch.float64
    assert torch.allclose(results[0], inputs.mean(dim=0), atol=5e-3)


class _FailingExchange:
    """Rank-local exchange whose all_to_all fails on its second call (the second piece)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size, self.calls = world_size, 0

    def all_to_all(self, out, inp):
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("peer 1 lost in piece 1")
        out.copy_(inp)

    def all_gather(self, out, inp):
        out.copy_(inp.expand_as(out))


def test_an_exchange_error_reaches_the_caller_and_no_thread_is_left():
    import threading

    t = torch.randn(1000)
    with pytest.raises(ConnectionError, match="piece 1"):
        compressed_all_reduce(t, "int8", exchange=_FailingExchange(), piece_elements=100)
    assert not [th for th in threading.enumerate() if th.name == "tb-compress-exchange"]
