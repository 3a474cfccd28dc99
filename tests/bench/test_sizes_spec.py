"""Size/list parsing and the op/dtype specification (pure)."""
import pytest

from torch_thunderbolt.bench import sizes as sz
from torch_thunderbolt.bench import spec
from torch_thunderbolt.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ("4K", 4096), ("4k", 4096), ("64K", 65536), ("1M", 1 << 20), ("256M", 256 << 20), ("1G", 1 << 30),
    ("512", 512), ("512B", 512), ("4KiB", 4096), ("4KB", 4096), ("1.5K", 1536), (" 8 ", 8),
])
def test_parse_size(text, expected):
    assert sz.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4Q", "-1", "0", "K", "1.3", "4 K B B", "1e6"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="bad size"):
        sz.parse_size(text)


def test_format_size_round_trips():
    for n in (1, 512, 4096, 65536, 1 << 20, 3 << 30, 1536):
        assert sz.parse_size(sz.format_size(n)) == n
    assert sz.format_size(1536) == "1536"


def test_size_range_is_nccl_tests_b_e_f():
    assert sz.size_range(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sz.size_range(4096, 1 << 20, 4) == [4096, 16384, 65536, 262144, 1 << 20]
    assert sz.size_range(8, 100, 2) == [8, 16, 32, 64]  # end is an upper bound
    assert sz.size_range(64, 64, 2) == [64]
    assert sz.size_range(64, 64, 1) == [64]


@pytest.mark.parametrize("b, e, f", [(0, 8, 2), (16, 8, 2), (8, 64, 1), (8, 64, 0.5), (1, 1 << 40, 1.01)])
def test_size_range_rejects(b, e, f):
    with pytest.raises(ConfigError):
        sz.size_range(b, e, f)


def test_parse_sizes_sorts_and_dedupes():
    assert sz.parse_sizes("1M,4K, 4096,64K") == [4096, 65536, 1 << 20]
    with pytest.raises(ConfigError, match="empty --sizes"):
        sz.parse_sizes(" , ")


def test_choose_expands_all_and_keeps_order():
    assert sz.choose(["broadcast", "allreduce"], spec.OPS, "op", spec.OP_ALIASES) == ["broadcast", "all_reduce"]
    assert sz.choose(["all"], spec.OPS, "op") == list(spec.OPS)
    with pytest.raises(ConfigError, match="unknown op 'reduce_all'"):
        sz.choose(["reduce_all"], spec.OPS, "op")


def test_parse_int_list():
    assert sz.parse_int_list("4,1,2,2", "link-streams") == [1, 2, 4]
    with pytest.raises(ConfigError, match="link-streams"):
        sz.parse_int_list("1,x", "link-streams")
    with pytest.raises(ConfigError, match="at least 1"):
        sz.parse_int_list("0", "link-streams")


@pytest.mark.parametrize("n, factors", [
    (2, {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
         "sendrecv": 1.0}),
    (4, {"all_reduce": 1.5, "reduce_scatter": 0.75, "all_gather": 0.75, "all_to_all": 0.75, "broadcast": 1.0,
         "sendrecv": 1.0}),
    (8, {"all_reduce": 1.75, "reduce_scatter": 0.875, "all_gather": 0.875, "all_to_all": 0.875,
         "broadcast": 1.0, "sendrecv": 1.0}),
])
def test_busbw_factors(n, factors):
    for op, factor in factors.items():
        assert spec.busbw_factor(op, n) == pytest.approx(factor)


def test_layout_rounds_like_nccl_tests():
    # all_reduce: whole elements; size column = bytes actually moved
    assert spec.layout("all_reduce", 4097, 4, 2) == spec.Layout("all_reduce", 4096, 1024, 1024, 1024)
    # all_gather: 3 ranks, 4096 B float32 = 1024 elements -> 341 per rank, output 1023
    lay = spec.layout("all_gather", 4096, 4, 3)
    assert (lay.nbytes, lay.count, lay.in_numel, lay.out_numel) == (1023 * 4, 341, 341, 1023)
    lay = spec.layout("reduce_scatter", 4096, 4, 3)
    assert (lay.in_numel, lay.out_numel) == (1023, 341)
    lay = spec.layout("all_to_all", 4096, 2, 4)
    assert (lay.count, lay.in_numel, lay.out_numel, lay.nbytes) == (512, 2048, 2048, 4096)
    # never empty
    assert spec.layout("all_gather", 1, 4, 8).in_numel == 1


def test_algbw_is_bytes_per_ns():
    assert spec.algbw_gbps(1_000_000, 1000.0) == pytest.approx(1.0)  # 1 MB in 1 ms = 1 GB/s
    assert spec.algbw_gbps(10, 0.0) == 0.0


def test_dtype_names_and_aliases():
    assert spec.dtype("fp16").name == "float16"
    assert spec.dtype("bf16").nccl_name == "bfloat16"
    assert spec.dtype("float").itemsize == 4
    with pytest.raises(ConfigError, match="unknown --dtype 'complex64'"):
        spec.dtype("complex64")


def test_check_world_size_guards_exactness_and_sendrecv():
    spec.check_world_size(["all_reduce"], 15, spec.dtype("int8"))
    with pytest.raises(ConfigError, match="int8 cannot hold the exact sum over 16 ranks"):
        spec.check_world_size(["all_reduce"], 16, spec.dtype("int8"))
    spec.check_world_size(["all_gather"], 64, spec.dtype("int8"))  # no sum: any world size
    with pytest.raises(ConfigError, match="sendrecv needs at least 2 ranks"):
        spec.check_world_size(["sendrecv"], 1, spec.dtype("float32"))
