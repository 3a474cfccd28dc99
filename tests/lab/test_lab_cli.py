"""`torch-thunderbolt lab ...` through the real CLI dispatcher, without root (dry runs and saved state)."""
import json
import sys

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.lab.state import save_state


def test_dry_run_prints_the_plan(capsys):
    assert main(["lab", "up", "--hosts", "3", "--topology", "chain", "--name", "c1", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ip netns add c1-mac0"
    assert "ip netns exec c1-mac1 sysctl -qw net.ipv4.ip_forward=1" in out
    assert any("tbf rate 10gbit" in line for line in out)  # 10gbit is the default rate


def test_bad_input_is_one_line_exit_2(capsys, tmp_path):
    assert main(["lab", "up", "--hosts", "3", "--topology", "pair", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == \
        "torch-thunderbolt lab: error: topology 'pair' needs exactly 2 hosts, got 3"
    assert main(["lab", "status", "--name", "c2", "--state-dir", str(tmp_path)]) == 2
    assert "no lab named 'c2'" in capsys.readouterr().err
    assert main(["lab", "exec", "--name", "c2", "--state-dir", str(tmp_path), "mac0"]) == 2
    assert main(["lab"]) == 2
    assert "expected an action" in capsys.readouterr().err


def test_hostfile_from_saved_state(capsys, tmp_path):
    save_state(plan_lab(2, "pair", 2, None, None, name="c3"), tmp_path)
    out = tmp_path / "hosts.json"
    assert main(["lab", "hostfile", "--name", "c3", "--state-dir", str(tmp_path), "-o", str(out)]) == 0
    hosts = json.loads(out.read_text())
    assert [h["ifname"] for h in hosts] == ["tb1_0,tb1_1", "tb0_0,tb0_1"]
    assert all(h["exec"] == "lab" and h["lab"] == "c3" for h in hosts)


def test_exec_needs_a_command(capsys, tmp_path):
    save_state(plan_lab(2, "pair", name="c4"), tmp_path)
    assert main(["lab", "exec", "--name", "c4", "--state-dir", str(tmp_path), "mac0", "--"]) == 2
    assert "expected a command" in capsys.readouterr().err


def test_without_root_the_error_says_so(capsys, tmp_path, monkeypatch):
    import os

    from torch_thunderbolt.testing.lab import lab_skip_reason

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["lab", "up", "--hosts", "2", "--topology", "pair", "--name", "c5",
                 "--state-dir", str(tmp_path)]) == 2
    assert "`lab up` needs root" in capsys.readouterr().err
    assert not (tmp_path / "lab-c5.json").exists()
    assert "needs root" in lab_skip_reason()


def test_require_linux_refuses_other_platforms():
    from torch_thunderbolt.errors import ConfigError
    from torch_thunderbolt.lab.executor import require_linux

    require_linux("linux")
    for platform in ("darwin", "win32", "freebsd14"):
        with pytest.raises(ConfigError, match="needs Linux network namespaces"):
            require_linux(platform)


def test_lab_on_a_mac_is_one_clear_error_at_once(capsys, monkeypatch, tmp_path):
    """Every action, even a dry run or one for a lab that does not exist, stops first on a non-Linux host."""
    monkeypatch.setattr(sys, "platform", "darwin")
    for argv in (["up", "--hosts", "2", "--topology", "pair", "--dry-run"], ["down"], ["status"],
                 ["exec", "--state-dir", str(tmp_path), "mac0", "--", "true"]):
        assert main(["lab", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs Linux network namespaces" in err[0] and "'darwin'" in err[0], err


def test_exec_runs_a_bare_python_as_this_interpreter(monkeypatch):
    """Under a stock sudo, `python` on PATH is not the venv's: `lab exec` runs this interpreter instead."""
    import subprocess

    from torch_thunderbolt.cli import lab as lab_cli
    from torch_thunderbolt.lab import executor, view

    class FakeLab:
        def exec_argv(self, host, argv):
            return ["ip", "netns", "exec", f"t-{host}", *argv]

    ran = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(view.Lab, "load", classmethod(lambda cls, name, state_dir=None: FakeLab()))
    monkeypatch.setattr(executor, "running_as_root", lambda: True)
    monkeypatch.setattr(lab_cli.subprocess, "run",
                        lambda argv, check=False: ran.append(argv) or subprocess.CompletedProcess(argv, 0))
    assert main(["lab", "exec", "mac2", "--", "python", "-c", "print('hi')"]) == 0
    assert ran == [["ip", "netns", "exec", "t-mac2", sys.executable, "-c", "print('hi')"]]
