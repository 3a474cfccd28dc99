"""Soak: a long seeded stream of random collectives (ops, sizes, dtypes, subgroups, async batches) on every
rank, each result checked bit-exactly against algorithms/reference.py, resident memory sampled.

Every rank draws the same op sequence from the seed and regenerates every member's input from
(seed, op index, rank), so it can compute the reference answer alone. Inputs are small integers, so sums
and products are exact in every dtype and the comparison is `torch.equal`.
"""
from __future__ import annotations

from tests.core.mp import PRELUDE

SCRIPT = PRELUDE + r"""
import datetime, itertools, random, psutil
from torch_thunderbolt.algorithms import reference as ref

dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=120))
r, w = dist.get_rank(), dist.get_world_size()
N, SEED = int(os.environ["TB_OPS"]), int(os.environ["TB_SEED"])
SELFTEST = os.environ.get("TB_SELFTEST") == "1"
subsets = [c for k in range(2, w + 1) for c in itertools.combinations(range(w), k)]
groups = {s: (dist.new_group(list(s)) if len(s) < w else dist.group.WORLD) for s in subsets}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
FLOAT_OPS = ["sum", "min", "max", "product"]
INT_OPS = FLOAT_OPS + ["band", "bor", "bxor"]
REDOP = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
         "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
         "bxor": dist.ReduceOp.BXOR}
KINDS = ["all_reduce"] * 4 + ["broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce", "send_recv"]

def draw(i):
    rng = random.Random(SEED * 1000003 + i)
    members = rng.choice(subsets) if rng.random() < 0.4 else tuple(range(w))
    kind, dtype = rng.choice(KINDS), rng.choice(DTYPES)
    op = rng.choice(INT_OPS if not dtype.is_floating_point else FLOAT_OPS)
    big = rng.random() < 0.05
    n = max(1, int(2 ** rng.uniform(0, 20 if big else 16)))
    n = -(-n // len(members)) * len(members)  # divisible by the group size (reduce_scatter, all_to_all)
    return dict(members=members, kind=kind, dtype=dtype, op=op, n=n, root=rng.randrange(len(members)),
                pair=rng.sample(members, 2), async_=kind != "send_recv" and rng.random() < 0.3)

def make_input(i, q, d):
    g = torch.Generator().manual_seed((SEED * 1000003 + i) * 16 + q)
    low = 0 if d["dtype"] == torch.uint8 or d["op"] == "product" else -3
    high = 3 if d["op"] == "product" else 4
    return torch.randint(low, high, (d["n"],), generator=g).to(d["dtype"])

def issue(i, d):
    # -> (work or None, check function) for this rank; None when this rank is not a member
    if r not in d["members"]:
        return None
    members, g = d["members"], groups[d["members"]]
    me, gsize = members.index(r), len(members)
    ins = [make_input(i, q, d) for q in members]
    x = ins[me].clone()
    kind, root_global = d["kind"], members[d["root"]]
    a = d["async_"]
    if kind == "all_reduce":
        work = dist.all_reduce(x, REDOP[d["op"]], group=g, async_op=a)
        return work, lambda: [(x, ref.all_reduce(ins, d["op"])[me])]
    if kind == "broadcast":
        work = dist.broadcast(x, root_global, group=g, async_op=a)
        return work, lambda: [(x, ins[d["root"]])]
    if kind == "all_gather":
        out = torch.empty(d["n"] * gsize, dtype=d["dtype"])
        work = dist.all_gather_into_tensor(out, x, group=g, async_op=a)
        return work, lambda: [(out, ref.all_gather(ins)[me])]
    if kind == "reduce_scatter":
        out = torch.empty(d["n"] // gsize, dtype=d["dtype"])
        op = d["op"] if d["op"] in ("sum", "min", "max", "product") else "sum"
        work = dist.reduce_scatter_tensor(out, x, REDOP[op], group=g, async_op=a)
        return work, lambda: [(out, ref.reduce_scatter(ins, op, [d["n"] // gsize] * gsize)[me])]
    if kind == "all_to_all":
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=g, async_op=a)
        splits = [[d["n"] // gsize] * gsize for _ in members]
        return work, lambda: [(out, ref.all_to_all(ins, splits)[me])]
    if kind == "reduce":
        work = dist.reduce(x, root_global, REDOP[d["op"]], group=g, async_op=a)
        return work, lambda: [(x, ref.reduce_all(ins, d["op"]))] if r == root_global else []
    src, dst = d["pair"]
    if r == src:
        dist.send(x, dst)
        return None, lambda: []
    if r == dst:
        y = torch.empty_like(x)
        dist.recv(y, src)
        return None, lambda: [(y, ins[members.index(src)])]
    return None

proc = psutil.Process()
rss = {"start": proc.memory_info().rss}

def shmem_mb():
    # Shared-memory pages this process has touched (Linux): they count in RSS but are the shm transport's
    # fixed-size rings and windows, filled in as traffic first reaches them, not heap growth.
    try:
        with open("/proc/self/status") as f:
            return next((int(l.split()[1]) >> 10 for l in f if l.startswith("RssShmem:")), None)
    except OSError:
        return None
mismatches, bad, pending, done, t0 = 0, [], [], 0, time.monotonic()

def settle():
    global mismatches, done
    for i, d, work, check in pending:
        if work is not None:
            work.wait()
        for got, want in check():
            if SELFTEST and i == 0:
                got = got.clone().flatten()
                got[0] += 1  # prove the checker sees a wrong element
            if not torch.equal(got, want):
                mismatches += 1
                if len(bad) < 5:
                    bad.append(f"op {i}: {d['kind']} {d['op']} {d['dtype']} n={d['n']} members={d['members']}")
        done += 1
    pending.clear()

for i in range(N):
    d = draw(i)
    res = issue(i, d)
    if res is not None:
        pending.append((i, d, *res))
    if not d["async_"] or len(pending) >= 4:
        settle()
    if i == N // 10:
        rss["warm"] = proc.memory_info().rss
    if N >= 1000 and i % (N // 20) == 0:
        rss.setdefault("trace_mb", []).append(proc.memory_info().rss >> 20)
        rss.setdefault("shmem_trace_mb", []).append(shmem_mb())
        print(f"PROGRESS {i} {time.monotonic() - t0:.0f}s rss={proc.memory_info().rss >> 20}MB", flush=True)
settle()
dist.barrier()
rss["end"] = proc.memory_info().rss
rss["end_shmem_mb"] = shmem_mb()
from torch_thunderbolt.backend.process_group import _live_groups
# Scratch each group keeps for its largest op so far: bounded by (groups x largest op), not a leak.
rss["scratch_mb"] = round(sum(getattr(pg._comm, "_scratch", None).numel() for pg in _live_groups
                              if getattr(pg._comm, "_scratch", None) is not None) / 2**20, 1)
result({"ops": N, "participated": done, "mismatches": mismatches, "bad": bad, "rss": rss,
        "seconds": round(time.monotonic() - t0, 1)})
dist.destroy_process_group()
"""
