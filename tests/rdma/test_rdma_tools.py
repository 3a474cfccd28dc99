"""`doctor` and `topo` about RDMA over Thunderbolt: the doctor's checks over made-up facts (macOS versions,
`rdma_ctl status` outputs, devices as the probe reports them) and over a fake fabric with faults; `topo`'s
RDMA state of each port and cable from recorded-style `rdma_ctl status` / `ibv_devinfo -v` fixtures."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.topology.topo_fixtures import mac_outputs, scenario_hosts
from torch_thunderbolt.config import Config
from torch_thunderbolt.doctor import FAIL, OK, WARN, RdmaFacts, check_rdma, gather_rdma
from torch_thunderbolt.platform import Platform
from torch_thunderbolt.testing.fake_verbs import fake_fabric
from torch_thunderbolt.topology.discover import CommandResult, subprocess_runner
from torch_thunderbolt.topology.macos import build_macos_host, parse_ibv_devinfo, parse_rdma_ctl, rdma_state
from torch_thunderbolt.topology.model import Port
from torch_thunderbolt.topology.report import analyse, cluster_report, host_summary
from torch_thunderbolt.transport.rdma import DeviceState

GOOD = dataclasses.asdict(DeviceState("rdma_en2", port="ACTIVE", gid_index=1, ipv4="10.77.0.1", frame_limit=512 << 10))


def _by_check(findings):
    return {f.check: f for f in findings}


@pytest.mark.parametrize("version, status", [("15.6", WARN), ("26.1", WARN), ("26.2", WARN), ("26.2.1", WARN),
                                             ("26.3", OK), ("27.0", OK)])
def test_doctor_says_which_macos_has_rdma_and_which_takes_large_receives(version: str, status: str) -> None:
    found = _by_check(check_rdma(RdmaFacts(macos=version, rdma_ctl="enabled\n", provider="librdma.dylib",
                                           devices=[GOOD]), Config()))
    assert found["RDMA: macOS"].status == status
    if version.startswith("26.2"):
        assert "4 KiB receives only" in found["RDMA: macOS"].detail and "26.3" in found["RDMA: macOS"].fix
    elif status == WARN:
        assert "needs 26.2 or later" in found["RDMA: macOS"].detail


def test_doctor_reads_rdma_ctl_and_says_how_to_enable_it() -> None:
    forced = Config(transport="rdma")
    off = _by_check(check_rdma(RdmaFacts(macos="26.3", rdma_ctl="disabled\n", provider="librdma.dylib"), forced))
    assert off["RDMA: rdma_ctl"].status == FAIL and "Recovery" in off["RDMA: rdma_ctl"].fix
    assert "rdma_ctl enable" in off["RDMA: rdma_ctl"].fix
    on = _by_check(check_rdma(RdmaFacts(macos="26.3", rdma_ctl="enabled\n", provider="librdma.dylib",
                                        devices=[GOOD]), forced))
    assert on["RDMA: rdma_ctl"].status == OK and on["RDMA: rdma_en2"].status == OK
    assert "::ffff:10.77.0.1" in on["RDMA: rdma_en2"].detail and "512 KiB" in on["RDMA: rdma_en2"].detail
    missing = _by_check(check_rdma(RdmaFacts(macos="26.1", rdma_ctl=None, error="no verbs library could be loaded"),
                                   Config()))
    assert missing["RDMA: rdma_ctl"].status == WARN and missing["RDMA: library"].status == WARN
    assert parse_rdma_ctl("enabled") and parse_rdma_ctl("RDMA: disabled") is False and parse_rdma_ctl("?") is None


def test_doctor_names_each_device_problem_with_its_fix() -> None:
    down = dataclasses.asdict(DeviceState("rdma_en3", port="DOWN", problem="port 1 of rdma_en3 is DOWN: plug in "
                                          "the Thunderbolt 5 cable"))
    tb4 = dataclasses.asdict(DeviceState("rdma_en4", port="ACTIVE", gid_index=1, ipv4="10.77.0.5"))
    facts = RdmaFacts(macos="26.3", rdma_ctl="enabled", provider="librdma.dylib", devices=[GOOD, down, tb4],
                      port_speeds={"en2": 80.0, "en3": 80.0, "en4": 40.0})
    found = _by_check(check_rdma(facts, Config(transport="tcp")))
    assert found["RDMA: rdma_en3"].status == WARN and found["RDMA: rdma_en3"].fix.startswith("plug in")
    assert found["RDMA: rdma_en4"].status == WARN and "Thunderbolt 5" in found["RDMA: rdma_en4"].fix
    assert found["RDMA: transport"].status == WARN and "rdma_en2" in found["RDMA: transport"].detail
    hung = _by_check(check_rdma(RdmaFacts(macos="26.3", rdma_ctl="enabled", hung=True), Config()))
    assert hung["RDMA: devices"].status == FAIL and "restart" in hung["RDMA: devices"].fix
    none = _by_check(check_rdma(RdmaFacts(macos="26.3", rdma_ctl="enabled", provider="librdma.dylib"),
                                Config(transport="rdma")))
    assert none["RDMA: devices"].status == FAIL and "Thunderbolt 5" in none["RDMA: devices"].fix


def test_doctor_probes_a_fake_fabric_as_a_job_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    devices = {"rdma_fake0": "10.201.0.1", "rdma_fake1": "10.201.0.2", "rdma_fake2": None}
    with fake_fabric(tmp_path / "fab", devices=devices) as fab:
        fab.set_fault("rdma_fake1", "port_up", 0)
        monkeypatch.setenv("THUNDERBOLT_VERBS", f"fake:{fab.path}")
        facts = gather_rdma(subprocess_runner, Platform.for_system("linux"), {}, {})
        found = _by_check(check_rdma(facts, Config(transport="rdma")))
    assert found["RDMA: library"].status == OK and "fake fabric" in found["RDMA: library"].detail
    assert found["RDMA: rdma_fake0"].status == OK and "::ffff:10.201.0.1" in found["RDMA: rdma_fake0"].detail
    assert found["RDMA: rdma_fake1"].status == FAIL and "DOWN" in found["RDMA: rdma_fake1"].detail
    assert found["RDMA: rdma_fake2"].status == FAIL and "IPv4 address" in found["RDMA: rdma_fake2"].fix


def test_doctor_reports_a_probe_that_hangs_as_a_wedged_port() -> None:
    def run(argv, timeout=60.0):
        return CommandResult(124, "", f"{argv[0]}: timed out after {timeout:.0f} s")
    facts = gather_rdma(run, Platform.for_system("linux"), {}, {})
    assert facts.hung and _by_check(check_rdma(facts, Config()))["RDMA: devices"].status == FAIL


# --- topo ---------------------------------------------------------------------------------------------------

def test_topo_shows_which_ports_and_cables_carry_rdma() -> None:
    a, b = scenario_hosts("tb5_pair")
    assert a.port("en2").rdma == "yes" and b.port("en3").rdma == "yes"
    assert b.port("en2").rdma == "no: port PORT_DOWN"  # (no cable there)
    report = cluster_report(analyse([a, b]))
    cables = report.split("Cables:")[1].split("\n\n")[0]
    assert "RDMA" in cables.splitlines()[1] and cables.splitlines()[2].rstrip().endswith("yes")
    assert "RDMA" in host_summary(a).splitlines()[1]


def test_topo_says_why_a_port_has_no_rdma() -> None:
    outputs = mac_outputs("tb5_pair", "mac-a")
    devinfo = parse_ibv_devinfo(outputs["ibv_devinfo"])
    assert devinfo["rdma_en2"] == ("PORT_ACTIVE", ["10.77.0.1"]) and devinfo["rdma_en3"] == ("PORT_DOWN", [])
    port = Port("Thunderbolt 1", ifname="en2", speed_gbps=80.0)
    assert rdma_state(port, None, None) == ""  # no RDMA tools: not known
    assert "not enabled" in rdma_state(port, False, devinfo) and "Recovery" in rdma_state(port, False, devinfo)
    assert "Thunderbolt 4" in rdma_state(dataclasses.replace(port, speed_gbps=40.0), True, devinfo)
    assert "no RDMA device" in rdma_state(dataclasses.replace(port, ifname="en9"), True, devinfo)
    assert "wedged" in rdma_state(port, True, None)
    no_gid = {"rdma_en2": ("PORT_ACTIVE", [])}
    assert "IPv4 address" in rdma_state(port, True, no_gid)
    older = {k: v for k, v in outputs.items() if k not in ("rdma_ctl", "ibv_devinfo")}  # a Mac before 26.2
    host = build_macos_host("mac-a", older)
    assert all(p.rdma == "" for p in host.ports) and "RDMA" not in host_summary(host)


# --- scripts/tb5_rdma_check.py ------------------------------------------------------------------------------

def _script():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "tb5_rdma_check.py"
    spec = importlib.util.spec_from_file_location("tb5_rdma_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tb5_check_prints_this_run_beside_the_published_figures() -> None:
    check = _script()

    def doc(latency: float, gbytes: float) -> dict:
        rows = [{"backend": "thunderbolt", "op": "sendrecv", "bytes": n, "time_us": latency, "algbw_gbps": gbytes,
                 "wrong": 0} for n in (64, 4096, 65536)]
        rows += [{"backend": "thunderbolt", "op": "all_reduce", "bytes": 1 << 20, "time_us": 500.0,
                  "algbw_gbps": gbytes, "wrong": 1}]
        return {"meta": {}, "results": rows}

    table = check.render(check.compare(doc(12.5, 5.0), doc(140.0, 1.0)))
    lines = table.splitlines()
    assert "published (their measurement)" in lines[0] and "this run: rdma" in lines[0]
    assert "4.15 us" in lines[1] and "12.5 us" in lines[1] and "140.0 us" in lines[1]
    assert "75 Gbit/s" in lines[3] and "40.0 Gbit/s" in lines[3]
    assert "WRONG RESULT" in lines[4] and lines[5].count("-") >= 2  # no 16 MiB rows: "-"
