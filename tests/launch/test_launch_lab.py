"""The launcher on an emulated 3-Mac chain (root only): gloo all_reduce across the middle host."""
import json
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab

from_here = Path(__file__).parent

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture
def chain3():
    skip_unless_lab()
    with lab_session(3, "chain", rate="10gbit") as lab:
        yield lab


@pytest.mark.timeout(120)
def test_gloo_all_reduce_on_a_chain(chain3, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(chain3.hostfile()))
    before = chain3.counters("mac1")
    code = main(["launch", "--hostfile", str(hostfile), "--master-port", "29517", "--grace", "2", "--",
                 sys.executable, str(from_here / "scripts" / "allreduce.py"), "--backend", "gloo"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    lines = sorted(line for line in out.splitlines() if "allreduce" in line)
    master = chain3.addresses("mac0")[0]
    assert lines == [
        f"[rank 0] allreduce rank=0 world=3 ifname=tb1_0 master={master} result=6",
        f"[rank 1] allreduce rank=1 world=3 ifname=tb0_0 master={master} result=6",
        f"[rank 2] allreduce rank=2 world=3 ifname=tb1_0 master={master} result=6"]
    # mac2's traffic to mac0 crossed mac1: both its cables carried bytes in both directions.
    after = chain3.counters("mac1")
    assert all(after[dev][0] > before[dev][0] and after[dev][1] > before[dev][1] for dev in after)
