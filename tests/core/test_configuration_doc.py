"""docs/configuration.md and config.SETTINGS say the same: every setting the package reads is in the table,
documented in its audience's section with the table's default, and parsed in config.py only."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from torch_thunderbolt.config import ADVANCED, MAX_USER_SETTINGS, SETTING_NAMES, SETTINGS, USER, Config
from torch_thunderbolt.doctor import OK, WARN, run_checks
from torch_thunderbolt.transport.netif import loopback_ifname

from .test_config_doctor import by_check, facts

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "torch_thunderbolt"
DOC = REPO / "docs" / "configuration.md"
SECTIONS = {USER: "## User settings", ADVANCED: "## Advanced"}
NAME = re.compile(r"\bTHUNDERBOLT_[A-Z0-9_]*[A-Z0-9]\b")  # not a prefix such as THUNDERBOLT_SHM_*


def documented(text: str) -> dict[str, dict[str, str]]:
    """audience -> {variable: default} from the tables of each section of the page."""
    out: dict[str, dict[str, str]] = {}
    for audience, heading in SECTIONS.items():
        assert heading in text, f"docs/configuration.md has no section {heading!r}"
        body = text.split(heading, 1)[1].split("\n## ", 1)[0]
        rows = [line.split("|")[1:3] for line in body.splitlines() if line.startswith("| `THUNDERBOLT_")]
        out[audience] = {name.strip().strip("`"): default.strip().replace("`", "") for name, default in rows}
    return out


def test_every_setting_is_documented_in_its_section_with_its_default() -> None:
    docs = documented(DOC.read_text())
    for audience in SECTIONS:
        table = {s.name: s.default for s in SETTINGS if s.audience == audience}
        assert docs[audience] == table, f"{audience}: docs/configuration.md differs from config.SETTINGS"


def test_the_check_fails_when_the_page_and_the_table_disagree() -> None:
    text = DOC.read_text()
    assert documented(text.replace("| `THUNDERBOLT_DEBUG` | 0 |", "| `THUNDERBOLT_DEBUG` | 1 |"))[USER] != {
        s.name: s.default for s in SETTINGS if s.audience == USER}
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("| `THUNDERBOLT_CC`"))
    assert "THUNDERBOLT_CC" not in documented(dropped)[ADVANCED]


def test_users_have_at_most_ten_settings_and_every_setting_an_audience() -> None:
    assert MAX_USER_SETTINGS == 10
    assert len([s for s in SETTINGS if s.audience == USER]) <= MAX_USER_SETTINGS
    assert {s.audience for s in SETTINGS} <= {USER, ADVANCED}
    assert len(SETTING_NAMES) == len(SETTINGS)  # no name twice


def test_every_name_the_package_mentions_is_a_setting_and_every_setting_is_parsed_in_config_py() -> None:
    """A variable parsed (or named in a message, a comment) without a row in SETTINGS fails here, as does
    a row config.py never reads."""
    mentioned: dict[str, set[str]] = {}
    for path in [*PKG.rglob("*.py"), REPO / "torch_thunderbolt_autoload.py", REPO / "torch_thunderbolt_cli.py"]:
        for name in NAME.findall(path.read_text()):
            mentioned.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert "THUNDERBOLT_IFNAME" in mentioned  # the reader finds names
    stray = {name: sorted(where) for name, where in mentioned.items() if name not in SETTING_NAMES}
    assert not stray, f"THUNDERBOLT_* names that are no setting of config.SETTINGS: {stray}"
    source = (PKG / "config.py").read_text()
    after_table = source.split("\nSETTING_NAMES = ", 1)[1]
    unparsed = [s.name for s in SETTINGS if f'"{s.name}"' not in after_table]
    assert not unparsed, f"in SETTINGS but never read by config.py: {unparsed}"


# Reads of THUNDERBOLT_* variables outside config.py, each with its reason.
RAW_READS = {
    # a disabled autoload must import nothing of ours, so the "off" values are checked before config.py
    "torch_thunderbolt_autoload.py": {"THUNDERBOLT_AUTOLOAD"},
    # the launcher hands the user's secret (value or @file) on to the ranks; config.parse_secret judges it
    "torch_thunderbolt/cli/launch.py": {"THUNDERBOLT_SECRET"},
    # selfcheck's local ranks, like launch's, get the user's secret or a fresh one; the ranks' config judges it
    "torch_thunderbolt/selfcheck/local.py": {"THUNDERBOLT_SECRET"},
}


def _env_reads(path: Path) -> set[str]:
    """THUNDERBOLT_* names read through X.get("..."), X["..."] (not written), X.pop("...") or getenv("...")."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv", "pop"):
                key = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        if isinstance(key, str) and key.startswith("THUNDERBOLT_"):
            found.add(key)
    return found


def test_settings_are_read_from_the_environment_in_config_py_only() -> None:
    reads = {}
    for path in [*PKG.rglob("*.py"), REPO / "torch_thunderbolt_autoload.py"]:
        rel = str(path.relative_to(REPO))
        if rel == "torch_thunderbolt/config.py" or rel.startswith("torch_thunderbolt/testing/"):
            continue  # testing/ sets variables for the ranks it starts; it is no job
        extra = _env_reads(path) - RAW_READS.get(rel, set())
        if extra:
            reads[rel] = sorted(extra)
    assert _env_reads(PKG / "config.py")  # the reader finds reads
    assert not reads, f"THUNDERBOLT_* read outside config.py: {reads}"


def test_spinning_is_no_setting_but_still_a_config_field() -> None:
    assert Config.from_env({"THUNDERBOLT_SPIN_US": "5", "THUNDERBOLT_SHM_SPIN_US": "5"}) == Config()
    assert Config(spin_us=0).spin_us == 0


@pytest.mark.parametrize("env, status, words", [
    ({}, OK, ["the defaults"]),
    ({"THUNDERBOLT_IFNAME": loopback_ifname(), "THUNDERBOLT_CHUNK": "2M"}, OK,
     ["user: THUNDERBOLT_IFNAME", "advanced: THUNDERBOLT_CHUNK"]),
    ({"THUNDERBOLT_TRANSPROT": "tcp"}, WARN, ["THUNDERBOLT_TRANSPROT", "no setting", "docs/configuration.md"]),
    ({"THUNDERBOLT_SPIN_US": "0"}, WARN, ["THUNDERBOLT_SPIN_US"]),
])
def test_doctor_lists_the_settings_set_by_audience_and_names_unknown_ones(env, status, words) -> None:
    found = by_check(run_checks(facts(env=env)))["configuration"]
    text = found.detail + " " + found.fix
    assert found.status == status and all(w in text for w in words), found


def test_doctor_never_shows_a_value() -> None:
    secret = "0123456789abcdef" * 4
    found = by_check(run_checks(facts(env={"THUNDERBOLT_SECRET": secret})))["configuration"]
    assert found.status == OK and "THUNDERBOLT_SECRET" in found.detail and secret not in found.detail
