"""Configuration parsing, the doctor's checks, the autoload entry point and the demo command."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torch_thunderbolt.config import Config, parse_size
from torch_thunderbolt.doctor import FAIL, OK, WARN, Facts, run_checks
from torch_thunderbolt.errors import ConfigError

from .mp import REPO


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
    ({"THUNDERBOLT_TRANSPORT": "rdma"}, "THUNDERBOLT_TRANSPORT"),
    ({"THUNDERBOLT_CHUNK": "12"}, "at least 1K"),
    ({"THUNDERBOLT_CHUNK": "lots"}, "expected a size"),
    ({"THUNDERBOLT_LISTEN_ALL": "maybe"}, "expected 0 or 1"),
])
def test_bad_values_name_the_variable(env: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Config.from_env(env)


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


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_demo_command_runs_two_local_ranks() -> None:
    out = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "demo", "--size", "1M"], cwd=REPO,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all_reduce of [rank+1]*4          -> [3.0, 3.0, 3.0, 3.0]" in out.stdout
    assert "rank 1 received from rank 0       -> [0.0, 1.0, 2.0]" in out.stdout
