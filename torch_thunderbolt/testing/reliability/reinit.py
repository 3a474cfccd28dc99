"""Abort and re-init leave nothing behind: the scenario shared by the CI test (tests/reliability/test_reinit.py)
and the long runs (scripts/reliability/reinit_cycles.py).

Each rank process runs cycles of init_process_group -> a round of ops checked exact -> destroy or abort
(programs/reinit.py); every `kill_every`-th cycle one rank kills itself after its round, its peers must each
get a PeerLostError naming it, end their group, and start the next cycle with a replacement process this
driver starts for the dead rank (as an elastic agent would). After every cycle each process reports what it
holds: file descriptors, threads, shared memory, and on the fake verbs fabric its queue pairs, memory
regions, protection domains, contexts and completion queues. After a warm-up none of these may grow.

The ranks rendezvous through a TCPStore this driver serves (one prefix per cycle), so that no rank's death
takes the store with it. Kinds of link: `tcp`, `shm` (3 ranks on this host each), `hierarchical` (4 ranks
pretending to be 2 hosts x 2: shared memory within a host, TCP across) and `rdma` (3 ranks over a fake verbs
fabric, one device each); and `lab`: 3 emulated Macs in a ring (network namespaces, root only), one rank
each over TCP, the store served inside the first Mac's namespace by a process of its own.
"""
from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

from torch_thunderbolt.testing import leftovers
from torch_thunderbolt.testing.ranks import HYBRID, LOOPBACK, SHM, Rank, SegmentCheck, Setup, start_ranks
from torch_thunderbolt.transport import shm_segment

from .programs import reinit as reinit_program

KINDS = ("tcp", "shm", "hierarchical", "rdma")
LAB_KINDS = ("lab",)  # needs root (network namespaces): kept out of KINDS, which the CI test runs everywhere
ENDS = ("destroy", "abort", "group_abort")
# What must not grow after the warm-up: counts of the process, and of each kind of fabric object.
COUNTERS = ("fds", "threads", "shm", "shm_maps", "objects")
WARMUP = 2  # cycles of each process not compared (the first group makes what every later one re-uses)
# The link kind each setup must have given the default group (the transport's `kind`).
EXPECTED_KIND = {"tcp": "tcp", "shm": "shm", "hierarchical": "shm+tcp", "rdma": "rdma", "lab": "tcp"}
LAB_STORE_PORT = 29571  # the store's port in the first emulated Mac's namespace (a fresh one: always free)


def world_of(kind: str) -> int:
    return 4 if kind == "hierarchical" else 3


def victims_of(kind: str) -> tuple[int, ...]:
    """Whom kill cycles take, in turn. Rank 0 (and rank 2 of the pretended second host) live through every
    cycle, so at least one process per host is measured over the whole run."""
    return (3, 1) if kind == "hierarchical" else (1, 2)


def plan(kind: str, cycles: int, kill_every: int) -> list[dict[str, Any]]:
    """Per cycle: how it ends (destroy, abort, group_abort in turn) and its victim (every `kill_every`-th
    cycle; 0: none)."""
    victims = victims_of(kind)
    out = []
    kills = 0
    for c in range(cycles):
        victim = None
        if kill_every and (c + 1) % kill_every == 0:
            victim = victims[kills % len(victims)]
            kills += 1
        out.append({"end": ENDS[c % len(ENDS)], "victim": victim})
    return out


def setup_of(kind: str) -> Setup:
    if kind == "tcp":
        return LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "tcp"})
    if kind == "shm":
        return SHM.but(segments=SegmentCheck.NONE).with_env({"THUNDERBOLT_TRANSPORT": "shm"})
    if kind == "hierarchical":
        return HYBRID.but(segments=SegmentCheck.NONE).with_env({"THUNDERBOLT_TRANSPORT": "auto"})
    if kind == "rdma":
        return LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "rdma"})
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS + LAB_KINDS)}")


@dataclass
class Process:
    """One rank process of the run and what it reported."""
    rank: int
    first: int  # the first cycle it took part in
    returncode: int
    cycles: list[dict[str, Any]]  # its CYCLE records
    start: dict[str, Any]  # its START record (what it held before its first group)
    failed: list[dict[str, Any]]  # its FAILED records
    stderr: str


@dataclass
class ReinitRun:
    kind: str
    plan: list[dict[str, Any]]
    processes: list[Process] = field(default_factory=list)
    leftover_segments: list[str] = field(default_factory=list)
    left_open: dict[str, int] = field(default_factory=dict)  # fake-fabric objects freed by a provider's close
    seconds: float = 0.0

    def survivors(self, min_cycles: int) -> Iterator[Process]:
        """The processes that finished at least `min_cycles` cycles (the ones measured for growth)."""
        return (p for p in self.processes if len(p.cycles) >= min_cycles)

    def growth(self, warmup: int = WARMUP) -> list[str]:
        """Every count that rose after a process's warm-up (over its value at the end of the warm-up), and
        every fabric object still held after a cycle."""
        found = []
        for p in self.survivors(warmup + 1):
            base = p.cycles[warmup - 1]["held"]
            for rec in p.cycles[warmup:]:
                held = rec["held"]
                for k in COUNTERS:
                    if held[k] > base[k]:
                        found.append(f"rank {p.rank} (from cycle {p.first}): {k} {base[k]} after cycle "
                                     f"{p.cycles[warmup - 1]['cycle']}, {held[k]} after cycle {rec['cycle']}"
                                     + (f"; fds {base['fd_kinds']} -> {held['fd_kinds']}" if k == "fds" else "")
                                     + (f"; threads {base['py_threads']} -> {held['py_threads']}"
                                        if k == "threads" else ""))
            for rec in p.cycles:
                if any(rec["held"]["fabric"].values()):
                    found.append(f"rank {p.rank}: after cycle {rec['cycle']} still holds {rec['held']['fabric']}")
        return found

    def problems(self) -> list[str]:
        """Everything that went wrong besides growth: a process that failed, a result that was not exact, a
        kill that some survivor did not see as a PeerLostError naming the victim, a cycle some rank missed,
        another kind of link than the setup's, segments left behind, verbs objects left to the provider."""
        out = []
        world = world_of(self.kind)
        for p in self.processes:
            victim_cycles = [c for c in range(p.first, len(self.plan)) if self.plan[c]["victim"] == p.rank]
            expected_rc = -signal.SIGKILL if victim_cycles else 0
            if p.returncode != expected_rc:
                out.append(f"rank {p.rank} (from cycle {p.first}) exited {p.returncode}, expected {expected_rc}: "
                           f"{p.failed or p.stderr[-1500:]}")
            for rec in p.cycles:
                if rec["bad"]:
                    out.append(f"rank {p.rank} cycle {rec['cycle']}: not exact: {rec['bad']}")
                if rec["kind"] != EXPECTED_KIND[self.kind]:
                    out.append(f"rank {p.rank} cycle {rec['cycle']}: link kind {rec['kind']}")
                victim = self.plan[rec["cycle"]]["victim"]
                lost = rec["lost"]
                if victim is not None and (lost is None or lost["type"] != "PeerLostError" or lost["peer"] != victim):
                    out.append(f"rank {p.rank} cycle {rec['cycle']}: rank {victim} was killed, got {lost}")
        for c, step in enumerate(self.plan):
            done = sorted(p.rank for p in self.processes for rec in p.cycles if rec["cycle"] == c)
            want = sorted(r for r in range(world) if r != step["victim"])
            if done != want:
                out.append(f"cycle {c}: finished by ranks {done}, expected {want}")
        if any(self.left_open.values()):
            out.append(f"verbs objects never destroyed, freed only when their provider closed: {self.left_open}")
        if self.leftover_segments:
            out.append(f"shared-memory segments or doorbells of dead processes left: {self.leftover_segments}")
        return out

    def summary(self) -> dict[str, Any]:
        """Per counter, over the processes that lived through the whole run: its value after the warm-up
        and at the end (min-max over those processes), and the cycles' seconds."""
        whole = [p for p in self.processes if p.first == 0 and len(p.cycles) == len(self.plan)]
        out: dict[str, Any] = {"kind": self.kind, "cycles": len(self.plan),
                               "kills": sum(1 for s in self.plan if s["victim"] is not None),
                               "processes": len(self.processes), "seconds": round(self.seconds, 1)}
        for k in (*COUNTERS, "rss_mb"):
            after = [p.cycles[min(WARMUP, len(p.cycles)) - 1]["held"][k] for p in whole]
            last = [p.cycles[-1]["held"][k] for p in whole]
            out[k] = {"after_warmup": [min(after), max(after)] if after else None,
                      "end": [min(last), max(last)] if last else None}
        fabric = [rec["held"]["fabric"] for p in self.processes for rec in p.cycles]
        if any(fabric):
            out["fabric_max"] = {k: max(f.get(k, 0) for f in fabric) for k in fabric[0]}
        secs = sorted(rec["seconds"] for p in whole for rec in p.cycles)
        if secs:
            out["cycle_seconds"] = {"min": secs[0], "median": secs[len(secs) // 2], "max": secs[-1]}
        return out


def run_cycles(kind: str, cycles: int, workdir: Path, *, kill_every: int = 4, timeout: float = 600.0,
               group_timeout: int = 120) -> ReinitRun:
    """`cycles` cycles on `kind`, a kill every `kill_every`-th; every process is killed by `timeout`
    (an AssertionError with the ranks' output)."""
    import torch.distributed as dist

    from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric

    world = world_of(kind)
    steps = plan(kind, cycles, kill_every)
    run = ReinitRun(kind, steps)
    env = {"TB_PLAN": json.dumps(steps), "TB_TIMEOUT": str(group_timeout),
           "THUNDERBOLT_CONNECT_TIMEOUT": str(group_timeout)}
    before = leftovers.segments_and_doorbells()
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            if kind in LAB_KINDS:
                setup = stack.enter_context(_lab_store(world, group_timeout))
            else:
                store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=group_timeout),
                                      wait_for_workers=False)
                setup = setup_of(kind).but(master_port=store.port)
            devices = {f"rdma_fake{i}": f"10.201.0.{i + 1}" for i in range(world)}
            fabric = stack.enter_context(fake_fabric(workdir / "fabric", devices)) if kind == "rdma" else None
            if fabric is not None:
                env.update(fabric_env(fabric))
            with start_ranks(reinit_program, world, workdir / "ranks", args=["cycles"], env=env,
                             setup=setup) as ranks:
                _drive(ranks, steps, world, time.monotonic() + timeout)
                run.processes = [_process(r) for r in ranks]
            if fabric is not None:
                run.left_open = {d.name: fabric.left_open(d.name) for d in fabric.devices}
    finally:
        run.seconds = time.monotonic() - t0
        run.leftover_segments = leftovers.new_with_dead_creator(before)
        shm_segment.cleanup_stale_segments()
    return run


@contextlib.contextmanager
def _lab_store(world: int, group_timeout: int) -> Iterator[Setup]:
    """`world` emulated Macs in a ring and a rendezvous store served inside the first one's namespace (the
    ranks, each in its own namespace, cannot reach this process's loopback): the setup of their ranks."""
    import subprocess
    import sys

    from torch_thunderbolt.testing.lab import lab_session, lab_setup

    with lab_session(world, "ring", cc="reno") as lab:
        host = lab.hosts()[0]
        code = ("import sys, time, datetime, torch.distributed as d; "
                "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), True, "
                "timeout=datetime.timedelta(seconds=int(sys.argv[4])), wait_for_workers=False); "
                "print('up', flush=True); time.sleep(1e9)")
        server = subprocess.Popen(lab.exec_argv(host, [sys.executable, "-c", code, lab.addresses(host)[0],
                                                       str(LAB_STORE_PORT), str(world), str(group_timeout)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if server.stdout is None or server.stdout.readline().strip() != "up":
                raise AssertionError(f"the lab's store did not start: {server.stderr.read() if server.stderr else ''}")
            yield lab_setup(lab).but(master_port=LAB_STORE_PORT)
        finally:
            server.kill()
            server.wait()


def _drive(ranks: Any, steps: list[dict[str, Any]], world: int, deadline: float) -> None:
    """Start a replacement for each victim once it died, until every process has exited; at the first
    process that failed otherwise, or at `deadline`, stop every process (an AssertionError)."""
    deaths = {r: [c for c, s in enumerate(steps) if s["victim"] == r] for r in range(world)}
    current: dict[int, Rank] = {r: ranks[r] for r in range(world)}
    while True:
        ranks.poll()
        for r, proc in list(current.items()):
            rc = proc.returncode
            if rc is None:
                continue
            if rc == -signal.SIGKILL and deaths[r]:
                died_in = deaths[r].pop(0)
                if died_in + 1 < len(steps):
                    current[r] = ranks.restart(r, {"TB_FIRST": str(died_in + 1)})
                    continue
            del current[r]
            if rc != 0 and rc != -signal.SIGKILL:
                ranks.kill_all()  # its peers would wait for it until their timeout
                return
        if not current:
            return
        if time.monotonic() > deadline:
            ranks.kill_all()
            detail = "\n".join(f"--- rank {p.rank} ({p.out_path.name}) stderr:\n{p.stderr()[-1500:]}" for p in ranks)
            raise AssertionError(f"re-init cycles hung (killed after the run's timeout)\n{detail}")
        time.sleep(0.1)


def _process(r: Rank) -> Process:
    start = r.tagged("START")
    first = start[0]["first"] if start else -1
    return Process(r.rank, first, r.returncode if r.returncode is not None else -1, r.tagged("CYCLE"),
                   start[0] if start else {}, r.tagged("FAILED"), r.stderr())
