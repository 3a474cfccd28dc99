import json
import shlex
import sys

import pytest

from torch_thunderbolt.cli import topo
from torch_thunderbolt.cli.main import build_parser, main
from torch_thunderbolt.errors import ConfigError, ThunderboltError
from torch_thunderbolt.topology.discover import CommandResult
from torch_thunderbolt.topology.macos import MACOS_COMMANDS
from torch_thunderbolt.topology.model import load_host_dump

from . import topo_fixtures
from .topo_fixtures import FILES, mac_host, mac_outputs, scenario_hosts, write_dumps


def _args(*argv):
    return build_parser().parse_args(["topo", *argv])


def mac_runner(scenario, host, log=None, fail=()):
    """A fake `run` answering macOS discovery from fixtures and recording every other command."""
    outputs = mac_outputs(scenario, host)
    by_argv = {tuple(argv): outputs.get(key) for key, argv in MACOS_COMMANDS.items()}

    def run(argv):
        if tuple(argv) in by_argv:
            out = by_argv[tuple(argv)]
            return CommandResult(0, out) if out is not None else CommandResult(127, "", f"{argv[0]}: not found")
        if log is not None:
            log.append(list(argv))
        if any(f in " ".join(argv) for f in fail):
            return CommandResult(1, "", "** Error: The parameters were not valid.")
        return CommandResult(0, "")
    return run


def test_cluster_from_dumps_json(tmp_path, capsys):
    dumps = write_dumps(scenario_hosts("ring3"), tmp_path)
    assert main(["topo", "--from", *dumps, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shape"] == "ring" and len(data["cables"]) == 3 and data["bridge_loops"] == []
    assert all(c["satisfied"] for c in data["commands"])


def test_outputs_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    dumps = write_dumps(scenario_hosts("chain3"), tmp_path)
    hf, dot, png = tmp_path / "hosts.json", tmp_path / "g.dot", tmp_path / "g.png"
    assert main(["topo", "--from", *dumps, "--hostfile", str(hf), "--dot", str(dot), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "shape: chain" in out and "10.77.0.4/30" in out
    assert [h["name"] for h in json.loads(hf.read_text())] == ["mac-a", "mac-b", "mac-c"]
    assert dot.read_text().startswith("graph thunderbolt {") and png.read_bytes()[:4] == b"\x89PNG"


def test_bridge_loop_exits_1_and_says_how_to_fix(tmp_path, capsys):
    dumps = write_dumps(scenario_hosts("bridge_loop"), tmp_path)
    assert main(["topo", "--from", *dumps]) == 1
    out = capsys.readouterr().out
    assert "1 FOUND" in out and "broadcast storm" in out and "deletem en2" in out


@pytest.mark.parametrize("content, message", [
    ("{ not json", "invalid JSON"),
    ('{"SPThunderboltDataType": []}', "non-empty 'name'"),
])
def test_malformed_dump_is_a_clean_error(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["topo", "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("torch-thunderbolt topo: error:")


def test_missing_dump_and_bad_options(tmp_path, capsys):
    assert main(["topo", "--from", str(tmp_path / "nope.json")]) == 2
    assert "cannot read dump" in capsys.readouterr().err
    assert main(["topo", "--hostfile", "x.json"]) == 2
    assert "need the cluster" in capsys.readouterr().err
    dumps = write_dumps(scenario_hosts("pair"), tmp_path)
    assert main(["topo", "--from", *dumps, "--base", "10.0.0.0/33"]) == 2
    assert "--base" in capsys.readouterr().err


def test_local_summary_on_linux_without_thunderbolt(tmp_path, capsys):
    no_ip = lambda argv: CommandResult(127, "", "not found")  # noqa: E731
    assert topo.run(_args(), runner=no_ip, system="Linux", hostname="vm", sysfs_root=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "No Thunderbolt interfaces found on vm" in out and "/sys/bus/thunderbolt/devices" in out


def test_local_topo_on_this_machine_runs(capsys):
    assert main(["topo"]) == 0
    assert "Thunderbolt" in capsys.readouterr().out


def test_dump_on_a_mac_round_trips(capsys):
    assert topo.run(_args("--dump", "-"), runner=mac_runner("pair", "mac-a"), system="Darwin",
                    hostname="mac-a") == 0
    assert load_host_dump(capsys.readouterr().out, "stdout") == mac_host("pair", "mac-a")


def test_local_summary_on_a_mac(capsys):
    assert topo.run(_args(), runner=mac_runner("pair", "mac-a"), system="Darwin", hostname="mac-a") == 0
    assert "Thunderbolt 1  en2  connected" in capsys.readouterr().out


def test_failing_system_profiler_is_a_clean_error(capsys):
    def run(argv):
        return CommandResult(1, "", "system_profiler: not permitted")
    with pytest.raises(ThunderboltError, match="system_profiler SPThunderboltDataType -json` failed .*not permitted"):
        topo.run(_args(), runner=run, system="Darwin", hostname="m")


# A Mac as a non-login ssh command sees it: this PATH, Apple's python3 (3.9, no torch), the system tools,
# and our interpreter only where this machine has it (the same install path on every Mac).
REMOTE_PATH = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")
STOCK_MAC = {"/usr/bin/sudo", "/usr/bin/python3", "/usr/sbin/networksetup", "/sbin/ifconfig",
             "/usr/sbin/system_profiler"}
DUMP_ARGS = ["-m", "torch_thunderbolt", "topo", "--dump", "-"]


def remote_program(word, installed):
    """The file a Mac's ssh shell runs for `word` (a path or a name looked up in REMOTE_PATH), or None."""
    if "/" in word:
        return word if word in installed else None
    return next((f"{d}/{word}" for d in REMOTE_PATH if f"{d}/{word}" in installed), None)


def ssh_runner(scenario, log, installed=STOCK_MAC | {sys.executable}):
    """A fake `run` for `ssh HOST COMMAND`: resolves COMMAND's program (and sudo's) like a stock Mac would."""
    dumps = {f"admin@{h.name}": json.dumps(h.to_json()) for h in scenario_hosts(scenario)}

    def run(argv):
        log.append(list(argv))
        assert argv[0] == "ssh"
        target, words = argv[-2], shlex.split(argv[-1])
        if target not in dumps:
            return CommandResult(255, "", f"ssh: connect to host {target}: no route to host")
        if words[:2] == ["sudo", "-n"] and remote_program("sudo", installed):
            words = words[2:]
        program = remote_program(words[0], installed)
        if program is None:
            return CommandResult(127, "", f"zsh:1: command not found: {words[0]}")
        if words[1:] == DUMP_ARGS:
            if program != sys.executable:  # Apple's python3: no torch, no torch_thunderbolt
                return CommandResult(1, "", f"{program}: No module named torch_thunderbolt")
            return CommandResult(0, dumps[target])
        return CommandResult(0, "")
    return run


def _is_dump(argv):
    return shlex.split(argv[-1])[1:] == DUMP_ARGS


def test_ssh_gather_and_hostfile(tmp_path, capsys):
    log, hf = [], tmp_path / "hosts.json"
    args = _args("--ssh", "admin@mac-a,admin@mac-b,admin@mac-c", "--hostfile", str(hf))
    assert topo.run(args, runner=ssh_runner("chain3", log), hostname="laptop") == 0
    assert [a[-2] for a in log] == ["admin@mac-a", "admin@mac-b", "admin@mac-c"]
    assert all("BatchMode=yes" in a for a in log)
    assert all(shlex.split(a[-1]) == [sys.executable, *DUMP_ARGS] for a in log)  # this interpreter, by path
    assert [h["ssh"] for h in json.loads(hf.read_text())] == ["admin@mac-a", "admin@mac-b", "admin@mac-c"]
    # The interpreter the dumps ran with goes into the hostfile, and `launch` takes it from there.
    from torch_thunderbolt.launch.hostfile import read_hostfile

    assert [h.python for h in read_hostfile(hf)] == [sys.executable] * 3


def test_ssh_unreachable_host_is_a_clean_error(capsys):
    log = []
    with pytest.raises(ThunderboltError) as info:
        topo.run(_args("--ssh", "admin@mac-a,admin@ghost"), runner=ssh_runner("pair", log), hostname="x")
    assert "ssh admin@ghost" in str(info.value) and "no route" in str(info.value)


def test_ssh_python_option_and_clear_errors_when_the_interpreter_is_missing(capsys):
    log = []
    args = _args("--ssh", "admin@mac-a,admin@mac-b", "--python", "/opt/homebrew/bin/python3.12")
    with pytest.raises(ThunderboltError) as info:
        topo.run(args, runner=ssh_runner("pair", log), hostname="x")
    message = str(info.value)
    assert shlex.split(log[0][-1])[0] == "/opt/homebrew/bin/python3.12"
    assert "ssh admin@mac-a" in message and "no Python at /opt/homebrew/bin/python3.12 on admin@mac-a" in message
    assert "--python" in message
    with pytest.raises(ConfigError, match="must be an absolute path"):
        topo.run(_args("--ssh", "admin@mac-a", "--python", "python3.12"), runner=ssh_runner("pair", []), hostname="x")
    with pytest.raises(ThunderboltError, match="/usr/bin/python3 on admin@mac-a has no torch_thunderbolt"):
        topo.run(_args("--ssh", "admin@mac-a", "--python", "/usr/bin/python3"), runner=ssh_runner("pair", []),
                 hostname="x")


def test_apply_over_ssh_runs_only_unsatisfied_commands(capsys):
    log = []
    args = _args("--ssh", "admin@mac-a,admin@mac-b,admin@mac-c,admin@mac-d", "--apply")
    assert topo.run(args, runner=ssh_runner("mesh4", log), hostname="laptop") == 0
    applied = [a[-1] for a in log if not _is_dump(a)]
    assert len(applied) == 24 and all(cmd.startswith("sudo -n /usr/sbin/networksetup ") for cmd in applied)
    assert "sudo -n /usr/sbin/networksetup -setmanual 'Thunderbolt 1' 10.77.0.1 255.255.255.252" in applied
    assert "Applied 24 commands, 4 already satisfied" in capsys.readouterr().err


def test_apply_already_configured_cluster_runs_nothing(capsys):
    log = []
    assert topo.run(_args("--ssh", "admin@mac-a,admin@mac-b,admin@mac-c", "--apply"),
                    runner=ssh_runner("ring3", log), hostname="laptop") == 0
    assert all(_is_dump(a) for a in log)


def test_apply_from_dumps_runs_locally_and_reports_unreachable_hosts(tmp_path, capsys):
    dumps = write_dumps(scenario_hosts("pair"), tmp_path)
    log = []
    rc = topo.run(_args("--from", *dumps, "--apply"), runner=mac_runner("pair", "mac-a", log),
                  system="Darwin", hostname="mac-a")
    assert rc == 1  # mac-b's commands could not be run from here
    assert [a[-4:] for a in log][-1] == ["-setmanual", "Thunderbolt 1", "10.77.0.1", "255.255.255.252"]
    assert len(log) == 4 and all(a[a[0] == "sudo"] in ("/usr/sbin/networksetup", "/sbin/ifconfig") for a in log)
    assert "on mac-b:" in capsys.readouterr().err


def test_apply_stops_at_the_first_failure(tmp_path, capsys):
    dumps = write_dumps(scenario_hosts("pair"), tmp_path)
    log = []
    runner = mac_runner("pair", "mac-a", log, fail=("-createnetworkservice",))
    with pytest.raises(ThunderboltError) as info:
        topo.run(_args("--from", *dumps, "--apply"), runner=runner, system="Darwin", hostname="mac-a")
    assert "on mac-a" in str(info.value) and "parameters were not valid" in str(info.value)
    assert not any("-setmanual" in a for a in log)


def test_png_without_matplotlib_fails_before_doing_anything(tmp_path, capsys, monkeypatch):
    """As bench checks --plot: no hostfile, no .dot, no report and no --apply when --png cannot be drawn."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    dumps = write_dumps(scenario_hosts("pair"), tmp_path)
    hf, dot, png = tmp_path / "hosts.json", tmp_path / "g.dot", tmp_path / "g.png"
    log = []
    argv = ["--from", *dumps, "--hostfile", str(hf), "--dot", str(dot), "--png", str(png), "--apply"]
    with pytest.raises(ConfigError, match=r"--png needs matplotlib: pip install matplotlib .*pip install -e '\.\[plot\]'"):
        topo.run(_args(*argv), runner=mac_runner("pair", "mac-a", log), system="Darwin", hostname="mac-a")
    assert log == [] and not hf.exists() and not dot.exists() and not png.exists()
    assert capsys.readouterr().out == ""
    assert main(["topo", *argv]) == 2  # through the command line: one line, exit 2
    assert "--png needs matplotlib" in capsys.readouterr().err and not hf.exists()


@pytest.mark.parametrize("scenario", ["pair", "bridge_loop_de", "tb5_pair"])
def test_record_saves_the_raw_outputs_as_a_fixture(tmp_path, capsys, scenario):
    """`topo --record DIR` on a (faked) Mac writes each command's output unchanged under the fixtures' names,
    so the folder drops into tests/fixtures/topology/<scenario>/ and reads back as the same host."""
    host = scenario_hosts(scenario)[0].name
    run = mac_runner(scenario, host)
    assert topo.run(_args("--record", str(tmp_path / "rec")), runner=lambda argv: (
        CommandResult(0, "ProductName: macOS\nProductVersion: 15.5\n") if argv == ["/usr/bin/sw_vers"] else run(argv)),
        system="Darwin", hostname=host) == 0
    folder = tmp_path / "rec" / host
    outputs = mac_outputs(scenario, host)  # (a Mac without RDMA has no rdma_ctl or ibv_devinfo output)
    assert set(outputs) <= set(FILES)
    for key, name in FILES.items():
        assert (folder / name).exists() == (key in outputs), name
        if key in outputs:
            assert (folder / name).read_text() == outputs[key]
    meta = json.loads((folder / "record.json").read_text())
    assert meta["system"] == "Darwin" and "ProductVersion: 15.5" in meta["os_version"]
    assert [c["output"] for c in meta["commands"]] == list(MACOS_COMMANDS) and meta["parsed"]["ok"]
    recorded = topo_fixtures.build_macos_host(host, {k: (folder / n).read_text() for k, n in FILES.items()
                                                     if (folder / n).exists()})
    assert recorded.to_json() == mac_host(scenario, host).to_json() == meta["parsed"]["host"]
    out = capsys.readouterr().out
    assert f"Recorded {host}'s discovery outputs in {folder}/" in out and "MAC and IP addresses" in out


def test_record_keeps_failures_and_parse_errors(tmp_path, capsys):
    """A failing command or an output our parser cannot read is recorded (that is the bug report), not fatal."""
    run = mac_runner("pair", "mac-a")

    def broken(argv):
        if argv[-1] == "-listallnetworkservices":
            return CommandResult(1, "", "** Error: permission denied")
        if argv[-1] == "-json":
            return CommandResult(0, '{"SPThunderboltDataType": "not a list"}')
        return run(argv)
    assert topo.run(_args("--record", str(tmp_path)), runner=broken, system="Darwin", hostname="mac-a") == 0
    meta = json.loads((tmp_path / "mac-a" / "record.json").read_text())
    assert not (tmp_path / "mac-a" / "services.txt").exists()
    assert {c["output"]: c["exit"] for c in meta["commands"]}["services"] == 1
    assert meta["parsed"]["ok"] is False and meta["parsed"]["error"]
    out = capsys.readouterr().out
    assert "failed (exit 1): ** Error: permission denied" in out and "topo reads them: NO:" in out
    with pytest.raises(ConfigError, match="--record saves this host's outputs"):
        topo.run(_args("--record", str(tmp_path), "--from", "x.json"), runner=broken, system="Darwin")


def test_record_on_linux_writes_the_sysfs_snapshot_and_ip(tmp_path, capsys):
    folder = tmp_path / "rec"
    (tmp_path / "sys").mkdir()
    ip = (topo_fixtures.FIXTURES / "linux_pair" / "nuc-a" / "ip_addr.json").read_text()
    assert topo.run(_args("--record", str(folder)), runner=lambda argv: CommandResult(0, ip), system="Linux",
                    hostname="nuc-a", sysfs_root=str(tmp_path)) == 0
    assert json.loads((folder / "nuc-a" / "sysfs.json").read_text()) == {"devices": {}, "net": {}}
    assert (folder / "nuc-a" / "ip_addr.json").read_text() == ip
    assert json.loads((folder / "nuc-a" / "record.json").read_text())["parsed"]["ok"]


def test_apply_over_ssh_without_passwordless_sudo_says_what_to_allow(capsys):
    log = []
    runner = ssh_runner("mesh4", log)

    def no_sudo(argv):
        if "sudo -n" in argv[-1]:
            return CommandResult(1, "", "sudo: a password is required")
        return runner(argv)
    with pytest.raises(ThunderboltError) as info:
        topo.run(_args("--ssh", "admin@mac-a,admin@mac-b", "--apply"), runner=no_sudo, hostname="laptop")
    message = str(info.value)
    assert "sudo: a password is required" in message and "sudoers line in the README" in message
    assert "sudo visudo -f /etc/sudoers.d/torch-thunderbolt" in message


def test_the_readmes_sudoers_line_allows_every_command_topo_plans_and_no_other():
    """First day, step 4: sudo matches each entry's program exactly and its arguments as a glob."""
    import fnmatch
    import re

    from torch_thunderbolt.topology.report import analyse

    readme = (topo_fixtures.FIXTURES.parents[2] / "README.md").read_text()
    [line] = re.findall(r"^ *(me ALL=\(root\) NOPASSWD: .*)$", readme, re.M)
    entries = [e.strip().split(" ", 1) for e in line.split("NOPASSWD:", 1)[1].split(",")]

    def allowed(argv):
        return any(argv[0] == program and fnmatch.fnmatchcase(" ".join(argv[1:]), pattern)
                   for program, pattern in entries)
    planned = [c.argv for scenario in ("pair", "chain3", "ring3", "mesh4", "double", "bridge_loop", "bridge_loop_de",
                                       "tb5_pair") for c in analyse(scenario_hosts(scenario), mtu=9000).commands]
    assert {a[1] if "networksetup" in a[0] else a[2] for a in planned} >= {"-setmanual", "deletem"}
    assert all(allowed(a) for a in planned), [a for a in planned if not allowed(a)]
    assert not allowed(["/usr/sbin/networksetup", "-setairportpower", "en0", "off"])
    assert not allowed(["/sbin/ifconfig", "en0", "down"])
