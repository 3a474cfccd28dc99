"""The examples for tests: import one in this process, or run one as a subprocess in its own session and
always reap its whole process group."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """examples/<name>.py, or a module of the examples' `models` package ("models.launch"), imported by
    path under the name the examples use for each other when run as scripts (`from models.launch import`),
    without putting examples/ on sys.path. Each is imported once (sys.modules), like any module."""
    if "models" not in sys.modules:  # first: every example script imports it
        _import_file("models", EXAMPLES / "models" / "__init__.py", package=True)
    top = name.split(".")[0]
    if top not in sys.modules:
        _import_file(top, EXAMPLES / f"{top}.py")
    return importlib.import_module(name)


def _import_file(name: str, path: Path, package: bool = False) -> None:
    spec = importlib.util.spec_from_file_location(name, path,
                                                  submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def run_example(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """argv[0] is a script name in examples/ or "-m"; kills every rank on timeout or failure."""
    cmd = [sys.executable, *argv] if argv[0] == "-m" else [sys.executable, str(EXAMPLES / argv[0]), *argv[1:]]
    # The runs here use gloo: keep them independent of the installed package's `import torch` autoload
    # hook, which the core's own tests cover.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    # The examples import their models from the package: this checkout's, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")) if p)
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
