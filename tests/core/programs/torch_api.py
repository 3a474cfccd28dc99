"""Ranks of test_torch_api.py: the public torch.distributed API on the thunderbolt backend, checked against
local references (`whole_api`), and the init methods (`init_method`)."""
from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import main, result


def whole_api() -> None:
    """Every check of the public API on this rank: True, or what went wrong."""
    init = os.environ.get("TEST_INIT", "env://")
    kw = {}
    if init != "env://":
        kw = dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("thunderbolt", init_method=init, timeout=datetime.timedelta(seconds=60), **kw)
    r, w = dist.get_rank(), dist.get_world_size()
    checks = {}

    def check(name, fn):
        try:
            ok = fn()
            checks[name] = True if ok is None else bool(ok)
        except Exception as exc:  # report, keep going: one run checks everything
            checks[name] = f"{type(exc).__name__}: {exc}"

    def inp(rank, n=5, dtype=torch.float32):
        return (torch.arange(n) % 3 + rank + 1).to(dtype)

    ops = {"SUM": (dist.ReduceOp.SUM, lambda xs: sum(xs)), "PRODUCT": (dist.ReduceOp.PRODUCT, lambda xs: torch.stack(xs).prod(0)),
           "MIN": (dist.ReduceOp.MIN, lambda xs: torch.stack(xs).min(0).values), "MAX": (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).max(0).values),
           "AVG": (dist.ReduceOp.AVG, lambda xs: sum(xs) / len(xs))}
    for name, (op, f) in ops.items():
        def t(op=op, f=f):
            x = inp(r); dist.all_reduce(x, op=op)
            return torch.equal(x, f([inp(q) for q in range(w)]))
        check(f"all_reduce_{name}", t)
    for name, op, f in (("BAND", dist.ReduceOp.BAND, torch.bitwise_and), ("BOR", dist.ReduceOp.BOR, torch.bitwise_or),
                        ("BXOR", dist.ReduceOp.BXOR, torch.bitwise_xor)):
        def t(op=op, f=f):
            x = inp(r, dtype=torch.int32); dist.all_reduce(x, op=op)
            want = inp(0, dtype=torch.int32)
            for q in range(1, w): want = f(want, inp(q, dtype=torch.int32))
            return torch.equal(x, want)
        check(f"all_reduce_{name}", t)

    def premul():
        x, op = inp(r), dist._make_nccl_premul_sum(2.0)
        if not hasattr(op, "factor"):  # an older torch hides the factor: a clear error, never a plain sum
            try:
                dist.all_reduce(x, op=op)
            except ValueError as exc:
                return "PREMUL_SUM" in str(exc) and torch.__version__ in str(exc)
            return False
        dist.all_reduce(x, op=op)
        return torch.equal(x, 2 * sum(inp(q) for q in range(w)))
    check("all_reduce_PREMUL_SUM", premul)

    def bigsum():
        x = torch.full((3_000_001,), float(r + 1)); dist.all_reduce(x)
        return bool((x == w * (w + 1) / 2).all())
    check("all_reduce_large", bigsum)

    def bcast():
        x = inp(r, 1_000_003); dist.broadcast(x, src=w - 1); return torch.equal(x, inp(w - 1, 1_000_003))
    check("broadcast", bcast)

    def reduce_():
        x = inp(r); dist.reduce(x, dst=1 % w); return r != 1 % w or torch.equal(x, sum(inp(q) for q in range(w)))
    check("reduce", reduce_)

    def ag():
        out = [torch.empty(5) for _ in range(w)]; dist.all_gather(out, inp(r))
        return all(torch.equal(out[q], inp(q)) for q in range(w))
    check("all_gather", ag)

    def ag_uneven():
        out = [torch.empty(q + 1) for q in range(w)]; dist.all_gather(out, inp(r, r + 1))
        return all(torch.equal(out[q], inp(q, q + 1)) for q in range(w))
    check("all_gather_uneven", ag_uneven)

    def agt():
        out = torch.empty(5 * w); dist.all_gather_into_tensor(out, inp(r)); return torch.equal(out, torch.cat([inp(q) for q in range(w)]))
    check("all_gather_into_tensor", agt)

    def rs():
        out = torch.empty(4); dist.reduce_scatter(out, [inp(r, 4) * (q + 1) for q in range(w)])
        return torch.equal(out, sum(inp(p, 4) for p in range(w)) * (r + 1))
    check("reduce_scatter", rs)

    def rst():
        out = torch.empty(4); dist.reduce_scatter_tensor(out, inp(r, 4 * w))
        return torch.equal(out, sum(inp(p, 4 * w) for p in range(w))[4 * r : 4 * r + 4])
    check("reduce_scatter_tensor", rst)

    def gather():
        g = [torch.empty(5) for _ in range(w)] if r == 0 else None
        dist.gather(inp(r), g, dst=0); return r != 0 or all(torch.equal(g[q], inp(q)) for q in range(w))
    check("gather", gather)

    def scatter():
        out = torch.empty(5); dist.scatter(out, [inp(q) * 10 for q in range(w)] if r == 0 else None, src=0)
        return torch.equal(out, inp(r) * 10)
    check("scatter", scatter)

    def a2a():
        outs = [torch.empty(2) for _ in range(w)]; dist.all_to_all(outs, [torch.full((2,), float(10 * r + q)) for q in range(w)])
        return all(torch.equal(outs[q], torch.full((2,), float(10 * q + r))) for q in range(w))
    check("all_to_all", a2a)

    def a2as_even():
        out = torch.empty(2 * w); dist.all_to_all_single(out, torch.arange(2 * w, dtype=torch.float) + 100 * r)
        return torch.equal(out, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float) + 100 * q for q in range(w)]))
    check("all_to_all_single_even", a2as_even)

    def a2as_uneven():
        in_splits = [q + 1 for q in range(w)]; out_splits = [r + 1] * w
        x = torch.cat([torch.full((q + 1, 2), float(10 * r + q)) for q in range(w)])
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(out, x, out_splits, in_splits)
        return torch.equal(out, torch.cat([torch.full((r + 1, 2), float(10 * q + r)) for q in range(w)]))
    check("all_to_all_single_uneven", a2as_uneven)
    check("barrier", lambda: dist.barrier())

    def monitored():  # torch implements it in Python for gloo only: a documented limitation, a clear error
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        except ValueError as exc:
            return "GLOO" in str(exc)
        return False
    check("monitored_barrier_is_a_clear_error", monitored)

    def p2p():
        nxt, prv = (r + 1) % w, (r - 1) % w
        if w == 1: return True
        a = torch.empty(3); b = torch.empty(3)
        reqs = [dist.irecv(b, prv, tag=7), dist.irecv(a, prv, tag=5),
                dist.isend(torch.full((3,), float(r)), nxt, tag=5), dist.isend(torch.full((3,), float(r + 100)), nxt, tag=7)]
        for q in reqs: q.wait()
        return torch.equal(a, torch.full((3,), float(prv))) and torch.equal(b, torch.full((3,), float(prv + 100)))
    check("isend_irecv_tags_out_of_order", p2p)

    def sendrecv_big():
        if w == 1: return True
        if r == 0: dist.send(torch.arange(2_000_000, dtype=torch.float64), 1)
        elif r == 1:
            x = torch.empty(2_000_000, dtype=torch.float64); dist.recv(x, 0); return torch.equal(x, torch.arange(2_000_000, dtype=torch.float64))
    check("send_recv_large", sendrecv_big)

    def p2p_shapes():  # 2-D and non-contiguous tensors on both ends (staged through a copy)
        if w == 1: return True
        src = torch.arange(12.0).view(3, 4)
        if r == 0:
            dist.send(src, 1); dist.send(src.t(), 1); dist.send(torch.tensor(5.0), 1)
        elif r == 1:
            a = torch.empty(3, 4); dist.recv(a, 0)
            b = torch.empty(3, 4).t(); dist.recv(b, 0)
            c = torch.empty(()); dist.recv(c, 0)
            return torch.equal(a, src) and torch.equal(b, src.t()) and c.item() == 5.0
        return True
    check("send_recv_shapes", p2p_shapes)

    def anysource():
        if w == 1: return True
        if r == 0:
            got = set()
            for _ in range(w - 1):
                x = torch.empty(1); src = dist.recv(x, tag=9); got.add((src, int(x.item())))
            return got == {(q, q * 11) for q in range(1, w)}
        dist.send(torch.tensor([float(r * 11)]), 0, tag=9)
    check("recv_any_source", anysource)

    def batch():
        if w == 1: return True
        nxt, prv = (r + 1) % w, (r - 1) % w
        x = torch.empty(4)
        ops_ = [dist.P2POp(dist.irecv, x, prv), dist.P2POp(dist.isend, torch.full((4,), float(r)), nxt)]
        for q in dist.batch_isend_irecv(ops_): q.wait()
        return torch.equal(x, torch.full((4,), float(prv)))
    check("batch_isend_irecv", batch)

    def p2p_future_only():  # nobody calls wait(): the futures must still complete
        if w == 1: return True
        if r == 0:
            dist.isend(torch.arange(4.0), 1, tag=21).get_future().wait()
            return True
        if r == 1:
            x = torch.empty(4); dist.irecv(x, 0, tag=21).get_future().wait()
            return torch.equal(x, torch.arange(4.0))
        return True
    check("p2p_get_future_without_wait", p2p_future_only)

    def coalesce():
        xs = [inp(r, 3), inp(r, 7, torch.float64)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for x in xs: dist.all_reduce(x)
        cm.wait()
        return torch.equal(xs[0], sum(inp(q, 3) for q in range(w))) and torch.equal(xs[1], sum(inp(q, 7, torch.float64) for q in range(w)))
    check("coalescing_manager", coalesce)

    def objects():
        objs = [None] * w; dist.all_gather_object(objs, {"rank": r, "s": "x" * r})
        ok = objs == [{"rank": q, "s": "x" * q} for q in range(w)]
        lst = [{"a": 1}, [2, 3]] if r == 0 else [None, None]; dist.broadcast_object_list(lst, src=0)
        ok &= lst == [{"a": 1}, [2, 3]]
        g = [None] * w if r == 0 else None; dist.gather_object(("g", r), g, dst=0)
        ok &= r != 0 or g == [("g", q) for q in range(w)]
        out = [None]; dist.scatter_object_list(out, [("s", q) for q in range(w)] if r == 0 else None, src=0)
        ok &= out[0] == ("s", r)
        if w > 1:
            if r == 0: dist.send_object_list([{"k": "v"}], dst=1)
            elif r == 1:
                got = [None]; dist.recv_object_list(got, src=0); ok &= got == [{"k": "v"}]
        return ok
    check("object_collectives", objects)

    def async_ops():
        x = inp(r, 100_000); work = dist.all_reduce(x, async_op=True)
        fut = work.get_future(); work.wait(timeout=datetime.timedelta(seconds=30))
        fut.wait()
        return work.is_completed() and torch.equal(x, sum(inp(q, 100_000) for q in range(w)))
    check("async_wait_future_is_completed", async_ops)

    def future_chain():
        x = inp(r); fut = dist.all_reduce(x, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        return torch.equal(fut.wait(), 2 * sum(inp(q) for q in range(w)))
    check("future_then", future_chain)

    def subgroups():
        evens = [q for q in range(w) if q % 2 == 0]
        g = dist.new_group(evens)
        ok = True
        if r in evens:
            x = inp(r); dist.all_reduce(x, group=g); ok &= torch.equal(x, sum(inp(q) for q in evens))
        sub, _ = dist.new_subgroups(group_size=1)
        y = inp(r); dist.all_reduce(y, group=sub); ok &= torch.equal(y, inp(r))
        return ok
    check("new_group_new_subgroups", subgroups)

    def functional():
        x = inp(r)
        y = funcol.all_reduce(x, "sum", dist.group.WORLD).wait() if hasattr(funcol.all_reduce(x, "sum", dist.group.WORLD), "wait") else funcol.all_reduce(x, "sum", dist.group.WORLD)
        g = funcol.all_gather_tensor(inp(r, 2), 0, dist.group.WORLD)
        g = g.wait() if hasattr(g, "wait") else g
        return torch.equal(torch.as_tensor(y), sum(inp(q) for q in range(w))) and torch.equal(torch.as_tensor(g), torch.cat([inp(q, 2) for q in range(w)]))
    check("functional_collectives", functional)

    def dtypes():
        ok = True
        for dt in (torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.uint8, torch.complex64):
            x = inp(r, 33, dt); dist.all_reduce(x); ok &= torch.equal(x, sum(inp(q, 33, dt) for q in range(w)))
        b = torch.tensor([r % 2 == 0, False, True]); dist.all_reduce(b, op=dist.ReduceOp.MAX)
        ok &= torch.equal(b, torch.tensor([True, False, True]))
        return ok
    check("dtypes", dtypes)

    def noncontig():
        x = torch.arange(20.0).view(4, 5).t() * (r + 1); dist.all_reduce(x)
        return torch.equal(x, torch.arange(20.0).view(4, 5).t() * (w * (w + 1) / 2))
    check("non_contiguous", noncontig)

    def one_cpu_tensor_shapes():
        # A single contiguous CPU tensor is reduced in place without staging: every shape it can have.
        s = w * (w + 1) / 2
        zero_dim = torch.tensor(float(r + 1)); dist.all_reduce(zero_dim)
        grid = torch.full((3, 4), float(r + 1)); dist.all_reduce(grid)
        base = torch.full((2,), float(r + 1)); odd = base[1:2].as_strided((1,), (7,)); dist.all_reduce(odd)
        leaf = torch.full((6,), float(r + 1), requires_grad=True); dist.all_reduce(leaf)
        empty = torch.empty(0); dist.all_reduce(empty)
        return (zero_dim.item() == s and torch.equal(grid, torch.full((3, 4), s)) and base.tolist() == [r + 1, s]
                and torch.equal(leaf.detach(), torch.full((6,), s)) and empty.numel() == 0)
    check("one_cpu_tensor_shapes", one_cpu_tensor_shapes)

    def where_ops_run():
        # A blocking op runs in the caller's thread whatever its size (the caller waits anyway); an async
        # one above the small-message size on the group's worker (it overlaps the caller); a small one inline.
        pg = dist.distributed_c10d._get_default_group()
        real, in_caller = pg._comm.all_reduce, []

        def spy(*args, **kwargs):
            in_caller.append(threading.current_thread() is threading.main_thread())
            return real(*args, **kwargs)

        real_gather = pg._comm.all_gather

        def spy_gather(*args, **kwargs):
            in_caller.append(threading.current_thread() is threading.main_thread())
            return real_gather(*args, **kwargs)

        pg._comm.all_reduce, pg._comm.all_gather = spy, spy_gather
        try:
            big, small = torch.full((1 << 20,), float(r + 1)), torch.full((4,), float(r + 1))
            dist.all_reduce(big)
            dist.all_reduce(big, async_op=True).wait()
            dist.all_reduce(small, async_op=True).wait()
            parts = [torch.empty(1 << 20) for _ in range(w)]  # the list form: its size is its tensors'
            dist.all_gather(parts, torch.full((1 << 20,), float(r)), async_op=True).wait()
            dist.all_gather(parts, torch.full((1 << 20,), float(r)))
        finally:
            del pg._comm.all_reduce, pg._comm.all_gather
        s = w * (w + 1) / 2
        # (a torch whose options have no asyncOp tells no blocking call apart: large ones go to the worker)
        blocking = hasattr(dist.AllreduceOptions(), "asyncOp")
        return (in_caller == [blocking, False, True, False, blocking] and bool((big == s * w).all())
                and bool((small == s).all()) and all(bool((p == q).all()) for q, p in enumerate(parts)))
    check("where_ops_run", where_ops_run)
    dist.destroy_process_group()
    result(checks)


def init_method() -> None:
    """The group started with the init_method TEST_INIT; one all_reduce."""
    init = os.environ["TEST_INIT"]
    kw = {} if init.startswith("thunderbolt") else dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("thunderbolt", init_method=init, timeout=datetime.timedelta(seconds=60), **kw)
    x = torch.ones(3) * (dist.get_rank() + 1); dist.all_reduce(x)
    dist.destroy_process_group()
    result(x.tolist())


if __name__ == "__main__":
    main({"whole_api": whole_api, "init_method": init_method})
