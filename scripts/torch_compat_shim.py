"""The test process of scripts/torch_compat.py: runs ONE test of PyTorch's own distributed suite
(torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase) the way PyTorch's
test/distributed/test_distributed_spawn.py does, and prints one `TORCH_COMPAT_RESULT {json}` line.

    BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=/tmp TORCH_COMPAT_BACKEND=thunderbolt \\
        python scripts/torch_compat_shim.py test_all_reduce_sum [test_barrier ...]

THE SHIM, and all it does: with TORCH_COMPAT_BACKEND=thunderbolt, `import torch_thunderbolt` and wrap
torch.distributed's init_process_group, new_group and _new_group_with_tag so that a requested backend
"gloo" becomes "thunderbolt" (also inside "cpu:gloo"-style strings). Nothing else is changed: the suite still
reads BACKEND=gloo for its own "which tests apply to gloo" checks, while every process group really is a
thunderbolt one. So `dist.get_backend()` honestly answers "thunderbolt", and torch's own gloo-only code paths
(e.g. monitored_barrier's backend check) see "thunderbolt" too: tests failing for that reason are shim
artefacts or real gaps, to be judged one by one, never silently renamed here.

With the "spawn" start method the ranks re-import this file as `__mp_main__`, so the shim (module level, keyed
on the inherited environment) is installed in every rank, and the test class below is found by pickle there.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import unittest
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

RESULT_PREFIX = "TORCH_COMPAT_RESULT "
START_PREFIX = "TORCH_COMPAT_START "
TARGET_ENV = "TORCH_COMPAT_BACKEND"  # "gloo" (untouched) or "thunderbolt" (the shim renames gloo)
START_ENV = "TORCH_COMPAT_START_METHOD"  # "spawn" (PyTorch's way) or "fork"


def rename_backend(backend: Any) -> Any:
    """'gloo' -> 'thunderbolt' in a backend spec ('gloo', Backend.GLOO, 'cpu:gloo,cuda:nccl'); other values
    (None, 'nccl', ...) unchanged."""
    if backend is None:
        return None
    text = str(backend)
    parts = []
    for item in text.split(","):
        dev, sep, name = item.rpartition(":")
        parts.append(f"{dev}{sep}thunderbolt" if name.strip().lower() == "gloo" else item)
    renamed = ",".join(parts)
    return backend if renamed == text else renamed


def _wrap(fn: Callable[..., Any], position: int) -> Callable[..., Any]:
    """`fn` with its `backend` argument (keyword, or positional at `position`) passed through rename_backend."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = rename_backend(kwargs["backend"])
        elif len(args) > position:
            args = args[:position] + (rename_backend(args[position]),) + args[position + 1:]
        return fn(*args, **kwargs)

    wrapper.__torch_compat_shim__ = True  # type: ignore[attr-defined]
    return wrapper


def install_shim() -> None:
    """Route requested backend "gloo" to "thunderbolt" for init_process_group / new_group (idempotent)."""
    import torch_thunderbolt  # noqa: F401 - registers the "thunderbolt" backend

    # init_process_group(backend, init_method, ...); new_group(ranks, timeout, backend, ...);
    # _new_group_with_tag(ranks, timeout, backend, ...) (what new_subgroups, device meshes... reach).
    for name, position in (("init_process_group", 0), ("new_group", 2), ("_new_group_with_tag", 2)):
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__torch_compat_shim__", False):
            continue
        wrapped = _wrap(fn, position)
        setattr(c10d, name, wrapped)  # calls inside distributed_c10d look the name up here
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)


if os.environ.get(TARGET_ENV) == "thunderbolt":
    install_shim()

# distributed_test reads BACKEND, WORLD_SIZE at import: only the tool's test processes set them.
if "BACKEND" in os.environ and "WORLD_SIZE" in os.environ:
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """As in PyTorch's test_distributed_spawn.py (start method selectable, spawn by default)."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(START_ENV, "spawn") == "fork":
                # Faster (no re-import of torch per rank); this torch has no _fork_processes.
                # fork-ok: opt-in only (spawn is the default); never use it on macOS
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _outcome(result: unittest.TestResult) -> tuple[str, str]:
    if result.errors or result.failures:
        return "fail", "\n".join(text for _, text in result.errors + result.failures)
    if result.skipped:
        return "skip", "\n".join(reason for _, reason in result.skipped)
    if result.expectedFailures:
        return "pass", "expected failure"
    if result.unexpectedSuccesses:
        return "fail", "unexpected success"
    return "pass", ""


def main(argv: list[str]) -> int:
    """`--list`: the suite's test names. Otherwise run the named tests one after the other, each framed by a
    START line and a RESULT line on stdout (the tool watches them to time each test out on its own)."""
    if argv[:1] == ["--list"]:
        names = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test"))
        print(RESULT_PREFIX + json.dumps(names), flush=True)
        return 0
    for name in argv:
        print(START_PREFIX + name, flush=True)
        try:
            suite = unittest.TestSuite([TestDistBackendWithSpawn(name)])
        except ValueError as exc:  # no such test
            status, detail = "fail", f"ValueError: {exc}"
        else:
            result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
            status, detail = _outcome(result)
        print(RESULT_PREFIX + json.dumps({"test": name, "status": status, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
