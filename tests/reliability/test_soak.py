"""Short soak / stress in CI: a few hundred random collectives (kinds, in-place forms, non-contiguous views,
0-d and empty tensors, dtypes, every reduce op, refused pairs, subgroups, async batches) on 2 and 3 ranks,
on the default transport (shared memory on one host) and on TCP, every result checked against a reference
computed locally; each run ends with ranks that disagree on the reduce op, which must be a MismatchError on
every rank. The op stream: torch_thunderbolt/testing/reliability/programs/soak.py; the long runs:
scripts/reliability/soak.py."""
from __future__ import annotations

import pytest

from torch_thunderbolt.testing.ranks import run_ranks
from torch_thunderbolt.testing.reliability.programs import soak

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

# What a CI run must have drawn at least once (over all ranks), so that "0 mismatches" means something.
MUST_SEE = (
    [f"kind:{k}" for k in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
                           "all_to_all_v", "reduce", "send_recv")]
    + [f"inplace:{k}" for k in ("all_gather", "reduce_scatter", "all_to_all")]
    + [f"stacked:{k}" for k in ("all_gather", "reduce_scatter")]
    + [f"layout:{k}" for k in ("t2d", "step2", "size1_strided", "zero_d", "empty_2d")]
    + [f"shape:{k}" for k in ("empty", "one", "views")]
    + [f"dtype:{k}" for k in ("float32", "float64", "bfloat16", "int32", "int64", "bool", "complex64")]
    + [f"op:{k}" for k in ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")]
    + ["refused", "async"]
)

# (world, transport, the mixed reduce ops of the last call). Default = shared memory for ranks on one host.
CONFIGS = [(2, "default", "sum,max"), (3, "default", "sum,avg"), (2, "tcp", "sum,avg"), (3, "tcp", "sum,max")]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{w}-{t}-{m}" for w, t, m in CONFIGS])
def short_soak(request, tmp_path_factory) -> list[dict]:
    """One short run per config, shared by the tests below (each checks one promise)."""
    world, transport, mixed = request.param
    env = {"TB_OPS": "400", "TB_SEED": str(7 + world), "TB_MIXED": mixed, "TB_TIMEOUT": "20"}
    if transport != "default":
        env["THUNDERBOLT_TRANSPORT"] = transport
    results = run_ranks(soak, world, tmp_path_factory.mktemp("soak"), timeout=150, env=env)
    return [r.json() for r in results]


def test_short_soak_exact_results_and_mixed_ops_fail_everywhere(short_soak) -> None:
    outs = short_soak
    for rank, o in enumerate(outs):
        assert not o["errors"], f"rank {rank} failed in the op stream: {o['errors']}"
        assert o["mismatches"] == 0, f"rank {rank}: {o['bad']}"
        assert o["participated"] > 250, o["participated"]
    seen = set().union(*(o["seen"] for o in outs))
    assert not set(MUST_SEE) - seen, f"never drawn: {sorted(set(MUST_SEE) - seen)}"
    for rank, o in enumerate(outs):  # the last op: ranks disagree on the reduce op
        m = o["mixed"]
        assert m["ok"] is False and m["type"] == "MismatchError", f"rank {rank}: {m}"
        assert m["seconds"] < 10, f"rank {rank} took {m['seconds']:.1f}s to see the mismatch: {m}"


def test_short_soak_unsupported_pairs_refused_before_any_traffic(short_soak) -> None:
    """AVG on int32/bool, BAND on float32, uint16, PREMUL_SUM on int32/bool ...: a ValueError on every rank,
    the tensor untouched, and the group goes on (the ops after each one check that)."""
    assert not any(o["refusals"] for o in short_soak), "\n".join(p for o in short_soak for p in o["refusals"])


def test_the_soak_checker_catches_a_wrong_element(tmp_path) -> None:
    env = {"TB_OPS": "5", "TB_SEED": "7", "TB_SELFTEST": "1", "THUNDERBOLT_TRANSPORT": "tcp"}
    results = run_ranks(soak, 2, tmp_path, timeout=120, env=env)
    assert any(r.json()["mismatches"] > 0 for r in results)


# One mixed case per collective that reduces, with no op stream before it (TB_OPS=0): the premul-scaled sum
# against a plain sum, and a reduce (whose non-roots only send) with SUM against MAX.
MIXED_KINDS = [("all_reduce", "sum,premul_sum", 2, "default"), ("reduce_scatter", "sum,premul_sum", 2, "default"),
               ("reduce", "sum,max", 3, "tcp")]


@pytest.mark.parametrize("kind,ops,world,transport", MIXED_KINDS, ids=[f"{k}-{o}" for k, o, _, _ in MIXED_KINDS])
def test_mixed_reduce_ops_fail_on_every_rank_of_each_collective(kind, ops, world, transport, tmp_path) -> None:
    env = {"TB_OPS": "0", "TB_SEED": "1", "TB_MIXED": ops, "TB_MIXED_KIND": kind, "TB_TIMEOUT": "20"}
    if transport != "default":
        env["THUNDERBOLT_TRANSPORT"] = transport
    outs = [r.json()["mixed"] for r in run_ranks(soak, world, tmp_path, timeout=90, env=env)]
    assert all(m["ok"] is False and m["type"] == "MismatchError" for m in outs), outs


# Pairs of calls that pair up but do not mean the same thing (programs/soak.py `mismatched_call`): another
# dtype with the same bytes, another element count, other split sizes, another packing. Each must be a
# MismatchError on every rank (a rank that only sends may finish first: then at its next call), never a
# result read in another dtype or packing, never a timeout.
MISMATCHED = [("send_recv_dtype", 2, "tcp"), ("send_recv_dtype", 3, "default"), ("send_recv_count", 2, "default"),
              ("all_gather_coalesced_dtype", 2, "tcp"), ("all_gather_coalesced_dtype", 3, "default"),
              ("all_reduce_coalesced_layout", 2, "default"), ("all_reduce_coalesced_layout", 3, "tcp"),
              ("all_gather_uneven", 2, "tcp"), ("all_to_all_splits", 3, "default"), ("broadcast_dtype", 2, "tcp"),
              ("sparse_shape", 2, "default")]


@pytest.mark.parametrize("case,world,transport", MISMATCHED, ids=[f"{c}-{w}-{t}" for c, w, t in MISMATCHED])
def test_mismatched_pairs_fail_on_every_rank(case, world, transport, tmp_path) -> None:
    env = {"TB_OPS": "0", "TB_SEED": "1", "TB_MISMATCH": case, "TB_TIMEOUT": "20"}
    if transport != "default":
        env["THUNDERBOLT_TRANSPORT"] = transport
    outs = [r.json()["mismatch"] for r in run_ranks(soak, world, tmp_path, timeout=90, env=env)]
    for rank, o in enumerate(outs):
        first = o if not o["ok"] else o["next_call"]
        # On 3 ranks a rank the pair does not involve may hear of it first as the FIN of a rank that failed.
        allowed = ("MismatchError",) if world == 2 or rank < 2 else ("MismatchError", "PeerLostError")
        assert first["ok"] is False and first["type"] in allowed, (rank, outs)
        assert first["seconds"] < 10, (rank, outs)
    assert any(o.get("type") == "MismatchError" for o in outs), outs
