"""examples/compression_train.py: argument checking, and one tiny end-to-end run."""
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "compression_train.py"


def _load():
    spec = importlib.util.spec_from_file_location("compression_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_are_checked():
    script = _load()
    args = script.parse_args(["--modes", "fp32, int8", "--steps", "3"])
    assert args.modes == ["fp32", "int8"] and args.steps == 3 and args.backend == "gloo"
    with pytest.raises(SystemExit):
        script.parse_args(["--modes", "int4"])
    with pytest.raises(SystemExit):
        script.parse_args(["--world-size", "0"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_tiny_run_prints_every_mode():
    cmd = [sys.executable, str(SCRIPT), "--steps", "3", "--hidden", "8", "--numel", "1000"]
    # Own session, so that a timeout can stop the spawned ranks too (they are in our process group).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    rows = [line.split()[0] for line in out.splitlines() if line and not line.startswith(("#", "data", "mode"))]
    assert rows[-5:] == ["fp32", "int8", "int8-noef", "fp16", "bf16"], out
