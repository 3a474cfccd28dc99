"""scripts/lab_bench.py: its pure parts (no lab needed), and its short --quick compression run (root)."""
import importlib.util
import subprocess
import sys

import pytest

from torch_thunderbolt.testing.lab import skip_unless_lab
from torch_thunderbolt.testing.ranks import REPO


def _load():
    spec = importlib.util.spec_from_file_location("lab_bench", REPO / "scripts" / "lab_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lab_bench", module)  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


lab_bench = _load()


def _rec(backend, op, nbytes, t, busbw):
    return {"backend": backend, "op": op, "bytes": nbytes, "time_us": t, "time_us_min": t * 0.9,
            "time_us_max": t * 1.5, "busbw_gbps": busbw}


def test_one_cable_scenario_names_only_the_first_cable_of_each_host():
    hosts = [{"name": "mac0", "ifname": "tb1_0,tb1_1"}, {"name": "mac1", "ifname": "tb0_0,tb0_1"}]
    assert [h["ifname"] for h in lab_bench.hostfile_for(hosts, lab_bench.ONE_CABLE)] == ["tb1_0", "tb0_0"]
    assert [h["ifname"] for h in lab_bench.hostfile_for(hosts, lab_bench.TWO_CABLES)] == ["tb1_0,tb1_1",
                                                                                         "tb0_0,tb0_1"]


def test_table_rows_pair_backends_and_give_gloo_time_over_ours():
    records = [_rec("gloo", "all_reduce", 64 << 20, 3000.0, 0.1), _rec("thunderbolt", "all_reduce", 64 << 20,
                                                                        1500.0, 0.2),
               _rec("thunderbolt", "broadcast", 4096, 50.0, 0.01), _rec("gloo", "broadcast", 4096, 200.0, 0.0),
               {"backend": "thunderbolt", "op": "link_tcp", "bytes": 1, "gbps": 1.0}]
    rows = lab_bench.bench_table(records)
    assert rows[2] == ("| all_reduce | 64M | 1.50 ms [1.35 ms–2.25 ms] | 0.200 | 3.00 ms [2.70 ms–4.50 ms] | "
                       "0.100 | **2.00×** |")
    assert rows[3].startswith("| broadcast | 4K | 50 µs [45 µs–75 µs]") and rows[3].endswith("**4.00×** |")
    assert len(rows) == 4


def test_spread_and_sizes():
    assert lab_bench.spread([1.0, 3.0, 2.0]) == "2.000 [1.000–3.000]"
    assert [lab_bench.fmt_size(n) for n in (4096, 1 << 20, 64 << 20, 4092)] == ["4K", "1M", "64M", "4092"]


@pytest.mark.lab
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_compression_run_counts_a_quarter_of_the_bytes(tmp_path):
    """The short CI version of the compression measurement: bytes only, no timing asserted."""
    skip_unless_lab()
    out = tmp_path / "lab.md"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "lab_bench.py"), "--quick", "--scenarios",
                           "compression", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| thunderbolt")}
    fp32, int8 = (int(rows[k][3].strip().replace(",", "")) for k in ("thunderbolt fp32", "thunderbolt int8"))
    assert fp32 == 1 << 20  # --quick measures a 1 MB all_reduce; a pair sends the whole tensor once
    assert 0.24 < int8 / fp32 < 0.27  # 1 byte per value plus a 4-byte scale per 256 values
