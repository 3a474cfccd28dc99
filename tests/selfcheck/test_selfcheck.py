"""`torch-thunderbolt selfcheck` on one host (2 ranks), with injected faults, with a host that does not answer,
and its report against the documented schema."""
from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.config import parse_injections
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.selfcheck import report
from torch_thunderbolt.selfcheck.model import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def selfcheck(tmp_path: Path, *flags: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict | None]:
    done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "selfcheck", "--out-dir", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    found = sorted(glob.glob(str(tmp_path / "selfcheck-*.json")))
    return done, (json.loads(Path(found[-1]).read_text()) if found else None)


def lines_of(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_on_one_host(tmp_path):
    done, doc = selfcheck(tmp_path, "--quick")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert doc is not None and report.validate(doc) == []
    assert doc["world_size"] == 2 and doc["result"] in ("ok", "warn")
    checks = lines_of(doc)
    for kind in ("shm", "tcp"):
        for family in FAMILIES:
            assert checks[f"{family} over {kind} on cpu"]["detail"].endswith("exact against the reference")
    assert "vs gloo" in checks["bench against gloo"]["detail"]
    assert {r["bytes"] for r in doc["bench"]["records"]} == {4096, 1 << 20}
    assert "a rank leaving" in checks and "ok" in done.stdout
    md = Path(doc_path := sorted(glob.glob(str(tmp_path / "selfcheck-*.md")))[-1]).read_text()
    assert "## Checks" in md and f"wrote {doc_path}" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_full_on_one_host(tmp_path):
    done, doc = selfcheck(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report.validate(doc) == [] and not doc["quick"]
    assert {r["bytes"] for r in doc["bench"]["records"]} == {4096, 1 << 20, 64 << 20}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_wrong_result_fails_its_line(tmp_path):
    done, doc = selfcheck(tmp_path, "--quick", "--inject", "wrong:1:all_gather")
    assert done.returncode == 1
    checks = lines_of(doc)
    for kind in ("shm", "tcp"):
        line = checks[f"all_gather over {kind} on cpu"]
        assert line["status"] == "FAIL" and line["ranks"] == [1] and "rank 1" in line["detail"], line
        assert checks[f"broadcast over {kind} on cpu"]["status"] == "ok"
    assert "FAIL all_gather over shm on cpu: rank 1" in done.stdout
    assert report.validate(doc) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hanging_rank_is_named(tmp_path):
    done, doc = selfcheck(tmp_path, "--quick", "--check-timeout", "5", "--inject", "hang:1:broadcast")
    assert done.returncode == 1
    line = lines_of(doc)["broadcast over shm on cpu"]
    assert line["status"] == "FAIL" and line["ranks"] == [1], line
    assert "stuck: rank 1 (started it, never finished)" in line["detail"]
    assert doc["stopped"] and doc["checks"][-1]["check"] == "broadcast over shm on cpu"
    assert "Traceback" not in done.stdout


@pytest.mark.timeout(60)
def test_a_host_that_does_not_answer(tmp_path):
    hostfile = tmp_path / "hosts.json"
    # 192.0.2.0/24 is TEST-NET-1: never routed, so the connection gets no answer.
    hostfile.write_text(json.dumps([{"name": "gone", "ssh": "nobody@192.0.2.1"}, {"name": "here", "exec": "local"}]))
    done, _ = selfcheck(tmp_path, "--hostfile", str(hostfile), "--ssh-option=-oConnectTimeout=2", timeout=50)
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL host gone answers: "), done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_injections_parse_in_config():
    assert [(i.fault, i.rank, i.op) for i in parse_injections(["wrong:1:all_reduce", "hang:0"], FAMILIES)] == \
        [("wrong", 1, "all_reduce"), ("hang", 0, "")]
    for bad in ("wrong:1", "hang:x", "wrong:1:nope", "slow:1"):
        with pytest.raises(ConfigError, match="--inject"):
            parse_injections([bad], FAMILIES)


def test_the_schema_checker_finds_what_breaks_it():
    sch = report.schema()
    assert sch["properties"]["version"] == {"const": 1}
    good = {"status": "ok", "check": "c", "detail": "d", "fix": "", "seconds": 0.1, "ranks": [], "errors": []}
    item = sch["properties"]["checks"]["items"]
    assert report.validate(good, item) == []
    assert report.validate({**good, "status": "fine"}, item) == ["report.status: 'fine' is not one of ['ok', 'warn', 'FAIL']"]
    assert report.validate({**good, "ranks": [True]}, item) == ["report.ranks[0]: expected integer, got bool"]
    assert report.validate({k: v for k, v in good.items() if k != "errors"}, item) == ["report: lacks 'errors'"]
    assert "report.version: expected 1, got 2" in report.validate({"version": 2}, sch)
