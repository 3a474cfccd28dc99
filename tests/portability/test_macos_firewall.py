"""The macOS firewall step: which binary each Python installation really listens with, what socketfilterfw
prints, the doctor's verdict, and the README's step that uses them.

Each installation layout is rebuilt under a temporary root with the files and symlinks that installer
makes, so `os.path.realpath` resolves them as it would on a Mac. For every framework build the binary that
listens is not `realpath(sys.executable)`, which is what the first-day step used to allow."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.doctor import FAIL, OK, WARN, check_firewall
from torch_thunderbolt.macos_firewall import (SOCKETFILTERFW, FirewallFacts, Interpreter, allow_commands,
                                              listed_verdict, listening_binary, parse_app_blocked,
                                              parse_global_state, parse_listed_apps, read_firewall)
from torch_thunderbolt.topology.discover import CommandResult

REPO = Path(__file__).resolve().parents[2]
APP = "Resources/Python.app/Contents/MacOS/Python"


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def _link(path: Path, target: str | Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def _python_org(root: Path) -> Path:
    """python.org's installer: the framework, its launcher bin/python3.12 and /usr/local/bin links."""
    version = root / "Library/Frameworks/Python.framework/Versions/3.12"
    _file(version / "bin/python3.12")  # the launcher (Mac/Tools/pythonw.c)
    _link(version / "bin/python3", "python3.12")
    _file(version / APP)
    _link(root / "Library/Frameworks/Python.framework/Versions/Current", "3.12")
    _link(root / "usr/local/bin/python3", version / "bin/python3")
    return version


def _homebrew(root: Path) -> Path:
    """Homebrew's python@3.12: a framework under the Cellar, reached through opt/ and bin/ symlinks."""
    keg = root / "opt/homebrew/Cellar/python@3.12/3.12.8"
    version = keg / "Frameworks/Python.framework/Versions/3.12"
    _file(version / "bin/python3.12")
    _file(version / APP)
    _link(keg / "bin/python3.12", "../Frameworks/Python.framework/Versions/3.12/bin/python3.12")
    _link(root / "opt/homebrew/opt/python@3.12", "../Cellar/python@3.12/3.12.8")
    _link(root / "opt/homebrew/bin/python3.12", "../Cellar/python@3.12/3.12.8/bin/python3.12")
    return root / "opt/homebrew/opt/python@3.12/Frameworks/Python.framework/Versions/3.12"


def _venv(root: Path, base_python: Path) -> Path:
    """`python -m venv .venv`: bin/python is a symlink to the interpreter that made it."""
    _link(root / "Users/me/torch-thunderbolt/.venv/bin/python", base_python)
    return root / "Users/me/torch-thunderbolt/.venv/bin/python"


def layouts(root: Path) -> dict[str, tuple[Interpreter, Path]]:
    """Each installation: (what Python reports, the file that listens)."""
    org = _python_org(root / "org")
    brew_prefix = _homebrew(root / "brew")
    brew_app = root / "brew/opt/homebrew/Cellar/python@3.12/3.12.8/Frameworks/Python.framework/Versions/3.12" / APP
    uv_home = root / "uv/Users/me/.local/share/uv/python/cpython-3.12.8-macos-aarch64-none"
    uv_python = _file(uv_home / "bin/python3.12")
    pyenv_home = root / "pyenv/Users/me/.pyenv/versions/3.12.8"
    pyenv_python = _file(pyenv_home / "bin/python3.12")
    _link(pyenv_home / "bin/python3", "python3.12")
    return {
        "python.org": (Interpreter(str(root / "org/usr/local/bin/python3"), str(org), "Python"), org / APP),
        "python.org venv": (Interpreter(str(_venv(root / "org", root / "org/usr/local/bin/python3")), str(org),
                                        "Python"), org / APP),
        "homebrew": (Interpreter(str(root / "brew/opt/homebrew/bin/python3.12"), str(brew_prefix), "Python"),
                     brew_app),
        "homebrew venv": (Interpreter(str(_venv(root / "brew", root / "brew/opt/homebrew/bin/python3.12")),
                                      str(brew_prefix), "Python"), brew_app),
        "uv venv": (Interpreter(str(_venv(root / "uv", uv_python)), str(uv_home), ""), uv_python),
        "pyenv": (Interpreter(str(pyenv_home / "bin/python3"), str(pyenv_home), ""), pyenv_python),
    }


@pytest.mark.parametrize("layout", ["python.org", "python.org venv", "homebrew", "homebrew venv", "uv venv",
                                    "pyenv"])
def test_the_binary_that_listens_for_each_installation(tmp_path: Path, layout: str) -> None:
    py, listens = layouts(tmp_path)[layout]
    assert listening_binary(py) == os.path.realpath(listens)
    assert not os.path.islink(listening_binary(py))


@pytest.mark.parametrize("layout", ["python.org", "python.org venv", "homebrew", "homebrew venv"])
def test_a_framework_build_does_not_listen_with_the_file_sys_executable_resolves_to(tmp_path: Path,
                                                                                    layout: str) -> None:
    py, listens = layouts(tmp_path)[layout]
    old_step = os.path.realpath(py.executable)  # what README's `realpath(sys.executable)` allowed
    assert old_step.endswith("/bin/python3.12") and old_step != listening_binary(py)


def test_a_framework_without_its_app_falls_back_to_the_executable(tmp_path: Path) -> None:
    exe = _file(tmp_path / "Python.framework/Versions/3.12/bin/python3.12")
    py = Interpreter(str(exe), str(tmp_path / "Python.framework/Versions/3.12"), "Python")
    assert listening_binary(py) == str(exe)


def test_the_commands_name_the_binary_quoted() -> None:
    assert allow_commands("/Applications/My Python/Python") == [
        f"sudo {SOCKETFILTERFW} --add '/Applications/My Python/Python'",
        f"sudo {SOCKETFILTERFW} --unblockapp '/Applications/My Python/Python'"]


# socketfilterfw's output as macOS prints it (seen in public projects' tests and notes).
GLOBAL_STATES = [("Firewall is enabled. (State = 1)\n", 1), ("Firewall is disabled. (State = 0)\n", 0),
                 ("Firewall is enabled. (State = 2)\n", 2), ("Firewall is enabled.\n", 1),
                 ("Firewall settings cannot be modified from command line on managed Mac computers.\n", None),
                 ("", None)]


@pytest.mark.parametrize("text, state", GLOBAL_STATES)
def test_global_state(text: str, state: int | None) -> None:
    assert parse_global_state(text) == state


@pytest.mark.parametrize("text, blocked", [
    ("The application at path ( /x/Python ) is not blocked from accepting incoming connections.", False),
    ("The application /x/Python is permitted to accept incoming connections.", False),
    ("Application at path ( /x/Python ) is blocked from accepting incoming connections.", True),
    ("The application at path ( /x/Python ) is not part of the firewall list", None),
    ("", None)])
def test_app_blocked(text: str, blocked: bool | None) -> None:
    assert parse_app_blocked(text) is blocked


BREW_APP = "/opt/homebrew/Cellar/python@3.12/3.12.8/Frameworks/Python.framework/Versions/3.12/" + APP
LISTAPPS = ("ALF: total number of apps = 3 \n\n1 :  /usr/libexec/bootpd \n \t ( Allow incoming connections ) \n\n"
            f"2 :  {BREW_APP} \n \t ( Block incoming connections ) \n\n"
            "3 :  /Library/Frameworks/Python.framework/Versions/3.12/Resources/Python.app \n"
            " \t ( Allow incoming connections ) \n")


def test_listed_apps_and_a_bundle_stands_for_its_binary() -> None:
    apps = parse_listed_apps(LISTAPPS)
    assert apps == {"/usr/libexec/bootpd": True, BREW_APP: False,
                    "/Library/Frameworks/Python.framework/Versions/3.12/Resources/Python.app": True}
    assert parse_listed_apps("ALF: total number of apps = 1\n1 : /opt/x ( Allow incoming connections )\n") == {
        "/opt/x": True}
    assert listed_verdict(apps, BREW_APP) is False
    assert listed_verdict(apps, "/Library/Frameworks/Python.framework/Versions/3.12/" + APP) is True
    assert listed_verdict(apps, "/Users/me/.pyenv/versions/3.12.8/bin/python3.12") is None


def _fw(state: str, listed: str = "", blocked: str = "", binary: str = BREW_APP) -> FirewallFacts:
    return FirewallFacts(binary, state, listed, blocked)


def test_doctor_verdicts() -> None:
    on = "Firewall is enabled. (State = 1)\n"
    assert check_firewall(_fw("Firewall is disabled. (State = 0)\n")).status == OK
    all_blocked = check_firewall(_fw("Firewall is enabled. (State = 2)\n"))
    assert all_blocked.status == FAIL and "Block all incoming connections" in all_blocked.fix
    blocked = check_firewall(_fw(on, LISTAPPS, "The application /x is permitted to accept incoming connections."))
    assert blocked.status == FAIL and BREW_APP in blocked.detail
    assert f"sudo {SOCKETFILTERFW} --unblockapp {BREW_APP}" in blocked.fix
    # --getappblocked answers "permitted" for an app it does not know: the listing decides.
    unknown = check_firewall(_fw(on, "ALF: total number of apps = 0\n",
                                 "The application /x is permitted to accept incoming connections.",
                                 binary="/Users/me/.pyenv/versions/3.12.8/bin/python3.12"))
    assert unknown.status == WARN and "not in its list" in unknown.detail and "--firewall-command" in unknown.fix
    allowed = check_firewall(_fw(on, LISTAPPS, "", binary="/Library/Frameworks/Python.framework/Versions/3.12/"
                                 + APP))
    assert allowed.status == OK
    assert check_firewall(_fw("")).status == WARN


def test_read_firewall_asks_only_while_it_is_on() -> None:
    calls: list[list[str]] = []

    def run(argv):
        calls.append(list(argv))
        out = {"--getglobalstate": "Firewall is enabled. (State = 1)\n", "--listapps": LISTAPPS}.get(argv[1], "")
        return CommandResult(0, out)

    facts = read_firewall(run, BREW_APP)
    assert calls == [[SOCKETFILTERFW, "--getglobalstate"], [SOCKETFILTERFW, "--listapps"],
                     [SOCKETFILTERFW, "--getappblocked", BREW_APP]]
    assert facts.listed == LISTAPPS
    off = read_firewall(lambda argv: CommandResult(0, "Firewall is disabled. (State = 0)\n"), BREW_APP)
    assert off.listed == "" and off.app_blocked == ""


def test_firewall_command_prints_both_commands_for_this_python(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--firewall-command"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith(f"sudo {SOCKETFILTERFW} --add /")
    assert out[1].startswith(f"sudo {SOCKETFILTERFW} --unblockapp /")


def test_readme_firewall_step_allows_the_binary_that_listens() -> None:
    readme = (REPO / "README.md").read_text()
    step = re.search(r"\*\*Firewall and Local Network\.\*\*(.*?)\n\d+\. \*\*", readme, re.S)
    assert step, "README's first-day firewall step is missing"
    assert "doctor --firewall-command" in step.group(1)
    assert "realpath(sys.executable)" not in readme
