"""Outputs that alias inputs on every algorithm, and ranks that disagree on the reduce op or the layout,
on the in-memory transport (the fast tier): exact results, or a MismatchError on every rank."""
from __future__ import annotations

import itertools
import threading
import time
import zlib

import pytest
import torch

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import CollectiveTimeout, MismatchError, PeerLostError
from torch_thunderbolt.protocol.signature import describe_sig, encode_sig
from torch_thunderbolt.testing.worlds import memory_world, on_threads
from torch_thunderbolt.transport.memory import MemoryHub

ALGOS = ["auto", "ring", "direct", "chain", "biring"]


def _cfg(algo: str) -> Config:
    return Config(algo=algo, small_bytes=64, chunk_bytes=1024)


def _mismatch_errors(call, window: int, cfg: Config | None = None) -> list[BaseException]:
    """call(comm) on two ranks in memory (`window` > 0: with a shared window), which ranks that disagree must
    fail: a MismatchError on one rank at least (the in-memory peer of a failed rank may see it as lost).
    Returns every rank's error."""
    errors: list[BaseException] = []

    def body(comm):
        try:
            call(comm)
        except Exception as exc:
            errors.append(exc)
            raise

    with pytest.raises((MismatchError, PeerLostError)):
        memory_world(2, body, cfg=cfg, window_bytes=window, comm_timeout=10)
    assert any(isinstance(e, MismatchError) for e in errors), errors
    return errors


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [8, 3000])
def test_in_place_reduce_scatter_is_exact(algo, world, n):
    def body(comm):
        base = torch.arange(n * world, dtype=torch.float64)
        x = base * (comm.rank + 1) + comm.rank
        out = x[comm.rank * n : (comm.rank + 1) * n]
        comm.reduce_scatter(out, x, [n] * world)
        want = sum(base * (q + 1) + q for q in range(world))[comm.rank * n : (comm.rank + 1) * n]
        return torch.equal(out, want)

    assert all(memory_world(world, body, cfg=_cfg(algo)))


@pytest.mark.parametrize("algo", ALGOS)
def test_in_place_all_gather_all_to_all_gather_scatter_are_exact(algo):
    world, n = 3, 700

    def body(comm):
        r = comm.rank
        out = torch.zeros(n * world)
        out[r * n : (r + 1) * n] = r + 1
        comm.all_gather(out, out[r * n : (r + 1) * n])
        ok = torch.equal(out, torch.cat([torch.full((n,), q + 1.0) for q in range(world)]))
        buf = torch.arange(n * world, dtype=torch.float32) + 1000 * r  # all_to_all with out == in
        comm.all_to_all(buf, buf, [n] * world, [n] * world)
        ok &= torch.equal(buf, torch.cat([torch.arange(r * n, (r + 1) * n, dtype=torch.float32) + 1000 * q
                                          for q in range(world)]))
        g = torch.zeros(n * world)  # gather: the root's input is its own block of the output
        g[r * n : (r + 1) * n] = r + 5
        comm.gather(g if r == 0 else None, g[r * n : (r + 1) * n], 0, [n] * world)
        if r == 0:
            ok &= torch.equal(g, torch.cat([torch.full((n,), q + 5.0) for q in range(world)]))
        s = torch.arange(n * world, dtype=torch.float32)  # scatter: the root's output is a block of its input
        comm.scatter(s[r * n : (r + 1) * n], s if r == 0 else None, 0, [n] * world)
        ok &= torch.equal(s[r * n : (r + 1) * n], torch.arange(r * n, (r + 1) * n, dtype=torch.float32))
        return ok

    assert all(memory_world(world, body, cfg=_cfg(algo)))


@pytest.mark.parametrize("window", [0, 4096])
@pytest.mark.parametrize("ops", [("sum", "max"), ("sum", "avg"), ("min", "max"), ("sum", "product")])
@pytest.mark.parametrize("n", [4, 5000])
def test_different_reduce_ops_are_a_mismatch_on_every_rank(window, ops, n):
    errors = _mismatch_errors(lambda comm: comm.all_reduce(torch.ones(n) * (comm.rank + 1), ops[comm.rank % 2]),
                              window, Config(small_bytes=64))
    # Nobody returns a result of its own op as if it had worked (the in-memory peer of a failed rank sees
    # it as lost).
    assert len(errors) == 2 and not any(isinstance(e, CollectiveTimeout) for e in errors), errors


def test_an_8_bit_layout_checksum_collides_and_the_signature_does_not():
    """Block layouts with the same total that an 8-bit check (crc32 & 0xFF) cannot tell apart: the
    signature's 32-bit digest must."""
    layouts = [list(c) for c in itertools.product(range(1, 64), repeat=2)]
    by_total: dict = {}
    for c in layouts:
        by_total.setdefault(sum(c), []).append(c)
    old = new = 0
    for group in by_total.values():
        for a, b in itertools.combinations(group, 2):
            old += (zlib.crc32(repr(a).encode()) & 0xFF) == (zlib.crc32(repr(b).encode()) & 0xFF)
            new += encode_sig("reduce_scatter", "float32", 0, sum(a), "sum", tuple(a)) == encode_sig(
                "reduce_scatter", "float32", 0, sum(b), "sum", tuple(b))
    assert old > 0  # the weakness is real: the search finds 8-bit collisions
    assert new == 0


def test_the_signature_names_the_reduce_op_and_root():
    sig = encode_sig("reduce", "float32", 3, 10, "max")
    assert describe_sig(sig) == "reduce(float32, MAX, root 3)"
    assert encode_sig("reduce", "float32", 259, 10, "max") != sig  # roots equal modulo 256 still differ


def test_a_timeout_says_timed_out_where_tools_look_for_it():
    def body(comm):
        if comm.rank == 0:
            comm.barrier()

    with pytest.raises(CollectiveTimeout, match=" Timed out "):
        memory_world(2, body, comm_timeout=0.5)


def test_an_unsupported_dtype_is_refused_before_any_traffic_and_the_group_goes_on():
    def body(comm):
        with pytest.raises(ValueError, match="uint16"):
            comm.all_reduce(torch.ones(4, dtype=torch.uint16))
        x = torch.ones(4)
        comm.all_reduce(x)
        return torch.equal(x, torch.full((4,), 2.0))

    assert all(memory_world(2, body, window_bytes=4096))


@pytest.mark.parametrize("op,dtype", [("avg", torch.bool), ("avg", torch.int32), ("premul_sum", torch.int32),
                                      ("premul_sum", torch.bool), ("max", torch.complex64)])
def test_an_op_the_dtype_cannot_take_is_refused_with_the_tensor_untouched(op, dtype):
    def body(comm):
        x = torch.ones(6, dtype=dtype)
        before = x.clone()
        with pytest.raises(ValueError, match=op.upper()):
            comm.all_reduce(x, op, 2.0 if op == "premul_sum" else None)
        assert torch.equal(x, before)
        y = torch.ones(6)
        comm.all_reduce(y)  # the group goes on
        return torch.equal(y, torch.full((6,), 2.0))

    assert all(memory_world(2, body, window_bytes=4096))


def _view(x: torch.Tensor) -> memoryview:
    return memoryview(x.numpy()).cast("B")


@pytest.mark.parametrize("receive_first", [False, True], ids=["message-first", "receive-first"])
def test_a_point_to_point_message_of_another_dtype_is_refused_on_both_ranks_with_the_tensor_untouched(
        receive_first):
    """float32[2] sent, int32[2] expected (8 bytes each): the signatures the backend gives the two calls
    differ, so the receive fails before any byte lands, and the sender is told."""
    hub = MemoryHub(2)
    sigs = {0: encode_sig("send", "float32", 0, 2), 1: encode_sig("send", "int32", 0, 2)}
    y = torch.full((2,), 7, dtype=torch.int32)
    ready = threading.Event()

    def body(r: int) -> None:
        t = hub.transports[r]
        if r == 0:
            if receive_first:
                ready.wait(5)
            t.wait([t.isend_p2p(1, 0, _view(torch.ones(2)), sigs[0])], time.monotonic() + 5)
            deadline = time.monotonic() + 5
            while t.broken is None and time.monotonic() < deadline:
                t.progress(0.05)
            t.check_usable()
        else:
            req = t.irecv_p2p(0, 0, _view(y), sigs[1])
            ready.set()
            t.wait([req], time.monotonic() + 5)

    run = on_threads(2, body, 10)
    assert not run.hung and set(run.errors) == {0, 1}, run.errors
    assert all(isinstance(e, MismatchError) for e in run.errors.values()), run.errors
    assert "send(float32) of 2 elements" in str(run.errors[1]) and "send(int32) of 2 elements" in str(run.errors[1])
    assert torch.equal(y, torch.full((2,), 7, dtype=torch.int32))


@pytest.mark.parametrize("window", [0, 4096])
def test_all_gather_of_the_same_bytes_packed_from_other_dtypes_is_a_mismatch(window):
    """What all_gather_coalesced passes: 16 bytes of float32[4] on one rank, of int32[4] on the other."""
    def call(comm):
        layout = ("coalesced", (("float32" if comm.rank == 0 else "int32", 4),))
        comm.all_gather(torch.zeros(32, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8), layout=layout)

    errors = _mismatch_errors(call, window)
    assert all(isinstance(e, (MismatchError, PeerLostError)) for e in errors), errors


@pytest.mark.parametrize("window", [0, 4096])
@pytest.mark.parametrize("n", [4, 5000])
def test_all_reduce_of_tensors_packed_differently_is_a_mismatch(window, n):
    """all_reduce_coalesced of [n, n] on one rank and [2n] on the other: the same flat buffer, another packing."""
    _mismatch_errors(lambda comm: comm.all_reduce(torch.ones(2 * n), layout=(n, n) if comm.rank == 0 else None),
                     window, Config(small_bytes=64))
