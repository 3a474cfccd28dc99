"""Ranks of test_device_threads.py: every collective on tensors of the fake accelerator (fake_device), each
checked for exact values and for which threads ran ops on device tensors (only the issuer's, or the main
thread that waits)."""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.hooks import CompressionState, bf16_hook, fp16_hook, int8_hook
from torch_thunderbolt.testing.fake_device import install, values
from torch_thunderbolt.testing.program import main, result


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
        it ran must have run in `issuer` or the main thread (which waits)."""
        log.clear()
        try:
            ok = fn()
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}"
            return
        bad = sorted({t for t in log.threads() if t not in (issuer, "MainThread")})
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
            n = 200_000
            g = dev(torch.full((n,), float(r + 1)))
            out = hook(state, Bucket(g, 0)).wait()
            want = sum(q + 1 for q in range(w)) / w
            got = values(g)
            return out.device.type == D and bool(torch.allclose(got, torch.full((n,), want), atol=0.02))
        check(f"{name}_hook", run_hook)
        check(f"{name}_hook_again", run_hook)  # error feedback: the residual from the first call is reused
    result(checks)


if __name__ == "__main__":
    main({"device_checks": device_checks})
