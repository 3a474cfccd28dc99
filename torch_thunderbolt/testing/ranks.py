"""Rank processes for tests and scripts: N copies of a rank program with the environment torchrun would
give them, each in its own session so that it and whatever it starts can be killed. A run never outlives
its timeout and never leaves a process behind, even when the test fails.

    from tests.core.programs import failures
    results = run_ranks(failures, 3, tmp_path, args=["kill_9"], env={"THUNDERBOLT_TRANSPORT": "tcp"})
    results[0].json()  # the last RESULT line rank 0 printed (testing.program.result)

A program is a module (run with `python -m`, so it can import its package), a module name, or a path to a
.py file. What tells families of runs apart is a `Setup`, not a copy of the runner: `LOOPBACK` (the
default), `SHM` (small shm rings, and no segment of the run's ranks may survive it), `HYBRID` (ranks
pretend to live two per host), `reliability_setup()` and, for emulated clusters, `testing.lab.lab_setup`.

`start_ranks` is the lower half, for scenarios that act on ranks while they run (kill one, SIGSTOP one,
cut a cable): it returns the live `Ranks`, which record when each process exited.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

from torch_thunderbolt.transport import shm_segment

from . import leftovers
from .program import WORKDIR_ENV, saved_name
from .zygote import TORCH_PRELOAD, Zygote, ZygoteProcess

REPO = Path(__file__).resolve().parents[2]

Program = Union[ModuleType, str, "os.PathLike[str]"]
Env = Mapping[str, str]

_NO_ENV: Env = MappingProxyType({})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_ranks(rank: int, world: int) -> dict[str, str]:
    """Every rank on this host, as torchrun numbers a single-node job."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}


class SegmentCheck(enum.Enum):
    """Which shared-memory segments and doorbell sockets a run must not leave behind (asserted after the
    run, whether it passed or not). Only the run's own count: other jobs on this host may be setting up."""
    NONE = "none"
    OF_RANKS = "created by the run's ranks"  # each rank writes its pid first (testing.program.register_pid)
    NEW = "appeared during the run, creator dead"  # for programs that do not register their pids


@dataclass(frozen=True)
class Setup:
    """How a family of runs differs from a plain loopback run; `but(...)` derives a variant.

    Each rank's environment is, in this order: ours without the variables starting with `strip` (the
    ranks must not inherit the test runner's THUNDERBOLT_*), MASTER_ADDR/PORT, WORLD_SIZE, PYTHONPATH
    (`pythonpath`, then this checkout), OMP_NUM_THREADS=1, then `env`, then `rank_env(rank, world)`,
    then the caller's env and per-rank env."""
    env: Env = field(default_factory=lambda: _NO_ENV)
    strip: tuple[str, ...] = ("THUNDERBOLT_", "TORCH_DISTRIBUTED")
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free loopback port for each run
    rank_env: Callable[[int, int], Env] = loopback_ranks
    wrap: Callable[[int], Sequence[str]] | None = None  # argv prefix of rank r (e.g. `ip netns exec NS`)
    pythonpath: tuple[str, ...] = ()
    segments: SegmentCheck = SegmentCheck.NONE

    def but(self, **changes: Any) -> Setup:
        return dataclasses.replace(self, **changes)

    def with_env(self, env: Env) -> Setup:
        return self.but(env=MappingProxyType({**self.env, **env}))


LOOPBACK = Setup()
# Small rings by default, so multi-slot messages and full rings are exercised.
SHM = Setup(env=MappingProxyType({"THUNDERBOLT_SHM_SLOT": "4K", "THUNDERBOLT_SHM_SLOTS": "2"}),
            segments=SegmentCheck.OF_RANKS)
# Each rank claims host rank // 2 (testing.program.pretend_hosts), so `auto` picks the hybrid transport
# exactly as it would across real hosts.
HYBRID = Setup(env=MappingProxyType({"TEST_FAKE_HOSTS": "1"}), segments=SegmentCheck.NEW)


def reliability_setup(environ: Env | None = None) -> Setup:
    """The reliability scenarios' runs. They test the TCP path (the one Thunderbolt uses): ranks on one host
    would otherwise get shared memory under THUNDERBOLT_TRANSPORT=auto; TB_RELIABILITY_TRANSPORT=shm|auto
    tests that. TB_RELIABILITY_CODE=DIR runs the ranks on another copy of the package (to try a patch side
    by side; it must hold torch_thunderbolt.testing too)."""
    environ = os.environ if environ is None else environ
    code = environ.get("TB_RELIABILITY_CODE")
    return Setup(env=MappingProxyType({"THUNDERBOLT_TRANSPORT": environ.get("TB_RELIABILITY_TRANSPORT", "tcp")}),
                 pythonpath=(code,) if code else ())


@dataclass(frozen=True)
class RankResult:
    """What one finished rank did: exit status and output."""
    rank: int
    returncode: int
    stdout: str
    stderr: str
    workdir: Path

    def tagged(self, tag: str) -> list[Any]:
        """Every `TAG {json}` line this rank printed, parsed (testing.program.emit)."""
        return _tagged(self.stdout, tag)

    def results(self) -> list[Any]:
        """Every RESULT line, in order."""
        return self.tagged("RESULT")

    def json(self) -> Any:
        """The last RESULT line; an AssertionError showing the rank's output when there is none."""
        found = _tagged(self.stdout, "RESULT", last=True)
        if not found:
            raise AssertionError(f"rank {self.rank} printed no RESULT line\nstdout:\n{self.stdout[-4000:]}\n"
                                 f"stderr:\n{self.stderr[-3000:]}")
        return found[-1]

    def saved(self) -> Any:
        """What the rank stored with testing.program.save (tensors, dicts with non-string keys ...)."""
        import torch

        return torch.load(self.workdir / saved_name(self.rank), weights_only=False)


@dataclass
class Rank:
    """One running (or finished) rank; its output goes to files so a scenario can read it while it runs."""
    rank: int
    proc: "subprocess.Popen | ZygoteProcess"
    out_path: Path
    err_path: Path
    exited_at: float | None = None  # wall clock (time.time()), comparable with what ranks print

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def tagged(self, tag: str) -> list[Any]:
        """Every `TAG {json}` line this rank printed so far, parsed."""
        return _tagged(self.stdout(), tag)


@dataclass
class Ranks:
    """The ranks of one run. Use as a context manager (or call kill_all) so that none outlives the test.
    `ranks[r]` is rank r's first process; `restart` appends replacements after them."""
    workdir: Path
    ranks: list[Rank] = field(default_factory=list)
    spawn: Callable[[int, Env, str], Rank] | None = None  # (rank, extra env, output file stem) -> a new process

    def restart(self, rank: int, env: Env = _NO_ENV) -> Rank:
        """A new process for `rank` (replacing one that died: an elastic job's new worker), with `env` over
        the rank's environment; its output goes to rank<r>.<n>.out/.err (n: its number among rank r's
        processes). It is one of `ranks` from now on, so kill_all ends it too."""
        if self.spawn is None:
            raise RuntimeError("these ranks were not started by start_ranks: nothing knows how to restart one")
        n = sum(1 for r in self.ranks if r.rank == rank)
        self.ranks.append(self.spawn(rank, env, f"rank{rank}.{n}"))
        return self.ranks[-1]

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def __iter__(self) -> Iterator[Rank]:
        return iter(self.ranks)

    def __getitem__(self, rank: int) -> Rank:
        return self.ranks[rank]

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def poll(self) -> None:
        now = time.time()
        for r in self.ranks:
            if r.exited_at is None and r.proc.poll() is not None:
                r.exited_at = now

    def wait(self, deadline: float, step: float = 0.02) -> bool:
        """Wait (wall clock `deadline`) for every rank to exit; False if some are still running."""
        while True:
            self.poll()
            if not self.alive():
                return True
            if time.time() >= deadline:
                return False
            time.sleep(step)

    def kill_all(self) -> None:
        """SIGKILL each live rank's whole session (ranks lead their own), then reap them. SIGCONT first: a
        SIGSTOPped rank must not outlive us."""
        for r in self.ranks:
            if r.proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(r.proc.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        for r in self.ranks:
            try:
                r.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.poll()

    def results(self) -> list[RankResult]:
        return [RankResult(r.rank, r.proc.returncode if r.proc.returncode is not None else -1, r.stdout(),
                           r.stderr(), self.workdir) for r in self.ranks]


def program_argv(program: Program) -> list[str]:
    """The interpreter's arguments for `program`: a module (object or dotted name) runs with -m, a path as
    a script."""
    if isinstance(program, ModuleType):
        return ["-m", program.__name__]
    text = os.fspath(program)
    if isinstance(program, os.PathLike) or text.endswith(".py") or os.sep in text:
        return [text]
    return ["-m", text]


def start_zygote(setup: Setup = LOOPBACK, preload: Sequence[str] = TORCH_PRELOAD) -> Zygote:
    """A zygote (testing.zygote) for ranks of `setup`: started with the environment they share (PYTHONPATH,
    OMP_NUM_THREADS=1, `setup.env`), so what it preloads is what they would import."""
    return Zygote(preload, _shared_env(setup, {}))


def _shared_env(setup: Setup, run: Env) -> dict[str, str]:
    """What every rank of `setup` gets (and its zygote): ours without `strip`, PYTHONPATH, OMP_NUM_THREADS=1,
    then `run` (the run's own variables), then `setup.env`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(setup.strip)}
    env.update({"PYTHONPATH": os.pathsep.join([*setup.pythonpath, str(REPO)]), "OMP_NUM_THREADS": "1", **run})
    env.update(setup.env)
    return env


def start_ranks(program: Program, world: int, workdir: Path, *, args: Sequence[str] = (),
                env: Env | None = None, setup: Setup = LOOPBACK,
                per_rank: Mapping[int, Env] | None = None, zygote: Zygote | None = None) -> Ranks:
    """Start `world` ranks of `program` (with `args`) in `workdir`, their working directory, where their
    output goes (rank<r>.out/.err). The caller must kill_all the result (or use it in a `with`). `zygote`:
    fork them from it (testing.zygote: no interpreter start, no torch import) instead of starting
    interpreters; its PYTHONPATH is the ranks' (it was started with it)."""
    if zygote is not None and setup.wrap is not None:
        raise ValueError("ranks forked from a zygote cannot be wrapped (setup.wrap): start them as processes")
    workdir.mkdir(parents=True, exist_ok=True)
    base = _shared_env(setup, {
        "MASTER_ADDR": setup.master_addr,
        "MASTER_PORT": str(setup.master_port if setup.master_port is not None else free_port()),
        "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1", WORKDIR_ENV: str(workdir)})
    argv = [sys.executable, *program_argv(program), *args]

    def spawn(r: int, extra: Env, stem: str) -> Rank:
        e = {**base, **setup.rank_env(r, world), **(env or {}), **(per_rank or {}).get(r, {}), **extra}
        out, err = workdir / f"{stem}.out", workdir / f"{stem}.err"
        if zygote is not None:
            return Rank(r, ZygoteProcess(zygote, zygote.spawn(argv[1:], e, workdir, out, err)), out, err)
        with open(out, "w") as fo, open(err, "w") as fe:
            p = subprocess.Popen([*(setup.wrap(r) if setup.wrap else []), *argv], env=e, stdout=fo, stderr=fe,
                                 start_new_session=True, cwd=workdir)
        return Rank(r, p, out, err)

    ranks = Ranks(workdir, spawn=spawn)
    try:
        for r in range(world):
            ranks.ranks.append(spawn(r, _NO_ENV, f"rank{r}"))
    except BaseException:
        ranks.kill_all()
        raise
    return ranks


def run_ranks(program: Program, world: int, workdir: Path, *, args: Sequence[str] = (), env: Env | None = None,
              setup: Setup = LOOPBACK, per_rank: Mapping[int, Env] | None = None, timeout: float = 60.0,
              expect_ok: bool = True, zygote: Zygote | None = None) -> list[RankResult]:
    """Run `world` ranks of `program` to the end; every process is killed when `timeout` seconds run out
    (an AssertionError with each rank's stderr). With `expect_ok`, every rank must exit 0. `zygote`: as
    for start_ranks."""
    with _segment_check(setup.segments, workdir):
        with start_ranks(program, world, workdir, args=args, env=env, setup=setup, per_rank=per_rank,
                         zygote=zygote) as ranks:
            if not ranks.wait(time.time() + timeout):
                ranks.kill_all()
                detail = "\n".join(f"--- rank {r.rank} stderr:\n{r.stderr()[-2000:]}" for r in ranks)
                raise AssertionError(f"ranks hung (killed after {timeout}s)\n{detail}")
        results = ranks.results()
    if expect_ok:
        for res in results:
            assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}\n{res.stderr[-4000:]}"
    return results


def run_torchrun(program: Program, nproc: int, workdir: Path, *, args: Sequence[str] = (), env: Env | None = None,
                 torchrun_args: Sequence[str] = (), timeout: float = 60.0) -> RankResult:
    """`nproc` ranks of `program` on this host started by torchrun (`python -m torch.distributed.run`), as a
    user's job is, with torchrun's own store on a free --master-port (`torchrun_args` come before the
    program). The workers' output is torchrun's: the result is torchrun's, and each worker's RESULT lines
    are among its `results()`. torchrun starts every worker in a session of its own, so a worker must
    register its pid first (testing.program.register_pid): whatever happens, torchrun's session and every
    registered worker's are killed at the end, and at `timeout` (an AssertionError with the output)."""
    for old in workdir.glob("pid_*"):  # an earlier run's workers in the same directory
        old.unlink()
    argv = ["--nproc-per-node", str(nproc), "--master-port", str(free_port()), *torchrun_args,
            *program_argv(program), *args]
    with start_ranks("torch.distributed.run", 1, workdir, args=argv, env=env) as ranks:
        try:
            finished = ranks.wait(time.time() + timeout)
        finally:
            for pid in rank_pids(workdir):
                for kill in (os.killpg, os.kill):  # a worker leads its own session
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        if not finished:
            ranks.kill_all()
            raise AssertionError(f"torchrun hung (killed after {timeout}s)\nstdout:\n{ranks[0].stdout()[-3000:]}\n"
                                 f"stderr:\n{ranks[0].stderr()[-3000:]}")
    return ranks.results()[0]


def shm_snippet(body: str, workdir: Path) -> Path:
    """A rank program for the SHM setup made from the text of its body, for tests whose program is still a
    string: it runs after testing.program.shm_snippet_namespace() (r, w, t, store, result ...). New
    programs are modules."""
    path = workdir / "shm_snippet.py"
    path.write_text("from torch_thunderbolt.testing.program import shm_snippet_namespace\n"
                    "globals().update(shm_snippet_namespace())\n" + textwrap.dedent(body))
    return path


def rank_pids(workdir: Path) -> set[int]:
    """Pids of the ranks of the last run in `workdir` that registered theirs (testing.program.register_pid)."""
    texts = [p.read_text().strip() for p in workdir.glob("pid_*")]
    return {int(t) for t in texts if t.isdigit()}


@contextlib.contextmanager
def _segment_check(kind: SegmentCheck, workdir: Path) -> Iterator[None]:
    """Asserts, after the run (passed or not), that it left none of the segments `kind` covers; removes
    whatever a dead creator left either way, so that one failing test does not fail the next ones."""
    if kind is SegmentCheck.NONE:
        yield
        return
    before: set[str] = set()
    if kind is SegmentCheck.OF_RANKS:
        for old in workdir.glob("pid_*"):  # a previous run's ranks in the same directory
            old.unlink()
    else:
        before = leftovers.segments_and_doorbells()
    try:
        yield
    finally:
        if kind is SegmentCheck.OF_RANKS:
            # Segments are unlinked right after set-up: even kill -9 leaves none.
            left = sorted(leftovers.segments_and_doorbells(rank_pids(workdir)))
        else:
            left = leftovers.new_with_dead_creator(before)
        shm_segment.cleanup_stale_segments()
        assert not left, f"shared-memory leftovers after the run: {left}"


def _tagged(text: str, tag: str, last: bool = False) -> list[Any]:
    prefix = tag + " "
    lines = [ln[len(prefix):] for ln in text.splitlines() if ln.startswith(prefix)]
    return [json.loads(ln) for ln in (lines[-1:] if last else lines)]
