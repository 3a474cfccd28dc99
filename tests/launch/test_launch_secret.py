"""`launch` gives every rank of a job the same fresh THUNDERBOLT_SECRET, a different one per job, and never
on a command line (ssh ranks read it from the channel's stdin)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.launch.hostfile import parse_hostfile
from torch_thunderbolt.launch.ranks import build_rank_specs

HERE = Path(__file__).parent
SECRET = "5ec2e7a1b9d0" * 4
HOSTS = parse_hostfile([{"name": "a", "ssh": "me@a.local", "addresses": ["169.254.1.1"], "ifname": "en2"},
                        {"name": "b", "exec": "local"}])

SHOW_SECRET = """
import os
print(f"RANK={os.environ['RANK']} SECRET={os.environ.get('THUNDERBOLT_SECRET')}", flush=True)
"""


def test_every_rank_gets_the_secret_outside_argv_and_repr():
    specs = build_rank_specs(HOSTS, 2, ["python", "t.py"], cwd="/w", secret=SECRET)
    assert [s.private_env for s in specs] == [{"THUNDERBOLT_SECRET": SECRET}] * 4
    for spec in specs:
        assert "THUNDERBOLT_SECRET" not in spec.env
        assert not any(SECRET in arg for arg in spec.argv) and SECRET not in repr(spec)
    assert specs[0].stdin_preamble() == f"{SECRET}\n".encode()  # ssh: on the channel
    assert specs[2].stdin_preamble() == b""  # local: in the process environment
    # One given with --env (or in the hostfile's env) wins, and is moved off the command line too.
    mine = "f00d" * 10
    specs = build_rank_specs(HOSTS, 1, ["p"], cwd="/", extra_env={"THUNDERBOLT_SECRET": mine}, secret=SECRET)
    assert [s.private_env for s in specs] == [{"THUNDERBOLT_SECRET": mine}] * 2
    assert not any(mine in arg for s in specs for arg in s.argv)
    with pytest.raises(ConfigError, match="single line"):
        build_rank_specs(HOSTS, 1, ["p"], cwd="/", secret="a\nb")


@pytest.mark.timeout(20)
def test_the_remote_script_reads_the_secret_from_the_channel(tmp_path):
    spec = build_rank_specs(HOSTS, 1, [sys.executable, "-c", SHOW_SECRET], cwd=str(tmp_path), secret=SECRET)[0]
    remote = spec.argv[-1]
    assert SECRET not in remote
    # What sshd does: the remote string to a shell with -c, stdin = the channel, kept open (EOF = stop).
    proc = subprocess.Popen(["sh", "-c", remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={k: v for k, v in os.environ.items() if k != "THUNDERBOLT_SECRET"})
    try:
        proc.stdin.write(spec.stdin_preamble())
        proc.stdin.flush()
        line = proc.stdout.readline().decode()
        assert line == f"RANK=0 SECRET={SECRET}\n"
        assert proc.wait(timeout=10) == 0  # the channel still open: the job ended by itself
        proc.stdin.close()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_dry_run_hides_the_secret(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("THUNDERBOLT_SECRET", SECRET)
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "a", "ssh": "me@a", "addresses": ["169.254.0.1"]}]))
    assert main(["launch", "--hostfile", str(hf), "--dry-run", "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "THUNDERBOLT_SECRET=(hidden)" in out and SECRET not in out
    monkeypatch.setenv("THUNDERBOLT_SECRET", "short")  # the user's own, checked before anything starts
    assert main(["launch", "--hostfile", str(hf), "--dry-run", "--", "python", "t.py"]) == 2
    assert "THUNDERBOLT_SECRET: expected a random secret" in capsys.readouterr().err


def _secrets(out: str) -> dict[int, str]:
    found = {}
    for line in out.splitlines():
        if "RANK=" in line and "SECRET=" in line:
            rank, secret = line.split("RANK=")[1].split(" SECRET=")
            found[int(rank)] = secret
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_launch_gives_every_rank_one_fresh_secret_per_job(tmp_path, script, fake_ssh_env, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("THUNDERBOLT_SECRET", raising=False)  # so that only the ssh channel can bring it
    argv_log = tmp_path / "argv.log"
    for key in ("PATH", "FAKE_SSH_LOG"):
        monkeypatch.setenv(key, fake_ssh_env[key])
    monkeypatch.setenv("FAKE_SSH_ARGV_LOG", str(argv_log))
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "a", "ssh": "me@host-a", "addresses": ["127.0.0.1"]},
                              {"name": "b", "ssh": "me@host-b"}]))
    job = script("show.py", SHOW_SECRET)
    jobs = []
    for _ in range(2):
        code = main(["launch", "--hostfile", str(hf), "--nproc-per-host", "2", "--", sys.executable, job])
        out, err = capsys.readouterr()
        assert code == 0, err
        jobs.append(_secrets(out))
    for found in jobs:
        assert sorted(found) == [0, 1, 2, 3]
        assert len(set(found.values())) == 1, found  # the same for every rank of the job
        assert Config.from_env({"THUNDERBOLT_SECRET": found[0]}).secret == found[0].encode()  # and valid
    assert jobs[0][0] != jobs[1][0]  # fresh per job
    ssh_argvs = argv_log.read_text()
    assert ssh_argvs.count("me@host-") == 8
    assert jobs[0][0] not in ssh_argvs and jobs[1][0] not in ssh_argvs  # not on any command line
    # Local ranks get it in their environment, and a secret the user set is the one used.
    monkeypatch.setenv("THUNDERBOLT_SECRET", SECRET)
    assert main(["launch", "--nproc-per-host", "2", "--", sys.executable, job]) == 0
    assert _secrets(capsys.readouterr().out) == {0: SECRET, 1: SECRET}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_thunderbolt_job_under_launch_is_authenticated_and_does_not_warn(tmp_path, fake_ssh_env, capsys,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("THUNDERBOLT_SECRET", raising=False)
    for key in ("PATH", "FAKE_SSH_LOG"):
        monkeypatch.setenv(key, fake_ssh_env[key])
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"name": "a", "ssh": "me@host-a", "addresses": ["127.0.0.1"]},
                              {"name": "b", "ssh": "me@host-b"}]))
    code = main(["launch", "--hostfile", str(hf), "--master-port", str(_free_port()), "--env",
                 "THUNDERBOLT_TRANSPORT=tcp", "--env", f"PYTHONPATH={fake_ssh_env['PYTHONPATH']}", "--",
                 sys.executable, str(HERE / "scripts" / "allreduce.py"), "--backend", "thunderbolt"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert sorted(line.split(" ifname")[0] for line in out.splitlines() if "allreduce" in line) == [
        "[rank 0] allreduce rank=0 world=2", "[rank 1] allreduce rank=1 world=2"]
    assert all(line.endswith("result=3") for line in out.splitlines() if "allreduce" in line)
    assert "THUNDERBOLT_SECRET is not set" not in err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
