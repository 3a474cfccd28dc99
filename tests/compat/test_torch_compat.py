"""PyTorch's own distributed tests with thunderbolt standing in for gloo (scripts/torch_compat.py), a fast
representative subset, plus the tool's own mechanics (backend renaming, key lines, hard timeouts)."""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


compat = _load("torch_compat")

# One or two per family: reductions, broadcast, gathers/scatters, barrier, p2p, DDP, object collectives.
# None for reduce_scatter or all_to_all: torch's suite has no reduce_scatter test on CPU (only *_cuda ones) and
# skips its all_to_all tests for gloo ("Only MPI supports ..."); test_broadcast_object_list is skipped upstream.
CI_TESTS = [
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_coalesced_sum",
    "test_broadcast",
    "test_all_gather",
    "test_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_batch_isend_irecv_gloo",
    "test_barrier",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_isend",
    "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_all_gather_object_default_pg",
    "test_all_reduce_sum_async",
    "test_scatter_object_list",
]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torch_suite_subset_passes_where_gloo_does() -> None:
    # fork and one test process per backend: the subset in well under 90 s on 2 cores (spawn re-imports
    # torch in every rank of every test, ~5 s each).
    table = compat.compare(CI_TESTS, world=2, transports=["auto"], timeout=60, batch=len(CI_TESTS),
                           start_method="fork")
    gloo = {t: row["gloo"].status for t, row in table.items()}
    # The harness itself works: gloo runs (not skips) every one of these CPU tests.
    assert all(s == "pass" for s in gloo.values()), f"gloo itself did not pass: {gloo}"
    regs = [(t, lb, o) for t, lb, o in compat.regressions(table) if compat.excuse(t, o) is None]
    assert not regs, "gloo passes, thunderbolt does not:\n" + "\n".join(
        f"{test} [{label}] {o.status}: {o.key}" for test, label, o in regs)


def test_shim_renames_only_gloo() -> None:
    shim = _load("torch_compat_shim")
    assert shim.rename_backend("gloo") == "thunderbolt"
    assert shim.rename_backend("GLOO") == "thunderbolt"
    assert shim.rename_backend("cpu:gloo,cuda:nccl") == "cpu:thunderbolt,cuda:nccl"
    assert shim.rename_backend(None) is None
    assert shim.rename_backend("nccl") == "nccl"
    import torch.distributed as dist

    assert shim.rename_backend(dist.Backend.GLOO) == "thunderbolt"


def test_key_line_picks_the_last_error() -> None:
    text = ("RuntimeError: Process 0 exited with error code 10 and exception:\nTraceback (most recent call last):\n"
            '  File "x.py", line 3, in f\n    raise ValueError("rank 1: bad")\nValueError: rank 1: bad\n\n')
    assert compat.key_line(text) == "ValueError: rank 1: bad"
    assert compat.key_line("just a line\n") == "just a line"


def test_regressions_are_gloo_pass_and_we_dont() -> None:
    O = compat.Outcome
    table = {"a": {"gloo": O("pass", 1), "tb/auto": O("fail", 1, "E: x")},
             "b": {"gloo": O("fail", 1), "tb/auto": O("fail", 1)},
             "c": {"gloo": O("pass", 1), "tb/auto": O("pass", 1)},
             "d": {"gloo": O("pass", 1), "tb/auto": O("timeout", 1)}}
    assert [(t, lb) for t, lb, _ in compat.regressions(table)] == [("a", "tb/auto"), ("d", "tb/auto")]


def test_known_difference_excuses_only_its_own_failure() -> None:
    O = compat.Outcome
    assert compat.excuse("test_get_backend", O("fail", 1, "AssertionError: 'thunderbolt' != 'gloo'"))
    assert compat.excuse("test_get_backend", O("fail", 1, "RuntimeError: peer lost")) is None
    assert compat.excuse("test_get_backend", O("timeout", 1, "'thunderbolt' != 'gloo'")) is None
    assert compat.excuse("test_all_reduce_sum", O("fail", 1, "'thunderbolt' != 'gloo'")) is None


def test_hung_test_is_killed_with_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in test process: starts a "rank" that would outlive it, announces a test and hangs.
    pidfile = tmp_path / "rank.pid"
    fake = tmp_path / "fake_shim.py"
    fake.write_text(
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'a').write(f'{{p.pid}}\\n')\n"
        f"print({compat.START_PREFIX!r} + sys.argv[1], flush=True)\n"
        "time.sleep(600)\n")
    monkeypatch.setattr(compat, "SHIM", fake)
    t0 = time.monotonic()
    res = compat.run_tests(["test_hangs", "test_next"], compat.Config("gloo"),
                           compat.RunSpec(world=2, timeout=2.0), batch=2)
    assert time.monotonic() - t0 < 30
    assert res["test_hangs"].status == "timeout"
    assert "test_next" in res  # the batch restarted after the hung test
    rank_pids = [int(x) for x in pidfile.read_text().split()]
    assert len(rank_pids) == 2  # one per test process: the batch restarted once
    survivors = []
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            survivors = [pid for pid in rank_pids if _alive(pid)]
            if not survivors:
                break
            time.sleep(0.05)
        assert not survivors, f"children of hung test processes survived the group kill: {survivors}"
    finally:
        for pid in survivors:  # don't leave them behind when the assertion fails
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
