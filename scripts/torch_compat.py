"""Run PyTorch's own distributed tests (DistributedTest._DistTestBase, as test_distributed_spawn.py does) with
real gloo and with thunderbolt standing in for gloo, and compare.

    nice -n 10 .venv/bin/python scripts/torch_compat.py -k all_reduce --world 2 --transport auto,tcp
    nice -n 10 .venv/bin/python scripts/torch_compat.py --world 2,3 --transport rdma   # over a fake fabric

Every test runs with BACKEND=gloo, so the suite's "does this apply to gloo?" checks choose the same tests for
both columns; in the thunderbolt column scripts/torch_compat_shim.py renames a requested backend "gloo" to
"thunderbolt" in init_process_group / new_group (and nothing else). The shim's docstring says what follows.

Each test runs in a subprocess of its own session (the test process and its ranks), hard-killed as a group
when it outlives --timeout; --batch N lets one test process run N tests in a row (saves the ~4 s torch import
per test; a test that times out or crashes is recorded and the batch restarts after it). The table shows
pass / fail / skip / timeout per test and configuration; the JSON file keeps the details (the failing tests'
key error line and last lines of output). Exit status 1 when a test gloo passes does not pass for us (fails,
times out or skips), unless KNOWN_DIFFERENCES lists it; 2 on a usage error.

Cost on the 2-core dev box: with the default spawn start method every rank re-imports torch (~10-15 s a test
per column); `--start-method fork --batch 25` runs all 285 tests at world 2, gloo + one transport, in ~10 min
(most tests skip on CPU: CUDA/NCCL/MPI-only, or world >= 8 for the *_group ones).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

REPO = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().with_name("torch_compat_shim.py")
RESULT_PREFIX = "TORCH_COMPAT_RESULT "
START_PREFIX = "TORCH_COMPAT_START "
STATUSES = ("pass", "fail", "skip", "timeout")
TAIL_LINES = 30

# Tests gloo passes and thunderbolt is allowed not to: test -> (text the failure's key line must contain,
# one-line justification checked against torch's code and the test's output). A listed test failing for any
# other reason still counts. Add nothing unverified; report candidates to the lead instead.
_MONITORED = ("monitored_barrier is only implemented for GLOO backend",
              "torch's monitored_barrier refuses every backend but gloo (distributed_c10d.py: "
              "`if get_backend(group) != Backend.GLOO: raise ValueError`), whatever the group can do")
KNOWN_DIFFERENCES: dict[str, tuple[str, str]] = {
    "test_get_backend": ("'thunderbolt' != 'gloo'",
                         "asserts dist.get_backend() == BACKEND ('gloo'); the shim renames only the requested "
                         "backend, so the group truthfully reports 'thunderbolt'"),
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_failure_order": _MONITORED,  # world >= 8 only
    "test_monitored_barrier_wait_all_ranks": _MONITORED,  # world >= 8 only
}

# A Python error line ("RuntimeError: ...", "torch.distributed.DistBackendError: ...") or torch's own
# multiprocess test timeouts: what the report quotes as a failure's key line.
_KEY_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*(?:Error|Exception|Timeout|Exit)\b.*"
                       r"|.*(?:Timing out after|timed out|Timed out).*)$")


@dataclass
class Config:
    """One column: real gloo, or thunderbolt on one THUNDERBOLT_TRANSPORT."""

    backend: str  # "gloo" or "thunderbolt"
    transport: str = ""  # THUNDERBOLT_TRANSPORT for thunderbolt; "" for gloo

    @property
    def label(self) -> str:
        return "gloo" if self.backend == "gloo" else f"tb/{self.transport}"


@dataclass
class Outcome:
    status: str  # one of STATUSES
    seconds: float
    key: str = ""  # the error's key line (fail / timeout) or the skip reason
    tail: list[str] = field(default_factory=list)  # last lines of the error output (fail / timeout only)


@dataclass
class RunSpec:
    world: int
    timeout: float = 120.0
    start_method: str = "spawn"
    pythonpath: str = str(REPO)
    verbs: str = ""  # THUNDERBOLT_VERBS for the rdma column (a fake fabric on a machine without RDMA)


def key_line(text: str) -> str:
    """The line a reader needs first: the last error-looking line, else the last non-empty one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _KEY_LINE.match(ln) and not ln.startswith("Traceback"):
            return ln[:400]
    return lines[-1][:400] if lines else ""


def _child_env(cfg: Config, spec: RunSpec, tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("THUNDERBOLT_", "TORCH_DISTRIBUTED", "TORCH_COMPAT_"))}
    env.update({
        "BACKEND": "gloo",  # also in the thunderbolt column: see the shim
        "WORLD_SIZE": str(spec.world),
        "TEMP_DIR": tmp,
        # As PyTorch's run_test.py does for its init-file runs: tests that re-create the default group (e.g.
        # test_barrier_timeout_global) run only with file:// (the suite itself always uses a file:// store).
        "INIT_METHOD": "file://" + os.path.join(tmp, "init_dir", "shared_init_file"),
        "TMPDIR": tmp,  # MultiProcessTestCase's init files and temp dirs land here and go with it
        "TORCH_COMPAT_BACKEND": cfg.backend,
        "TORCH_COMPAT_START_METHOD": spec.start_method,
        "PYTHONPATH": spec.pythonpath,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        # torch's own per-test join timeout, below ours, so a hung test usually fails with its ranks'
        # tracebacks before we have to SIGKILL the group.
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(max(5, int(spec.timeout * 0.8))),
    })
    if cfg.backend == "thunderbolt":
        env["THUNDERBOLT_TRANSPORT"] = cfg.transport
        if cfg.transport == "rdma" and spec.verbs:
            env["THUNDERBOLT_VERBS"] = spec.verbs
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the test process's whole session (its ranks and helpers too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-TAIL_LINES:]


def _run_batch(tests: list[str], cfg: Config, spec: RunSpec) -> Iterator[tuple[str, Outcome]]:
    """Run `tests` in one test process; yield each test's outcome. Stops after a timeout or crash (the
    caller restarts with the tests not yet run)."""
    tmp = tempfile.mkdtemp(prefix="torch_compat_")
    for sub in ("barrier", "init_dir"):
        os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    err_path = Path(tmp) / "stderr.txt"
    lines: queue.Queue[str | None] = queue.Queue()
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, str(SHIM), *tests], cwd=tmp, env=_child_env(cfg, spec, tmp),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for ln in proc.stdout:
            lines.put(ln)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    current: str | None = None
    started = time.monotonic()
    # The first test also pays the test process's start-up (torch import): allow for it once.
    deadline = started + spec.timeout + 30
    try:
        while True:
            try:
                ln = lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                _kill_group(proc)
                if current is not None:
                    tail = _tail(err_path)
                    yield current, Outcome("timeout", round(time.monotonic() - started, 1),
                                           f"killed after {spec.timeout:.0f} s: {key_line(chr(10).join(tail))}",
                                           tail)
                return
            if ln is None:  # the test process exited
                proc.wait()
                if current is not None:
                    tail = _tail(err_path)
                    yield current, Outcome("fail", round(time.monotonic() - started, 1),
                                           f"test process exited {proc.returncode} mid-test: "
                                           f"{key_line(chr(10).join(tail))}", tail)
                return
            if ln.startswith(START_PREFIX):
                current = ln[len(START_PREFIX):].strip()
                started = time.monotonic()
                deadline = started + spec.timeout
            elif ln.startswith(RESULT_PREFIX) and current is not None:
                res = json.loads(ln[len(RESULT_PREFIX):])
                status, detail = res["status"], res["detail"]
                if status == "fail" and re.search(r"Timing out after|terminated or timed out", detail):
                    status = "timeout"  # torch's own join timeout fired first
                tail = detail.splitlines()[-TAIL_LINES:] if status in ("fail", "timeout") else []
                key = key_line(detail) if status != "pass" else ""
                yield current, Outcome(status, round(time.monotonic() - started, 1), key, tail)
                current = None
                deadline = time.monotonic() + 60  # for the next START line, or the process's exit
    finally:
        _kill_group(proc)  # stray ranks of a finished test process too
        reader.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def run_tests(tests: list[str], cfg: Config, spec: RunSpec, batch: int = 1) -> dict[str, Outcome]:
    """Every test of `tests` under `cfg`, at most `batch` per test process, restarting after a test that
    timed out or crashed its process."""
    results: dict[str, Outcome] = {}
    todo = list(tests)
    while todo:
        chunk = todo[:max(1, batch)]
        for name, outcome in _run_batch(chunk, cfg, spec):
            results[name] = outcome
        if chunk[0] not in results:  # the process died before starting anything: don't loop forever
            results[chunk[0]] = Outcome("fail", 0.0, "test process started no test", [])
        todo = [t for t in todo if t not in results]
    return results


def list_tests(spec: RunSpec) -> list[str]:
    """The names of DistributedTest._DistTestBase's tests, as this torch has them."""
    tmp = tempfile.mkdtemp(prefix="torch_compat_")
    try:
        out = subprocess.run([sys.executable, str(SHIM), "--list"], env=_child_env(Config("gloo"), spec, tmp),
                             capture_output=True, text=True, timeout=120, cwd=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for ln in out.stdout.splitlines():
        if ln.startswith(RESULT_PREFIX):
            return list(json.loads(ln[len(RESULT_PREFIX):]))
    raise RuntimeError(f"could not list torch's distributed tests (exit {out.returncode}):\n{out.stderr[-3000:]}")


def select(names: Iterable[str], patterns: list[str]) -> list[str]:
    """Names containing any of the -k substrings (all names when none given); exact names as given."""
    names = list(names)
    if not patterns:
        return names
    return [n for n in names if any(p in n for p in patterns)]


def compare(tests: list[str], world: int, transports: list[str], timeout: float = 120.0, jobs: int = 1,
            batch: int = 1, start_method: str = "spawn", pythonpath: str = str(REPO),
            gloo: dict[str, Outcome] | None = None, progress: bool = False,
            verbs: str = "") -> dict[str, dict[str, Outcome]]:
    """{test: {column label: Outcome}} for gloo and thunderbolt on each transport at `world` ranks.
    `gloo`: earlier gloo outcomes to reuse instead of running gloo again; `verbs`: THUNDERBOLT_VERBS for rdma."""
    spec = RunSpec(world, timeout, start_method, pythonpath, verbs)
    configs = ([] if gloo is not None else [Config("gloo")]) + [Config("thunderbolt", t) for t in transports]
    chunks = [tests[i:i + max(1, batch)] for i in range(0, len(tests), max(1, batch))]
    work = [(cfg, chunk) for chunk in chunks for cfg in configs]
    table: dict[str, dict[str, Outcome]] = {t: {} for t in tests}
    if gloo is not None:
        for t in tests:
            if t in gloo:
                table[t]["gloo"] = gloo[t]
    lock = threading.Lock()

    def one(item: tuple[Config, list[str]]) -> None:
        cfg, chunk = item
        res = run_tests(chunk, cfg, spec, batch)
        with lock:
            for name, outcome in res.items():
                table[name][cfg.label] = outcome
                if progress:
                    print(f"[w{world} {cfg.label:>8}] {outcome.status:<7} {outcome.seconds:6.1f}s {name}"
                          + (f"  | {outcome.key[:150]}" if outcome.status in ("fail", "timeout") else ""),
                          file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, work))
    return table


def excuse(test: str, outcome: Outcome) -> str | None:
    """KNOWN_DIFFERENCES' justification when it covers this very failure, else None."""
    known = KNOWN_DIFFERENCES.get(test)
    return known[1] if known and outcome.status == "fail" and known[0] in outcome.key else None


def regressions(table: dict[str, dict[str, Outcome]]) -> list[tuple[str, str, Outcome]]:
    """(test, column, outcome) wherever gloo passed and a thunderbolt column did not."""
    out = []
    for test, row in table.items():
        if row.get("gloo") is None or row["gloo"].status != "pass":
            continue
        for label, outcome in row.items():
            if label != "gloo" and outcome.status != "pass":
                out.append((test, label, outcome))
    return out


def counts(table: dict[str, dict[str, Outcome]], label: str) -> dict[str, int]:
    c = {s: 0 for s in STATUSES}
    for row in table.values():
        if label in row:
            c[row[label].status] += 1
    return c


def format_table(world: int, table: dict[str, dict[str, Outcome]], labels: list[str]) -> str:
    width = max([len(t) for t in table] + [4])
    head = f"{'test (world ' + str(world) + ')':<{width}}  " + "  ".join(f"{lb:>8}" for lb in labels)
    rows = [head, "-" * len(head)]
    for test, row in table.items():
        cells = []
        for lb in labels:
            o = row.get(lb)
            mark = o.status if o else "-"
            if lb != "gloo" and o and row.get("gloo") and row["gloo"].status == "pass" and o.status != "pass":
                mark = ("~" if excuse(test, o) else "!") + mark  # gloo passes, we don't (~: known difference)
            cells.append(f"{mark:>8}")
        rows.append(f"{test:<{width}}  " + "  ".join(cells))
    for lb in labels:
        c = counts(table, lb)
        rows.append(f"{lb}: " + ", ".join(f"{c[s]} {s}" for s in STATUSES))
    return "\n".join(rows)


def _load_gloo(path: str, world: int) -> dict[str, Outcome]:
    data = json.loads(Path(path).read_text())
    rows = data.get("worlds", {}).get(str(world), {})
    return {t: Outcome(**row["gloo"]) for t, row in rows.items() if "gloo" in row}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="exact test names (default: all of _DistTestBase's)")
    ap.add_argument("-k", action="append", default=[], help="substring filter on test names (repeatable)")
    ap.add_argument("--world", default="2", help="comma-separated world sizes (default 2)")
    ap.add_argument("--transport", default="auto", help="THUNDERBOLT_TRANSPORT values, comma-separated")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per test before its group is killed")
    ap.add_argument("--jobs", type=int, default=1, help="test processes at once (default 1)")
    ap.add_argument("--batch", type=int, default=1,
                    help="tests per test process (default 1: each test in its own process)")
    ap.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                    help="how ranks start (spawn, as PyTorch's test_distributed_spawn.py; fork is faster)")
    ap.add_argument("--pythonpath", default=str(REPO), help="where torch_thunderbolt is imported from")
    ap.add_argument("--reuse-gloo", metavar="JSON", help="take gloo's outcomes from an earlier --json file")
    ap.add_argument("--json", default="torch_compat.json", help="results file (default torch_compat.json)")
    ap.add_argument("--list", action="store_true", help="print the selected test names and exit")
    args = ap.parse_args(argv)
    try:
        worlds = [int(w) for w in args.world.split(",") if w.strip()]
        transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    except ValueError:
        ap.error("--world takes integers, e.g. 2,3")
    if any(w < 2 for w in worlds):
        ap.error("--world: the suite needs at least 2 ranks")
    if any(t not in ("auto", "tcp", "shm", "rdma") for t in transports):
        ap.error("--transport takes auto, tcp, shm, rdma")
    verbs = os.environ.get("THUNDERBOLT_VERBS", "")
    fabric_dir = None
    if "rdma" in transports and not verbs:
        # No RDMA here: the rdma column runs over a fake verbs fabric, two devices per rank (a test's groups
        # each take a device's queue pairs, about 10 per device), removed at the end.
        sys.path.insert(0, args.pythonpath)
        from torch_thunderbolt.testing.fake_verbs import Fabric

        fabric_dir = tempfile.mkdtemp(prefix="torch-compat-fabric-")
        count = 2 * max(worlds)
        Fabric.create(fabric_dir, {f"rdma_fake{i}": f"10.201.0.{i + 1}" for i in range(count)}).close()
        verbs = f"fake:{fabric_dir}"

    names = args.tests or list_tests(RunSpec(worlds[0], args.timeout, args.start_method, args.pythonpath))
    tests = select(names, args.k)
    if args.list:
        print("\n".join(tests))
        return 0
    if not tests:
        ap.error("no test selected")
    labels = ["gloo"] + [f"tb/{t}" for t in transports]
    report: dict = {"argv": sys.argv, "start_method": args.start_method, "pythonpath": args.pythonpath,
                    "timeout": args.timeout, "worlds": {}, "gloo_passes_we_fail": []}
    failed_unexcused = 0
    t0 = time.monotonic()
    for world in worlds:
        gloo = _load_gloo(args.reuse_gloo, world) if args.reuse_gloo else None
        table = compare(tests, world, transports, args.timeout, args.jobs, args.batch, args.start_method,
                        args.pythonpath, gloo, progress=True, verbs=verbs)
        print(format_table(world, table, labels))
        report["worlds"][str(world)] = {t: {lb: asdict(o) for lb, o in row.items()} for t, row in table.items()}
        regs = regressions(table)
        for test, label, o in regs:
            known = excuse(test, o)
            report["gloo_passes_we_fail"].append({"world": world, "column": label, "test": test,
                                                  "status": o.status, "key": o.key, "known": known,
                                                  "tail": o.tail})
            failed_unexcused += known is None
        print(f"world {world}: {len(regs)} gloo passes, we fail "
              f"({sum(1 for t, _, o in regs if excuse(t, o) is None)} not excused by KNOWN_DIFFERENCES)")
        for test, label, o in regs:
            print(f"  {label:>8} {o.status:<7} {test}: {o.key}" + (" [known]" if excuse(test, o) else ""))
    if fabric_dir is not None:
        shutil.rmtree(fabric_dir, ignore_errors=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"summary: {failed_unexcused} gloo passes, we fail (unexcused), {len(tests)} tests x "
          f"{len(worlds)} world(s) x {len(labels)} columns in {time.monotonic() - t0:.0f} s; details in {args.json}")
    return 1 if failed_unexcused else 0


if __name__ == "__main__":
    sys.exit(main())
