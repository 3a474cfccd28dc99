"""Pure parts: layout math, wire bytes, codecs, the launch orderer, the mode parser."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.compression import (
    Int8Codec,
    chunk_bytes,
    chunk_layout,
    codec_for,
    dequantize_int8,
    mode_from_env,
    quantize_int8,
    wire_bytes,
)
from torch_thunderbolt.compression.pipeline import OrderedLauncher
from torch_thunderbolt.errors import ConfigError


@pytest.mark.parametrize("numel,world", [(0, 2), (1, 2), (1, 3), (7, 3), (256, 2), (257, 2), (1000, 3)])
def test_layout_covers_numel_with_less_than_one_element_per_rank_of_padding(numel, world):
    layout = chunk_layout(numel, world)
    assert layout.padded >= numel
    assert layout.padded - numel < world
    assert layout.padded == world * layout.shard


def test_wire_bytes_formulas():
    # 2 ranks, 1024 elements: each rank sends one shard of 512 twice.
    assert wire_bytes(1024, "int8", 2, 256) == 2 * (512 + 4 * 2)
    assert wire_bytes(1024, "fp16", 2) == 2 * 1024
    assert wire_bytes(1024, "bf16", 2) == 2 * 1024
    assert wire_bytes(1024, "none", 2) == 4 * 1024
    # 3 ranks, 1000 elements: shards of 334, int8 blocks of 256 -> 2 scales per shard.
    assert wire_bytes(1000, "int8", 3, 256) == 2 * 2 * (334 + 8)
    assert chunk_bytes(334, "int8", 256) == 342
    assert wire_bytes(0, "int8", 4) == 0
    assert wire_bytes(10**6, "int8", 1) == 0


def test_int8_is_about_a_quarter_of_fp32_on_large_tensors():
    n = 22_000_000  # ~86 MB of fp32 gradients, the ViT-B/16 case
    ratio = wire_bytes(n, "int8", 2) / wire_bytes(n, "none", 2)
    assert 0.25 < ratio < 0.26


@pytest.mark.parametrize("bad", ["int4", "", "fp32", None])
def test_bad_mode_is_a_config_error_naming_the_choices(bad):
    with pytest.raises(ConfigError, match="none, int8, fp16, bf16"):
        wire_bytes(10, bad, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_block_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="block size"):
        codec_for("int8", bad)


def test_mode_from_env():
    assert mode_from_env({}) == ("none", 256)
    assert mode_from_env({"THUNDERBOLT_COMPRESSION": "INT8"}) == ("int8", 256)
    assert mode_from_env({"THUNDERBOLT_COMPRESSION": "bf16", "THUNDERBOLT_COMPRESSION_BLOCK": "64"}) == ("bf16", 64)
    with pytest.raises(ConfigError, match="THUNDERBOLT_COMPRESSION_BLOCK"):
        mode_from_env({"THUNDERBOLT_COMPRESSION": "int8", "THUNDERBOLT_COMPRESSION_BLOCK": "big"})
    with pytest.raises(ConfigError, match="got 'int9'"):
        mode_from_env({"THUNDERBOLT_COMPRESSION": "int9"})


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3),
    shard=st.integers(0, 700),
    block=st.sampled_from([1, 3, 64, 256, 1000]),
    seed=st.integers(0, 2**31),
    spread=st.floats(1e-6, 1e6),
)
def test_int8_roundtrip_error_is_at_most_half_a_scale_per_element(rows, shard, block, seed, spread):
    x = torch.randn(rows, shard, generator=torch.Generator().manual_seed(seed)) * spread
    codec = Int8Codec(block)
    wire = codec.encode(x)
    assert wire.shape == (rows, codec.chunk_bytes(shard))
    y = codec.decode(wire, shard)
    for b in range(math.ceil(shard / block)):
        part = slice(b * block, min((b + 1) * block, shard))
        absmax = x[:, part].abs().amax(dim=1, keepdim=True)
        err = (y[:, part] - x[:, part]).abs()
        assert torch.all(err <= absmax / 254 * (1 + 1e-5) + 1e-30)


def test_int8_block_extremes_are_exact_and_zero_blocks_stay_zero():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, -3.0, 1.0, 3.0, 0.5]])
    q, scales = quantize_int8(x, 4)
    assert scales.tolist() == [[0.0, pytest.approx(3.0 / 127)]]
    y = dequantize_int8(q, scales, 4)
    assert y[0, :4].tolist() == [0.0] * 4
    assert y[0, 4].item() == pytest.approx(-3.0, rel=1e-6) and y[0, 6].item() == pytest.approx(3.0, rel=1e-6)


def test_int8_non_finite_poisons_its_block_only():
    x = torch.tensor([[1.0, float("inf"), 2.0, 3.0, 4.0, float("nan"), 5.0, 6.0]])
    y = Int8Codec(2).decode(Int8Codec(2).encode(x), 8)
    assert not torch.isfinite(y[0, :2]).any() and not torch.isfinite(y[0, 4:6]).any()
    assert torch.isfinite(y[0, 2:4]).all() and torch.isfinite(y[0, 6:]).all()


@pytest.mark.parametrize("mode,dtype,u", [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)])
def test_cast_codec_rounds_once(mode, dtype, u):
    x = torch.randn(2, 999, generator=torch.Generator().manual_seed(1))
    codec = codec_for(mode)
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 and wire.shape == (2, 2 * 999)
    y = codec.decode(wire, 999)
    assert torch.equal(y, x.to(dtype).float())
    assert torch.all((y - x).abs() <= u * x.abs() + 2**-24)


def test_decode_rejects_wrong_wire_shape():
    with pytest.raises(ConfigError, match=r"uint8 \[rows, 20\]"):
        codec_for("fp16").decode(torch.zeros(1, 19, dtype=torch.uint8), 10)


def test_none_mode_has_no_codec():
    with pytest.raises(ConfigError, match="plain all_reduce"):
        codec_for("none")


def test_ordered_launcher_issues_in_ticket_order_whatever_the_completion_order():
    launcher = OrderedLauncher()
    tickets = [launcher.take() for _ in range(4)]
    issued = []
    launcher.submit(tickets[2], lambda: issued.append(2))
    launcher.submit(tickets[1], None)  # a failed phase 1 still frees its turn
    assert issued == []
    launcher.submit(tickets[0], lambda: issued.append(0))
    assert issued == [0, 2]
    launcher.submit(tickets[3], lambda: issued.append(3))
    assert issued == [0, 2, 3]


def _reference_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Whole-row block-absmax quantise + dequantise, written the obvious way (padding to whole blocks)."""
    rows, shard = x.shape
    nb = math.ceil(shard / block)
    padded = torch.zeros(rows, nb * block)
    padded[:, :shard] = x
    blocks = padded.view(rows, nb, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1), 0).round().to(torch.int8)
    return (q.float() * scale).view(rows, -1)[:, :shard]


@pytest.mark.parametrize("block", [1, 3, 256, 1000])
def test_int8_slabs_match_a_whole_row_reference_across_slab_boundaries(block, monkeypatch):
    import torch_thunderbolt.compression.codecs as codecs

    monkeypatch.setattr(codecs, "SLAB_ELEMENTS", 2048)  # many slabs, short last block, tiny tensors
    x = torch.randn(3, 5 * 2048 + 77, generator=torch.Generator().manual_seed(block))
    codec = Int8Codec(block)
    wire = codec.encode(x)
    y = codec.decode(wire, x.shape[1])
    ref = _reference_int8(x, block)
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-7)
    total = torch.full((1, x.shape[1]), 0.5)
    codec.decode(wire[1:2], x.shape[1], out=total, accumulate=True)
    assert torch.allclose(total, ref[1:2] + 0.5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "fp16", "bf16"])
def test_decode_into_out_and_accumulate_match_plain_decode(mode):
    x = torch.randn(2, 1001, generator=torch.Generator().manual_seed(3))
    codec = codec_for(mode)
    wire = codec.encode(x)
    plain = codec.decode(wire, 1001)
    out = torch.empty(2, 1001)
    assert codec.decode(wire, 1001, out=out) is out and torch.equal(out, plain)
    codec.decode(wire, 1001, out=out, accumulate=True)
    assert torch.allclose(out, 2 * plain)
