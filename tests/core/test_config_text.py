"""Bad bytes and careless files: every THUNDERBOLT_* value that is not UTF-8 text is a ConfigError naming its
variable (never a UnicodeEncodeError later, never the value itself), and a secret file that other users can
read is refused as ssh refuses such a private key; `doctor` reports exactly what a job would."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_thunderbolt.config as config_module
from torch_thunderbolt.config import Config, parse_secret
from torch_thunderbolt.doctor import FAIL, OK, run_checks
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.testing.ranks import REPO

from .test_config_doctor import by_check, facts

# Every variable the one parser reads (taken from its source, so a new one is fuzzed too).
VARIABLES = sorted(set(re.findall(r"THUNDERBOLT_[A-Z_]+[A-Z]", open(config_module.__file__).read())))
SECRET = "0123456789abcdef" * 4


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_the_fuzz_covers_every_variable() -> None:
    assert len(VARIABLES) >= 24 and {"THUNDERBOLT_SECRET", "THUNDERBOLT_CC", "THUNDERBOLT_IFNAME",
                                      "THUNDERBOLT_SHM_DIR", "THUNDERBOLT_AUTOLOAD"} <= set(VARIABLES)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VARIABLES), st.binary(min_size=1, max_size=48).filter(_not_utf8), st.sampled_from(["", "@"]))
def test_a_value_that_is_not_utf8_is_a_config_error_naming_the_variable(var: str, raw: bytes, prefix: str) -> None:
    value = prefix + os.fsdecode(raw)  # what os.environ holds for those bytes (surrogateescape)
    with pytest.raises(ConfigError) as info:
        Config.from_env({var: value})
    text = str(info.value)
    assert var in text and "UTF-8" in text, text
    assert value not in text and repr(value)[1:-1] not in text  # never shown: it may be the secret
    found = by_check(run_checks(facts(env={var: value})))["configuration"]
    assert found.status == FAIL and found.detail == text


@pytest.mark.parametrize("var, raw", [("THUNDERBOLT_SECRET", b"\xff" * 40 + SECRET.encode()),
                                      ("THUNDERBOLT_CC", b"cub\xefc")])
def test_through_the_real_environment(var: str, raw: bytes) -> None:
    """os.environb, as a shell gives bytes to a process: the parser and the socket set-up of a Config that
    holds them (THUNDERBOLT_CC is applied per socket) raise ConfigError, not UnicodeEncodeError."""
    code = ("import socket\n"
            "from torch_thunderbolt.config import Config\n"
            "from torch_thunderbolt.errors import ConfigError\n"
            "from torch_thunderbolt.rendezvous.tcp import SocketTuner\n"
            "try:\n"
            "    Config.from_env()\n"
            "except ConfigError as exc:\n"
            "    print('parse', type(exc).__name__, exc)\n"
            "import os\n"
            "cfg = Config(congestion_control=os.environ.get('THUNDERBOLT_CC', ''))\n"
            "try:\n"
            "    SocketTuner(cfg).tune(socket.socket())\n"
            "    print('tune ok')\n"
            "except ConfigError as exc:\n"
            "    print('tune', type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environb.items() if not k.startswith(b"THUNDERBOLT_")}
    env[var.encode()] = raw
    env[b"PYTHONPATH"] = str(REPO).encode()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    stdout = out.stdout.decode()
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert f"parse ConfigError {var}: expected UTF-8 text" in stdout, stdout
    if var == "THUNDERBOLT_CC" and hasattr(socket, "TCP_CONGESTION"):
        assert "tune ConfigError THUNDERBOLT_CC=" in stdout, stdout


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_secret_file_other_users_can_read_or_change_is_refused(tmp_path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        parse_secret(f"@{path}")
    text = str(info.value)
    assert f"THUNDERBOLT_SECRET=@{path}" in text and f"mode {mode:04o}" in text and f"chmod 600 {path}" in text
    assert SECRET not in text
    found = by_check(run_checks(facts(env={"THUNDERBOLT_SECRET": f"@{path}"})))["configuration"]
    assert found.status == FAIL and found.detail == text


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_secret_file_is_read(tmp_path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    assert Config.from_env({"THUNDERBOLT_SECRET": f"@{path}"}).secret == SECRET.encode()
    assert by_check(run_checks(facts(env={"THUNDERBOLT_SECRET": f"@{path}"})))["configuration"].status == OK


def test_a_secret_from_a_pipe_has_no_mode_to_check() -> None:
    read, write = os.pipe()
    try:
        os.write(write, SECRET.encode())
        os.close(write)
        write = -1
        assert parse_secret(f"@/dev/fd/{read}") == SECRET.encode()
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
