"""The README's recipes for HF Accelerate and Lightning, run with the real packages (the `frameworks`
extra) under `torch-thunderbolt launch --nproc-per-host 2`: training on the thunderbolt backend ends with
the same parameters as on gloo, on every rank. Skipped when the packages are not installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).parent / "programs"

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]


def launch(program: str, backend: str, tmp_path: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "torch_thunderbolt", "launch", "--nproc-per-host", "2", "--",
                           sys.executable, str(PROGRAMS / program), backend],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1], done.stdout[-3000:]
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.timeout(600)
def test_accelerate_recipe_trains_as_gloo_does(tmp_path) -> None:
    pytest.importorskip("accelerate", reason="HF Accelerate is not installed (pip install accelerate, or the "
                        "checkout's frameworks extra: pip install -e '.[frameworks]')")
    ours, gloo = launch("accelerate_ddp.py", "thunderbolt", tmp_path), launch("accelerate_ddp.py", "gloo", tmp_path)
    for r in ours:
        assert (r["backend"], r["distributed_type"], r["processes"], r["wrapped"]) == \
            ("thunderbolt", "DistributedType.MULTI_CPU", 2, "DistributedDataParallel")
        assert r["accelerate_backend"] == "gloo"  # Accelerate's own name for CPU ranks (docs/tools.md)
    assert ours[0]["params"] == ours[1]["params"] == gloo[0]["params"]  # two ranks: the sums are exact


@pytest.mark.timeout(120)
def test_accelerate_refuses_our_backend_by_name_on_cpu(tmp_path) -> None:
    """Why the recipe creates the group itself: Accelerate replaces any backend named for CPU ranks by gloo
    and refuses the mismatch. If a newer Accelerate accepts it, this fails: update the README."""
    pytest.importorskip("accelerate", reason="HF Accelerate is not installed")
    code = ("from accelerate import Accelerator\nfrom accelerate.utils import InitProcessGroupKwargs\n"
            "Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend='thunderbolt')])\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100,
                          cwd=tmp_path)
    assert done.returncode != 0 and "Your assigned backend thunderbolt is not available, please use gloo" in done.stderr


@pytest.mark.timeout(600)
def test_lightning_recipe_trains_as_gloo_does(tmp_path) -> None:
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning, or the "
                        "checkout's frameworks extra: pip install -e '.[frameworks]')")
    ours, gloo = launch("lightning_ddp.py", "thunderbolt", tmp_path), launch("lightning_ddp.py", "gloo", tmp_path)
    assert [(r["backend"], r["world"]) for r in ours] == [("thunderbolt", 2)] * 2
    assert ours[0]["params"] == ours[1]["params"] == gloo[0]["params"]
