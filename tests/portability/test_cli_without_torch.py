"""The command line imports torch only for the subcommands that need it.

`import torch` takes seconds (and prints torch's own warnings): `--help`, `topo`, `launch --dry-run` and
`lab --help` must not pay for it. Each command runs in a subprocess whose PYTHONPATH puts a `torch` package
first that fails when imported, so any import of torch, however indirect, fails the command. Both ways of
starting the command are covered: `python -m torch_thunderbolt` and the console script's entry point.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.topology.topo_fixtures import scenario_hosts, write_dumps

REPO = Path(__file__).resolve().parents[2]
BLOCKED = "torch was imported by the command line"
# What pip's generated `torch-thunderbolt` script does (pyproject's [project.scripts] entry).
CONSOLE_SCRIPT = "import sys; from torch_thunderbolt_cli import main; sys.exit(main())"


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(f"raise ImportError({BLOCKED!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), str(REPO)])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def _run(env: dict[str, str], how: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    start = [sys.executable, "-m", "torch_thunderbolt"] if how == "-m" else [sys.executable, "-c", CONSOLE_SCRIPT]
    return subprocess.run([*start, *argv], env=env, capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("how", ["-m", "console script"])
@pytest.mark.parametrize("argv", [["--help"], ["topo", "--help"], ["launch", "--help"], ["lab", "--help"],
                                  ["doctor", "--help"], ["bench", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(no_torch_env, how, argv) -> None:
    done = _run(no_torch_env, how, *argv)
    assert done.returncode == 0, done.stderr
    assert BLOCKED not in done.stderr and "usage: torch-thunderbolt" in done.stdout


def test_topo_and_launch_run_without_torch(no_torch_env, tmp_path) -> None:
    dumps = write_dumps(scenario_hosts("pair"), tmp_path)
    done = _run(no_torch_env, "-m", "topo", "--from", *dumps, "--hostfile", str(tmp_path / "hosts.json"))
    assert done.returncode == 0, done.stderr
    assert "shape: pair" in done.stdout
    done = _run(no_torch_env, "console script", "launch", "--nproc-per-host", "2", "--dry-run", "--",
                "python", "train.py")
    assert done.returncode == 0, done.stderr
    assert "RANK=1" in done.stdout


def test_a_program_importing_the_package_still_registers_the_backend(tmp_path) -> None:
    """Only the command line defers: `import torch_thunderbolt` in a program (or `python -c`) registers."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    code = ("import sys, torch_thunderbolt, torch.distributed as dist; "
            "sys.exit(0 if 'thunderbolt' in dist.Backend.backend_list else 3)")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0
    script = tmp_path / "prog.py"
    script.write_text(code.replace("; ", "\n"))
    # An interpreter option before the script, and a "-m torch_thunderbolt" among the script's own arguments.
    done = subprocess.run([sys.executable, "-X", "utf8", str(script), "-m", "torch_thunderbolt"], env=env,
                          timeout=120)
    assert done.returncode == 0


def test_subcommands_that_use_the_backend_register_it(tmp_path) -> None:
    """`python -m torch_thunderbolt doctor` (which reports the registration) sees the backend registered."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "backend 'thunderbolt' registered" in done.stdout, done.stdout + done.stderr
