"""The README's torchrun line, as written, on two emulated Macs: one `torchrun` per Mac with `--master-addr`
the first Mac's Thunderbolt (cable) address. Also what a Mac whose store connection is blocked sees: a
refused MASTER_PORT and a MASTER_ADDR with no route give our error at once, not torch's long wait."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_thunderbolt.testing.lab import counter_delta, lab_session, skip_unless_lab
from torch_thunderbolt.testing.ranks import REPO

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

TORCHRUN = Path(sys.executable).parent / "torchrun"
SECRET = "5f0c8a1e9b7d4c2a6e3f1b8d0a9c7e5f"  # any 32+ random characters, the same on both Macs
PORT = 29617

JOB = """
import json, torch, torch.distributed as dist
dist.init_process_group("thunderbolt")
x = torch.full((3 << 20,), float(dist.get_rank() + 1))
dist.all_reduce(x)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                              "backend": dist.get_backend(), "ok": bool((x == 3).all())}), flush=True)
dist.destroy_process_group()
"""

STORE = """
import json, sys
from datetime import timedelta
import torch.distributed as dist, torch_thunderbolt
try:
    dist.init_process_group("thunderbolt", timeout=timedelta(minutes=10))
    print("RESULT " + json.dumps({"error": None}))
except Exception as exc:
    print("RESULT " + json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "GLOO_", "MASTER_", "TORCH"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _results(out: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]


@pytest.mark.timeout(240)
def test_the_readmes_torchrun_line_on_two_macs(tmp_path) -> None:
    skip_unless_lab()
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun beside {sys.executable}")
    job = tmp_path / "train.py"
    job.write_text(textwrap.dedent(JOB))
    env = _env(THUNDERBOLT_SECRET=SECRET)
    with lab_session(2, "pair", cc="reno") as lab:
        master = lab.addresses(0)[0]  # the first Mac's address on the cable
        before = lab.counters(0)
        procs = []
        try:
            for node in (0, 1):
                # The README's line, with this Mac's --node-rank.
                line = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                        "--master-addr", master, "--master-port", str(PORT), str(job)]
                procs.append(subprocess.Popen(lab.exec_argv(node, line), env=env, cwd=tmp_path, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
            outs = [p.communicate(timeout=200) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
        moved = counter_delta(before, lab.counters(0))
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "THUNDERBOLT_SECRET is not set" not in err
    results = sorted((r for out, _ in outs for r in _results(out)), key=lambda r: r["rank"])
    assert results == [{"rank": r, "world": 2, "backend": "thunderbolt", "ok": True} for r in (0, 1)]
    # The 12 MB all_reduce went over the cable (the interface towards MASTER_ADDR): about half each way.
    assert sum(tx for _, tx in moved.values()) > 6 << 20 and sum(rx for rx, _ in moved.values()) > 6 << 20


@pytest.mark.timeout(180)
def test_a_blocked_store_connection_between_two_macs_is_our_error(tmp_path) -> None:
    skip_unless_lab()
    script = tmp_path / "rank1.py"
    script.write_text(textwrap.dedent(STORE))
    with lab_session(2, "pair", cc="reno") as lab:
        master = lab.addresses(0)[0]
        outcomes = {}
        # Nobody serves MASTER_PORT on the first Mac (rank 0 not started, or another port); and an address
        # on no network of the second Mac (a wrong MASTER_ADDR: the kernel answers ENETUNREACH, no packet).
        for case, addr in (("refused", master), ("no route", "10.213.0.9")):
            env = _env(RANK="1", WORLD_SIZE="2", MASTER_ADDR=addr, MASTER_PORT="29699", THUNDERBOLT_SECRET=SECRET,
                       THUNDERBOLT_CONNECT_TIMEOUT="2")
            done = lab.run(1, [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=150)
            [outcomes[case]] = _results(done.stdout) or [{"error": "none printed", "message": done.stderr[-2000:]}]
    refused, unrouted = outcomes["refused"], outcomes["no route"]
    assert refused["error"] == "PeerLostError", refused
    assert f"rendezvous store at {master}:29699" in refused["message"] and "refused" in refused["message"]
    assert "firewall" in refused["message"]
    assert unrouted["error"] == "ConfigError", unrouted
    assert "no route from this Mac to the rendezvous store at 10.213.0.9:29699" in unrouted["message"]


def test_the_readme_gives_the_torchrun_line_this_file_runs() -> None:
    """The README's lines (values aside) are the ones the lab test runs: same options, same order."""
    import re

    readme = (REPO / "README.md").read_text()
    lines = re.findall(r"^torchrun (.*?) +# (first|second) Mac$", readme, re.M)
    assert [kind for _, kind in lines] == ["first", "second"]
    for node, (line, _) in enumerate(lines):
        words = line.split()
        assert words == ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                         words[7], "--master-port", words[9], "train.py"]
