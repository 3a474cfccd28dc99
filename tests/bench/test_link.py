"""The raw TCP link measurement, both ends in this process over loopback."""
import threading

import pytest

from torch_thunderbolt.bench import link
from torch_thunderbolt.errors import ThunderboltError

PLAN = link.LinkPlan(streams=(1, 3), nbytes=3 << 20, repeats=2, pings=50, sockbuf=None, timeout=20.0)


def test_socket_buffer_respects_system_cap():
    assert link.socket_buffer(4 << 20, 4 << 20) == 4 << 20
    assert link.socket_buffer(4 << 20, None) == 4 << 20
    assert link.socket_buffer(8 << 20, 212992) is None  # would be clamped below autotuning: leave it
    assert link.socket_buffer(None, 1 << 30) is None


def test_read_rmem_max(tmp_path):
    f = tmp_path / "rmem_max"
    f.write_text("4194304\n")
    assert link.read_rmem_max(str(f)) == 4194304
    assert link.read_rmem_max(str(tmp_path / "absent")) is None


def test_local_address_towards_loopback():
    assert link.local_address_towards("127.0.0.1", 29500) == "127.0.0.1"


@pytest.mark.timeout(60)
def test_measure_against_serve_over_loopback():
    listener = link.open_listener("127.0.0.1", PLAN)
    errors = []

    def server():
        try:
            link.serve(listener, PLAN)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        records, latency = link.measure("127.0.0.1", listener.getsockname()[1], PLAN)
    finally:
        thread.join(30)
        listener.close()
    assert errors == [] and not thread.is_alive()
    assert [r["streams"] for r in records] == [1, 3]
    assert all(r["gbps"] > 0 and r["gbps_min"] <= r["gbps"] <= r["gbps_max"] for r in records)
    assert all(0 < r["duplex_gbps_min"] <= r["duplex_gbps"] <= r["duplex_gbps_max"] for r in records)
    assert records[1]["bytes"] == 3 << 20
    assert latency["iters"] == 50 and 0 < latency["latency_us_p10"] <= latency["latency_us"] <= latency["latency_us_p90"]


@pytest.mark.timeout(30)
def test_run_reports_rank1_listen_failure_to_every_rank(monkeypatch):
    def broken(*args):
        raise OSError("no such address")

    monkeypatch.setattr(link, "local_address_towards", broken)
    shared = []

    def share(obj):
        shared.append(obj)
        return obj

    with pytest.raises(ThunderboltError, match="rank 1 cannot listen"):
        link.run(1, PLAN, ("127.0.0.1", 1), share)
    # rank 0 receives the same message through the collective and fails instead of hanging
    with pytest.raises(ThunderboltError, match="rank 1 cannot listen"):
        link.run(0, PLAN, ("127.0.0.1", 1), lambda obj: shared[0])


@pytest.mark.timeout(30)
def test_connect_failure_is_peer_lost():
    listener = link.open_listener("127.0.0.1", PLAN)
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(ThunderboltError, match="cannot connect to rank 1"):
        link.measure("127.0.0.1", port, PLAN)


def test_memcpy_measurement_and_its_line():
    from torch_thunderbolt.bench import memcpy

    rec = memcpy.measure(1 << 20, repeats=3)
    assert rec["bytes"] == 1 << 20 and rec["threads"] == 1
    assert 0 < rec["gbps_min"] <= rec["gbps"] <= rec["gbps_max"]
    line = memcpy.describe(rec, rec)
    assert line.startswith("# memcpy, 1 thread, 1048576 B:") and "before" in line and "after" in line
