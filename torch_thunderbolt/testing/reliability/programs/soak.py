"""A rank of the soak / stress run (tests/reliability/test_soak.py, scripts/reliability/soak.py): a long
seeded stream of random collectives on every rank, each result checked bit-exactly against a reference
computed locally (algorithms/reference.py), resident memory sampled.

Every rank draws the same op sequence from the seed and regenerates every member's input from
(seed, op index, rank), so it can compute the reference answer alone. Inputs are small integers (and
premul factors powers of two or -1, 3), so sums, products and averages are exact or rounded the same way
in every dtype, and the comparison is `torch.equal`.

What is drawn (all from one shared `random.Random` per op):
- kinds: all_reduce (always in place), broadcast, all_gather_into_tensor, reduce_scatter_tensor,
  all_to_all_single (even splits, or uneven ones), reduce, send/recv on the default group;
- the in-place forms: reduce_scatter_tensor whose output is this rank's slice of the input,
  all_gather_into_tensor whose input is this rank's slice of the output, all_to_all_single with
  output is input; and the stacked forms (all_gather's output, reduce_scatter's input of shape (group, n));
- shapes: 1 ... 65,536 elements (5 % up to 1 M), 0-d tensors, empty tensors, and for all_reduce, broadcast,
  reduce and send/recv views that are not contiguous (a transposed 2-D tensor, x[::2], the size-1 strided
  `torch.zeros(2)[::2]`), each rank its own layout, with the memory around a view checked untouched;
- dtypes float32/64, float16, bfloat16, int32/64, uint8, bool, complex64; reduce ops SUM, AVG (floating and
  complex), PRODUCT, MIN, MAX, BAND/BOR/BXOR (integers and bool), PREMUL_SUM (floating), each where the
  backend computes it;
- (op, dtype) pairs the backend does not compute (AVG on int32, BAND on float32, MIN on complex64, any op on
  uint16): every rank must get a ValueError before any traffic and the group must go on;
- 40 % on a random subgroup (every subset of >= 2 ranks is a group); 30 % with async_op=True in batches of
  up to 4 across groups.

TB_MIXED=random (or TB_MIXED=sum,max: the two ops; TB_MIXED_KIND=reduce: the collective) ends the run
with one collective whose reduce op differs between ranks (SUM on some, MAX or AVG or ... on the others):
every rank must raise MismatchError, never return its own op's result and never time out. It breaks the
group, so it is the last op. TB_MISMATCH=<case> ends it instead with a pair of calls that pair up but
do not mean the same (another dtype, element count, split sizes or packing; `mismatched_call`), which
must be a MismatchError on every rank.
"""
from __future__ import annotations

import datetime
import itertools
import os
import random
import sys
import time
import traceback

import psutil
import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.testing.program import Exit, main, outcome, result


def soak() -> Exit | None:

    TIMEOUT = float(os.environ.get("TB_TIMEOUT", "120"))
    dist.init_process_group("thunderbolt", timeout=datetime.timedelta(seconds=TIMEOUT))
    r, w = dist.get_rank(), dist.get_world_size()
    N, SEED = int(os.environ["TB_OPS"]), int(os.environ["TB_SEED"])
    SELFTEST = os.environ.get("TB_SELFTEST") == "1"
    MIXED = os.environ.get("TB_MIXED", "")  # "random", or the two ops ("sum,max"); empty: no mixed op
    subsets = [c for k in range(2, w + 1) for c in itertools.combinations(range(w), k)]
    groups = {s: (dist.new_group(list(s)) if len(s) < w else dist.group.WORLD) for s in subsets}
    FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    INTS = [torch.int32, torch.int64, torch.uint8]
    DTYPES = FLOATS * 2 + INTS * 2 + [torch.bool, torch.complex64]
    OPS_FOR = {"float": ["sum", "avg", "product", "min", "max", "premul_sum"],
               "int": ["sum", "product", "min", "max", "band", "bor", "bxor"],
               "bool": ["sum", "product", "min", "max", "band", "bor", "bxor"],
               "complex": ["sum", "avg"]}
    REDOP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
             "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
             "bxor": dist.ReduceOp.BXOR}
    PREMUL = [0.5, 2.0, -1.0, 0.25, 3.0]
    KINDS = ["all_reduce"] * 4 + ["broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce", "send_recv"]
    VIEW_KINDS = ("all_reduce", "broadcast", "reduce", "send_recv")  # layouts other than a flat tensor
    # Pairs the backend refuses (ValueError before any traffic): torch has no kernel or the op is undefined.
    # Also AVG on bool and PREMUL_SUM on integers and bool (torch cannot divide or scale those in place).
    REFUSED = [("all_reduce", "avg", torch.int32), ("all_reduce", "band", torch.float32),
               ("all_reduce", "min", torch.complex64), ("reduce_scatter", "bxor", torch.float64),
               ("all_reduce", "sum", torch.uint16), ("reduce", "max", torch.complex64),
               ("all_reduce", "avg", torch.bool), ("reduce_scatter", "avg", torch.bool),
               ("all_reduce", "premul_sum", torch.int32), ("reduce", "premul_sum", torch.bool)]

    def dclass(dtype):
        return ("bool" if dtype == torch.bool else "complex" if dtype.is_complex else
                "float" if dtype.is_floating_point else "int")

    def redop(d):
        if d["op"] == "premul_sum":
            return dist._make_nccl_premul_sum(d["factor"])
        return REDOP[d["op"]]

    def draw(i):
        rng = random.Random(SEED * 1000003 + i)
        members = rng.choice(subsets) if rng.random() < 0.4 else tuple(range(w))
        g = len(members)
        roll = rng.random()
        kind = ("refused" if roll < 0.02 else "all_to_all_v" if roll < 0.06 else rng.choice(KINDS))
        dtype = rng.choice(DTYPES)
        d = dict(members=members, kind=kind, dtype=dtype, root=rng.randrange(g), pair=rng.sample(members, 2),
                 async_=kind not in ("send_recv", "refused") and rng.random() < 0.3, inplace=False, factor=None,
                 shape="flat", layouts=["flat"] * g, splits=None)
        if kind == "refused":
            d["kind"], d["op"], d["dtype"] = rng.choice(REFUSED)
            d["n"] = g * rng.choice((1, 5, 300))
            d["refused"] = True
            d["factor"] = 2.0 if d["op"] == "premul_sum" else None
            return d
        d["op"] = rng.choice(OPS_FOR[dclass(dtype)])
        if d["op"] == "premul_sum":
            d["factor"] = rng.choice(PREMUL)
        if kind == "all_to_all_v":  # uneven splits: rank a sends splits[a][b] elements to rank b
            d["splits"] = [[rng.choice((0, 1, 3, 17, 1000)) for _ in members] for _ in members]
            d["n"] = None
            return d
        shape = rng.choices(["flat", "views", "one", "empty"], [70, 15, 8, 7])[0]
        if shape == "views" and kind not in VIEW_KINDS:
            shape = "flat"
        if shape == "one" and kind in ("reduce_scatter", "all_to_all"):
            shape = "empty" if rng.random() < 0.5 else "flat"
        d["shape"] = shape
        if shape == "flat":
            big = rng.random() < 0.05
            n = max(1, int(2 ** rng.uniform(0, 20 if big else 16)))
            d["n"] = -(-n // g) * g  # divisible by the group size (reduce_scatter, all_to_all)
            d["inplace"] = kind in ("all_gather", "reduce_scatter", "all_to_all") and rng.random() < 0.5
            # torch's other form: all_gather's output / reduce_scatter's input as (group size, n) (stacked)
            d["stacked"] = kind in ("all_gather", "reduce_scatter") and rng.random() < 0.3
        elif shape == "views":
            a, b = rng.randint(2, 300), rng.randint(2, 300)
            d["n"], d["ab"] = a * b, (a, b)
            d["layouts"] = [rng.choice(("flat", "t2d", "step2")) for _ in members]
        elif shape == "one":
            d["n"] = 1
            d["layouts"] = [rng.choice(("flat", "zero_d", "size1_strided")) if kind in VIEW_KINDS else
                            rng.choice(("flat", "zero_d")) for _ in members]
        else:
            d["n"] = 0
            d["layouts"] = [rng.choice(("flat", "empty_2d")) for _ in members]
            d["inplace"] = kind in ("all_gather", "reduce_scatter", "all_to_all") and rng.random() < 0.5
        return d

    def values(i, q, d, n=None):
        # member q's input values, flat
        n = d["n"] if n is None else n
        g = torch.Generator().manual_seed((SEED * 1000003 + i) * 16 + q)
        dt = d["dtype"]
        if dt == torch.bool:
            return torch.randint(0, 2, (n,), generator=g).bool()
        low = 0 if dt == torch.uint8 or d["op"] == "product" else -3
        high = 3 if d["op"] == "product" else 4
        if dt.is_complex:
            re, im = (torch.randint(low, high, (n,), generator=g).float() for _ in range(2))
            return torch.complex(re, im).to(dt)
        return torch.randint(low, high, (n,), generator=g).to(dt)

    SENTINEL = 77

    def place(flat, layout, d):
        # -> (tensor in `layout` holding `flat`, check that the memory around the view is untouched)
        n, dt = flat.numel(), flat.dtype
        fill = True if dt == torch.bool else SENTINEL
        if layout == "flat":
            return flat.clone(), lambda: True
        if layout == "t2d":  # a transposed 2-D tensor: not contiguous
            a, b = d["ab"]
            base = torch.empty(b, a, dtype=dt)
            x = base.t()
            x.copy_(flat.view(a, b))
            return x, lambda: True
        if layout in ("step2", "size1_strided"):  # x[::2] of a buffer twice the size; torch.zeros(2)[::2] for n=1
            base = torch.full((2 * n,), fill, dtype=dt)
            x = base[::2]
            x.copy_(flat)
            return x, lambda: bool((base[1::2] == fill).all())
        if layout == "zero_d":
            return flat.reshape(()).clone(), lambda: True
        if layout == "empty_2d":
            return torch.empty(0, 3, dtype=dt), lambda: True
        raise AssertionError(layout)

    def reduced(ins, d):
        # The reference reduction of every member's input, as torch defines it for this op.
        ins = [x * d["factor"] for x in ins] if d["op"] == "premul_sum" else ins
        if d["op"] == "avg" and d["dtype"].is_complex and d["kind"] == "all_reduce":
            # torch's all_reduce hands a complex tensor to the backend as a real view (torch.view_as_real), so
            # the average divides real and imaginary parts as floats; complex division rounds differently.
            return torch.view_as_complex(torch.view_as_real(ref.reduce_all(ins, "sum")) / len(ins))
        return ref.reduce_all(ins, "sum" if d["op"] == "premul_sum" else d["op"])

    def issue(i, d):
        # -> (work or None, check function -> [(got, want)]) for this rank; None when this rank is not a member
        if r not in d["members"]:
            return None
        members, g = d["members"], groups[d["members"]]
        me, gsize = members.index(r), len(members)
        kind, root_global = d["kind"], members[d["root"]]
        a = d["async_"]
        if d.get("refused"):
            # Refused means a ValueError before any traffic: the tensor is untouched and the group goes on (the
            # ops after this one show that). Anything else is recorded and the stream goes on if it can.
            x = ((torch.arange(d["n"]) + r) % 2).to(d["dtype"])  # any reduction would change some rank's x
            before = x.clone()
            try:
                if kind == "all_reduce":
                    dist.all_reduce(x, redop(d), group=g)
                elif kind == "reduce":
                    dist.reduce(x, root_global, redop(d), group=g)
                else:
                    dist.reduce_scatter_tensor(torch.empty(d["n"] // gsize, dtype=d["dtype"]), x, redop(d), group=g)
                got = "no error"
            except ValueError:
                got = None
            except Exception as exc:
                got = f"{type(exc).__name__}: {exc}"[:300]
            touched = not torch.equal(x, before)
            if got or touched:
                refusals.append(describe(i, d) + f": {got or 'ValueError'}" + (", tensor changed" if touched else ""))
            return None, lambda: []
        if kind == "all_to_all_v":
            splits = d["splits"]
            ins = [values(i, q, d, sum(splits[k])) for k, q in enumerate(members)]
            x = ins[me].clone()
            out = torch.full((sum(s[me] for s in splits),), 0, dtype=d["dtype"])
            work = dist.all_to_all_single(out, x, [s[me] for s in splits], splits[me], group=g, async_op=a)
            return work, lambda: [(out, ref.all_to_all(ins, splits)[me])]
        ins = [values(i, q, d) for q in members]
        x, untouched = place(ins[me], d["layouts"][me], d)
        checks = lambda pairs: pairs + [(torch.tensor(untouched()), torch.tensor(True))]
        if kind == "all_reduce":
            work = dist.all_reduce(x, redop(d), group=g, async_op=a)
            return work, lambda: checks([(x.reshape(-1), reduced(ins, d))])
        if kind == "broadcast":
            work = dist.broadcast(x, root_global, group=g, async_op=a)
            return work, lambda: checks([(x.reshape(-1), ins[d["root"]])])
        if kind == "reduce":
            work = dist.reduce(x, root_global, redop(d), group=g, async_op=a)
            # (a non-root's tensor holds no defined result)
            return work, lambda: checks([(x.reshape(-1), reduced(ins, d))]
                                        if r == root_global else [])
        if kind == "send_recv":
            src, dst = d["pair"]
            if r == src:
                dist.send(x, dst)
                return None, lambda: checks([(x.reshape(-1), ins[me])])  # the sender's tensor is left alone
            if r == dst:
                y, untouched_y = place(torch.zeros_like(ins[me]), d["layouts"][me], d)
                dist.recv(y, src)
                return None, lambda: [(y.reshape(-1), ins[members.index(src)]),
                                      (torch.tensor(untouched_y()), torch.tensor(True))]
            return None
        n, part = d["n"], d["n"] // gsize
        if kind == "all_gather":
            out = torch.full((gsize, n) if d.get("stacked") else (n * gsize,), 0, dtype=d["dtype"])
            if d["inplace"]:  # the input is this rank's slice of the output
                x = out.view(-1)[me * n : (me + 1) * n]
                x.copy_(ins[me])
            work = dist.all_gather_into_tensor(out, x, group=g, async_op=a)
            return work, lambda: [(out.reshape(-1), ref.all_gather(ins)[me])]
        if kind == "reduce_scatter":
            x = x.view(gsize, part) if d.get("stacked") else x
            out = x.view(-1)[me * part : (me + 1) * part] if d["inplace"] else torch.empty(part, dtype=d["dtype"])
            work = dist.reduce_scatter_tensor(out, x, redop(d), group=g, async_op=a)
            return work, lambda: [(out, reduced(ins, d)[me * part : (me + 1) * part])]
        if kind == "all_to_all":
            out = x if d["inplace"] else torch.empty_like(x)
            work = dist.all_to_all_single(out, x, group=g, async_op=a)
            splits = [[part] * gsize for _ in members]
            return work, lambda: [(out.reshape(-1), ref.all_to_all(ins, splits)[me])]
        raise AssertionError(kind)

    def features(d):
        f = [f"kind:{d['kind']}", f"dtype:{str(d['dtype'])[6:]}", f"shape:{d['shape']}"]
        if d["kind"] in ("all_reduce", "reduce", "reduce_scatter") or d.get("refused"):
            f.append(f"op:{d['op']}")
        if d.get("refused"):
            f.append("refused")
        if d["inplace"]:
            f.append(f"inplace:{d['kind']}")
        if d.get("stacked"):
            f.append(f"stacked:{d['kind']}")
        if d["async_"]:
            f.append("async")
        f += [f"layout:{lay}" for lay in set(d["layouts"]) if lay != "flat"]
        return f

    def describe(i, d):
        keys = ("kind", "op", "dtype", "n", "members", "shape", "layouts", "inplace", "stacked", "async_", "factor",
                "splits")
        return f"op {i}: " + ", ".join(f"{k}={d.get(k)}" for k in keys if d.get(k) is not None)

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
    seen = {}
    errors = []
    refusals = []  # unsupported (op, dtype) pairs not refused cleanly
    selftest_done = []  # TB_SELFTEST corrupts the first result element this rank checks

    def settle():
        nonlocal mismatches, done
        for i, d, work, check in pending:
            if work is not None:
                work.wait()
            for got, want in check():
                if SELFTEST and not selftest_done and got.numel():
                    selftest_done.append(i)
                    got = got.clone().flatten()
                    got[0] = ~got[0] if got.dtype == torch.bool else got[0] + 1  # prove the checker sees it
                # reshape: a result is checked element by element whatever the layout (a (0, 3) view is empty)
                if got.dtype != want.dtype or not torch.equal(got.reshape(-1), want.reshape(-1)):
                    mismatches += 1
                    if len(bad) < 5:
                        bad.append(describe(i, d) + f": got {got.reshape(-1)[:6].tolist()} want "
                                   f"{want.reshape(-1)[:6].tolist()}")
            for f in features(d):
                seen[f] = seen.get(f, 0) + 1
            done += 1
        pending.clear()

    current = None
    try:
        for i in range(N):
            d = draw(i)
            current = (i, d)
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
        current = None
        settle()
        dist.barrier()
    except Exception as exc:  # reported, not hidden: the test fails on any error
        where = describe(*current) if current else "settling the last batch"
        pend = [describe(i, d) for i, d, _, _ in pending]
        errors.append({"where": where, "pending": pend, "type": type(exc).__name__, "msg": str(exc)[:2000],
                       "trace": traceback.format_exc()[-3000:]})
    rss["end"] = proc.memory_info().rss
    rss["end_shmem_mb"] = shmem_mb()
    from torch_thunderbolt.backend.process_group import ThunderboltProcessGroup
    # Scratch each group keeps for its largest op so far: bounded by (groups x largest op), not a leak.
    ours = [pg for pg in groups.values() if isinstance(pg, ThunderboltProcessGroup)]
    rss["scratch_mb"] = round(sum(pg._comm._scratch.numel() for pg in ours if pg._comm._scratch is not None)
                              / 2**20, 1)
    summary = {"ops": N, "participated": done, "mismatches": mismatches, "bad": bad, "errors": errors,
               "refusals": refusals[:10], "refusal_problems": len(refusals), "rss": rss,
               "seen": seen, "seconds": round(time.monotonic() - t0, 1)}
    result(summary)

    # -- mixed reduce ops: the last op (it breaks the group) -----------------------------------------------------
    MIXED_PAIRS = [("sum", "max"), ("sum", "avg"), ("min", "max"), ("sum", "product"), ("avg", "max"),
                   ("sum", "premul_sum"), ("band", "bor")]

    def draw_mixed():
        rng = random.Random(SEED * 1000003 + 999_999_937)
        a, b = rng.choice(MIXED_PAIRS) if MIXED == "random" else MIXED.split(",")
        kind = rng.choice(("all_reduce", "all_reduce", "reduce_scatter", "reduce"))
        kind = os.environ.get("TB_MIXED_KIND") or kind  # to reproduce one case
        dtype = torch.int32 if a in ("band", "bor", "bxor") else rng.choice((torch.float32, torch.float64, torch.bfloat16))
        n = w * rng.choice((1, 4, 300, 70_000, 600_000))  # one-shot, window / ring paths
        others = rng.sample(range(w), rng.randint(1, w - 1))  # these ranks use b, the rest a
        return dict(kind=kind, ops=(a, b), dtype=dtype, n=n, b_ranks=sorted(others), root=rng.randrange(w),
                    factor=2.0)

    # -- mismatched pairs: calls that pair up, with the same bytes or not, but do not mean the same thing --------
    # (TB_MISMATCH=<case>; the last op, like TB_MIXED.) Every rank must raise MismatchError: at the call, or,
    # for a rank that only sends (a send, a broadcast's root), at its next call; never return a result read
    # in another dtype or packing.
    def mismatched_call(case, n):
        one = r == 0  # rank 0 calls one form, the others the other
        if case == "send_recv_dtype":  # 8 bytes both ways: float32[2] sent, int32[2] expected
            if r == 0:
                dist.send(torch.ones(n), 1)
            elif r == 1:
                dist.recv(torch.zeros(n, dtype=torch.int32), 0)
        elif case == "send_recv_count":
            if r == 0:
                dist.send(torch.ones(n), 1)
            elif r == 1:
                dist.recv(torch.zeros(n + 1), 0)
        elif case == "all_gather_coalesced_dtype":
            dtype = torch.float32 if one else torch.int32
            dist.all_gather_coalesced([[torch.zeros(n, dtype=dtype)] for _ in range(w)], [torch.ones(n, dtype=dtype)])
        elif case == "all_reduce_coalesced_layout":
            dist.all_reduce_coalesced([torch.ones(n), torch.ones(n)] if one else [torch.ones(2 * n)])
        elif case == "all_gather_uneven":  # the same total, other block sizes
            sizes = [n + 1, n - 1] + [n] * (w - 2) if one else [n] * w
            dist.all_gather([torch.zeros(c) for c in sizes], torch.ones(sizes[r]))
        elif case == "all_to_all_splits":  # rank 0 sends rank 1 one element more than rank 1 expects
            ins = [n + 1 if (one and q == 1) else n for q in range(w)]
            outs = [n] * w
            dist.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)
        elif case == "broadcast_dtype":
            dist.broadcast(torch.ones(n, dtype=torch.float32 if one else torch.int32), 0)
        elif case == "sparse_shape":
            size = n if one else 2 * n
            dist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (size,)))
        else:
            raise ValueError(f"unknown TB_MISMATCH case {case!r}")

    MISMATCH = os.environ.get("TB_MISMATCH", "")
    if MISMATCH and not errors:
        time.sleep(0.5)  # every rank has left the barrier: the abort cannot overtake its last message
        got = outcome(lambda: mismatched_call(MISMATCH, int(os.environ.get("TB_MISMATCH_N", "4"))))
        if got["ok"]:
            got["next_call"] = outcome(lambda: dist.barrier())
        got["case"] = MISMATCH
        result(dict(summary, mismatch=got))
        return _exit_once_every_rank_has_its_outcome("tb_soak_mismatch_done", w, TIMEOUT)

    if MIXED and not errors:
        m = draw_mixed()
        mine = m["ops"][1] if r in m["b_ranks"] else m["ops"][0]
        op = dist._make_nccl_premul_sum(m["factor"]) if mine == "premul_sum" else REDOP[mine]
        x = torch.ones(m["n"], dtype=m["dtype"]) * (r + 1)
        time.sleep(0.5)  # every rank has left the barrier: the abort cannot overtake its last message

        def mixed():
            if m["kind"] == "all_reduce":
                dist.all_reduce(x, op)
            elif m["kind"] == "reduce":
                dist.reduce(x, m["root"], op)
            else:
                dist.reduce_scatter_tensor(torch.empty(m["n"] // w, dtype=m["dtype"]), x, op)
        got = outcome(mixed)
        if got["ok"] and m["kind"] == "reduce" and r != m["root"]:
            # A reduce's non-root only sends: like a broadcast's root, it returns before anyone could object,
            # and is told by the rank that found the mismatch at its next call, which must fail the same way.
            got = outcome(lambda: dist.barrier())
            got["at_next_call"] = True
        got["case"] = {k: (str(v) if k == "dtype" else v) for k, v in m.items()} | {"my_op": mine}
        result(dict(summary, mixed=got))
        return _exit_once_every_rank_has_its_outcome("tb_soak_mixed_done", w, TIMEOUT)
    dist.destroy_process_group()
    return None


def _exit_once_every_rank_has_its_outcome(key: str, world: int, timeout: float) -> Exit:
    """After a call that broke the group by design: stay until every rank has its outcome, counted in the
    store under `key` (the group is broken), as a rank that exits early would make a slower one see a lost
    peer instead of the mismatch checked; then exit without waiting for the group's teardown. (Rank 0
    serves the store and may leave as soon as the count is full: a lost store is fine here.)"""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add(key, 1)
        t_end = time.monotonic() + timeout + 30
        while store.add(key, 0) < world and time.monotonic() < t_end:
            time.sleep(0.05)
    except Exception:
        pass
    sys.stdout.flush()
    return Exit(0, hard=True)


if __name__ == "__main__":
    main({"soak": soak})
