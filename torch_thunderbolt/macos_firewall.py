"""The macOS application firewall: which binary to allow, and what `socketfilterfw` says about it.

The firewall judges the program image that accepts a connection, not the path the user typed:
- A framework build of Python (python.org's installer, Homebrew's python@3.x, pyenv with
  `--enable-framework`) installs `bin/python3.X` as a small launcher (CPython's Mac/Tools/pythonw.c) that
  re-executes, in the same process, `Resources/Python.app/Contents/MacOS/Python` inside the framework; that
  binary is what listens. `sys.executable` still names the launcher (or a venv's `bin/python`, which points
  at the launcher), so allowing `realpath(sys.executable)` allows a file that never listens.
- A venv runs its base interpreter: the same rule applies to the base, found through `sys.base_prefix`.
- A non-framework build (uv's and pyenv's default builds, conda) runs the file `sys.executable` resolves to.

Everything here but `this_interpreter` and `read_firewall` is a pure function of strings, so each
installation layout and each `socketfilterfw` output is a unit test.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import sysconfig
from dataclasses import dataclass
from typing import Callable, Sequence

SOCKETFILTERFW = "/usr/libexec/ApplicationFirewall/socketfilterfw"


@dataclass(frozen=True)
class Interpreter:
    """The facts about a Python installation that decide which binary runs."""

    executable: str  # sys.executable
    base_prefix: str  # sys.base_prefix: the installation a venv was made from (the venv's own prefix otherwise)
    framework: str  # sysconfig's PYTHONFRAMEWORK: "Python" for a framework build, "" otherwise


def this_interpreter() -> Interpreter:
    return Interpreter(executable=sys.executable, base_prefix=sys.base_prefix,
                       framework=str(sysconfig.get_config_var("PYTHONFRAMEWORK") or ""))


def framework_app_binary(base_prefix: str, framework: str) -> str:
    """Where a framework build keeps the binary its launcher executes (CPython's Mac/Makefile installs the
    interpreter as Python.app/Contents/MacOS/$(PYTHONFRAMEWORK) under the version's Resources)."""
    return os.path.join(base_prefix, "Resources", "Python.app", "Contents", "MacOS", framework)


def listening_binary(py: Interpreter, realpath: Callable[[str], str] = os.path.realpath,
                     exists: Callable[[str], bool] = os.path.exists) -> str:
    """The file whose process accepts connections when `py.executable` runs, with every symlink resolved
    (Homebrew's `opt/` and a venv's `bin/python` are symlinks; the firewall lists real files)."""
    if py.framework:
        app = framework_app_binary(py.base_prefix, py.framework)
        if exists(app):
            return realpath(app)
    return realpath(py.executable)


def allow_commands(binary: str) -> list[str]:
    """The two commands that let `binary` accept incoming connections (run with sudo)."""
    quoted = shlex.quote(binary)
    return [f"sudo {SOCKETFILTERFW} --add {quoted}", f"sudo {SOCKETFILTERFW} --unblockapp {quoted}"]


# --- what socketfilterfw prints -------------------------------------------------------------------------

FIREWALL_OFF, FIREWALL_ON, FIREWALL_BLOCK_ALL = 0, 1, 2


def parse_global_state(text: str) -> int | None:
    """`--getglobalstate`: "Firewall is enabled. (State = 1)" -> 1; "(State = 0)" off, "(State = 2)" on and
    blocking every incoming connection but essential services'. None when the text says neither (a managed
    Mac's "cannot be modified ..." notice, an error)."""
    found = re.search(r"State\s*=\s*(\d)", text)
    if found:
        return int(found.group(1))
    if re.search(r"Firewall is disabled", text):
        return FIREWALL_OFF
    if re.search(r"Firewall is enabled", text):
        return FIREWALL_ON
    return None


def parse_app_blocked(text: str) -> bool | None:
    """`--getappblocked PATH`: True when it says the app is blocked, False when permitted or not blocked,
    None otherwise ("not part of the firewall", an error). Seen worded both as "The application at path ( P )
    is not blocked from accepting incoming connections." and "The application P is permitted to accept
    incoming connections."; it answers "permitted" also for a path the firewall does not list, so the
    listing (`parse_listed_apps`) decides whether the app is known at all."""
    low = text.lower()
    if "not part of the firewall" in low:
        return None
    if re.search(r"\bis not blocked\b", low) or "is permitted" in low:
        return False
    if re.search(r"\bis blocked\b", low):
        return True
    return None


def parse_listed_apps(text: str) -> dict[str, bool]:
    """`--listapps`: every listed path -> whether it may accept incoming connections. The listing is
    "ALF: total number of apps = N", then per app "K :  PATH" and "( Allow incoming connections )" or
    "( Block incoming connections )", on the next line or the same one."""
    apps: dict[str, bool] = {}
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        entry = re.match(r"^\d+\s*:\s*(.+?)\s*(\(\s*(Allow|Block) incoming connections\s*\))?$", line)
        if entry:
            pending = entry.group(1).strip()
            if entry.group(3):
                apps[pending], pending = entry.group(3) == "Allow", ""
            continue
        verdict = re.match(r"^\(\s*(Allow|Block) incoming connections\s*\)$", line)
        if verdict and pending:
            apps[pending], pending = verdict.group(1) == "Allow", ""
    return apps


def listed_verdict(apps: dict[str, bool], binary: str) -> bool | None:
    """Whether the listing allows `binary` (listed itself, or as the .app bundle holding it, which is how
    the firewall lists an app allowed from its prompt); None when neither is listed."""
    candidates = [binary]
    bundle = re.match(r"^(.*?\.app)/Contents/MacOS/[^/]+$", binary)
    if bundle:
        candidates.append(bundle.group(1))
    for path in candidates:
        if path in apps:
            return apps[path]
    return None


@dataclass(frozen=True)
class FirewallFacts:
    """What `socketfilterfw` said on this Mac about the binary that listens."""

    binary: str
    global_state: str  # `--getglobalstate` output ("" when it did not run)
    listed: str  # `--listapps` output
    app_blocked: str  # `--getappblocked BINARY` output


def read_firewall(run: Callable[[Sequence[str]], object], binary: str) -> FirewallFacts:
    """Ask `socketfilterfw` (none of these queries needs root). `run` returns an object with `returncode`
    and `stdout`, like topology.discover's runner; a failed query leaves its text empty."""
    def ask(*args: str) -> str:
        res = run([SOCKETFILTERFW, *args])
        return str(getattr(res, "stdout", "") or "") if getattr(res, "returncode", 1) == 0 else ""

    state = ask("--getglobalstate")
    if parse_global_state(state) in (None, FIREWALL_OFF):
        return FirewallFacts(binary, state, "", "")
    return FirewallFacts(binary, state, ask("--listapps"), ask("--getappblocked", binary))
