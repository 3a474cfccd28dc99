"""Helpers for launcher tests: a fake `ssh` on PATH and a way to run the CLI as a subprocess."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import torch_thunderbolt.launch

HERE = Path(__file__).parent
REPO = Path(torch_thunderbolt.launch.__file__).resolve().parents[2]


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for `python -m torch_thunderbolt` subprocesses (works without installing the package)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def fake_ssh_env(tmp_path, cli_env) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'fake_ssh.py'} \"$@\"\n")
    (bindir / "ssh").chmod(0o755)
    env = dict(cli_env)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["FAKE_SSH_LOG"] = str(tmp_path / "ssh.log")
    return env


@pytest.fixture
def script(tmp_path):
    """Write a small Python program into tmp_path and return its path."""
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write
