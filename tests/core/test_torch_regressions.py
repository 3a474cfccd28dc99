"""Cases from PyTorch's own tests and real training code that gloo gets right and a backend can easily get
wrong: each runs on real processes, on the default transport (shared memory for 2 ranks on one host) and
on TCP, against a reference computed locally."""
from __future__ import annotations

import json

import pytest

from torch_thunderbolt.testing.ranks import run_ranks

from .programs import torch_regressions

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CONFIGS = [(2, {}), (2, {"THUNDERBOLT_TRANSPORT": "tcp"}), (3, {"THUNDERBOLT_TRANSPORT": "tcp"}),
           (3, {"THUNDERBOLT_TRANSPORT": "shm"})]


@pytest.mark.parametrize("world,env", CONFIGS, ids=["2-auto", "2-tcp", "3-tcp", "3-shm"])
def test_cases_gloo_gets_right(world, env, tmp_path):
    for res in run_ranks(torch_regressions, world, tmp_path, args=["gloo_cases"], timeout=180, env=env):
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        checks = json.loads(lines[0][len("RESULT "):])
        bad = {k: v for k, v in checks.items() if v is not True}
        assert not bad, f"rank {res.rank}: {bad}"
        mixed = json.loads(lines[1][len("RESULT "):])["mixed"]
        assert not mixed["ok"] and mixed["type"] == "MismatchError", (res.rank, mixed)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", ["reduce", "gather"])
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_ranks_that_disagree_about_the_root_fail_at_once(world, op, transport, tmp_path):
    """Over TCP nobody sends anything to a rank that waits for the wrong root: found by the PING a waiting
    rank sends, which names the op it waits for (not by the group timeout, 60 s here)."""
    results = run_ranks(torch_regressions, world, tmp_path, args=["disagree_on_root"], timeout=120,
                        env={"TEST_OP": op, "THUNDERBOLT_TRANSPORT": transport}, expect_ok=False)
    outs = [res.json() for res in results]
    for r, o in enumerate(outs):
        failed = o["first"] if not o["first"]["ok"] else o["then"]
        assert not failed["ok"], (r, outs)
        assert failed["type"] in ("MismatchError",), (r, outs)
        assert failed["seconds"] < 20, (r, outs)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_failed_receive_leaves_the_group_broken_not_posted(transport, tmp_path):
    results = run_ranks(torch_regressions, 2, tmp_path, args=["failed_receive"], timeout=90,
                        env={"TEST_CASE": "timeout", "THUNDERBOLT_TRANSPORT": transport})
    out = results[0].json()
    assert out["first"]["type"] == "CollectiveTimeout" and " Timed out " in out["first"]["msg"], out
    assert not out["second"]["ok"], out  # the group is BROKEN: no silent success, no hang
    assert out["x"] == [0.0] * 4, out  # nothing was written late into the buffer given up on


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_receive_larger_than_the_message_breaks_the_group(transport, tmp_path):
    results = run_ranks(torch_regressions, 2, tmp_path, args=["failed_receive"], timeout=90,
                        env={"TEST_CASE": "size", "THUNDERBOLT_TRANSPORT": transport})
    out0, out1 = results[0].json(), results[1].json()
    assert out0["first"]["type"] == "MismatchError", out0
    assert not out0["then"]["ok"] and not out1["then"]["ok"], (out0, out1)
    assert out0["then"]["seconds"] < 20 and out1["then"]["seconds"] < 20, (out0, out1)


def test_monitored_barrier_on_the_group_names_the_missing_rank(tmp_path):
    """torch's dist.monitored_barrier refuses non-gloo backends; called on the group object (as torch's own
    tests do) it reports like gloo's: the rank that did not arrive within the timeout."""
    results = run_ranks(torch_regressions, 3, tmp_path, args=["monitored"], timeout=90,
                        env={"THUNDERBOLT_TRANSPORT": "tcp"}, expect_ok=False)
    outs = [res.json() for res in results]
    assert all(o["first"]["ok"] for o in outs), outs
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in outs[0]["second"]["msg"], outs
    assert not outs[2]["second"]["ok"], outs
