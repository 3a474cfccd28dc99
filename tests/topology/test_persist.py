"""Keeping the Thunderbolt ports out of the bridge after a reboot: the LaunchDaemon `topo --persist`
installs, and `launch`/`doctor` noticing members that came back (the fixtures' bridge0 holds every port,
as after a reboot)."""
from __future__ import annotations

import plistlib
import re
import stat
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.cli import launch, topo
from torch_thunderbolt.cli.main import build_parser
from torch_thunderbolt.doctor import WARN
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.launch.hostfile import parse_hostfile
from torch_thunderbolt.topology import persist
from torch_thunderbolt.topology.discover import CommandResult

from .test_cli import mac_runner, ssh_runner
from .topo_fixtures import FIXTURES, mac_host, scenario_hosts

REPO = Path(__file__).resolve().parents[2]


def test_the_daemon_runs_the_bridge_commands_at_load_and_again_later() -> None:
    data = plistlib.loads(persist.daemon_plist("bridge0", ["en2", "en3"]))
    assert data["Label"] == persist.LABEL and data["RunAtLoad"] is True
    assert data["StartInterval"] == persist.RECHECK_SECONDS
    assert data["ProgramArguments"] == ["/bin/sh", "-c", "/sbin/ifconfig bridge0 deletem en2 2>/dev/null; "
                                        "/sbin/ifconfig bridge0 deletem en3 2>/dev/null; exit 0"]
    with pytest.raises(ConfigError):
        persist.daemon_plist("bridge0", [])


def test_the_ports_kept_out_are_this_macs_thunderbolt_ports() -> None:
    host = mac_host("bridge_loop", "mac-a")
    bridge, ports = persist.ports_to_keep_out(host)
    assert bridge == "bridge0" and ports == [p.ifname for p in host.ports if p.ifname] and "en2" in ports
    with pytest.raises(ConfigError, match="macOS"):
        persist.ports_to_keep_out(scenario_hosts("linux_pair")[0])


def _args(*argv: str):
    return build_parser().parse_args(["topo", *argv])


def test_persist_installs_and_loads_the_daemon_as_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log: list[list[str]] = []
    monkeypatch.setattr(topo, "_is_root", lambda: True)
    rc = topo.run(_args("--persist"), runner=mac_runner("bridge_loop", "mac-a", log), system="Darwin",
                  hostname="mac-a", root=str(tmp_path))
    assert rc == 0
    path = tmp_path / "Library/LaunchDaemons" / f"{persist.LABEL}.plist"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    script = plistlib.loads(path.read_bytes())["ProgramArguments"][2]
    assert "/sbin/ifconfig bridge0 deletem en2" in script
    assert log[-2:] == [["/bin/launchctl", "bootout", f"system/{persist.LABEL}"],
                        ["/bin/launchctl", "bootstrap", "system", str(path)]]
    assert "To undo: sudo /bin/launchctl bootout" in capsys.readouterr().out


def test_persist_without_root_says_the_command_that_works_under_sudo(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topo, "_is_root", lambda: False)
    with pytest.raises(ConfigError, match=re.escape(f"sudo {sys.executable} -m torch_thunderbolt topo --persist")):
        topo.run(_args("--persist"), runner=mac_runner("bridge_loop", "mac-a"), system="Darwin", hostname="mac-a",
                 root=str(tmp_path))
    assert not (tmp_path / "Library").exists()
    with pytest.raises(ConfigError, match="by itself"):
        topo.run(_args("--persist", "--ssh", "admin@mac-a"), runner=mac_runner("bridge_loop", "mac-a"))


def test_apply_says_how_to_keep_it_after_a_reboot(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--ssh", "admin@mac-a,admin@mac-b,admin@mac-c", "--apply")
    assert topo.run(args, runner=ssh_runner("bridge_loop", []), hostname="laptop") == 0
    err = capsys.readouterr().err
    assert "does not survive a reboot" in err
    for mac in ("mac-a", "mac-b", "mac-c"):
        assert f"ssh -t admin@{mac} 'sudo {sys.executable} -m torch_thunderbolt topo --persist'" in err


def _ifconfig(scenario: str, host: str):
    text = (FIXTURES / scenario / host / "ifconfig.txt").read_text()
    return lambda argv: CommandResult(0, text) if argv == ["/sbin/ifconfig"] else CommandResult(1, "")


def test_launch_on_a_mac_says_when_the_ports_are_back_in_the_bridge() -> None:
    hosts = parse_hostfile([{"name": "mac-a", "ssh": "mac-a.local", "ifname": "en2,en3"},
                            {"name": "mac-b", "ssh": "mac-b.local", "ifname": "en2"}])
    warning = launch.bridge_warning(hosts, "/x/python", run=_ifconfig("bridge_loop", "mac-a"), system="darwin")
    assert "sudo /sbin/ifconfig bridge0 deletem en2; sudo /sbin/ifconfig bridge0 deletem en3" in warning
    assert "sudo /x/python -m torch_thunderbolt topo --persist" in warning
    assert launch.bridge_warning(hosts, "/x/python", run=_ifconfig("bridge_loop", "mac-a"), system="linux") == ""
    elsewhere = parse_hostfile([{"name": "mac-a", "ssh": "mac-a.local", "ifname": "en9"}])
    assert launch.bridge_warning(elsewhere, "/x/python", run=_ifconfig("bridge_loop", "mac-a"),
                                 system="darwin") == ""
    assert launch.bridge_warning(parse_hostfile(["mac-a.local"]), "/x/python",
                                 run=_ifconfig("bridge_loop", "mac-a"), system="darwin") == ""


def test_doctor_gives_the_same_advice() -> None:
    from torch_thunderbolt.doctor import _check_bridge

    found = _check_bridge(["en2", "en3"])
    assert found.status == WARN and found.fix == persist.bridge_back("bridge0", ["en2", "en3"])
    assert "topo --persist" in found.fix


def test_the_docs_say_that_apply_does_not_survive_a_reboot() -> None:
    readme = (REPO / "README.md").read_text()
    tools = (REPO / "docs/tools.md").read_text()
    for text in (readme, tools):
        assert "topo --persist" in text and "reboot" in text
