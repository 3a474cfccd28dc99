"""Configuration parsing, the doctor's checks, the autoload entry point and the demo command."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from torch_thunderbolt.config import Config, parse_size
from torch_thunderbolt.doctor import FAIL, OK, WARN, Facts, run_checks
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.testing.ranks import REPO


def test_defaults_and_values() -> None:
    cfg = Config.from_env({"THUNDERBOLT_IFNAME": "en2, en3", "THUNDERBOLT_STREAMS": "4",
                           "THUNDERBOLT_CHUNK": "2M", "THUNDERBOLT_ALGO": "Chain"})
    assert cfg.ifnames == ("en2", "en3") and cfg.streams == 4 and cfg.chunk_bytes == 2 << 20
    assert cfg.algo == "chain" and Config.from_env({}) == Config()
    assert parse_size("64K") == 65536 and parse_size("1.5M") == 1572864


@pytest.mark.parametrize("env, match", [
    ({"THUNDERBOLT_STREAMS": "0"}, "THUNDERBOLT_STREAMS: expected an integer from 1 to 64"),
    ({"THUNDERBOLT_STREAMS": "many"}, "THUNDERBOLT_STREAMS"),
    ({"THUNDERBOLT_ALGO": "fastest"}, "THUNDERBOLT_ALGO: expected one of"),
    ({"THUNDERBOLT_TRANSPORT": "infiniband"}, "THUNDERBOLT_TRANSPORT"),
    ({"THUNDERBOLT_CHUNK": "12"}, "at least 1K"),
    ({"THUNDERBOLT_CHUNK": "lots"}, "expected a size"),
    ({"THUNDERBOLT_LISTEN_ALL": "maybe"}, "expected 0 or 1"),
])
def test_bad_values_name_the_variable(env: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Config.from_env(env)


SIZE_VARS = ["THUNDERBOLT_CHUNK", "THUNDERBOLT_SMALL", "THUNDERBOLT_STRIPE", "THUNDERBOLT_SOCKET_BUFFER",
             "THUNDERBOLT_SHM_SLOT", "THUNDERBOLT_SHM_WINDOW"]
# Values that slipped through (accepted, or an OverflowError/TypeError instead of a ConfigError).
BAD_VALUES = [(var, text) for var in SIZE_VARS for text in ("inf", "-inf", "1e400", "nan", "99999999999999G")] + [
    ("THUNDERBOLT_SOCKET_BUFFER", "0"), ("THUNDERBOLT_SOCKET_BUFFER", "1"), ("THUNDERBOLT_SOCKET_BUFFER", "3G"),
    ("THUNDERBOLT_SOCKET_BUFFER", "2G"), ("THUNDERBOLT_CHUNK", "2G"),
    ("THUNDERBOLT_SHM_DIR", "/proc"), ("THUNDERBOLT_SHM_DIR", "/nonexistent-thunderbolt-dir"),
    ("THUNDERBOLT_SHM_DIR", str(REPO / "pyproject.toml")),  # a file, not a directory
    ("THUNDERBOLT_SHM_SLOTS", "1"), ("THUNDERBOLT_SHM_SLOTS", "many"), ("THUNDERBOLT_SHM_SLOT", "1000"),
    ("THUNDERBOLT_SHM_WINDOW", "2G"),
    ("THUNDERBOLT_AUTOLOAD", "garbage"),
    ("THUNDERBOLT_COMPRESSION", "int9"), ("THUNDERBOLT_COMPRESSION_BLOCK", "0"),
    ("THUNDERBOLT_COMPRESSION_BLOCK", "2000000"),
    ("THUNDERBOLT_VERBS", "soft-roce"), ("THUNDERBOLT_VERBS", "fake:"),
    ("THUNDERBOLT_VERBS", "fake:/nonexistent-thunderbolt-fabric"),
]


@pytest.mark.parametrize("var, text", BAD_VALUES)
def test_every_bad_value_is_a_config_error_naming_the_variable(var: str, text: str) -> None:
    with pytest.raises(ConfigError, match=var):
        Config.from_env({var: text})


@pytest.mark.parametrize("var, text", BAD_VALUES)
def test_doctor_reports_what_the_job_would_reject(var: str, text: str) -> None:
    found = by_check(run_checks(facts(env={var: text})))["configuration"]
    assert found.status == FAIL and var in found.detail


def test_doctor_reports_one_shm_slot_as_an_error() -> None:
    """The job fails mid-rendezvous with THUNDERBOLT_SHM_SLOTS=1, so doctor must not say [ok]."""
    found = by_check(run_checks(facts(env={"THUNDERBOLT_SHM_SLOTS": "1"})))["configuration"]
    assert found.status == FAIL and "THUNDERBOLT_SHM_SLOTS: expected an integer from 2 to 1024" in found.detail


def test_size_ranges_and_shm_fields_accept_good_values(tmp_path) -> None:
    cfg = Config.from_env({"THUNDERBOLT_SOCKET_BUFFER": "64K", "THUNDERBOLT_CHUNK": "1G", "THUNDERBOLT_SMALL": "0",
                           "THUNDERBOLT_SHM_SLOT": "256K", "THUNDERBOLT_SHM_SLOTS": "4",
                           "THUNDERBOLT_SHM_WINDOW": "0",
                           "THUNDERBOLT_SHM_DIR": str(tmp_path), "THUNDERBOLT_AUTOLOAD": "0"})
    assert (cfg.socket_buffer, cfg.chunk_bytes, cfg.small_bytes) == (64 << 10, 1 << 30, 0)
    assert (cfg.shm_slot_bytes, cfg.shm_slots, cfg.shm_window_bytes) == (256 << 10, 4, 0)
    assert cfg.shm_dir == str(tmp_path) and not cfg.autoload
    assert list(tmp_path.iterdir()) == []  # the writability probe leaves nothing behind
    assert Config.from_env({"THUNDERBOLT_SOCKET_BUFFER": str((1 << 31) - 1)}).socket_buffer == (1 << 31) - 1
    default = Config.from_env({})  # unset = automatic (by rank count, decided by the transport)
    assert (default.shm_spin_us, default.shm_window_bytes, default.shm_dir, default.autoload) == (None, None, "",
                                                                                                   True)


def test_a_missing_shm_dir_is_not_created(tmp_path) -> None:
    missing = tmp_path / "typo"
    with pytest.raises(ConfigError, match="THUNDERBOLT_SHM_DIR=.*does not exist"):
        Config.from_env({"THUNDERBOLT_SHM_DIR": str(missing)})
    assert not missing.exists()


@pytest.mark.parametrize("env", [{}, {"THUNDERBOLT_COMPRESSION": "INT8"},
                                 {"THUNDERBOLT_COMPRESSION": "bf16", "THUNDERBOLT_COMPRESSION_BLOCK": "64"},
                                 {"THUNDERBOLT_COMPRESSION_BLOCK": "2000000"}, {"THUNDERBOLT_COMPRESSION": "x"}])
def test_compression_settings_have_one_parser(env: dict) -> None:
    """compression.mode_from_env and the backend's Config agree, errors included."""
    from torch_thunderbolt.compression import mode_from_env

    def outcome(f):
        try:
            return f()
        except ConfigError as exc:
            return str(exc)

    cfg = outcome(lambda: Config.from_env(env))
    expected = cfg if isinstance(cfg, str) else (cfg.compression, cfg.compression_block)
    assert outcome(lambda: mode_from_env(env)) == expected


def test_a_taken_port_names_thunderbolt_port_and_suggests_0() -> None:
    from torch_thunderbolt.rendezvous import tcp as bootstrap

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rank 3: THUNDERBOLT_PORT: cannot listen on 127.0.0.1:{port} .*THUNDERBOLT_PORT=0"):
            bootstrap._listen("127.0.0.1", Config(port=port), rank=3)


def facts(**kw) -> Facts:
    base = dict(system="Darwin", python="3.11", torch="2.13.0", backend_registered=True, env={},
                interfaces={"lo0": ["127.0.0.1"], "en0": ["192.168.1.4"], "en2": ["10.77.0.1"]},
                thunderbolt_ifnames=["en2"], mtus={"en2": 1500}, congestion_control="",
                max_socket_buffer=8 << 20)
    base.update(kw)
    return Facts(**base)


def by_check(findings) -> dict:
    return {f.check: f for f in findings}


def test_doctor_suggests_the_thunderbolt_interface_and_mtu() -> None:
    found = by_check(run_checks(facts()))
    assert found["interface choice"].status == WARN and "THUNDERBOLT_IFNAME=en2" in found["interface choice"].fix
    assert found["en2 MTU"].status == WARN and "9000" in found["en2 MTU"].fix
    assert found["torch"].status == OK


def test_doctor_fails_on_bad_config_and_unknown_interface() -> None:
    assert by_check(run_checks(facts(env={"THUNDERBOLT_STREAMS": "x"})))["configuration"].status == FAIL
    found = by_check(run_checks(facts(env={"THUNDERBOLT_IFNAME": "en7"})))
    assert found["THUNDERBOLT_IFNAME"].status == FAIL and "en2" in found["THUNDERBOLT_IFNAME"].fix


def test_doctor_warns_on_small_socket_buffers_and_bridge() -> None:
    found = by_check(run_checks(facts(max_socket_buffer=1 << 20, bridge_members=["en2", "en3"])))
    assert found["socket buffers"].status == WARN
    assert found["Thunderbolt Bridge"].status == WARN


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "TORCH_DEVICE"))}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e)


@pytest.mark.timeout(180)
def test_autoload_registers_and_can_be_disabled() -> None:
    code = ("import sys, torch, torch.distributed as d; "
            "print('thunderbolt' in d.Backend.backend_list, 'torch_thunderbolt' in sys.modules)")
    assert _python(code).stdout.split() == ["True", "True"]
    assert _python(code, THUNDERBOLT_AUTOLOAD="0").stdout.split() == ["False", "False"]
    assert _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0").stdout.split() == ["False", "False"]
    explicit = _python(code.replace("torch.distributed as d;", "torch.distributed as d, torch_thunderbolt;"),
                       THUNDERBOLT_AUTOLOAD="0")
    assert explicit.stdout.split()[0] == "True"


@pytest.mark.timeout(120)
def test_autoload_with_a_bad_value_warns_and_does_not_break_import_torch() -> None:
    code = "import torch, torch.distributed as d; print('thunderbolt' in d.Backend.backend_list)"
    out = _python(code, THUNDERBOLT_AUTOLOAD="garbage")
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]
    assert "THUNDERBOLT_AUTOLOAD: expected 0 or 1, got 'garbage'" in out.stderr and "NOT registered" in out.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_demo_command_runs_two_local_ranks() -> None:
    out = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "demo", "--size", "1M"], cwd=REPO,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all_reduce of [rank+1]*4          -> [3.0, 3.0, 3.0, 3.0]" in out.stdout
    assert "rank 1 received from rank 0       -> [0.0, 1.0, 2.0]" in out.stdout


THREE_BAD = {"THUNDERBOLT_STREAMS": "many", "THUNDERBOLT_ALGO": "fastest", "THUNDERBOLT_CHUNK": "12"}


def test_every_bad_setting_is_named_in_one_error() -> None:
    cfg, problems = Config.parse_env({**THREE_BAD, "THUNDERBOLT_SMALL": "1M"})
    assert [str(p).split(":")[0] for p in problems] == ["THUNDERBOLT_STREAMS", "THUNDERBOLT_ALGO", "THUNDERBOLT_CHUNK"]
    assert cfg == Config(small_bytes=1 << 20)  # the good one taken, the bad ones at their defaults
    with pytest.raises(ConfigError) as info:
        Config.from_env(THREE_BAD)
    assert all(var in str(info.value) for var in THREE_BAD), str(info.value)


def test_doctor_reports_every_bad_setting_in_one_run_each_with_its_fix() -> None:
    found = [f for f in run_checks(facts(env=dict(THREE_BAD))) if f.status == FAIL]
    assert len(found) == 3, found
    for var, finding in zip(THREE_BAD, found):
        assert finding.detail.startswith(f"{var}: expected") and var in finding.fix, finding


@pytest.mark.timeout(180)
def test_the_doctor_command_lists_every_bad_setting_and_fails() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THUNDERBOLT_")}
    env.update(THREE_BAD, THUNDERBOLT_IFNAME="tbnope0", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "doctor", "--json"], capture_output=True,
                         text=True, timeout=150, env=env, cwd=REPO)
    assert run.returncode == 1, run.stderr[-2000:]
    failed = " ".join(f["detail"] for f in json.loads(run.stdout) if f["status"] == FAIL)
    assert all(var in failed for var in THREE_BAD) and "tbnope0" in failed, failed


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_interface_that_does_not_exist_fails_the_set_up_naming_the_rank(transport: str) -> None:
    """Whatever kinds of link the rank would use (shm alone needs no interface): before any link, on the
    rank with the setting, and on the rank waiting for it."""
    from torch_thunderbolt.rendezvous.group import connect
    from torch_thunderbolt.testing.worlds import SetUpOnThreads

    with SetUpOnThreads(2, connect, close_result=lambda c: c.transport.close()) as world:
        world.start(0, Config(transport=transport, connect_timeout=30))
        world.start(1, Config(transport=transport, connect_timeout=30, ifnames=("tbnope0",)))
        world.join()
        errors = {r: str(e) for r, e in world.errors.items()}
        assert set(errors) == {0, 1}, (errors, world.results)
        assert errors[1].startswith("rank 1: THUNDERBOLT_IFNAME: no interface named 'tbnope0'"), errors
        assert "rank 1 gave up during set-up: ConfigError: rank 1: THUNDERBOLT_IFNAME" in errors[0], errors


def test_the_store_probe_checks_the_interfaces_on_every_rank() -> None:
    """Before the store exists (rank 0 serves it): a rank 0 with a bad interface never leaves the others
    waiting for the store's clients."""
    from torch_thunderbolt.rendezvous.store_probe import probe_url

    with pytest.raises(ConfigError, match="rank 0: THUNDERBOLT_IFNAME: no interface named 'tbnope0'"):
        probe_url("env://?rank=0", env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                                        "THUNDERBOLT_IFNAME": "tbnope0"})


def test_a_congestion_control_this_kernel_lacks_is_refused_on_every_rank_and_by_doctor() -> None:
    from torch_thunderbolt.platform import current
    from torch_thunderbolt.rendezvous.tcp import machine_problems

    if not current().tcp_congestion or not hasattr(socket, "TCP_CONGESTION"):
        pytest.skip("no per-socket congestion control here (THUNDERBOLT_CC only warns)")
    problems = machine_problems(Config(congestion_control="tbnope"), interfaces={})
    assert len(problems) == 1 and "THUNDERBOLT_CC='tbnope': not available here" in str(problems[0]), problems
    assert machine_problems(Config(congestion_control="reno"), interfaces={}) == []
    found = by_check(run_checks(facts(cc_error=str(problems[0]))))["THUNDERBOLT_CC"]
    assert found.status == FAIL and "tbnope" in found.detail


def test_doctor_warns_that_a_shm_dir_on_a_mac_flushes_the_disk_at_each_segment(tmp_path) -> None:
    mac = by_check(run_checks(facts(env={"THUNDERBOLT_SHM_DIR": str(tmp_path)})))
    assert mac["THUNDERBOLT_SHM_DIR"].status == WARN and "F_FULLFSYNC" in mac["THUNDERBOLT_SHM_DIR"].detail
    assert "unset THUNDERBOLT_SHM_DIR" in mac["THUNDERBOLT_SHM_DIR"].fix
    linux = by_check(run_checks(facts(system="Linux", env={"THUNDERBOLT_SHM_DIR": str(tmp_path)})))
    assert "THUNDERBOLT_SHM_DIR" not in linux
    assert "THUNDERBOLT_SHM_DIR" not in by_check(run_checks(facts()))
