"""Ranks of test_shm_algorithms.py: the whole algorithm grid of tests/core/test_algorithms.py over the shm
transport; each rank checks its own results against algorithms/reference.py and reports the failures."""
from __future__ import annotations

import os

import torch

from tests.core import test_algorithms as ta
from torch_thunderbolt.algorithms import reference as ref
from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.testing.program import main, result, shm_rank


def grid() -> None:
    """Every case of every family for every algorithm in ALGOS; the failures, and a digest of one float sum."""
    me = shm_rank()
    t, r, w = me.transport, me.rank, me.world
    fails, done = [], 0

    def check(ok, what):
        nonlocal done
        done += 1
        if not ok:
            fails.append(what)

    def mk(rank, n, dt, seed):
        return ta.make_input(rank, n, dt, seed)
    seq = 0  # one transport, several Communicators: their op numbers go on from the last one's (a group's
    # op numbers only grow; a link holding data of an op this rank has finished reports a mismatch)
    for algo in os.environ["ALGOS"].split(","):
        comm = Communicator(t, ta.CFGS[algo], timeout=60)
        comm.seq = seq
        if algo in ("auto", "direct", "ring"):
            for seed, n, dt, op in ta.cases(w):
                x = mk(r, n, dt, seed)
                comm.all_reduce(x, op)
                check(torch.equal(x, ref.all_reduce([mk(q, n, dt, seed) for q in range(w)], op)[r]),
                      ("all_reduce", algo, n, str(dt), op))
        if algo in ("auto", "direct", "chain"):
            for n in ta.counts_for(w):
                for dt in (torch.float32, torch.int8, torch.bfloat16, torch.bool):
                    for root in range(w):
                        seed = n * 7 + root
                        x = mk(r, n, dt, seed)
                        comm.broadcast(x, root)
                        check(torch.equal(x, mk(root, n, dt, seed)), ("broadcast", algo, n, str(dt), root))
                        op = "sum" if dt != torch.bool else "bor"
                        y = mk(r, n, dt, seed + 7)
                        comm.reduce(y, root, op)
                        if r == root:
                            want = ref.reduce_all([mk(q, n, dt, seed + 7) for q in range(w)], op)
                            check(torch.equal(y, want), ("reduce", algo, n, str(dt), root))
        if algo in ("auto", "direct", "ring"):
            for seed, n in enumerate(ta.counts_for(w)):
                for dt in (torch.float32, torch.int64, torch.float16):
                    xs = [mk(q, n, dt, seed) for q in range(w)]
                    ag = torch.empty(w * n, dtype=dt)
                    comm.all_gather(ag, xs[r])
                    check(torch.equal(ag, torch.cat(xs)), ("all_gather", algo, n, str(dt)))
                    counts = [n + (q % 2) for q in range(w)]
                    xvs = [mk(q, counts[q], dt, seed) for q in range(w)]
                    agv = torch.empty(sum(counts), dtype=dt)
                    comm.all_gather(agv, xvs[r], counts)
                    check(torch.equal(agv, torch.cat(xvs)), ("all_gather_v", algo, n, str(dt)))
                    fulls = [mk(q, sum(counts), dt, seed + 1) for q in range(w)]
                    rs = torch.empty(counts[r], dtype=dt)
                    comm.reduce_scatter(rs, fulls[r], counts, "sum")
                    check(torch.equal(rs, ref.reduce_scatter(fulls, "sum", counts)[r]), ("reduce_scatter", algo, n))
                    root = seed % w
                    g = torch.empty(w * n, dtype=dt) if r == root else None
                    comm.gather(g, xs[r], root, [n] * w)
                    if r == root:
                        check(torch.equal(g, torch.cat(xs)), ("gather", algo, n))
                    src = mk(root, w * n, dt, seed + 2)
                    sc = torch.empty(n, dtype=dt)
                    comm.scatter(sc, src if r == root else None, root, [n] * w)
                    check(torch.equal(sc, torch.split(src, [n] * w)[r]), ("scatter", algo, n))
                    splits = [[(q + p + n) % 3 for p in range(w)] for q in range(w)]
                    ins = [mk(q, sum(splits[q]), dt, seed + 3) for q in range(w)]
                    out = torch.empty(sum(splits[p][r] for p in range(w)), dtype=dt)
                    comm.all_to_all(out, ins[r], splits[r], [splits[p][r] for p in range(w)])
                    check(torch.equal(out, ref.all_to_all(ins, splits)[r]), ("all_to_all", algo, n))
                    comm.barrier()
        seq = comm.seq
    x = torch.randn(5000, generator=torch.Generator().manual_seed(r))
    last = Communicator(t, ta.CFGS["ring"], timeout=60)
    last.seq = seq
    last.all_reduce(x)
    digest = float(x.double().sum())
    t.close()
    result({"done": done, "fails": fails[:20], "nfails": len(fails), "digest": digest})


if __name__ == "__main__":
    main({"grid": grid})
