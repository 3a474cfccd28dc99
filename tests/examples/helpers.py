"""Run an example script as a subprocess in its own session, and always reap its whole process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def examples_on_path() -> None:
    # The examples import their helpers as `models.*`, the way they do when run as scripts.
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def run_example(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """argv[0] is a script name in examples/ or "-m"; kills every rank on timeout or failure."""
    cmd = [sys.executable, *argv] if argv[0] == "-m" else [sys.executable, str(EXAMPLES / argv[0]), *argv[1:]]
    # The runs here use gloo: keep them independent of the installed package's `import torch` autoload
    # hook, which the core's own tests cover.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.Popen(cmd, cwd=EXAMPLES, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        # Spawned ranks share the session's process group; leave none behind, whatever happened.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_json(argv: list[str], out_path: Path, timeout: float) -> dict[str, Any]:
    res = run_example([*argv, "--json", str(out_path)], timeout)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return json.loads(out_path.read_text())
