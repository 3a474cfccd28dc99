import os
import sys
import subprocess

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.launch.hostfile import Host, parse_hostfile
from torch_thunderbolt.launch.ranks import (
    build_rank_specs, master_address, parse_env_assignments, rank_env, remote_script, ssh_argv)
from torch_thunderbolt.transport.netif import loopback_ifname

TWO_MACS = parse_hostfile([
    {"name": "a", "ssh": "me@a.local", "addresses": ["169.254.1.1", "169.254.2.1"], "ifname": "en2,en3"},
    {"name": "b", "ssh": "me@b.local", "addresses": ["169.254.1.2"], "ifname": "en2"}])


def test_torchrun_compatible_env_for_every_rank():
    specs = build_rank_specs(TWO_MACS, 2, ["python", "train.py"], cwd="/w", master_port=29600, inherited={})
    assert [s.rank for s in specs] == [0, 1, 2, 3]
    env = specs[3].env
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "169.254.1.1", "MASTER_PORT": "29600"}
    assert specs[0].env["THUNDERBOLT_IFNAME"] == "en2,en3"
    assert specs[0].env["GLOO_SOCKET_IFNAME"] == "en2"  # gloo: one device per rank, same count everywhere
    assert specs[0].env["OMP_NUM_THREADS"] == "1"
    assert specs[2].label == "rank 2" and specs[2].host.name == "b"


def test_omp_threads_left_alone_when_set_or_single_rank():
    assert "OMP_NUM_THREADS" not in rank_env(TWO_MACS, 0, 0, 2, "x", 1, inherited={"OMP_NUM_THREADS": "4"})
    assert "OMP_NUM_THREADS" not in rank_env(TWO_MACS, 0, 0, 1, "x", 1, inherited={})


def test_emulated_macs_share_this_machines_cores():
    """A lab's hosts (and local ones) are all this machine: one rank each still shares its cores with the
    others, so each gets one OpenMP thread, as several ranks on one host do."""
    lab = [Host(name=f"mac{i}", exec="lab", lab="ring3") for i in range(3)]
    assert all(rank_env(lab, h, 0, 1, "x", 1, inherited={})["OMP_NUM_THREADS"] == "1" for h in range(3))
    assert "OMP_NUM_THREADS" not in rank_env(lab, 0, 0, 1, "x", 1, inherited={"OMP_NUM_THREADS": "2"})
    assert "OMP_NUM_THREADS" not in rank_env(lab[:1], 0, 0, 1, "x", 1, inherited={})  # alone here
    mixed = [Host(name="here", exec="local"), *TWO_MACS]  # this Mac and two reached over ssh
    assert "OMP_NUM_THREADS" not in rank_env(mixed, 0, 0, 1, "x", 1, inherited={})
    assert "OMP_NUM_THREADS" not in rank_env(mixed, 1, 0, 1, "x", 1, inherited={})


def test_host_env_then_cli_env_override():
    host = Host(name="h", exec="local", env={"GLOO_SOCKET_IFNAME": loopback_ifname(), "A": "host"}, ifname="en2")
    env = rank_env([host], 0, 0, 1, "127.0.0.1", 1, extra_env={"A": "cli"})
    assert env["GLOO_SOCKET_IFNAME"] == loopback_ifname() and env["A"] == "cli" and env["THUNDERBOLT_IFNAME"] == "en2"


def test_master_address_prefers_a_thunderbolt_address_on_a_cable_to_everyone():
    cables = lambda *pairs: [{"address": a, "peer": p} for a, p in pairs]  # noqa: E731
    pair = parse_hostfile([{"name": "a", "ssh": "a.local", "addresses": ["169.254.0.1"],
                            "cables": cables(("169.254.0.1", "b"))}, {"name": "b", "ssh": "b.local"}])
    assert master_address(pair) == "169.254.0.1"
    # A chain a-b-c: a's only address is not on a cable to c, so the store goes on a's ssh address.
    chain = parse_hostfile([{"name": "a", "ssh": "me@a.local", "addresses": ["169.254.0.1"],
                             "cables": cables(("169.254.0.1", "b"))}, "b", "c"])
    assert master_address(chain) == "a.local"


def test_master_address_choice():
    assert master_address(TWO_MACS) == "169.254.1.1"
    assert master_address(parse_hostfile(["me@[fe80::1]", "b"])) == "fe80::1"
    assert master_address([Host(name="x")]) == "127.0.0.1"
    with pytest.raises(ConfigError, match="cannot choose MASTER_ADDR"):
        master_address([Host(name="x", exec="lab", lab="l"), Host(name="y", exec="ssh", ssh="y")])
    specs = build_rank_specs(TWO_MACS, 1, ["p"], cwd="/", master_addr="10.9.9.9")
    assert specs[1].env["MASTER_ADDR"] == "10.9.9.9"


def test_argv_per_exec_mode():
    lab_host = parse_hostfile([{"name": "mac1", "exec": "lab", "lab": "l7", "addresses": ["10.0.0.1"]}])
    spec = build_rank_specs(lab_host, 1, ["python", "t.py"], cwd="/w")[0]
    assert spec.argv == ["ip", "netns", "exec", "l7-mac1", sys.executable, "t.py"]
    assert (spec.cwd, spec.env_in_argv) == ("/w", False)
    ssh = build_rank_specs(TWO_MACS, 1, ["python", "t.py"], cwd="/w", ssh_options=["-p2222"])[1]
    assert ssh.argv[:6] == ["ssh", "-o", "BatchMode=yes", "-p2222", "--", "me@b.local"]
    assert ssh.argv[6].startswith("sh -c ") and ssh.env_in_argv and ssh.cwd is None


def test_remote_script_runs_in_cwd_with_env_and_keeps_the_exit_code(tmp_path):
    cwd = tmp_path / "dir with 'quotes' and $dollar"
    cwd.mkdir()
    env = {"RANK": "1", "ODD": "it's a \"test\" $HOME `x`"}
    cmd = ["sh", "-c", 'pwd; printf "%s\\n" "$ODD" "$RANK" "$1"; exit 4', "sh", "arg with space"]
    argv = ssh_argv(Host(name="h", exec="ssh", ssh="h"), env, cmd, str(cwd))
    # What sshd does with the remote string: hand it to the user's shell with -c.
    # Its stdin stays open as an ssh channel would (EOF there means "launcher gone": stop the job).
    channel_r, channel_w = os.pipe()
    try:
        done = subprocess.run(["sh", "-c", argv[-1]], stdin=channel_r, capture_output=True, timeout=10)
    finally:
        os.close(channel_r)
        os.close(channel_w)
    assert done.stdout.decode().splitlines() == [str(cwd), env["ODD"], "1", "arg with space"]
    assert done.returncode == 4


@pytest.mark.timeout(20)
def test_remote_job_is_stopped_when_the_ssh_channel_closes(tmp_path):
    pidfile = tmp_path / "pid"
    script = remote_script({}, ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], str(tmp_path))
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE)
    try:
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            subprocess.run(["sleep", "0.05"])
        proc.stdin.close()  # the connection went away
        assert proc.wait(timeout=10) == 128 + 15  # the job got SIGTERM, and wait reports it
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("bad", [dict(nproc_per_host=0), dict(cmd=[]), dict(master_port=70000)])
def test_bad_rank_arguments(bad):
    kwargs = dict(nproc_per_host=1, cmd=["p"], master_port=29500)
    kwargs.update(bad)
    with pytest.raises(ConfigError):
        build_rank_specs(TWO_MACS, kwargs["nproc_per_host"], kwargs["cmd"], cwd="/",
                         master_port=kwargs["master_port"])


def test_env_assignments():
    assert parse_env_assignments(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2", "A-B=1"):
        with pytest.raises(ConfigError, match="expected NAME=value"):
            parse_env_assignments([bad])


def test_bare_python_becomes_the_interpreter_by_path_on_ssh_hosts():
    from torch_thunderbolt.launch.ranks import host_command

    ssh, own = TWO_MACS[0], Host(name="c", exec="ssh", ssh="c", python="/opt/homebrew/bin/python3.12")
    for bare in ("python", "python3", "python3.12"):
        assert host_command(ssh, [bare, "t.py", "python"], "/venv/bin/python") == ["/venv/bin/python", "t.py", "python"]
    assert host_command(own, ["python3", "t.py"], "/venv/bin/python") == ["/opt/homebrew/bin/python3.12", "t.py"]
    assert host_command(ssh, ["/usr/local/bin/python3", "t.py"], "/v") == ["/usr/local/bin/python3", "t.py"]
    assert host_command(ssh, ["torchrun", "t.py"], "/v") == ["torchrun", "t.py"]


def test_bare_python_on_this_machine_is_the_launchers_interpreter():
    """`sudo .venv/bin/torch-thunderbolt launch --lab L -- python t.py`: sudo's secure_path has no venv, so
    a bare python on local and lab hosts runs as the launcher's own interpreter, whatever --python says."""
    from torch_thunderbolt.launch.ranks import host_command

    lab = Host(name="m", exec="lab", lab="l")
    for host in (Host(name="l"), lab):
        assert host_command(host, ["python3", "t.py"], "/v", here="/venv/bin/python") == ["/venv/bin/python", "t.py"]
        assert host_command(host, ["torchrun", "t.py"], "/v", here="/venv/bin/python") == ["torchrun", "t.py"]
    specs = build_rank_specs([lab], 1, ["python", "-m", "torch_thunderbolt", "bench"], cwd="/w", master_addr="10.0.0.1",
                             python="/elsewhere/python")
    assert specs[0].argv[4:] == [sys.executable, "-m", "torch_thunderbolt", "bench"]


def test_ssh_rank_checks_the_interpreter_and_runs_it_by_path():
    specs = build_rank_specs(TWO_MACS, 1, ["python3", "train.py"], cwd="/w", inherited={},
                             python="/Users/me/venv/bin/python")
    remote = specs[1].argv[-1]
    assert "[ -x /Users/me/venv/bin/python ] || { echo" in remote and "host b: no program at" in remote
    assert "/Users/me/venv/bin/python train.py" in remote and " python3 " not in remote
    with pytest.raises(ConfigError, match="--python 'python3' must be an absolute path"):
        build_rank_specs(TWO_MACS, 1, ["python3", "t.py"], cwd="/w", python="python3")


def test_hostfile_python_must_be_absolute():
    hosts = parse_hostfile([{"ssh": "a", "python": "/opt/homebrew/bin/python3.12"}, "b"])
    assert hosts[0].python == "/opt/homebrew/bin/python3.12" and hosts[1].python is None
    with pytest.raises(ConfigError, match="host #0: 'python' must be an absolute path"):
        parse_hostfile([{"ssh": "a", "python": "python3.12"}])
