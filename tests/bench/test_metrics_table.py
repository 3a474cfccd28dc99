"""Statistics, ratios, efficiency and the nccl-tests-style text output (pure)."""
import pytest

from torch_thunderbolt.bench import metrics, spec, table


def test_percentiles_interpolate_like_numpy():
    values = sorted([5.0, 1.0, 3.0, 2.0, 4.0])
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 10) == pytest.approx(1.4)
    assert metrics.percentile(values, 90) == pytest.approx(4.6)
    s = metrics.summarize([10.0, 1.0, 3.0, 2.0])
    assert (s.median, s.minimum, s.maximum, s.samples) == (2.5, 1.0, 10.0, 4)


def test_max_over_ranks_is_per_iteration():
    assert metrics.max_over_ranks([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]


def _result(backend="gloo", op="all_reduce", nbytes=1 << 20, times=(1000.0, 1000.0, 3000.0), n=4, wrong=0,
            kind=None):
    lay = spec.layout(op, nbytes, 4, n)
    return metrics.make_result(backend, kind or backend.split("#")[0], op, lay, n, "float32", "tcp", list(times),
                               wrong)


def test_make_result_bandwidths():
    r = _result()
    assert r.time_us == 1000.0 and r.time_us_max == 3000.0
    assert r.algbw_gbps == pytest.approx((1 << 20) / 1e6)
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 1.5)  # all_reduce, 4 ranks: 2(n-1)/n
    assert (r.redop, r.root, r.count) == ("sum", -1, 262144)
    b = _result(op="broadcast")
    assert (b.redop, b.root, b.busbw_gbps) == ("none", 0, pytest.approx(b.algbw_gbps))


def test_ratio_is_speed_vs_baseline_and_skips_wrong_results():
    fast = _result("thunderbolt", times=[500.0])
    slow = _result("gloo", times=[1000.0])
    broken = _result("thunderbolt", nbytes=4096, times=[1.0], wrong=3)
    base_small = _result("gloo", nbytes=4096, times=[100.0])
    rows = [fast, slow, broken, base_small]
    metrics.add_ratios(rows, "gloo")
    assert fast.ratio == pytest.approx(2.0)  # twice as fast
    assert slow.ratio is None
    assert broken.ratio is None
    metrics.add_ratios(rows, None)
    assert fast.ratio == pytest.approx(2.0)


def _link(gbps: float, duplex: float | None = None) -> dict:
    return {"gbps": gbps} if duplex is None else {"gbps": gbps, "duplex_gbps": duplex}


def test_efficiency_uses_each_backends_stream_count():
    tb = _result("thunderbolt", times=[1000.0], n=2)
    gl = _result("gloo", times=[1000.0], n=2)
    metrics.add_efficiency([tb, gl], {1: _link(2.0), 4: _link(4.0)}, {"thunderbolt": 4, "gloo": 1})
    assert tb.efficiency == pytest.approx(tb.busbw_gbps / 4.0) and tb.link_streams == 4
    assert gl.efficiency == pytest.approx(gl.busbw_gbps / 2.0) and gl.link_streams == 1
    other = _result("mpi", times=[1000.0])
    metrics.add_efficiency([other], {1: _link(2.0)}, {})
    assert other.efficiency is None


def test_efficiency_against_duplex_rate_for_symmetric_ops_only():
    ar = _result("thunderbolt", op="all_reduce", times=[1000.0], n=2)
    bc = _result("thunderbolt", op="broadcast", times=[1000.0], n=2)
    metrics.add_efficiency([ar, bc], {2: _link(4.0, duplex=2.5)}, {"thunderbolt": 2})
    assert ar.efficiency == pytest.approx(ar.busbw_gbps / 2.5) and ar.link_direction == "duplex"
    assert bc.efficiency == pytest.approx(bc.busbw_gbps / 4.0) and bc.link_direction == "one-way"
    assert "both directions at once" in table.format_table([ar], None, "tcp")


def test_record_flattens_extra_and_keeps_required_keys():
    r = _result()
    r.extra["note"] = "x"
    rec = r.record()
    assert rec["note"] == "x" and "extra" not in rec
    for key in ("backend", "op", "bytes", "world_size", "dtype", "transport", "time_us", "time_us_min",
                "time_us_max", "algbw_gbps", "busbw_gbps", "wrong", "time_us_p10", "time_us_p90"):
        assert key in rec


def test_table_has_nccl_tests_columns_and_footer():
    rows = [_result(nbytes=4096, times=[12.345]), _result(nbytes=1 << 20, times=[12345.0])]
    text = table.format_table(rows, None, "tcp")
    lines = text.splitlines()
    assert lines[0].startswith("# all_reduce on gloo (gloo), world_size 4, transport tcp")
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert column in lines[1]
    assert "ratio" not in lines[1] and "eff" not in lines[1]
    first = lines[3].split()
    assert first[:5] == ["4096", "1024", "float", "sum", "-1"] and first[5] == "12.35" and first[-1] == "0"
    assert lines[4].split()[5] == "12345"
    assert "# Out of bounds values : 0 OK" in text
    assert "# Avg bus bandwidth" in text
    # every data row lines up with the header
    assert len(lines[3]) == len(lines[1])


def test_table_ratio_and_eff_columns_and_failure_footer():
    tb = _result("thunderbolt", times=[500.0], n=2)
    gl = _result("gloo", times=[1000.0], n=2)
    bad = _result("thunderbolt", nbytes=4096, times=[10.0], n=2, wrong=7)
    rows = [tb, gl, bad, _result("gloo", nbytes=4096, times=[10.0], n=2)]
    metrics.add_ratios(rows, "gloo")
    metrics.add_efficiency(rows, {4: _link(2.0), 1: _link(1.0)}, {"thunderbolt": 4, "gloo": 1})
    text = table.format_table([bad, tb], "gloo", "auto")
    assert "ratio" in text and "vs gloo" in text and "eff" in text and "4 stream(s)" in text
    bad_line, good_line = text.splitlines()[3:5]
    assert bad_line.split()[-3:] == ["7", "-", "-"]  # a wrong result gets no ratio, no efficiency
    assert good_line.split()[-2] == "2.00"
    assert "# Out of bounds values : 7 FAILED" in text
    assert table.format_row(gl, "gloo", False).split()[-1] == "base"


@pytest.mark.parametrize("us, text", [(1.234, "1.23"), (123.45, "123.5"), (12345.6, "12346")])
def test_format_time(us, text):
    assert table.format_time(us) == text


def test_link_table():
    recs = [{"streams": 1, "gbps": 2.0, "gbps_min": 1.5, "gbps_max": 2.5, "congestion_control": "bbr"}]
    lat = {"bytes": 8, "iters": 100, "latency_us": 11.7, "latency_us_p10": 10.0, "latency_us_p90": 13.0}
    text = table.format_link(recs, lat, "127.0.0.1", 256 << 20, 3)
    assert "256MB per measurement" in text and "median of 3" in text
    assert text.splitlines()[2].split() == ["1", "2.00", "16.0", "1.50", "2.50", "bbr", "-"]
    recs[0]["duplex_gbps"] = 1.25
    assert table.format_link(recs, lat, "127.0.0.1", 256 << 20, 3).splitlines()[2].split()[-1] == "1.25"
    assert "median 11.7 us" in text


def test_progress_line():
    line = table.format_progress(5, 10, "all_reduce 4096 B", width=10)
    assert line.startswith("\r[#####.....] 5/10 all_reduce 4096 B")
    assert table.format_progress(3, 0, "x").startswith("\r[")
