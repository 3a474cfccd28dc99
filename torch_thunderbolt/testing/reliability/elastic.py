"""Elastic restarts under torchrun: several torchrun agents (one per host: pretended on loopback, or the
emulated Macs of a lab) run examples/elastic_train.py with `--nnodes=MIN:MAX --max-restarts=N
--rdzv-backend=c10d`; a test kills one agent's worker, a whole agent, or cuts a host's cables mid-training,
and the agents that remain restart, re-form with the ranks left and resume from the last checkpoint.
Shared by tests/reliability/test_elastic.py, tests/lab_cluster/test_lab_elastic.py and
scripts/reliability/elastic_restart.py (the figures).

Every agent runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see SHARED_STORE_OFF), as the documented command
(docs/fault-tolerance.md) does.
The c10d rendezvous store lives in one agent (`is_host=true`: agent 0 here, the first Mac on real ones):
that agent must stay, so the tests take another. Each agent is given `--local-addr` (its host's address the
others reach): torchrun otherwise tells the workers its host name, which on emulated hosts (one name for
all) and on Macs (a name that may resolve to Wi-Fi) is not the Thunderbolt address.

The example prints `ELASTIC {...}` lines (start, first_step, checkpoint, done) with wall-clock times, so
the time from a kill to the first step after the restart is read from them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

from torch_thunderbolt.testing.ranks import REPO

EXAMPLE = REPO / "examples" / "elastic_train.py"
TAG = "ELASTIC "
# torch 2.13's c10d rendezvous keeps one worker store for every round and the workers add no prefix per
# round, so a restarted group may read the previous round's records (gloo's set-up fails the same way):
# with this set, each round's rank 0 serves a new store (docs/fault-tolerance.md).
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# A lost agent leaves the rendezvous once it missed this many heartbeats this many seconds apart; until then
# the others cannot re-form (torch's default, 5 s x 3, makes that wait 15 s).
KEEP_ALIVE = (2, 3)
LAB_RDZV_PORT = 29612  # inside the lab's namespaces: never collides with the host's ports


@dataclass(frozen=True)
class Schedule:
    """The training the job runs (the example's arguments). The global batch must divide by every world
    size the job may have."""
    steps: int = 40
    every: int = 5
    pace: float = 0.25
    global_batch: int = 12

    def args(self) -> list[str]:
        return ["--steps", str(self.steps), "--every", str(self.every), "--pace", str(self.pace),
                "--global-batch", str(self.global_batch)]


@dataclass
class Agent:
    index: int
    proc: subprocess.Popen
    out_path: Path
    seen_pids: set[int] = field(default_factory=set)  # its workers, remembered so none outlives the job

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line[len(TAG):]) for line in self.output().splitlines() if line.startswith(TAG)]

    def workers(self) -> list[int]:
        """The agent's descendant processes now (its workers), remembered in `seen_pids`."""
        try:
            found = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        self.seen_pids.update(found)
        return found


class ElasticJob:
    """`agents` torchrun agents, one per host, with 1 worker each, run as a context manager: every agent
    and every worker it started is killed when the block ends, whatever happened.

    `wrap(i)`: the argv prefix that runs agent i on its host (`ip netns exec ...` in a lab; none on one
    host); `env_of(i)`: its extra environment; `local_addr(i)`: the address its host is reached at."""

    def __init__(self, workdir: Path, agents: int, endpoint: tuple[str, int], *, min_nodes: int,
                 schedule: Schedule = Schedule(), max_restarts: int = 3, last_call: float = 3.0,
                 keep_alive: tuple[int, int] = KEEP_ALIVE,
                 wrap: Callable[[int], Sequence[str]] | None = None,
                 env_of: Callable[[int], Mapping[str, str]] | None = None,
                 local_addr: Callable[[int], str] | None = None, env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.count = agents
        self.endpoint = endpoint
        self.min_nodes = min_nodes
        self.schedule = schedule
        self.max_restarts = max_restarts
        self.last_call = last_call
        self.keep_alive = keep_alive
        self.wrap = wrap or (lambda i: [])
        self.env_of = env_of or (lambda i: {})
        self.local_addr = local_addr or (lambda i: endpoint[0])
        self.env = dict(env or {})
        self.agents: list[Agent] = []
        self.checkpoints = workdir / "ckpt"
        self.final = workdir / "final.pt"

    def argv(self, i: int) -> list[str]:
        """Agent i's command line: the one docs/fault-tolerance.md gives for each Mac (same options in the
        same order; tests/reliability/test_elastic.py compares them), with this job's values."""
        host, port = self.endpoint
        every, attempts = self.keep_alive
        conf = (f"join_timeout=120,last_call_timeout={self.last_call:g},close_timeout=10,"
                f"keep_alive_interval={every},keep_alive_max_attempt={attempts},is_host={str(i == 0).lower()}")
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.min_nodes}:{self.count}",
                "--nproc-per-node=1", f"--max-restarts={self.max_restarts}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{port}", "--rdzv-id=elastic-test", f"--rdzv-conf={conf}",
                f"--local-addr={self.local_addr(i)}", str(EXAMPLE), "--checkpoint-dir", str(self.checkpoints),
                "--out", str(self.final), *self.schedule.args()]

    def options(self, i: int) -> list[str]:
        """torchrun's options in agent i's command line (before the script), as `--name=value` words."""
        argv = self.argv(i)
        return argv[argv.index("torch.distributed.run") + 1:argv.index(str(EXAMPLE))]

    def __enter__(self) -> ElasticJob:
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("THUNDERBOLT_", "TORCH", "MASTER_", "GLOO_", "LOGLEVEL"))}
        base.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")])),
                     "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",
                     SHARED_STORE_OFF: "1", **self.env})
        try:
            for i in range(self.count):
                out = self.workdir / f"agent{i}.log"
                with open(out, "w") as fo:
                    proc = subprocess.Popen([*self.wrap(i), *self.argv(i)], env={**base, **self.env_of(i)},
                                            stdout=fo, stderr=subprocess.STDOUT, cwd=self.workdir,
                                            start_new_session=True)
                self.agents.append(Agent(i, proc, out))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """SIGKILL every agent's session and every worker any agent ever had, then reap the agents."""
        for a in self.agents:
            a.workers()
        for a in self.agents:
            _kill(a.proc.pid, session=True)
            for pid in a.seen_pids:
                _kill(pid, session=True)
        for a in self.agents:
            try:
                a.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # -- what the job printed ------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """Every ELASTIC line of every agent's workers, in time order (checkpoint and done lines carry none)."""
        found = [dict(e, agent=a.index) for a in self.agents for e in a.events()]
        return sorted(found, key=lambda e: e.get("time", 0.0))

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The first event satisfying `predicate` within `timeout` seconds (None: none came)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for a in self.agents:
                a.workers()  # remember every worker while its agent lives
                for e in a.events():
                    if predicate(e):
                        return dict(e, agent=a.index)
            time.sleep(0.1)
        return None

    def wait(self, agents: Sequence[int], timeout: float) -> bool:
        """Whether agents `agents` all exited within `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for a in self.agents:
                a.workers()
            if all(self.agents[i].proc.poll() is not None for i in agents):
                return True
            time.sleep(0.2)
        return False

    # -- faults --------------------------------------------------------------------------------------------
    def kill_agent(self, i: int) -> float:
        """SIGKILL agent i and its worker (a host that vanished); the wall-clock time of the kill."""
        a = self.agents[i]
        workers = a.workers()
        at = time.time()
        _kill(a.proc.pid, session=True)
        for pid in workers:
            _kill(pid, session=True)
        return at

    def kill_worker(self, i: int) -> float:
        """SIGKILL agent i's worker only (a rank that crashed; its agent lives and restarts it)."""
        workers = self.agents[i].workers()
        if not workers:
            raise AssertionError(f"agent {i} has no worker to kill\n{self.agents[i].output()[-3000:]}")
        at = time.time()
        for pid in workers:
            _kill(pid, session=False)
        return at

    def failure_seen(self, after: float) -> float | None:
        """When the first agent saw its worker group fail or its membership change after wall-clock time
        `after` (torchrun's INFO log lines), or None."""
        return self._first_log_line(after, ("Worker group FAILED", "new nodes from group_rank"))

    def workers_started(self, after: float) -> float | None:
        """When the first agent started new workers after `after` (its rendezvous was complete), or None."""
        return self._first_log_line(after, ("Starting worker group",))

    def _first_log_line(self, after: float, markers: Sequence[str]) -> float | None:
        seen = [t for a in self.agents for line in a.output().splitlines() if any(m in line for m in markers)
                for t in [_log_time(line, after)] if t is not None and t >= after]
        return min(seen, default=None)

    def report(self) -> str:
        return "\n".join(f"--- agent {a.index} (exit {a.proc.poll()}):\n{_tail(a.output())}" for a in self.agents)


def lab_job(lab: Any, workdir: Path, *, schedule: Schedule = Schedule(), port: int = LAB_RDZV_PORT,
            **kw: Any) -> ElasticJob:
    """An ElasticJob with one agent per emulated Mac of `lab` (a lab.view.Lab), inside the Mac's namespace,
    on its cables (THUNDERBOLT_IFNAME), reached at its first cable address; the rendezvous store on the first
    Mac; MIN one Mac fewer than there are."""
    hosts = lab.hosts()
    return ElasticJob(workdir, len(hosts), (lab.addresses(hosts[0])[0], port), min_nodes=len(hosts) - 1,
                      schedule=schedule, wrap=lambda i: lab.exec_argv(hosts[i], []),
                      env_of=lambda i: {"THUNDERBOLT_IFNAME": lab.ifname_env(hosts[i])},
                      local_addr=lambda i: lab.addresses(hosts[i])[0], **kw)


def cut_cables(lab: Any, host: int) -> float:
    """Every cable of the lab's Mac `host` down at its end (the Mac is alive but unreachable); the
    wall-clock time of the cut."""
    name = lab.hosts()[host]
    at = time.time()
    for dev in lab.ifnames(name):
        subprocess.run(lab.exec_argv(name, ["ip", "link", "set", dev, "down"]), check=True)
    return at


def restart_figures(events: Sequence[dict[str, Any]], killed_at: float,
                    job: ElasticJob | None = None) -> dict[str, Any]:
    """From the events after a kill at `killed_at`: the restarted world, the step it resumed from, and the
    seconds from the kill to the restarted workers' start (group made, weights loaded) and to their first
    step; with `job`, also to an agent seeing the loss and to the new workers' launch (rendezvous done)."""
    after = [e for e in events if e.get("time", 0.0) > killed_at]
    starts = [e for e in after if e["event"] == "start"]
    firsts = [e for e in after if e["event"] == "first_step"]
    if not starts or not firsts:
        return {}
    seen = {}
    for key, at in (("to_failure_seen_s", job.failure_seen(killed_at) if job else None),
                    ("to_launch_s", job.workers_started(killed_at) if job else None)):
        if at is not None:
            seen[key] = round(at - killed_at, 2)
    return {"world": starts[0]["world"], "from_step": starts[0]["from_step"], "restart": starts[0]["restart"], **seen,
            "to_start_s": round(max(e["time"] for e in starts if e["world"] == starts[0]["world"]) - killed_at, 2),
            "to_first_step_s": round(min(e["time"] for e in firsts) - killed_at, 2)}


def reference_weights(workdir: Path, schedule: Schedule) -> dict[str, Any]:
    """The weights the job must end with: the example's --reference mode, one process without
    torch.distributed, the whole global batch of each of the same steps."""
    import torch

    out = workdir / f"reference-{schedule.steps}.pt"
    subprocess.run([sys.executable, str(EXAMPLE), "--reference", "--out", str(out), "--steps", str(schedule.steps),
                    "--global-batch", str(schedule.global_batch)], check=True, capture_output=True, timeout=300)
    return torch.load(out, weights_only=True)


def max_relative_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Over every tensor of two state dicts: max |a - b| / max |b| (inf if their keys or shapes differ)."""
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in a)


def _log_time(line: str, near: float) -> float | None:
    """The wall-clock time of a torchrun log line ("I1205 12:39:38.245000 ..."; local time, no year: the
    year of `near`)."""
    import datetime

    head = line.split(" ", 2)
    if len(head) < 3 or len(head[0]) != 5 or not head[0][1:].isdigit():
        return None
    year = datetime.datetime.fromtimestamp(near).year
    try:
        return datetime.datetime.strptime(f"{year}{head[0][1:]} {head[1]}", "%Y%m%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def _kill(pid: int, session: bool) -> None:
    for kill in ((os.killpg, os.kill) if session else (os.kill,)):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(text: str, lines: int = 40) -> str:
    keep = [ln for ln in text.splitlines() if "api.py:553]" not in ln and "launcher/api.py" not in ln]
    return "\n".join(keep[-lines:])
