"""scripts/setup.sh on a stock Mac: `python3` there is Apple's 3.9, which cannot run torch.

The tests give bash a PATH holding only fake interpreters (shell scripts printing a version), so what
setup finds does not depend on this machine's Pythons.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
INSTALL_HINT = "brew install python@3.12"


def _fake_python(bindir: Path, name: str, version: str, log: Path) -> Path:
    """A `python` that answers the version probe with `version`, and logs every call it gets."""
    path = bindir / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\necho {version}\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    return bindir


def _find(bindir: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, "-c", f". {REPO / 'scripts' / 'find_python.sh'} && find_python"],
                          env={"PATH": str(bindir), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=30)


def test_setup_refuses_apples_python_39_and_says_what_to_install(tmp_path, fake_bin):
    """setup.sh as a whole, in a copy of the repo without .venv: a 3.9 python3 must not make a venv."""
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    for script in (REPO / "scripts").glob("*.sh"):
        shutil.copy(script, copy / "scripts" / script.name)
    log = tmp_path / "calls.log"
    _fake_python(fake_bin, "python3", "3.9", log)
    (fake_bin / "dirname").symlink_to(shutil.which("dirname"))  # setup.sh's only outside tool before venv
    done = subprocess.run([BASH, str(copy / "scripts" / "setup.sh")], env={"PATH": str(fake_bin)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert INSTALL_HINT in done.stderr and "3.10 or newer" in done.stderr and "(3.9)" in done.stderr, done.stderr
    assert "-m venv" not in (log.read_text() if log.exists() else "")
    assert not (copy / ".venv").exists()


def test_only_an_old_python3_is_a_clear_error(tmp_path, fake_bin):
    _fake_python(fake_bin, "python3", "3.9", tmp_path / "log")
    done = _find(fake_bin)
    assert done.returncode == 1 and done.stdout == ""
    assert f"found only: {fake_bin / 'python3'} (3.9)" in done.stderr and INSTALL_HINT in done.stderr
    assert "python.org" in done.stderr


def test_no_python_at_all(fake_bin):
    done = _find(fake_bin)
    assert done.returncode == 1 and "no python3 found" in done.stderr and INSTALL_HINT in done.stderr


def test_a_versioned_python_wins_over_an_old_python3(tmp_path, fake_bin):
    _fake_python(fake_bin, "python3", "3.9", tmp_path / "log")
    _fake_python(fake_bin, "python3.12", "3.12", tmp_path / "log")
    _fake_python(fake_bin, "python3.10", "3.10", tmp_path / "log")
    done = _find(fake_bin)
    assert done.returncode == 0 and done.stdout.strip() == str(fake_bin / "python3.12"), done.stderr


def test_python3_is_used_when_new_enough(tmp_path, fake_bin):
    _fake_python(fake_bin, "python3", "3.14", tmp_path / "log")
    assert _find(fake_bin).stdout.strip() == str(fake_bin / "python3")


def test_python_override_is_used_or_refused_never_replaced(tmp_path, fake_bin):
    other = tmp_path / "other"
    other.mkdir()
    good = _fake_python(other, "py311", "3.11", tmp_path / "log")
    old = _fake_python(other, "py39", "3.9", tmp_path / "log")
    _fake_python(fake_bin, "python3.12", "3.12", tmp_path / "log")
    assert _find(fake_bin, {"PYTHON": str(good)}).stdout.strip() == str(good)
    done = _find(fake_bin, {"PYTHON": str(old)})
    assert done.returncode == 1 and f"PYTHON={old} is Python 3.9" in done.stderr and INSTALL_HINT in done.stderr
    missing = _find(fake_bin, {"PYTHON": str(other / "nope")})
    assert missing.returncode == 1 and "no such program" in missing.stderr
