"""Expected values: simulate each collective by hand from the filled inputs and check the bookkeeping."""
import pytest
import torch

from torch_thunderbolt.bench import check, spec
from torch_thunderbolt.bench.runner import make_buffers, prepare

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64]


def _inputs(op, lay, n, dtype):
    bufs = [make_buffers(op, lay, dtype) for _ in range(n)]
    for rank, b in enumerate(bufs):
        prepare(op, b, rank)
    return [b.inp.clone() for b in bufs]


def simulate(op, lay, n, dtype):
    """What a correct implementation delivers on each rank."""
    ins = _inputs(op, lay, n, dtype)
    per = lay.count
    if op == "all_reduce":
        total = torch.stack(ins).to(torch.int64).sum(0).to(dtype)
        return [total.clone() for _ in range(n)]
    if op == "broadcast":
        return [ins[0].clone() for _ in range(n)]
    if op == "all_gather":
        return [torch.cat(ins) for _ in range(n)]
    if op == "reduce_scatter":
        total = torch.stack(ins).to(torch.int64).sum(0).to(dtype)
        return [total[r * per:(r + 1) * per].clone() for r in range(n)]
    if op == "all_to_all":
        return [torch.cat([ins[j][r * per:(r + 1) * per] for j in range(n)]) for r in range(n)]
    if op == "sendrecv":
        return [ins[1], ins[0]] + [None] * (n - 2)
    raise AssertionError(op)


@pytest.mark.parametrize("op, n", [(op, n) for op in spec.OPS for n in (1, 2, 3, 5) if op != "sendrecv" or n > 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correct_results_have_no_wrong_elements(op, n, dtype):
    lay = spec.layout(op, 4096 + 20, torch.tensor([], dtype=dtype).element_size(), n)
    outs = simulate(op, lay, n, dtype)
    for rank, out in enumerate(outs):
        chunks = check.expected_chunks(op, rank, n, lay)
        if out is None:
            assert chunks == []
            continue
        assert check.count_wrong(out, chunks) == 0


@pytest.mark.parametrize("op", spec.OPS)
def test_single_corrupted_element_is_counted(op):
    n = 3
    lay = spec.layout(op, 1000, 4, n)
    out = simulate(op, lay, n, torch.float32)[1]
    out[lay.out_numel // 2] += 1
    assert check.count_wrong(out, check.expected_chunks(op, 1, n, lay)) == 1


def test_chunks_from_the_wrong_rank_or_place_are_caught():
    n = 4
    lay = spec.layout("all_gather", 4096, 4, n)
    good = simulate("all_gather", lay, n, torch.float32)[0]
    swapped = torch.cat([good[lay.count:2 * lay.count], good[:lay.count], good[2 * lay.count:]])
    assert check.count_wrong(swapped, check.expected_chunks("all_gather", 0, n, lay)) > 0
    shifted = torch.roll(good, 1)
    assert check.count_wrong(shifted, check.expected_chunks("all_gather", 0, n, lay)) > 0


def test_untouched_output_is_wrong_everywhere():
    lay = spec.layout("all_reduce", 4096, 4, 2)
    b = make_buffers("all_reduce", lay, torch.float32)
    prepare("all_reduce", b, 0)  # an all_reduce that did nothing leaves this rank's own input
    assert check.count_wrong(b.out, check.expected_chunks("all_reduce", 0, 2, lay)) == lay.out_numel
    lay = spec.layout("broadcast", 4096, 4, 2)
    b = make_buffers("broadcast", lay, torch.float32)
    prepare("broadcast", b, 1)  # a non-root rank starts from poison, never from the right answer
    assert check.count_wrong(b.out, check.expected_chunks("broadcast", 1, 2, lay)) == lay.out_numel


def test_output_of_wrong_size_is_wrong():
    lay = spec.layout("all_reduce", 64, 4, 2)
    chunks = check.expected_chunks("all_reduce", 0, 2, lay)
    assert check.count_wrong(torch.ones(3), chunks) == lay.out_numel


def test_fill_input_values():
    t = torch.empty(11, dtype=torch.int32)
    check.fill_input(t, 2)
    assert t.tolist() == [check.value(2, i) for i in range(11)] == [3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5]
