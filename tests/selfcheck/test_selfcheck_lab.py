"""The selfcheck through `launch` on an emulated 3-Mac chain (root only): every rank of the job checks, a rank
leaves last, the report follows the schema."""
from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_thunderbolt.selfcheck import report
from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def chain3():
    skip_unless_lab()
    with lab_session(3, "chain", rate="10gbit") as lab:
        yield lab


@pytest.mark.timeout(400)
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_selfcheck_on_three_emulated_macs(chain3, tmp_path, quick):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(chain3.hostfile()))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "launch", "--hostfile", str(hostfile),
                           "--master-port", "29518", "--grace", "2", "--", sys.executable, "-m", "torch_thunderbolt",
                           "selfcheck", "--out-dir", str(tmp_path), "--cable-rate", "10gbit",
                           *(["--quick"] if quick else [])],
                          capture_output=True, text=True, timeout=380, cwd=ROOT)
    took = time.monotonic() - start
    doc = json.loads(Path(sorted(glob.glob(str(tmp_path / "selfcheck-*.json")))[-1]).read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert report.validate(doc) == [] and doc["world_size"] == 3
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["links of kind shm"]["status"] == "not run"
    assert checks["links of kind shm"]["detail"].startswith("the ranks run on several hosts")
    assert checks["all_reduce over tcp on cpu"]["detail"].endswith("exact against the reference")
    leaving = checks["a rank leaving"]
    assert leaving["status"] == "ok" and "rank 2 left" in leaving["detail"], leaving
    assert len(doc["doctor"]) == 3  # one doctor per emulated host
    assert "bound" in checks["bench against gloo"]["detail"]
    assert len(set(doc["bench"]["meta"]["cabling"]["host_index"])) == 3
    assert doc["ddp"]["cpu"]["transport"] == "tcp" and checks["DDP step"]["status"] == "ok"
    assert [h["rank"] for h in doc["hosts"]] == [0, 1, 2] and doc["cables"]
    assert "Traceback" not in done.stdout
    print(f"selfcheck {'--quick ' if quick else ''}on the 3-host lab: {took:.1f} s wall, {doc['seconds']} s in the ranks")
