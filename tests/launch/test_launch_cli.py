"""`torch-thunderbolt launch` end to end on this machine: local mode, a fake ssh, Ctrl-C."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.transport.netif import loopback_ifname

SHOW_ENV = """
import os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "THUNDERBOLT_IFNAME", "EXTRA"]
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), "cwd=" + os.getcwd(), flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and os.environ["RANK"] == "1" else 0)
"""

SLEEPER = """
import os, sys, time
open(sys.argv[1] + "." + os.environ["RANK"], "w").write(str(os.getpid()))
print("started", flush=True)
if os.environ["RANK"] == "1" and sys.argv[2] == "fail":
    while not os.path.exists(sys.argv[1] + ".0"):
        time.sleep(0.02)
    sys.exit(9)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_dry_run_and_bad_input(capsys, tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "a", "ssh": "me@a", "addresses": ["169.254.0.1"], "ifname": "en2"}, "b"]))
    assert main(["launch", "--hostfile", str(hf), "--dry-run", "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# rank 0 on a (ssh): MASTER_ADDR=169.254.0.1 MASTER_PORT=29500 RANK=0")
    assert out[1].startswith("ssh -o BatchMode=yes -- me@a 'sh -c '")
    assert main(["launch", "--hostfile", str(tmp_path / "none.json"), "--", "x"]) == 2
    assert main(["launch", "--nproc-per-host", "0", "--", "x"]) == 2
    assert main(["launch", "--env", "oops", "--", "x"]) == 2
    assert main(["launch"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--nproc-per-host" in err and "NAME=value" in err
    assert "expected a command" in err


def _in_process(args, capsys):
    """Run the launcher in this process (no torch import per launch); -> (exit code, stdout, stderr)."""
    code = main(["launch", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_local_mode_runs_k_ranks_and_propagates_failure(tmp_path, script, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = script("show.py", SHOW_ENV)
    code, out, err = _in_process(["--nproc-per-host", "2", "--env", "EXTRA=x y", "--", sys.executable, job], capsys)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert lines[0].startswith("[rank 0] RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 GROUP_RANK=0 MASTER_ADDR=127.0.0.1")
    assert lines[1].startswith("[rank 1] RANK=1 WORLD_SIZE=2 LOCAL_RANK=1")
    assert all(line.endswith(f"EXTRA=x y cwd={tmp_path}") for line in lines)
    code, _, err = _in_process(["--nproc-per-host", "2", "--", sys.executable, job, "5"], capsys)
    assert code == 5 and "rank 1 on localhost exited with code 5" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ssh_mode_env_cwd_and_remote_stop(tmp_path, script, fake_ssh_env, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in ("PATH", "FAKE_SSH_LOG"):
        monkeypatch.setenv(key, fake_ssh_env[key])
    hf = tmp_path / "hosts.json"
    lo = loopback_ifname()
    hf.write_text(json.dumps([{"name": "a", "ssh": "me@host-a", "addresses": ["127.0.0.1"], "ifname": lo},
                              {"name": "b", "ssh": "me@host-b", "ifname": lo}]))
    job = script("show.py", SHOW_ENV)
    code, out, err = _in_process(["--hostfile", str(hf), "--", sys.executable, job], capsys)
    assert code == 0, err
    assert sorted(out.splitlines())[1] == \
        f"[rank 1] RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 GROUP_RANK=1 MASTER_ADDR=127.0.0.1 " \
        f"THUNDERBOLT_IFNAME={lo} EXTRA=None cwd={tmp_path}"
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["me@host-a", "me@host-b"]
    # A failing remote rank: the launcher kills its ssh to rank 0, and rank 0 (in its own session on the
    # "remote" side, out of reach of our signals) must still be stopped via the closed channel.
    sleeper = script("sleep.py", SLEEPER)
    code, _, _ = _in_process(["--hostfile", str(hf), "--grace", "2", "--", sys.executable, sleeper,
                              str(tmp_path / "pid"), "fail"], capsys)
    assert code == 9
    assert _gone(int((tmp_path / "pid.0").read_text()))


SHOW_PYTHON = """
import os, sys
print("python=" + sys.executable, flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ssh_ranks_run_this_interpreter_under_a_macs_ssh_path(tmp_path, script, fake_ssh_env, capsys, monkeypatch):
    """`launch -- python job.py` over ssh: the remote PATH (/usr/bin:/bin:/usr/sbin:/sbin, no venv) has no
    `python` with torch, so the ranks must run the launcher's interpreter by path; a host whose
    interpreter is missing fails with one message naming the host and the path."""
    monkeypatch.chdir(tmp_path)
    for key in ("PATH", "FAKE_SSH_LOG"):
        monkeypatch.setenv(key, fake_ssh_env[key])
    hosts = [{"name": "a", "ssh": "me@host-a", "addresses": ["127.0.0.1"]}, {"name": "b", "ssh": "me@host-b"}]
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps(hosts))
    job = script("which.py", SHOW_PYTHON)
    code, out, err = _in_process(["--hostfile", str(hf), "--", "python", job], capsys)
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[rank 0] python={sys.executable}", f"[rank 1] python={sys.executable}"]
    hosts[1]["python"] = str(tmp_path / "no-venv" / "bin" / "python3")
    hf.write_text(json.dumps(hosts))
    code, out, err = _in_process(["--hostfile", str(hf), "--", "python3", job], capsys)
    assert code == 127
    assert f"host b: no program at {tmp_path / 'no-venv' / 'bin' / 'python3'} there" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ctrl_c_stops_every_rank(tmp_path, script, cli_env):
    sleeper = script("sleep.py", SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "torch_thunderbolt", "launch", "--nproc-per-host", "2", "--",
                             sys.executable, sleeper, str(tmp_path / "pid"), "run"],
                            env=cli_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = [proc.stdout.readline(), proc.stdout.readline()]
        assert all("started" in line for line in started)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert "interrupted; stopping all ranks" in proc.stderr.read()
        assert all(_gone(int((tmp_path / f"pid.{r}").read_text())) for r in (0, 1))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_lab_option_builds_hosts_from_a_lab_state(capsys, tmp_path):
    from torch_thunderbolt.lab.blueprint import plan_lab
    from torch_thunderbolt.lab.state import save_state

    save_state(plan_lab(3, "chain", name="lc1"), tmp_path)
    assert main(["launch", "--lab", "lc1", "--lab-state-dir", str(tmp_path), "--master-port", "29511",
                 "--dry-run", "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"ip netns exec lc1-mac0 {shlex.quote(sys.executable)} t.py"  # sudo's PATH lacks the venv
    assert "MASTER_ADDR=10.213.0.1 MASTER_PORT=29511 RANK=2" in out[4]
    assert "THUNDERBOLT_IFNAME=tb1_0 GLOO_SOCKET_IFNAME=tb1_0" in out[4]
    assert "THUNDERBOLT_IFNAME=tb0_0,tb2_0 GLOO_SOCKET_IFNAME=tb0_0" in out[2]


def test_lab_ranks_off_linux_are_one_clear_error(capsys, tmp_path, monkeypatch):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "a", "exec": "lab", "lab": "x"}, {"name": "b", "exec": "lab", "lab": "x"}]))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert main(["launch", "--hostfile", str(hf), "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs Linux network namespaces" in err[0]


UNKNOWN_HOST = "ssh: Could not resolve hostname {host}: nodename nor servname provided, or not known"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ssh_failing_at_once_keeps_its_exit_code_and_says_what_to_check(tmp_path, cli_env):
    """An ssh that exits 255 without reading its stdin (an unknown host name) races the launcher's write of
    the job secret to it. 20 launches of 2 such hosts: every one exits 255 with ssh's message and ours, and
    none with a traceback (the broken pipe surfaced when the launcher closed the rank's stdin)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    # The host is the argument after `--`; exit at once, reading nothing (no Python: as fast as real ssh).
    ssh.write_text('#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\n'
                   f'echo "{UNKNOWN_HOST.format(host="$2")}" >&2\nexit 255\n')
    ssh.chmod(0o755)
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "studio1", "ssh": "me@studio1.local"},
                              {"name": "studio2", "ssh": "me@studio2.local"}]))
    env = dict(cli_env, PATH=f"{bindir}{os.pathsep}{cli_env['PATH']}")
    for attempt in range(20):
        done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "launch", "--hostfile", str(hf),
                               "--grace", "1", "--", "python", "train.py"], env=env, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        where = f"launch {attempt}: exit {done.returncode}\n{done.stderr}"
        assert done.returncode == 255, where
        assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, where
        assert "Could not resolve hostname me@studio" in done.stderr, where
        assert "exited with code 255; ssh to me@studio" in done.stderr, where
        assert "Remote Login" in done.stderr and "ssh -o BatchMode=yes me@studio" in done.stderr, where
