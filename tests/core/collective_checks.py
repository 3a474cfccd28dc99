"""Script text for rank programs: every collective of the torch API on W ranks, each result compared with
exact values (small integers, so every sum is exact in float32); what is wrong is collected in `bad`.
Used by the lab cluster tests and the hybrid transport tests (needs RANK, W, torch, dist, time)."""

EVERY_COLLECTIVE = """
bad = []

def data(n, r):
    # small integers: every sum below is exact in float32
    return (torch.arange(n, dtype=torch.float32) % 97) + 1000 * r

def total(n):
    return (torch.arange(n, dtype=torch.float32) % 97) * W + 1000 * sum(range(W))

def check(name, got, want):
    if not torch.equal(got, want):
        diff = (got != want).nonzero()
        bad.append(f"{name}: {diff.numel()} wrong, first at {diff[:1].flatten().tolist()}")

def every_collective():
    for label, n in (("small", 1000), ("large", (1 << 20) + 3)):
        t = data(n, RANK)
        dist.all_reduce(t)
        check(f"all_reduce sum {label}", t, total(n))
        t = data(n, RANK)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check(f"all_reduce max {label}", t, data(n, W - 1))
        for root in range(W):
            t = data(n, RANK) if RANK == root else torch.zeros(n)
            dist.broadcast(t, src=root)
            check(f"broadcast root {root} {label}", t, data(n, root))
        for root in (0, W - 1):
            t = data(n, RANK)
            dist.reduce(t, dst=root)
            if RANK == root:
                check(f"reduce root {root} {label}", t, total(n))
            else:  # non-roots keep their input
                check(f"reduce input kept {root} {label}", t, data(n, RANK))
        outs = [torch.zeros(n) for _ in range(W)]
        dist.all_gather(outs, data(n, RANK))
        for r in range(W):
            check(f"all_gather from {r} {label}", outs[r], data(n, r))
        out = torch.zeros(n)
        dist.reduce_scatter(out, [data(n, RANK) + r for r in range(W)])
        check(f"reduce_scatter {label}", out, total(n) + W * RANK)
        outs = [torch.zeros(n) for _ in range(W)]
        dist.all_to_all(outs, [data(n, RANK) + 10 * r for r in range(W)])
        for r in range(W):
            check(f"all_to_all from {r} {label}", outs[r], data(n, r) + 10 * RANK)
        # send/recv between every ordered pair, cabled or not
        for src in range(W):
            for dst in range(W):
                if src == dst:
                    continue
                if RANK == src:
                    dist.send(data(n, src) + dst, dst=dst, tag=7)
                elif RANK == dst:
                    t = torch.zeros(n)
                    dist.recv(t, src=src, tag=7)
                    check(f"send/recv {src}->{dst} {label}", t, data(n, src) + dst)
        dist.barrier()

def check_barrier(delay):
    # barrier: nobody leaves before the last rank arrives
    if RANK == W - 1:
        time.sleep(delay)
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    dist.barrier()
    left = torch.tensor([time.time()], dtype=torch.float64)
    arrived = [torch.zeros(1, dtype=torch.float64) for _ in range(W)]
    dist.all_gather(arrived, stamp)
    if left.item() < max(a.item() for a in arrived) - 0.05:
        bad.append("barrier: left before the last rank arrived")
"""
