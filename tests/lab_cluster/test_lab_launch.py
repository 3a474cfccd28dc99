"""`torch-thunderbolt launch --lab NAME` end to end with the thunderbolt backend on a 3-host chain."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab, unique_lab_name
from torch_thunderbolt.testing.ranks import REPO

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

JOB = """
import argparse, os
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()
if args.backend == "thunderbolt":
    import torch_thunderbolt  # noqa: F401
dist.init_process_group(backend=args.backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
big = torch.full((3 << 20,), float(rank + 1))
dist.all_reduce(big)
small = torch.tensor([float(rank + 1)])
dist.all_reduce(small)
pg = dist.group.WORLD
print(f"job rank={rank} world={world} backend={pg.name()} shape={pg._comm.shape.kind} "
      f"ifname={os.environ['THUNDERBOLT_IFNAME']} big_ok={bool((big == 6).all())} small={small.item():g}",
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_launch_lab_with_the_thunderbolt_backend(tmp_path):
    skip_unless_lab()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "GLOO_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    name, state = unique_lab_name(), tmp_path / "state"
    with lab_session(3, "chain", rate="5gbit", cc="reno", name=name, state_directory=str(state)) as lab:
        argv = [sys.executable, "-m", "torch_thunderbolt", "launch", "--lab", name, "--lab-state-dir", str(state),
                "--master-port", "29613", "--grace", "2", "--", sys.executable, str(script), "--backend",
                "thunderbolt"]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        lines = sorted(line for line in out.splitlines() if " job " in line)
        ifnames = [lab.ifname_env(h) for h in lab.hosts()]
    assert lines == [f"[rank {r}] job rank={r} world=3 backend=thunderbolt shape=chain ifname={ifnames[r]} "
                     f"big_ok=True small=6" for r in range(3)]
    assert ifnames[1] == "tb0_0,tb2_0"  # the middle host used both of its cables
