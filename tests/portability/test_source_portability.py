"""Source checks for things that work on the Linux dev box but break on a Mac.

- Loopback is `lo0` on macOS: a hard-coded `"lo"` for GLOO_SOCKET_IFNAME / an ifname makes gloo fail to
  start there, so code picks the name with `loopback_ifname()`.
- Forking a process that has imported torch (or will, in the child, with the parent's Objective-C and
  Metal state half-copied) crashes on macOS; scripts and examples use spawn or subprocess instead.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from torch_thunderbolt.transport.netif import loopback_ifname

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("torch_thunderbolt", "scripts", "examples", "tests")

# `GLOO_SOCKET_IFNAME"] = "lo"`, `setdefault("GLOO_SOCKET_IFNAME", "lo")`, `"ifname": "lo"`, `THUNDERBOLT_IFNAME=lo`
HARD_CODED_LO = re.compile(r"""(?:SOCKET_IFNAME|IFNAME|ifname)(?:["']?\]?\s*[=:,]\s*["']|=)lo(?![0-9a-z_])""")


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("platform, name", [("linux", "lo"), ("darwin", "lo0"), ("freebsd14", "lo0")])
def test_loopback_ifname_per_platform(platform, name):
    assert loopback_ifname(platform) == name


def test_loopback_ifname_defaults_to_this_machine():
    import sys

    assert loopback_ifname() == loopback_ifname(sys.platform)


def test_the_checks_catch_what_they_look_for():
    """The two scanners below must flag the shapes they exist for (else the repo checks prove nothing)."""
    assert HARD_CODED_LO.search('os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")')
    assert HARD_CODED_LO.search('env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback')
    assert HARD_CODED_LO.search('{"name": "a", "ifname": "lo"}')
    assert not HARD_CODED_LO.search('env["GLOO_SOCKET_IFNAME"] = "lo0"')
    assert HARD_CODED_LO.search('f"THUNDERBOLT_IFNAME=lo EXTRA=None"')
    assert not HARD_CODED_LO.search('"ifname": "lower"')
    assert not HARD_CODED_LO.search('{"ifname": lo}')  # a variable holding loopback_ifname()
    assert _forks(ast.parse('import multiprocessing as mp\nctx = mp.get_context("fork")'))
    assert _forks(ast.parse('import os\npid = os.fork()'))
    assert _forks(ast.parse('import multiprocessing\nmultiprocessing.set_start_method("fork")'))
    assert _forks(ast.parse('import multiprocessing as mp\np = mp.Process(target=f)'))
    assert not _forks(ast.parse('import multiprocessing as mp\nctx = mp.get_context("spawn")\nctx.Process()'))
    assert _allowed(["if opted_in:", "    # fork-ok: opt-in only", "    mp.get_context('fork')"], 3)
    assert not _allowed(["# fork-ok far above", "x = 1", "mp.get_context('fork')"], 3)


def test_no_hard_coded_linux_loopback_name():
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in _python_files(*SOURCE_DIRS) if p.name != Path(__file__).name
             for i, line in enumerate(p.read_text().splitlines(), 1) if HARD_CODED_LO.search(line)]
    assert not found, "use torch_thunderbolt.transport.netif.loopback_ifname() (lo0 on macOS):\n" + "\n".join(found)


def _forks(tree: ast.AST) -> list[int]:
    """Lines that fork: os.fork(), a "fork" start method, or multiprocessing's default-context Process
    (fork on Linux, which hides the problem here and changes behaviour on the Mac)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if name == "fork" and owner == "os":
            lines.append(node.lineno)
        elif name in ("get_context", "set_start_method") and "fork" in args:
            lines.append(node.lineno)
        elif name == "Process" and owner in ("mp", "multiprocessing"):
            lines.append(node.lineno)
    return lines


def _allowed(lines: list[str], lineno: int) -> bool:
    """An explicit opt-in (never the default) is marked `# fork-ok` on its line or the line above."""
    return any("# fork-ok" in lines[i - 1] for i in (lineno - 1, lineno) if i >= 1)


def test_scripts_and_examples_do_not_fork():
    found = []
    for p in _python_files("scripts", "examples"):
        text = p.read_text()
        found += [f"{p.relative_to(REPO)}:{n}" for n in _forks(ast.parse(text)) if not _allowed(text.splitlines(), n)]
    assert not found, "use mp.get_context('spawn') or subprocess (fork + torch crashes on macOS):\n" + "\n".join(found)
