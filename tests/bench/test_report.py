"""JSON document, congestion-control lookup and the plot."""
import argparse
import datetime
import json
import subprocess
import sys

import pytest

from torch_thunderbolt.bench import config as c
from torch_thunderbolt.bench import metrics, report, spec
from torch_thunderbolt.errors import ConfigError

NOW = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.timezone.utc)


def _cfg():
    parser = argparse.ArgumentParser()
    c.add_arguments(parser)
    return c.from_args(parser.parse_args(["--backends", "gloo,gloo", "--sizes", "4K,1M"]))


def _records():
    recs = []
    for backend in ("gloo", "gloo#2"):
        for nbytes in (4096, 1 << 20):
            lay = spec.layout("all_reduce", nbytes, 4, 2)
            recs.append(metrics.make_result(backend, "gloo", "all_reduce", lay, 2, "float32", "tcp",
                                            [100.0, 200.0], 0).record())
    link = [{"streams": 1, "bytes": 1 << 20, "gbps": 2.0, "gbps_min": 1.0, "gbps_max": 3.0, "time_us": 500.0,
             "congestion_control": "bbr"}]
    lat = {"latency_us": 11.0, "latency_us_p10": 10.0, "latency_us_p90": 12.0}
    return recs + report.link_records(link, lat, "127.0.0.1", 2)


def test_document_schema(tmp_path):
    meta = report.build_meta(_cfg(), 2, ["a", "b"], [{"label": "gloo"}], "auto", 4, "bbr", now=NOW)
    doc = report.document(meta, _records())
    assert report.validate_document(doc) == []
    path = tmp_path / "out.json"
    report.write_json(str(path), doc)
    loaded = json.loads(path.read_text())
    assert loaded["meta"]["timestamp"] == "2026-11-30T12:00:00+00:00"
    assert loaded["meta"]["tcp_congestion_control"] == "bbr"
    assert loaded["meta"]["iters"] == 20 and loaded["meta"]["hosts"] == ["a", "b"]
    first = loaded["results"][0]
    assert (first["backend"], first["op"], first["bytes"], first["world_size"]) == ("gloo", "all_reduce", 4096, 2)
    assert first["time_us"] == 150.0 and first["time_us_p10"] == 110.0 and first["time_us_p90"] == 190.0
    link = loaded["results"][-1]
    assert (link["op"], link["streams"], link["gbps"], link["latency_us"]) == ("link_tcp", 1, 2.0, 11.0)


def test_validate_document_reports_missing_keys():
    problems = report.validate_document({"meta": {}, "results": [{"op": "all_reduce"}, {"op": "link_tcp"}]})
    assert "results[0] lacks 'busbw_gbps'" in problems
    assert "results[1] lacks 'streams'" in problems
    assert "meta lacks 'timestamp'" in problems


def test_write_json_error_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot write --json"):
        report.write_json(str(tmp_path / "missing-dir" / "x.json"), {})


def test_congestion_control_linux_then_macos():
    assert report.system_congestion_control(read_file=lambda p: "cubic\n") == "cubic"

    def no_proc(path):
        raise FileNotFoundError(path)

    seen = []

    def sysctl(argv):
        seen.append(argv)
        return "newreno\n"

    assert report.system_congestion_control(read_file=no_proc, run_command=sysctl) == "newreno"
    assert seen == [["sysctl", "-n", "net.inet.tcp.cc.algorithm"]]

    def failing(argv):
        raise subprocess.CalledProcessError(1, argv)

    assert report.system_congestion_control(read_file=no_proc, run_command=failing) is None


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    report.write_plot(str(path), _records())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ConfigError, match=r"--plot needs matplotlib: pip install matplotlib"):
        report.require_matplotlib()


def test_a_ratio_between_different_paths_says_so():
    from torch_thunderbolt.bench.app import unlike_paths_note

    note = unlike_paths_note({"thunderbolt": "shm", "gloo": "tcp"}, "gloo")
    assert note is not None and "thunderbolt over shm, gloo over tcp" in note and "--transport tcp" in note
    assert unlike_paths_note({"thunderbolt": "tcp", "gloo": "tcp"}, "gloo") is None
    assert unlike_paths_note({"thunderbolt": "tcp", "gloo": "tcp", "floor": "none"}, "gloo") is None
    mixed = unlike_paths_note({"thunderbolt": "shm+tcp", "gloo": "tcp"}, "gloo")
    assert mixed is not None and "shm+tcp" in mixed
    assert unlike_paths_note({"thunderbolt": "shm"}, None) is None
