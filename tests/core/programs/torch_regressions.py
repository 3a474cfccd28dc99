"""Ranks of test_torch_regressions.py: cases from PyTorch's own tests and real training code that gloo gets
right. Each scenario checks its results against references computed locally and reports them with
result()."""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, outcome, result


def gloo_cases() -> None:
    """Every case on this rank (True, or what went wrong), then a call with mixed reduce ops."""
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=30))
    r, w = dist.get_rank(), dist.get_world_size()
    checks = {}

    def check(name, fn):
        try:
            ok = fn()
            checks[name] = True if ok is None else ok
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}"

    def grads_that_require_grad():
        # Double backward (gradient penalties, MAML): the gradient itself requires grad. The backend must not
        # run autograd-tracked arithmetic on it, on the one-shot path or the large one.
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        p.pow(2).sum().backward(create_graph=True)
        g = p.grad
        assert g.requires_grad
        dist.all_reduce(g)
        big = torch.ones(300_000, requires_grad=True) * 2
        dist.all_reduce(big)
        return torch.equal(g.detach(), torch.tensor([2.0, 4.0]) * w) and bool((big.detach() == 2 * w).all())
    check("all_reduce_requires_grad", grads_that_require_grad)

    def ddp_create_graph():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        x = torch.randn(5, 4) + r
        out = ddp(x).pow(2).sum()
        grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        penalty.backward()
        return all(p.grad is not None for p in model.parameters())
    check("ddp_grad_penalty", ddp_create_graph)

    def coalesced():
        ins = [torch.full((3,), float(r)), torch.empty(0), torch.full((2, 2), r + 0.5)]
        outs = [[torch.empty_like(x) for x in ins] for _ in range(w)]
        dist.all_gather_coalesced(outs, ins)
        cplx = [torch.tensor([1 + 1j * r], dtype=torch.complex64), torch.tensor([r, 3j], dtype=torch.complex64)]
        couts = [[torch.empty_like(x) for x in cplx] for _ in range(w)]
        dist.all_gather_coalesced(couts, cplx)
        return all(torch.equal(outs[q][0], torch.full((3,), float(q))) and outs[q][1].numel() == 0 and
                   torch.equal(outs[q][2], torch.full((2, 2), q + 0.5)) and
                   torch.equal(couts[q][0], torch.tensor([1 + 1j * q], dtype=torch.complex64)) and
                   torch.equal(couts[q][1], torch.tensor([q, 3j], dtype=torch.complex64)) for q in range(w))
    check("all_gather_coalesced", coalesced)

    def sparse():
        s = torch.sparse_coo_tensor(torch.tensor([[r, w]]), torch.tensor([1.0, 2.0]), (w + 2,))
        dist.all_reduce(s)
        want = torch.zeros(w + 2)
        want[:w] = 1.0
        want[w] = 2.0 * w
        return s.is_sparse and torch.equal(s.to_dense(), want)
    check("sparse_all_reduce", sparse)

    def sparse_ddp():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 3, sparse=True)
        ddp = torch.nn.parallel.DistributedDataParallel(emb)
        ddp(torch.tensor([r, 5])).sum().backward()
        want = torch.zeros(8, 3)
        for q in range(w):
            want[q] += 1.0 / w
        want[5] += 1.0
        return torch.allclose(emb.weight.grad.to_dense(), want)
    check("sparse_ddp_embedding", sparse_ddp)

    def rs_in_place(n):
        def run():
            base = torch.arange(n * w, dtype=torch.float32)
            x = base * (r + 1) + r
            want = sum(base * (q + 1) + q for q in range(w))[r * n : (r + 1) * n]
            out = x[r * n : (r + 1) * n]
            dist.reduce_scatter_tensor(out, x)
            return torch.equal(out, want) or f"got {out[:4].tolist()} want {want[:4].tolist()}"
        return run
    for n in (8, 1000, 300_000):
        check(f"reduce_scatter_tensor_in_place_{n}", rs_in_place(n))

    def ag_in_place():
        n = 1000
        out = torch.zeros(n * w)
        mine = out[r * n : (r + 1) * n]
        mine.fill_(r + 1)
        dist.all_gather_into_tensor(out, mine)
        return torch.equal(out, torch.cat([torch.full((n,), float(q + 1)) for q in range(w)]))
    check("all_gather_into_tensor_in_place", ag_in_place)

    def strided_size_one():
        x = torch.zeros(2)
        v = x[::2]
        if r == 0:
            v.fill_(5)
        dist.broadcast(v, 0)
        y = torch.zeros(2)
        dist.all_reduce(y[1::2].fill_(1))
        return v.item() == 5 and x[1].item() == 0 and y[1].item() == w
    check("size_one_strided", strided_size_one)

    def unsupported_dtype():
        try:
            dist.all_reduce(torch.ones(4, dtype=torch.uint16))
            return "no error for uint16"
        except ValueError as exc:
            if "uint16" not in str(exc):
                return f"unclear: {exc}"
        x = torch.ones(1000)
        dist.all_reduce(x)  # the group must still work
        return bool((x == w).all())
    check("unsupported_dtype_then_float", unsupported_dtype)
    result(checks)
    dist.barrier()
    time.sleep(0.5)  # every rank has left the barrier: the abort below cannot overtake its last message

    def mixed():  # last: it breaks the group
        x = torch.tensor([float(r + 1)] * 4)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
    result({"mixed": outcome(mixed)})


def disagree_on_root() -> None:
    """The last rank names another root for the reduce or gather TEST_OP."""
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    root = 0 if r < w - 1 else 1  # the last rank disagrees about the root
    op = os.environ["TEST_OP"]

    def run():
        x = torch.ones(1000) * (r + 1)
        if op == "reduce":
            dist.reduce(x, dst=root)
        else:
            dist.gather(x, [torch.empty(1000) for _ in range(w)] if r == root else None, dst=root)
    first = outcome(run)
    then = outcome(lambda: dist.all_reduce(torch.ones(4)))  # a rank that returned must not go on as if fine
    result({"first": first, "then": then})


def failed_receive() -> None:
    """TEST_CASE=timeout: a receive given up on; =size: a receive larger than the message."""
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=30))
    r = dist.get_rank()
    case = os.environ["TEST_CASE"]
    if case == "timeout":
        if r == 0:
            x = torch.zeros(4)
            work = dist.irecv(x, 1)
            first = outcome(lambda: work.wait(datetime.timedelta(seconds=1)))
            y = torch.zeros(4)
            second = outcome(lambda: dist.recv(y, 1))
            time.sleep(1.5)  # rank 1's sends have long arrived, if they were going to be written anywhere
            result({"first": first, "second": second, "x": x.tolist(), "y": y.tolist()})
        else:
            time.sleep(2)
            outcome(lambda: dist.send(torch.ones(4), 0))
            outcome(lambda: dist.send(torch.ones(4) * 2, 0))
            time.sleep(1)
            result({})
    else:  # a receive larger than the message
        if r == 0:
            first = outcome(lambda: dist.recv(torch.zeros(8), 1))
            then = outcome(lambda: dist.all_reduce(torch.ones(4)))
            result({"first": first, "then": then})
        else:
            dist.send(torch.ones(4), 0)
            result({"then": outcome(lambda: dist.all_reduce(torch.ones(4)))})


def monitored() -> None:
    """monitored_barrier on the group: first everyone arrives, then rank 1 does not."""
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=30))
    r = dist.get_rank()
    pg = dist.group.WORLD
    first = outcome(lambda: pg.monitored_barrier(datetime.timedelta(seconds=10)))  # everyone arrives
    if r == 1:
        time.sleep(4)
        result({"first": first})
    else:
        second = outcome(lambda: pg.monitored_barrier(datetime.timedelta(seconds=1)))  # rank 1 does not
        result({"first": first, "second": second})


if __name__ == "__main__":
    main({"gloo_cases": gloo_cases, "disagree_on_root": disagree_on_root, "failed_receive": failed_receive,
          "monitored": monitored})
