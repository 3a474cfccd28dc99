"""Every command the README and the docs give runs as written on a fresh machine: `torch-thunderbolt` is
reached where the shell can find it, and commands run as root name the venv's programs by path (a stock
sudo replaces PATH with its secure_path, without the venv: `sudo python`, `sudo torch-thunderbolt` and
`sudo pytest` fail there or run another interpreter)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from torch_thunderbolt.cli.main import self_command

REPO = Path(__file__).resolve().parents[2]
# What a user reads and copies: the manual, the figures' pages, the scripts' usage lines, the examples.
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "scripts").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.sh")),
        *sorted((REPO / "examples").rglob("*.py"))]
UNDER_STOCK_SUDO = re.compile(r"\bsudo\s+(?:-\S+\s+)*(python[\d.]*|torch-thunderbolt|pytest|torchrun)\b")


def test_no_root_command_relies_on_the_venv_being_on_path() -> None:
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in DOCS
             for n, line in enumerate(path.read_text().splitlines(), 1) if UNDER_STOCK_SUDO.search(line)]
    assert len(DOCS) > 10 and not found, "\n".join(found)


def test_the_pattern_catches_what_a_stock_sudo_cannot_run() -> None:
    for bad in ("sudo python scripts/lab_bench.py", "sudo torch-thunderbolt lab up", "sudo pytest tests/lab",
                "sudo -E python3.12 -m pytest"):
        assert UNDER_STOCK_SUDO.search(bad), bad
    for good in ("sudo .venv/bin/python scripts/lab_bench.py", "sudo .venv/bin/torch-thunderbolt lab up",
                 "sudo /usr/libexec/ApplicationFirewall/socketfilterfw --add", "sudo -n /usr/sbin/networksetup"):
        assert not UNDER_STOCK_SUDO.search(good), good


def test_the_quick_start_says_how_to_reach_the_command() -> None:
    quick = (REPO / "README.md").read_text().split("### Quick start")[1].split("\n### ")[0]
    assert "source .venv/bin/activate" in quick and ".venv/bin/torch-thunderbolt" in quick


def _venv(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "work" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "torch-thunderbolt"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_the_demo_names_the_command_as_this_shell_can_run_it(tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path)
    python = str(bin_dir / "python")
    # Not activated: PATH lacks the venv, so the name alone would be "command not found".
    assert self_command(python, path="/usr/bin:/bin", cwd=str(tmp_path / "work")) == ".venv/bin/torch-thunderbolt"
    assert self_command(python, path="/usr/bin:/bin", cwd="/") == str(bin_dir / "torch-thunderbolt")
    assert self_command(python, path=f"{bin_dir}{os.pathsep}/usr/bin", cwd="/") == "torch-thunderbolt"
    bare = tmp_path / "checkout-python"
    bare.write_text("")
    assert self_command(str(bare), path="/usr/bin", cwd="/") == f"{bare} -m torch_thunderbolt"


@pytest.mark.parametrize("page", ["docs/tools.md"])
def test_the_accelerate_recipe_says_which_backend_name_accelerate_reports(page: str) -> None:
    text = (REPO / page).read_text().split("**HF Accelerate**")[1].split("**Lightning**")[0]
    assert "accelerator.state.backend" in text and '`"gloo"`' in text and '`"thunderbolt"`' in text


def test_platforms_gathers_the_first_day_steps_and_what_is_not_emulated() -> None:
    text = (REPO / "docs" / "platforms.md").read_text()
    setting_up = text.split("## Setting up a Mac")[1].split("\n## ")[0]
    for step in ("doctor --firewall-command", "topo --persist", "THUNDERBOLT_KEEP_AWAKE", "Local Network",
                 "sudo .venv/bin/python"):
        assert step in setting_up, step
    not_emulated = text.split("## Not emulated here")[1].split("\n## ")[0]
    assert not_emulated.count("\n- ") >= 5
