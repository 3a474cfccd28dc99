"""`torch-thunderbolt selfcheck` on one host (2 ranks), with injected faults (a wrong result, a hanging rank),
with a host that does not answer, with ranks that never meet, over a fake RDMA fabric, and its report against
the documented schema."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.config import parse_injections
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.selfcheck import report
from torch_thunderbolt.selfcheck.model import FAMILIES
from torch_thunderbolt.testing import leftovers

ROOT = Path(__file__).resolve().parents[2]
# Settings a run could be tempted to change for speed (socket buffers, congestion control): read before and
# after, they must be equal.
SETTINGS = ("/proc/sys/net/core/rmem_max", "/proc/sys/net/core/wmem_max", "/proc/sys/net/ipv4/tcp_congestion_control",
            "/proc/sys/net/ipv4/tcp_rmem", "/proc/sys/net/ipv4/tcp_wmem")


def selfcheck(tmp_path: Path, *flags: str, timeout: float = 240, env: dict | None = None,
              cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, dict | None]:
    done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "selfcheck", "--out-dir", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
    found = sorted(glob.glob(str(tmp_path / "selfcheck-*.json")))
    return done, (json.loads(Path(found[-1]).read_text()) if found else None)


def lines_of(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"]}


def settings() -> dict[str, str]:
    out = {}
    for path in SETTINGS:
        try:
            out[path] = Path(path).read_text()
        except OSError:
            out[path] = ""
    return out


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_on_one_host_reports_everything_and_changes_nothing(tmp_path):
    out, home, tmp, cwd = (tmp_path / d for d in ("out", "home", "tmp", "cwd"))
    for d in (out, home, tmp, cwd):
        d.mkdir()
    before, segments = settings(), leftovers.segments_and_doorbells()
    done, doc = selfcheck(out, "--quick", cwd=cwd, env={"HOME": str(home), "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # Nothing but the report: no file anywhere else we can see (torch and the backend leave empty folders
    # in the temporary directory), no setting changed, no shared-memory segment left.
    assert files_under(cwd) == [] and files_under(home) == [] and files_under(tmp) == []
    assert len(files_under(out)) == 2
    assert settings() == before
    assert leftovers.new_with_dead_creator(segments) == []

    assert doc is not None and report.validate(doc) == []
    assert doc["version"] == 2 and doc["world_size"] == 2 and doc["result"] in ("ok", "warn")
    checks = lines_of(doc)
    for kind in ("shm", "tcp"):
        for family in FAMILIES:
            assert checks[f"{family} over {kind} on cpu"]["detail"].endswith("exact against the reference")
    assert "vs gloo" in checks["bench against gloo"]["detail"]
    assert {r["bytes"] for r in doc["bench"]["records"]} == {4096, 1 << 20}
    assert doc["bench"]["meta"]["memcpy"] and doc["bench"]["meta"]["cabling"]["host_index"] == [0, 0]
    assert "published over RDMA" not in checks["bench against gloo"]["detail"]  # ours ran over shm
    assert "a rank leaving" in checks
    # The versions and the machine of every rank, the interfaces of every host, DDP's figures.
    assert [h["rank"] for h in doc["hosts"]] == [0, 1]
    assert all(h["python"] and h["torch"] and h["torch_thunderbolt"] and h["cpu"] for h in doc["hosts"])
    (host, record), = doc["doctor"].items()
    assert record["chosen_addresses"] == ["127.0.0.1"] and record["topology"]["format"].startswith("torch-thunderbolt-topo")
    assert doc["cables"].startswith("Cluster: 1 host")
    ddp = doc["ddp"]["cpu"]
    assert ddp["transport"] == "shm" and 0 <= ddp["hidden"] <= 1 and ddp["exchange_s"] > 0
    assert f"hides {ddp['hidden']:.2f} of the exchange" in checks["DDP step"]["detail"]

    # Progress: a line as each check ends, numbered, then where the report is.
    numbered = re.findall(r"^\[\s*(\d+)/(\d+)\] (ok|warn|FAIL|not run) ", done.stdout, re.M)
    assert [int(n) for n, _, _ in numbered] == list(range(1, int(numbered[0][1]) + 1))
    assert done.stdout.startswith("# starting 2 ranks")
    md = sorted(glob.glob(str(out / "selfcheck-*.md")))[-1]
    assert f"wrote {md}" in done.stdout
    text = Path(md).read_text()
    for section in ("## Hosts", "## Interfaces and cables", "## Checks", "## DDP", "## Bench"):
        assert section in text


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_full_on_one_host(tmp_path):
    done, doc = selfcheck(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report.validate(doc) == [] and not doc["quick"]
    assert {r["bytes"] for r in doc["bench"]["records"]} == {4096, 1 << 20, 64 << 20}
    assert doc["ddp"]["cpu"]["iters"] == 7


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_wrong_result_fails_its_line(tmp_path):
    done, doc = selfcheck(tmp_path, "--quick", "--inject", "wrong:1:all_gather")
    assert done.returncode == 1
    checks = lines_of(doc)
    for kind in ("shm", "tcp"):
        line = checks[f"all_gather over {kind} on cpu"]
        assert line["status"] == "FAIL" and line["ranks"] == [1] and "rank 1" in line["detail"], line
        assert line["errors"] and all(e.startswith("rank 1: all_gather") for e in line["errors"])
        assert checks[f"broadcast over {kind} on cpu"]["status"] == "ok"
    assert [c["check"] for c in doc["checks"] if c["status"] == "FAIL"] == \
        ["all_gather over shm on cpu", "all_gather over tcp on cpu"]
    assert "FAIL all_gather over shm on cpu: rank 1" in done.stdout
    assert doc["result"] == "FAIL" and report.validate(doc) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hanging_rank_is_named(tmp_path):
    done, doc = selfcheck(tmp_path, "--quick", "--check-timeout", "5", "--inject", "hang:1:broadcast")
    assert done.returncode == 1
    line = lines_of(doc)["broadcast over shm on cpu"]
    assert line["status"] == "FAIL" and line["ranks"] == [1], line
    assert "stuck: rank 1 (started it, never finished)" in line["detail"]
    assert doc["stopped"] and doc["checks"][-1]["check"] == "broadcast over shm on cpu"
    assert "FAIL broadcast over shm on cpu: stuck: rank 1" in done.stdout
    assert "Traceback" not in done.stdout and report.validate(doc) == []


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hanging_rank_0_is_named_by_the_next(tmp_path):
    """Rank 0 prints and reports; when it is the one stuck, rank 1 names it and writes the report."""
    done, doc = selfcheck(tmp_path, "--quick", "--check-timeout", "5", "--inject", "hang:0:broadcast")
    assert done.returncode == 1
    assert doc is not None and doc["reported_by"] == 1 and report.validate(doc) == []
    assert glob.glob(str(tmp_path / "selfcheck-*-rank1.md"))
    line = lines_of(doc)["broadcast over shm on cpu"]
    assert line["status"] == "FAIL" and line["ranks"] == [0], line
    assert "stuck: rank 0 (started it, never finished)" in line["detail"]
    assert lines_of(doc)["all_reduce over shm on cpu"]["status"] == "ok"  # rank 0's verdicts before it
    assert "FAIL broadcast over shm on cpu: stuck: rank 0" in done.stdout
    assert "Traceback" not in done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_that_never_meet_are_a_fail_with_a_report(tmp_path):
    from torch_thunderbolt.bench.spawn import free_port

    # Rank 0 of 2, alone: the other rank never arrives.
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done, doc = selfcheck(tmp_path, "--check-timeout", "3", env=env, timeout=100)
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL rendezvous: rank 0 could not meet the other 1 rank(s)"), done.stdout
    assert "Traceback" not in done.stdout
    assert report.validate(doc) == [] and doc["result"] == "FAIL"
    assert [c["check"] for c in doc["checks"]] == ["rendezvous", "doctor on this host"]
    assert doc["checks"][0]["errors"][0].startswith("Traceback")  # in full, in the report
    assert len(doc["doctor"]) == 1 and len(doc["hosts"]) == 1


def _unreachable(kind: str) -> dict:
    if kind == "ssh":
        # TEST-NET-2: no host answers there (refused or silent, depending on the network around).
        return {"name": "gone", "ssh": "nobody@198.51.100.7"}
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a lab host needs root and iproute2")
    return {"name": "gone", "exec": "lab", "lab": "tbnosuchlab"}  # a lab namespace that does not exist


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ssh", "lab"])
def test_a_host_that_does_not_answer(tmp_path, kind):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"name": "here", "exec": "local"}, _unreachable(kind)]))
    done, _ = selfcheck(tmp_path, "--hostfile", str(hostfile), "--ssh-option=-oConnectTimeout=2", timeout=50)
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL host gone answers: "), done.stdout
    assert "here answers" not in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_over_a_fake_rdma_fabric_beside_the_published_figures(tmp_path):
    """The rdma kind checked like the others, and the bench over rdma beside the figures published for
    RDMA over Thunderbolt 5 (the fake fabric's own figures mean nothing: memory copies in Python)."""
    from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric

    with fake_fabric(tmp_path / "fabric") as fabric:
        out = tmp_path / "out"
        out.mkdir()
        done, doc = selfcheck(out, "--quick", env={**fabric_env(fabric), "THUNDERBOLT_TRANSPORT": "rdma"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report.validate(doc) == []
    checks = lines_of(doc)
    assert checks["links of kind rdma"]["detail"] == "a group over 2 ranks forced to rdma"
    for family in FAMILIES:
        assert checks[f"{family} over rdma on cpu"]["detail"].endswith("exact against the reference")
    bench = checks["bench against gloo"]["detail"]
    assert "over rdma" in bench and "published over RDMA between two Macs" in bench
    assert "PyTorch RDMA prototype, all_reduce: 1 MiB 7.08 GB/s; 16 MiB 9.07 GB/s (ours at 1MB" in bench
    (record,) = doc["doctor"].values()
    assert record["rdma"] is not None and record["rdma"]["devices"]
    assert "Published over RDMA between two Macs" in Path(glob.glob(str(out / "selfcheck-*.md"))[0]).read_text()


def test_the_published_figures_appear_over_rdma_only():
    rec = {"backend": "thunderbolt", "op": "all_reduce", "bytes": 1 << 20, "time_us": 150.0, "busbw_gbps": 7.0,
           "transport": "rdma", "ratio": 3.0, "bound_fraction": None}
    over_rdma = report.bench_summary([rec], "80gbit", single_host=False)
    assert "published over RDMA" in over_rdma and "(ours at 1MB: 150.0 us, 7.00 GB/s)" in over_rdma
    assert "no cable bound" not in over_rdma
    over_tcp = report.bench_summary([{**rec, "transport": "tcp"}], None, single_host=False)
    assert "published" not in over_tcp and "no cable bound" in over_tcp
    assert "no cable bound" not in report.bench_summary([{**rec, "transport": "shm"}], None, single_host=True)


def test_injections_parse_in_config():
    assert [(i.fault, i.rank, i.op) for i in parse_injections(["wrong:1:all_reduce", "hang:0"], FAMILIES)] == \
        [("wrong", 1, "all_reduce"), ("hang", 0, "")]
    for bad in ("wrong:1", "hang:x", "wrong:1:nope", "slow:1"):
        with pytest.raises(ConfigError, match="--inject"):
            parse_injections([bad], FAMILIES)


def test_the_schema_checker_finds_what_breaks_it():
    sch = report.schema()
    assert sch["properties"]["version"] == {"const": 2}
    good = {"status": "ok", "check": "c", "detail": "d", "fix": "", "seconds": 0.1, "ranks": [], "errors": []}
    item = sch["properties"]["checks"]["items"]
    assert report.validate(good, item) == []
    assert report.validate({**good, "status": "fine"}, item) == [
        "report.status: 'fine' is not one of ['ok', 'warn', 'FAIL', 'not run']"]
    assert report.validate({**good, "ranks": [True]}, item) == ["report.ranks[0]: expected integer, got bool"]
    assert report.validate({k: v for k, v in good.items() if k != "errors"}, item) == ["report: lacks 'errors'"]
    assert "report.version: expected 2, got 1" in report.validate({"version": 1}, sch)


def test_a_check_that_did_not_run_is_not_counted_ok(capsys):
    """Three states: a check skipped (no group of that kind) or not run on any rank is "not run" with its
    reason, and the summary counts it apart from the checks that ran."""
    import io

    from torch_thunderbolt.bench.config import RankEnv
    from torch_thunderbolt.selfcheck.model import NOT_RUN, OK, Line, Options, worst
    from torch_thunderbolt.selfcheck.rank import Selfcheck

    out = io.StringIO()
    sc = Selfcheck(Options(), RankEnv(0, 2, 0, "127.0.0.1", 29500), out=out)
    sc.total = 3
    sc._emit(Line(OK, "barrier over tcp on cpu", "1 case(s) exact against the reference"))
    sc._skip("all_reduce over rdma on cpu", "no rdma group (see 'links of kind rdma')")
    sc._emit(sc._combine("links of kind shm", [(NOT_RUN, "the ranks run on several hosts", "", [])] * 2, 0.1))
    assert [line.status for line in sc.lines] == ["ok", "not run", "not run"]
    assert "not run all_reduce over rdma on cpu: no rdma group" in out.getvalue()
    assert worst([NOT_RUN, OK]) == OK and worst([NOT_RUN, NOT_RUN]) == NOT_RUN
    doc = report.document(sc, None)
    assert doc["counts"] == {"ok": 1, "warn": 0, "FAIL": 0, "not run": 2} and doc["result"] == "ok"
    assert report.validate(doc) == []
    assert "ok 1, warn 0, FAIL 0, not run 2" in report.markdown(doc)


def test_the_documented_schema_is_the_packaged_one():
    """docs/selfcheck.md's table names every top-level key of report-schema.json, and no other."""
    text = (ROOT / "docs" / "selfcheck.md").read_text()
    table = text.split("## The report's JSON")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert documented == list(report.schema()["properties"])
    assert set(report.schema()["required"]) == set(documented)


def test_the_cables_come_from_every_hosts_discovery():
    from tests.topology.topo_fixtures import scenario_hosts

    hosts = scenario_hosts("chain3")
    doctor = {f"{h.name} (rank {r})": {"topology": h.to_json()} for r, h in enumerate(hosts)}
    text = report.cables(doctor)
    assert text.startswith("Cluster: 3 hosts, 2 cables, shape: chain") and "80 Gb/s TB5" in text
    assert "Address plan" not in text  # topo's plan is not the selfcheck's business
    # Two Macs of the same name are told apart by their rank.
    twins = {f"studio (rank {r})": {"topology": {**h.to_json(), "name": "studio"}} for r, h in enumerate(hosts[:2])}
    assert report.cables(twins).startswith("Cluster: 2 hosts, 1 cable")
    assert report.cables({}) == "no host could be discovered"


def test_the_report_points_to_the_guidance_row_for_its_cables():
    from torch_thunderbolt.selfcheck.report import guidance

    tb = {"port_speeds": {"en2": 40.0}, "rdma": None}
    slow = {"port_speeds": {}, "rdma": None}
    rdma = {"port_speeds": {"en2": 80.0}, "rdma": {"devices": ["rdma_en2"], "error": ""}}
    assert guidance({}, 1)["row"].endswith("#one-mac")
    assert guidance({"a": tb, "b": tb}, 2)["row"].endswith("#thunderbolt-over-tcp")
    assert guidance({"a": tb, "b": slow}, 2)["row"].endswith("#ethernet-speeds")
    assert guidance({"a": {"port_speeds": {"en2": 10.0}}, "b": tb}, 2)["row"].endswith("#ethernet-speeds")
    assert guidance({"a": rdma, "b": rdma}, 2)["row"].endswith("#thunderbolt-5-with-rdma")
    assert guidance({"a": rdma, "b": tb}, 2)["row"].endswith("#thunderbolt-over-tcp")
