"""Ranks of test_device_threads.py: every collective on tensors of the fake accelerator (fake_device), each
checked for exact values and for which threads ran ops on device tensors (the issuer's, a thread that waits,
autograd's; never one of the backend's). Async ops on device tensors overlap the caller, in every way torch
consumes them: work.wait(), the future's wait() and callbacks, DDP with and without hooks."""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from torch.autograd import Variable

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.hooks import CompressionState, bf16_hook, fp16_hook, int8_hook
from torch_thunderbolt.testing.fake_device import install, values
from torch_thunderbolt.testing.program import emit, main, result


def device_checks() -> None:
    """Every check on this rank: True, or what went wrong."""
    log = install()
    dist.init_process_group("thunderbolt", device_id=torch.device("tbfake", 0),
                            timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    D = "tbfake"
    checks = {}

    def dev(t):
        return t.to(D)

    def check(name, fn, issuer="MainThread"):
        """fn() runs the op(s) and returns True when the values are right; every fake-device op logged while
        it ran must have run in `issuer` or the main thread (which waits); issuer "*": in any thread but the
        backend's."""
        log.clear()
        try:
            ok = fn()
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}"
            return
        allowed = (issuer, "MainThread")
        bad = sorted({t for t in log.threads() if t not in allowed and (issuer != "*" or t.startswith("tb-"))})
        checks[name] = True if ok is True and not bad else {"values_ok": ok, "device_ops_on": bad}

    def data(n, rank, dtype=torch.float32):
        return (torch.arange(n) % 7 + rank).to(dtype)

    SIZES = (5, 300_000)  # the one-shot path and the large path (run on the worker for CPU tensors)
    for n in SIZES:
        want = sum(data(n, q) for q in range(w))

        def sync(n=n, want=want):
            x = dev(data(n, r)); dist.all_reduce(x); return torch.equal(values(x), want)

        def wait(n=n, want=want):
            x = dev(data(n, r)); dist.all_reduce(x, async_op=True).wait(); return torch.equal(values(x), want)

        def then(n=n, want=want):
            x = dev(data(n, r)); seen = []
            fut = dist.all_reduce(x, async_op=True).get_future().then(lambda f: seen.append(x.mul(1)))
            fut.wait()
            return torch.equal(values(x), want) and len(seen) == 1 and torch.equal(values(seen[0]), want)
        check(f"all_reduce_sync_{n}", sync)
        check(f"all_reduce_wait_{n}", wait)
        check(f"all_reduce_then_{n}", then)

        def bcast(n=n):
            x = dev(data(n, r)); dist.broadcast(x, src=w - 1); return torch.equal(values(x), data(n, w - 1))
        check(f"broadcast_{n}", bcast)

        def ag(n=n):
            outs = [dev(torch.zeros(n)) for _ in range(w)]
            dist.all_gather(outs, dev(data(n, r)), async_op=True).wait()
            return all(torch.equal(values(o), data(n, q)) for q, o in enumerate(outs))
        check(f"all_gather_{n}", ag)

        def agt(n=n):
            out = dev(torch.zeros(n * w)); dist.all_gather_into_tensor(out, dev(data(n, r)))
            return torch.equal(values(out), torch.cat([data(n, q) for q in range(w)]))
        check(f"all_gather_into_tensor_{n}", agt)

        def rst(n=n):
            out = dev(torch.zeros(n)); x = dev(torch.cat([data(n, r + b) for b in range(w)]))
            dist.reduce_scatter_tensor(out, x, async_op=True).get_future().wait()
            return torch.equal(values(out), sum(data(n, q + r) for q in range(w)))
        check(f"reduce_scatter_tensor_{n}", rst)

        def a2a(n=n):
            out = dev(torch.zeros(n * w)); x = dev(torch.cat([data(n, 10 * r + b) for b in range(w)]))
            dist.all_to_all_single(out, x)
            return torch.equal(values(out), torch.cat([data(n, 10 * q + r) for q in range(w)]))
        check(f"all_to_all_single_{n}", a2a)

        def red(n=n):
            x = dev(data(n, r)); dist.reduce(x, dst=0)
            return r != 0 or torch.equal(values(x), sum(data(n, q) for q in range(w)))
        check(f"reduce_{n}", red)

        def sendrecv(n=n):
            if r == 0:
                dist.send(dev(data(n, 0)), 1)
                x = dev(torch.zeros(n)); seen = []
                dist.irecv(x, 1).get_future().then(lambda f: seen.append(x.mul(1))).wait()
                return torch.equal(values(x), data(n, 1)) and len(seen) == 1
            if r == 1:
                x = dev(torch.zeros(n)); dist.recv(x, 0)
                ok = torch.equal(values(x), data(n, 0))
                dist.isend(dev(data(n, 1)), 0).wait()
                return ok
            return True
        check(f"send_recv_{n}", sendrecv)

    def from_other_thread():
        """A DDP-style bucket flow: the autograd thread issues the all_reduce and chains the copy into .grad;
        the main thread waits at the end of backward."""
        n = 300_000
        grad = dev(torch.zeros(n)); bucket = dev(data(n, r)); futs = []

        def backward():
            futs.append(dist.all_reduce(bucket, async_op=True).get_future().then(
                lambda f: grad.copy_(f.value()[0])))
        t = threading.Thread(target=backward, name="autograd-sim"); t.start(); t.join()
        futs[0].wait()
        return torch.equal(values(grad), sum(data(n, q) for q in range(w)))
    check("bucket_flow_from_autograd_thread", from_other_thread, issuer="autograd-sim")

    class Bucket:  # what the hooks use of dist.GradBucket
        def __init__(self, t, i): self.t, self.i = t, i
        def buffer(self): return self.t
        def index(self): return self.i

    state = CompressionState()
    for name, hook in (("int8", int8_hook), ("fp16", fp16_hook), ("bf16", bf16_hook)):
        def run_hook(hook=hook):
            # A device bucket: the average comes back in host memory (DDP copies it into .grad itself);
            # the bucket is left as it was.
            n = 200_000
            g = dev(torch.full((n,), float(r + 1)))
            out = hook(state, Bucket(g, 0)).wait()
            want = sum(q + 1 for q in range(w)) / w
            return (out.is_cpu and bool(torch.allclose(out, torch.full((n,), want), atol=0.02))
                    and torch.equal(values(g), torch.full((n,), float(r + 1))))
        check(f"{name}_hook", run_hook)
        check(f"{name}_hook_again", run_hook)  # error feedback: the residual from the first call is reused

    overlap_checks(checks, check, log)
    ddp_checks(checks, log)
    error_into_backward(checks)
    result(checks)


def overlap_checks(checks, check, log) -> None:
    """An async op on device tensors returns before it is done, and completes however torch consumes it."""
    r, w = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    n = 4 << 20  # 16 MB of float32: integers, so every backend's sums are exact

    def want(k):
        ref = torch.arange(n, dtype=torch.float32) % 1000 + r + k
        dist.all_reduce(ref, group=gloo)  # the CPU + gloo result
        return ref

    def unfinished_at_return():
        # Deterministic: the last rank issues its part only after every other rank has looked at its work,
        # so none of theirs can have finished by then. The last rank's timings are reported, not checked.
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r)
        ref = want(0)
        store = dist.distributed_c10d._get_default_store()
        if r != w - 1:
            t0 = time.perf_counter()
            work = dist.all_reduce(x, async_op=True)
            issue_s = time.perf_counter() - t0
            unfinished = not work.is_completed()
            store.set(f"looked{r}", "1")
            work.wait()
            emit("TIMING", {"issue_s": issue_s, "done_s": time.perf_counter() - t0})
        else:
            store.wait([f"looked{q}" for q in range(w - 1)])
            unfinished = True
            dist.all_reduce(x, async_op=True).wait()
        return unfinished and torch.equal(values(x), ref)
    check("async_16MB_returns_unfinished", unfinished_at_return)

    def future_wait():
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 1)
        value = dist.all_reduce(x, async_op=True).get_future().wait()
        return value[0] is x and torch.equal(values(x), want(1))
    check("async_future_wait", future_wait)

    def then_chain():
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 2)
        fut = dist.all_reduce(x, async_op=True).get_future()
        out = fut.then(lambda f: f.value()[0] * 2).then(lambda f: f.value() + 1).wait()
        return torch.equal(values(out), want(2) * 2 + 1)
    check("async_then_chain", then_chain)

    def poll_is_completed():
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 3)
        work = dist.all_reduce(x, async_op=True)
        while not work.is_completed():  # nothing else drives it: is_completed() completes it once in
            time.sleep(0.001)
        return torch.equal(values(x), want(3))
    check("async_poll_is_completed", poll_is_completed)

    def poll_done():
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 4)
        fut = dist.all_reduce(x, async_op=True).get_future()
        while not fut.done():
            time.sleep(0.001)
        return torch.equal(values(x), want(4))
    check("async_poll_future_done", poll_done)

    def issue_order():
        # Two ops on one tensor, the second issued before the first is waited on: it reads the first's result.
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 5)
        a = dist.all_reduce(x, async_op=True)
        b = dist.broadcast(x, src=0, async_op=True)
        b.wait()
        ref = want(5)
        dist.broadcast(ref, src=0, group=gloo)
        return a.is_completed() and torch.equal(values(x), ref)
    check("async_ops_take_effect_in_issue_order", issue_order)

    def next_op_completes():
        # The issuing thread's next op completes the earlier one (its callbacks run there).
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 6)
        seen = []
        work = dist.all_reduce(x, async_op=True)
        work.get_future().add_done_callback(lambda f: seen.append(threading.current_thread().name))
        dist.barrier()  # all ranks' bytes are in once everyone is here
        time.sleep(0.2)
        dist.all_reduce(dev_t(torch.ones(3)))
        return seen == ["MainThread"] and torch.equal(values(x), want(6))
    check("next_op_completes_earlier_ones", next_op_completes)

    def in_final_callback():
        # autograd's final callbacks (DDP's static_graph first pass issues its buckets there, then waits in
        # C++): an op issued there completes before it returns.
        p = dev_t(torch.ones(1000)).requires_grad_()
        got = []

        def final():
            x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 7)
            work = dist.all_reduce(x, async_op=True)
            got.append((work.is_completed(), x))

        p.register_post_accumulate_grad_hook(lambda t: Variable._execution_engine.queue_callback(final))
        p.sum().backward()
        return got[0][0] and torch.equal(values(got[0][1]), want(7))
    check("issued_in_autograd_final_callback", in_final_callback, issuer="*")

    def functional():
        from torch.distributed import _functional_collectives as fc
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 8)
        out = fc.all_reduce(x, "sum", dist.group.WORLD)
        return torch.equal(values(fc.wait_tensor(out)), want(8))
    check("functional_all_reduce", functional)

    def compiled():
        from torch.distributed import _functional_collectives as fc
        x = dev_t(torch.arange(n, dtype=torch.float32) % 1000 + r + 9)
        fn = torch.compile(lambda t: fc.all_reduce(t * 2, "sum", dist.group.WORLD) + 1, backend="aot_eager")
        return torch.equal(values(fn(x)), want(9) * 2 + 1)
    check("compiled_functional_all_reduce", compiled)


def dev_t(t):
    return t.to("tbfake")


def ddp_checks(checks, log) -> None:
    """DDP on the device, with and without hooks, trains bit for bit as DDP on the CPU over this backend
    (and close to CPU + gloo); no device op runs on a backend thread."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

    def train(device, group, hook, state, **kw):
        model = DDP(make().to(device), process_group=group, bucket_cap_mb=0.004, **kw)  # several buckets
        if hook is not None:
            model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step + 7 * r)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
        return [values(p) for p in model.module.parameters()]

    cases = {
        "default": (None, None, {}),
        "gradient_as_bucket_view": (None, None, {"gradient_as_bucket_view": True}),
        "torch_allreduce_hook": (default_hooks.allreduce_hook, None, {}),
        "torch_fp16_hook": (default_hooks.fp16_compress_hook, None, {}),
        "int8_hook": (int8_hook, "state", {}),
        "fp16_hook": (fp16_hook, "state", {}),
        "bf16_hook": (bf16_hook, "state", {}),
    }
    for name, (hook, state, kw) in cases.items():
        try:
            log.clear()
            on_device = train("tbfake", None, hook, CompressionState() if state else None, **kw)
            backend_ops = log.on_backend_threads()
            on_cpu = train("cpu", None, hook, CompressionState() if state else None, **kw)
            with_gloo = train("cpu", gloo, hook, CompressionState(process_group=gloo) if state else None, **kw)
        except Exception as exc:  # noqa: BLE001 - the check's outcome
            checks[f"ddp_{name}"] = f"{type(exc).__name__}: {exc}"
            continue
        same = all(torch.equal(a, b) for a, b in zip(on_device, on_cpu))
        close = all(torch.allclose(a, b, atol=1e-5 if state is None else 1e-2) for a, b in zip(on_device, with_gloo))
        checks[f"ddp_{name}"] = True if same and close and not backend_ops else {
            "same_as_cpu": same, "close_to_gloo": close, "device_ops_on_backend_threads": backend_ops[:5]}


def error_into_backward(checks) -> None:
    """A DDP exchange that fails (ranks all-reduce different dtypes) raises from backward() on every rank:
    DDP waits on the bucket futures in C++, where a completed future looks like a success. Last: the
    group is broken afterwards."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()

    def mismatched(state, bucket):
        t = bucket.buffer() if r == 0 else bucket.buffer().to(torch.float16)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: bucket.buffer())

    model = DDP(torch.nn.Linear(4, 4).to("tbfake"))
    model.register_comm_hook(None, mismatched)
    try:
        model(torch.ones(2, 4).to("tbfake")).sum().backward()
        checks["error_raised_from_backward"] = "backward() returned"
    except Exception as exc:  # noqa: BLE001 - the check's outcome
        checks["error_raised_from_backward"] = True if "MismatchError" in f"{type(exc).__name__}: {exc}" else repr(exc)


if __name__ == "__main__":
    main({"device_checks": device_checks})
