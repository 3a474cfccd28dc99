"""A randomized fault campaign against shrink, split and the group agreement, through torch's public API
only. Each trial is described by its seed alone (`make_trial`): a world of 3 or 4 ranks, a kind of link, and a
script of steps drawn at random: exact-checked collectives (all_reduce, broadcast, all_gather, a ring of
send/recv) on the default group or a subgroup, new_group, torch's split_group, shrink_group of the default
group or of a subgroup, a few DDP steps; and faults at random points: SIGKILL, SIGSTOP for less or more than
the group's timeout, a rank that sleeps past the timeout, a rank that joins a recovery's shrink late, and
a second fault while the survivors shrink (so that they call shrink_group again, with the ranks they now
know are lost, as docs/fault-tolerance.md advises).

The ranks run programs/campaign.py (which says what each records and how it recovers). This runner starts
them (testing.ranks.start_ranks) around a rendezvous store of its own (so a killed rank takes no store with
it), reads their records as they run, and injects each kill or stop `delay` seconds after letting its
victim go on from the step it waits at (or the survivors from the start of their shrink), so that it lands
at a moment of the ranks' own progress. A rank silent for three group timeouts plus HANG_MARGIN (when it is
not stopped) hangs: every rank prints its threads' stacks to its stderr and is killed. Then `judge`:

- wrong results: an op that returned success with any value other than the exact one, or on a group shrunk
  away from it; wrong views: a group whose torch view (`get_process_group_ranks`, `get_rank`) is not the
  one asked for;
- misblames: a rank never faulted that gets an error blaming (PeerLostError's peer, CollectiveTimeout's
  ranks, PeerAbortedError's peer) a rank not faulted before that error, unless the blamed rank was itself
  failing then because of a faulted one (a blame one group away from the culprit: counted apart);
- undocumented errors: any error but PeerLostError, CollectiveTimeout, MismatchError, BackendClosedError,
  PeerAbortedError (and torch's store timeout inside new_group/split_group);
- divergent views: healthy ranks that shrank the same group and got different groups, or finished with
  different ones; the group id each got is compared too, as a diagnostic (`gid_splits`);
- hangs, crashes (a rank exiting otherwise than by its program's end or the runner's kill), healthy ranks
  that did not finish, a trial that could not start, and anything left behind (processes, listening
  sockets, shared-memory segments and doorbells of the trial's ranks).

Steps that torch 2.13 itself cannot do right are left out (SKIP, counted): split_group after a shrink of
the default group, and groups torch would name like a live one.

`run_campaign` runs trials and sums them up (`Summary`); `python -m torch_thunderbolt.testing.reliability.campaign
--trials N --seed S [--json F]` runs them from the command line (trial k has seed S+k, so a failing one
reruns alone with `--trials 1 --seed S+k`; timing decides much of what a seed does, so it may not fail
again).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Sequence

from torch_thunderbolt.testing import leftovers
from torch_thunderbolt.testing.ranks import (HYBRID, LOOPBACK, SHM, Ranks, SegmentCheck, Setup, rank_pids, start_ranks,
                                             start_zygote)
from torch_thunderbolt.testing.zygote import Zygote
from torch_thunderbolt.transport import shm_segment

from .programs import campaign as campaign_program

TRANSPORTS = ("tcp", "shm", "auto", "hybrid")  # hybrid: `auto` with ranks pretending to be 2 per host
WORLDS = (3, 4)
OPS = ("all_reduce", "broadcast", "all_gather", "p2p")
SIZES = (5, 1000, 70_003)  # one message, a few, many chunks
TIMEOUT = 4.0  # the group's timeout (seconds): trials are quick, faults show at once
# SIGSTOP / sleep lengths, in group timeouts: a long one outlasts the status all_reduce's timeout (2 group
# timeouts), so the others give up on the victim, not on a member held up by it in a subgroup's op
STOP_SHORT, STOP_LONG = 0.25, 3.0
SLEEP_SHORT, SLEEP_LONG = 0.25, 2.5
DELAY = (0.0, 0.015)  # seconds from a held victim's go to its signal: a step takes a few milliseconds
RECOVERY_DELAY = (0.0, 0.01)  # ... from a survivor's go to shrink to the fault: the agreement takes milliseconds
LATE = (0.5, 1.3)  # a late shrink's delay range, in group timeouts (around the deadline: the racy edge)
START_LIMIT = 150.0  # seconds for every rank to start and set up on a busy machine
HANG_MARGIN = 15.0  # a rank silent for 3 timeouts plus this (not stopped by us) hangs
POLL = 0.05  # seconds between looks at the ranks' output
DOCUMENTED = frozenset({"PeerLostError", "CollectiveTimeout", "MismatchError", "BackendClosedError",
                        "PeerAbortedError"})
STORE_ERRORS = frozenset({"DistStoreError"})  # torch's store timeout: only where a group is set up through it
REMOVING = frozenset({"kill", "stop_long", "sleep_long"})  # faults after which the others exclude the victim
FIRST_FAULTS, FIRST_WEIGHTS = ("kill", "stop_long", "sleep_long", "stop_short", "sleep_short"), (35, 20, 15, 15, 15)
RECOVERY_FAULTS, RECOVERY_WEIGHTS = ("kill", "stop_long", "stop_short"), (50, 30, 20)
STEPS, STEP_WEIGHTS = ("op", "new_group", "split", "shrink_sub", "shrink_world", "ddp"), (50, 10, 8, 8, 4, 8)


# -- the trial a seed describes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """Everything a trial does, drawn from `seed`: the rank script (`steps`, the same on every rank, faults
    included: the runner injects kills and stops when the victim reaches their step) and the faults the
    runner injects once the survivors start shrinking (`recovery_faults`)."""
    seed: int
    world: int
    transport: str
    timeout: float
    steps: tuple[dict[str, Any], ...]
    recovery_faults: tuple[dict[str, Any], ...] = ()

    def spec(self) -> str:
        """The script as the ranks read it (programs/campaign.py, TB_CAMPAIGN)."""
        return json.dumps({"seed": self.seed, "timeout": self.timeout, "steps": list(self.steps),
                           "hold_recovery": bool(self.recovery_faults)})

    def faults(self) -> list[dict[str, Any]]:
        """Every fault scheduled: in the script, and on recovery."""
        return [s for s in self.steps if s["kind"] in ("fault", "late_shrink")] + list(self.recovery_faults)

    def record(self) -> dict[str, Any]:
        return {"seed": self.seed, "world": self.world, "transport": self.transport, "timeout": self.timeout,
                "steps": list(self.steps), "recovery_faults": list(self.recovery_faults)}


def make_trial(seed: int, timeout: float = TIMEOUT, transports: Sequence[str] = TRANSPORTS,
               worlds: Sequence[int] = WORLDS) -> Trial:
    """The trial of `seed` (pure: the same seed gives the same trial). At least two ranks are never the
    victim of a fault that removes a rank (kill, long stop or sleep) nor of the script's shrink of the
    default group; the runner holds to that as it injects, too."""
    rng = random.Random(seed)
    world = rng.choices(list(worlds), weights=[w - 1 for w in worlds])[0]  # (more of 4: room for two faults)
    transport = rng.choice(list(transports))
    budget = world - 2  # ranks the trial may remove
    faults: list[dict[str, Any]] = []
    victims = rng.sample(range(world), world)  # removing faults take distinct victims, in this order
    if rng.random() < 0.9:
        kind = rng.choices(FIRST_FAULTS, weights=FIRST_WEIGHTS)[0]
        if kind in REMOVING and not budget:
            kind = "stop_short"
        faults.append(_fault(kind, victims.pop(0) if kind in REMOVING else rng.randrange(world), rng, timeout))
        budget -= kind in REMOVING
    recovery: list[dict[str, Any]] = []
    if faults and faults[0]["length"] in REMOVING and rng.random() < 0.8:
        kind = rng.choices(RECOVERY_FAULTS, weights=RECOVERY_WEIGHTS)[0]
        if kind in REMOVING and not budget:
            kind = "stop_short"
        budget -= kind in REMOVING
        recovery.append({"kind": "fault", "fault": kind, "length": kind, "trigger": "recovery",
                         "pick": round(rng.random(), 4), "delay": round(rng.uniform(*RECOVERY_DELAY), 4),
                         "hold": round((STOP_SHORT if kind == "stop_short" else STOP_LONG) * timeout, 3)})
    if faults and rng.random() < 0.5:
        faults.append({"kind": "late_shrink", "victim": rng.randrange(world),
                       "delay": round(rng.uniform(*LATE) * timeout, 3)})
    steps: list[dict[str, Any]] = []
    subs: list[int] = []
    for i in range(rng.randint(8, 14)):
        key = rng.randrange(1 << 30)
        kind = rng.choices(STEPS, weights=STEP_WEIGHTS)[0]
        if kind == "shrink_sub" and not subs or kind == "shrink_world" and not budget:
            kind = "op"
        if kind == "op":
            on: Any = "world" if not subs or rng.random() < 0.6 else rng.choice(subs)
            steps.append({"kind": "op", "op": rng.choice(OPS), "on": on, "n": rng.choice(SIZES),
                          "root": rng.randrange(4), "redop": rng.choice(("sum", "sum", "max"))})
        elif kind in ("new_group", "split"):
            steps.append({"kind": kind, "size": rng.randint(2, world), "two": rng.random() < 0.5, "key": key})
            subs.append(i)
        elif kind == "shrink_sub":
            steps.append({"kind": "shrink_sub", "sub": rng.choice(subs), "key": key})
        elif kind == "shrink_world":
            steps.append({"kind": "shrink_world", "key": key})
            budget -= 1
        else:
            steps.append({"kind": "ddp", "iters": rng.randint(1, 3), "key": key})
    for f in faults:  # each at a random point with steps after it (a late shrink before the first fault)
        at = rng.randrange(len(steps) - 1)
        if f["kind"] == "late_shrink":
            at = min(at, next((k for k, s in enumerate(steps) if s["kind"] == "fault"), len(steps)))
        steps.insert(at, f)
    # a subgroup is named by the index of the step that made it: where it is now the faults are in
    now = {id(st): k for k, st in enumerate(steps)}
    made = {i: now[id(st)] for i, st in enumerate(s for s in steps if s["kind"] not in ("fault", "late_shrink"))}
    steps = [dict(st, sub=made[st["sub"]]) if st["kind"] == "shrink_sub" else
             dict(st, on=made[st["on"]]) if st["kind"] == "op" and st["on"] != "world" else st for st in steps]
    return Trial(seed, world, transport, timeout, tuple(steps), tuple(recovery))


def _fault(kind: str, victim: int, rng: random.Random, timeout: float) -> dict[str, Any]:
    hold = {"kill": 0.0, "stop_short": STOP_SHORT, "stop_long": STOP_LONG, "sleep_short": SLEEP_SHORT,
            "sleep_long": SLEEP_LONG}[kind] * timeout
    # (a sleep is the rank's own: the program knows only "sleep", for `hold` seconds)
    return {"kind": "fault", "fault": "sleep" if kind.startswith("sleep") else kind, "length": kind,
            "victim": victim, "delay": round(rng.uniform(*DELAY), 4), "hold": round(hold, 3)}


def setup_of(transport: str) -> Setup:
    """The ranks' setup for a kind of link; shared-memory segments are checked by the judge, per trial."""
    if transport == "tcp":
        return LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "tcp"})
    if transport == "shm":
        return SHM.but(segments=SegmentCheck.NONE).with_env({"THUNDERBOLT_TRANSPORT": "shm"})
    if transport == "auto":
        return LOOPBACK.with_env({"THUNDERBOLT_TRANSPORT": "auto"})
    if transport == "hybrid":
        return HYBRID.but(segments=SegmentCheck.NONE).with_env({"THUNDERBOLT_TRANSPORT": "auto"})
    raise ValueError(f"unknown transport {transport!r}; known: {', '.join(TRANSPORTS)}")


# -- running one trial -----------------------------------------------------------------------------------------
@dataclass
class Injected:
    """A fault as it happened: `at` is the wall clock (comparable with the ranks' records)."""
    fault: str  # kill, stop_short, stop_long, sleep_short, sleep_long, late_shrink
    victim: int
    at: float
    trigger: str  # "step <i>" or "recovery"
    hold: float = 0.0


@dataclass
class _Reader:
    """The records each rank printed so far, read as they come (whole lines only)."""
    ranks: Ranks
    offsets: dict[int, int] = field(default_factory=dict)
    partial: dict[int, bytes] = field(default_factory=dict)
    records: dict[int, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    heard: dict[int, float] = field(default_factory=dict)  # monotonic time each rank last printed

    def read(self) -> list[tuple[int, str, dict[str, Any]]]:
        new = []
        now = time.monotonic()
        for r in self.ranks:
            try:
                with open(r.out_path, "rb") as f:
                    f.seek(self.offsets.get(r.rank, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self.offsets[r.rank] = self.offsets.get(r.rank, 0) + len(chunk)
            text = self.partial.pop(r.rank, b"") + chunk
            *lines, rest = text.split(b"\n")
            if rest:
                self.partial[r.rank] = rest
            for line in lines:
                tag, _, body = line.decode(errors="replace").partition(" ")
                if not tag.isupper() or not body.startswith("{"):
                    continue
                try:
                    rec = json.loads(body)
                except json.JSONDecodeError:
                    continue
                self.records.setdefault(r.rank, []).append((tag, rec))
                self.heard[r.rank] = now
                new.append((r.rank, tag, rec))
        return new

    def of(self, rank: int, tag: str) -> list[dict[str, Any]]:
        return [rec for t, rec in self.records.get(rank, []) if t == tag]


@dataclass
class TrialOutcome:
    """What one trial did and every problem found in it (each a line naming the rank and the record)."""
    trial: Trial
    seconds: float = 0.0
    steps: int = 0  # script steps the furthest rank reached
    ops: int = 0  # collectives checked, every rank
    injected: list[Injected] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)  # error records by class, every rank
    shrinks: int = 0  # shrink_group calls of recoveries (every rank)
    retried_shrinks: int = 0  # of them, calls after a failed one
    wrong: list[str] = field(default_factory=list)
    wrong_views: list[str] = field(default_factory=list)
    misblames: list[str] = field(default_factory=list)
    undocumented: list[str] = field(default_factory=list)
    divergent: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    healthy_lost: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # diagnostics that are no failure by themselves
    cascades: list[str] = field(default_factory=list)  # blames of ranks held up by a faulted one elsewhere
    skipped: Counter = field(default_factory=Counter)  # steps left out, by why (torch's own limits)
    gid_splits: int = 0  # healthy ranks that made the same group under different ids (a diagnostic)
    phantoms: list[str] = field(default_factory=list)  # faulted ranks' groups the healthy did not make
    returncodes: dict[int, int | None] = field(default_factory=dict)

    PROBLEMS = ("wrong", "wrong_views", "misblames", "undocumented", "divergent", "hangs", "crashes",
                "healthy_lost", "leftovers", "setup")

    @property
    def ok(self) -> bool:
        return not any(getattr(self, k) for k in self.PROBLEMS)

    def problems(self) -> list[str]:
        return [f"{k}: {line}" for k in self.PROBLEMS for line in getattr(self, k)]

    def record(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("seconds", "steps", "ops", "shrinks", "retried_shrinks",
                                             "returncodes", "notes", "cascades", "gid_splits", "phantoms",
                                             *self.PROBLEMS)}
        out["skipped"] = dict(self.skipped)
        out.update(seed=self.trial.seed, world=self.trial.world, transport=self.trial.transport, ok=self.ok,
                   errors=dict(self.errors), injected=[asdict(f) for f in self.injected])
        return out

    def line(self) -> str:
        faults = ",".join(f"{f.fault}@{f.victim}" for f in self.injected) or "-"
        verdict = "ok" if self.ok else "FAIL " + "; ".join(
            f"{k} {len(getattr(self, k))}" for k in self.PROBLEMS if getattr(self, k))
        return (f"seed {self.trial.seed}: world {self.trial.world} {self.trial.transport}, {self.steps} steps, "
                f"{self.ops} ops, faults {faults}, shrinks {self.shrinks} ({self.retried_shrinks} retried), "
                f"{self.seconds:.1f}s: {verdict}")


def hang_limit(timeout: float) -> float:
    """The longest a rank may print nothing: a long sleep (SLEEP_LONG) or a status all_reduce (2 group
    timeouts) is the longest it waits by design."""
    return 3 * timeout + HANG_MARGIN


def run_trial(trial: Trial, workdir: Path, *, code: str | None = None, zygote: Zygote | None = None) -> TrialOutcome:
    """Run `trial` with its ranks in `workdir` (their output stays there); `code`: run the ranks on another
    copy of the package (a directory holding torch_thunderbolt), to try a patch side by side; `zygote`: fork
    the ranks from it (started on the same `code`) instead of starting interpreters."""
    import torch.distributed as dist

    workdir.mkdir(parents=True, exist_ok=True)
    outcome = TrialOutcome(trial)
    t0 = time.monotonic()
    listening = set(leftovers.listening_sockets())
    store = dist.TCPStore("127.0.0.1", 0, trial.world, True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_LIMIT))
    setup = setup_of(trial.transport).but(master_port=store.port)
    program: Any = campaign_program
    if code is not None:  # the program by path, its imports from `code`
        setup = setup.but(pythonpath=(code,))
        program = Path(campaign_program.__file__)
    try:
        ranks = start_ranks(program, trial.world, workdir, args=["trial"], setup=setup,
                            env={campaign_program.SPEC_ENV: trial.spec()}, zygote=zygote)
        reader = _Reader(ranks)
        try:
            _drive(trial, ranks, reader, store, outcome)
        finally:
            ranks.kill_all()  # (SIGCONT first: no stopped rank outlives the trial)
    finally:
        del store
        gc.collect()
    outcome.seconds = time.monotonic() - t0
    outcome.returncodes = {r.rank: r.returncode for r in ranks}
    reader.read()
    judge(trial, reader, outcome)
    _check_leftovers(workdir, listening, outcome)
    return outcome


def _drive(trial: Trial, ranks: Ranks, reader: _Reader, store: Any, outcome: TrialOutcome) -> None:
    """Watch the ranks until every one has exited: let held ranks go and inject the faults due then (at the
    moment each is due, not at the next look), stop a trial whose ranks do not start, and kill every rank
    at the first that hangs."""
    step_faults = {(s["victim"], f"fault{i}"): s for i, s in enumerate(trial.steps)
                   if s["kind"] == "fault" and s["fault"] != "sleep"}
    on_recovery = list(trial.recovery_faults)
    pending: list[tuple[float, str, int, dict[str, Any], str]] = []  # (when, action, rank, fault, trigger)
    stopped: dict[int, float] = {}  # rank -> when its SIGCONT is due
    removed: set[int] = set()  # ranks a fault removes (the runner keeps two ranks clear of them)
    finished: set[int] = set()  # ranks that are out or done (no fault is injected in them any more)
    start = time.monotonic()
    deadline = start + START_LIMIT + 6 * len(trial.steps) + 12 * trial.timeout + 4 * HANG_MARGIN
    for r in ranks:
        reader.heard[r.rank] = start
    while True:
        now = time.monotonic()
        for r, tag, rec in reader.read():
            if tag == "HOLD":
                f = step_faults.pop((r, rec["name"]), None)
                if f is not None:
                    pending.append((now + f["delay"], f["fault"], r, f, f"step {rec['name'][5:]}"))
                elif rec["name"].startswith("recover") and on_recovery and removed:
                    f = on_recovery.pop(0)
                    pending.append((now + f["delay"], f["fault"], -1, f, "recovery"))
                store.set(f"{campaign_program.GO_KEY}{rec['name']}/{r}", b"1")
            elif tag == "SLEEP":
                f = trial.steps[rec["i"]]
                outcome.injected.append(Injected(f["length"], r, rec["t"], f"step {rec['i']}", rec["seconds"]))
                if f["length"] in REMOVING:
                    removed.add(r)
            elif tag == "LATE":
                outcome.injected.append(Injected("late_shrink", r, rec["t"], "recovery", rec["seconds"]))
            elif tag in ("OUT", "DONE", "INIT_FAILED", "CRASH"):
                finished.add(r)
        now = time.monotonic()
        for item in sorted(p for p in pending if p[0] <= now):
            pending.remove(item)
            _inject(item, ranks, reader, outcome, pending, stopped, removed, finished)
        ranks.poll()
        if not ranks.alive():
            return
        limit = hang_limit(trial.timeout)
        silent = [r.rank for r in ranks.alive() if r.rank not in stopped and now - reader.heard[r.rank] > (
            START_LIMIT if not reader.of(r.rank, "READY") else limit)]
        if silent or now > deadline:
            _dump_stacks(ranks, stopped)
            for r in silent or [x.rank for x in ranks.alive()]:
                last = reader.records.get(r, [])[-1:]
                what = f"last record {last[0][0]} {json.dumps(last[0][1])[:300]}" if last else "no record"
                if not reader.of(r, "READY"):
                    outcome.setup.append(f"rank {r} did not set up in {START_LIMIT:.0f}s ({what}): "
                                         f"{ranks[r].stderr()[-600:]}")
                else:
                    outcome.hangs.append((f"rank {r} silent for {limit:.0f}s (group timeout {trial.timeout:g}s; "
                                          f"{what})" if silent else
                                          f"rank {r} still running at the trial's deadline ({what})")
                                         + f"; its threads: {ranks[r].err_path}")
            ranks.kill_all()
            return
        due = min((p[0] for p in pending), default=now + POLL)
        time.sleep(max(0.0, min(POLL, due - time.monotonic())))


def _dump_stacks(ranks: Ranks, stopped: dict[int, float]) -> None:
    """Every live rank prints its threads' stacks to its stderr (programs/campaign.py registers SIGUSR1 with
    faulthandler), for the report of a hang; a stopped one is let go first."""
    for r in ranks.alive():
        try:
            if r.rank in stopped:
                os.kill(r.proc.pid, signal.SIGCONT)
            os.kill(r.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)


def _inject(item: tuple[float, str, int, dict[str, Any], str], ranks: Ranks, reader: _Reader,
            outcome: TrialOutcome, pending: list, stopped: dict[int, float], removed: set[int],
            finished: set[int]) -> None:
    """Send one due signal: a kill, a stop (and schedule its SIGCONT), or a SIGCONT."""
    _, action, r, f, trigger = item
    now = time.monotonic()
    if action == "cont":
        if ranks[r].proc.poll() is None:
            os.kill(ranks[r].proc.pid, signal.SIGCONT)
        stopped.pop(r, None)
        reader.heard[r] = now  # (its silence counts from now)
        return
    if r < 0:  # a recovery's victim: one of the ranks still in the game, drawn as the seed says
        alive = sorted(x.rank for x in ranks if x.proc.poll() is None and x.rank not in finished
                       and x.rank not in removed and x.rank not in stopped)
        r = alive[int(f["pick"] * len(alive))] if alive else -1
    clear = [x.rank for x in ranks if x.rank not in removed and x.rank != r]
    if r < 0 or ranks[r].proc.poll() is not None or r in stopped or (
            action in REMOVING and len(clear) < 2):
        outcome.notes.append(f"fault {action} ({trigger}) not injected: no victim left for it")
        return
    if action == "kill":
        os.kill(ranks[r].proc.pid, signal.SIGKILL)
        removed.add(r)
    else:
        os.kill(ranks[r].proc.pid, signal.SIGSTOP)
        stopped[r] = now + f["hold"]
        pending.append((now + f["hold"], "cont", r, f, trigger))
        if action in REMOVING:
            removed.add(r)
    outcome.injected.append(Injected(action, r, time.time(), trigger, f.get("hold", 0.0)))


# -- judging ----------------------------------------------------------------------------------------------
def judge(trial: Trial, reader: _Reader, out: TrialOutcome) -> None:
    """Every check of the trial's records (see the module's docstring); fills `out`."""
    faulted_at: dict[int, float] = {}
    for f in out.injected:
        faulted_at.setdefault(f.victim, f.at)
    # the ranks the script's shrinks left out (one may miss its EXCLUDED: its last op, cut by the shrink)
    excluded = {r for r in range(trial.world) if reader.of(r, "EXCLUDED")} | {
        rec["exclude"] for r in range(trial.world) for rec in reader.of(r, "RECOVER") if rec.get("exclude") is not None}
    healthy = [r for r in range(trial.world) if r not in faulted_at and r not in excluded]
    killed_by_us = {f.victim for f in out.injected if f.fault == "kill"}
    hung = any(out.hangs) or any(out.setup)
    out.steps = max((rec["i"] + 1 for r in range(trial.world) for rec in reader.of(r, "STEP")), default=0)
    out.injected.sort(key=lambda f: f.at)
    failures = {r: _failures(reader, r) for r in range(trial.world)}

    def blamed_for_cause(g: int, t: float) -> bool:
        """Whether rank `g` was at time `t` itself held up by a faulted rank (an op of its failed then,
        naming one): a rank blamed for not arriving while it waited on the real culprit in another group."""
        return any(t0 - 0.1 <= t <= t1 + 0.1 and any(h in faulted_at and faulted_at[h] <= t1 + 0.05
                                                    for h in err["named"])
                   for err, t0, t1, _ in failures[g])

    for r in range(trial.world):
        for rec in reader.of(r, "OP"):
            out.ops += 1
            where = f"rank {r} step {rec['i']} {rec['what']} on {rec['on']} (members {rec['members']})"
            for w in rec["wrong"]:
                out.wrong.append(f"{where}: {w}")
            if rec["ok"] and rec["expect_fail"]:
                out.wrong.append(f"{where}: succeeded on a group shrunk away from this rank")
            if rec["err"] is not None and rec["expect_fail"] and not any(
                    s in rec["err"]["msg"] for s in ("shrunk to ranks", "shrink_group")):
                out.notes.append(f"{where}: a group shrunk away failed without naming the shrink: "
                                 f"{rec['err']['type']}: {rec['err']['msg'][:200]}")
        for err, t0, t, where in failures[r]:
            kind = err["type"]
            out.errors[kind] += 1
            if kind not in DOCUMENTED and not (kind in STORE_ERRORS and err["where"] in ("new_group", "split")):
                out.undocumented.append(f"{where}: {kind}: {err['msg'][:300]}")
            if r in healthy:
                wrongly = [g for g in err["named"] if g not in excluded and (g not in faulted_at or
                                                                             faulted_at[g] > t + 0.05)]
                held_up = [g for g in wrongly if blamed_for_cause(g, t)]
                if held_up:
                    out.cascades.append(f"{where}: {kind} blames rank(s) {held_up}, held up by a faulted rank "
                                        f"in another op then: {err['msg'][:200]}")
                if [g for g in wrongly if g not in held_up]:
                    out.misblames.append(f"{where}: {kind} blames healthy rank(s) {wrongly}: {err['msg'][:300]}")
        calls = reader.of(r, "SHRINK")
        out.shrinks += len(calls)
        out.retried_shrinks += sum(1 for c in calls if c["attempt"] > 0)
        for rec in reader.of(r, "VIEW"):
            if rec["got"] != rec["want"] or rec["rank_got"] != rec["rank_want"]:
                out.wrong_views.append(f"rank {r} step {rec['i']} {rec['what']} of ranks {rec['members']}: torch's "
                                       f"view {rec['got']} (rank {rec['rank_got']}), want {rec['want']} (rank "
                                       f"{rec['rank_want']})")
        for rec in reader.of(r, "SHRUNK"):
            if rec["torch_view"] != rec["torch_want"] or rec["rank"] != rec["rank_want"]:
                arith = " (torch's _finalize_shrunk_group arithmetic)" if rec["torch_view"] == rec["torch_arith"] else ""
                out.wrong_views.append(f"rank {r} shrink_group of ranks {rec['parent']} to {rec['want']}: torch's "
                                       f"view {rec['torch_view']} (rank {rec['rank']}), want {rec['torch_want']} "
                                       f"(rank {rec['rank_want']}){arith}")
        for rec in reader.of(r, "SKIP"):
            out.skipped[rec["why"]] += 1
        for rec in reader.of(r, "CRASH"):
            out.crashes.append(f"rank {r}: {rec['trace'][-1500:]}")
        for rec in reader.of(r, "INIT_FAILED"):
            out.setup.append(f"rank {r} could not set up: {rec['err']}")
        rc = out.returncodes.get(r)
        if not hung and rc != 0 and not (r in killed_by_us and rc == -signal.SIGKILL) and not reader.of(r, "CRASH") \
                and not reader.of(r, "INIT_FAILED"):
            out.crashes.append(f"rank {r} exited {rc}: {reader.ranks[r].stderr()[-1500:]}")
        if r in healthy and not reader.of(r, "DONE") and not hung:
            why = reader.of(r, "OUT")
            out.healthy_lost.append(f"rank {r} (never faulted) did not finish: "
                                    f"{why[-1]['why'] if why else 'no OUT record'}")
    _judge_views(trial, reader, healthy, out)


def _failures(reader: _Reader, r: int) -> list[tuple[dict[str, Any], float, float, str]]:
    """Rank r's error records: (error, start, end, where)."""
    out = []
    for rec in reader.of(r, "OP"):
        if rec["err"] is not None:
            out.append((rec["err"], rec["t0"], rec["t"],
                        f"rank {r} step {rec['i']} {rec['what']} on {rec['on']} (members {rec['members']})"))
    calls = {c["attempt"]: c["t"] for c in reader.of(r, "SHRINK")}
    for rec in reader.of(r, "SHRINK_FAILED"):
        out.append((rec["err"], calls.get(rec["attempt"], rec["t"]), rec["t"],
                    f"rank {r} shrink_group (call {rec['attempt']})"))
    return out


def _judge_views(trial: Trial, reader: _Reader, healthy: list[int], out: TrialOutcome) -> None:
    """Healthy ranks that shrank the same group got the same group (and, as a diagnostic, the same id), and
    those that finished agree on the final group."""
    children: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}
    gids: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[Any, list[int]]] = {}
    for r in healthy:
        for rec in reader.of(r, "SHRUNK"):
            parent, got = tuple(rec["parent"]), tuple(rec["want"])
            children.setdefault(parent, {}).setdefault(got, []).append(r)
            gids.setdefault((parent, got), {}).setdefault(rec.get("gid"), []).append(r)
    for parent, kids in children.items():
        if len(kids) > 1:
            out.divergent.append(f"healthy ranks shrank {list(parent)} to different groups: "
                                 + "; ".join(f"ranks {rs} to {list(k)}" for k, rs in kids.items()))
    for (parent, got), by_gid in gids.items():
        if len(by_gid) > 1:
            out.notes.append(f"group ids differ for {list(got)} shrunk from {list(parent)}: "
                             + "; ".join(f"ranks {rs}: id {g}" for g, rs in by_gid.items()))
            out.gid_splits += 1
    # A faulted rank whose shrink succeeded into a group its healthy members did not make (it took their
    # proposals of an attempt they gave up): no failure of its own (it was faulted), noted for the agreement
    for r in range(trial.world):
        if r in healthy:
            continue
        for rec in reader.of(r, "SHRUNK"):
            parent, got = tuple(rec["parent"]), tuple(rec["want"])
            others = [m for m in got if m in healthy and m != r and r not in children.get(parent, {}).get(got, [])]
            missing = [m for m in others if m not in children.get(parent, {}).get(got, [])]
            if missing:
                out.phantoms.append(f"rank {r} (faulted) made {list(got)} from {list(parent)}, which healthy "
                                    f"rank(s) {missing} did not make")
    finals: dict[tuple[int, ...], list[int]] = {}
    for r in healthy:
        for rec in reader.of(r, "DONE")[-1:]:
            finals.setdefault(tuple(rec["members"]), []).append(r)
    if len(finals) > 1:
        out.divergent.append("healthy ranks finished in different groups: "
                             + "; ".join(f"ranks {rs} in {list(m)}" for m, rs in finals.items()))
    for members, rs in finals.items():
        gone = [g for g in members if g in healthy and g not in rs]
        if gone:
            out.divergent.append(f"ranks {rs} finished in {list(members)}, but healthy ranks {gone} did not")


def _check_leftovers(workdir: Path, listening: set[str], out: TrialOutcome) -> None:
    """Nothing of the trial's ranks may survive it: processes, listening sockets, segments and doorbells."""
    procs = leftovers.settled(lambda: leftovers.processes_mentioning(str(workdir)), 5.0)
    out.leftovers += [f"process {p}" for p in procs]
    sockets = leftovers.settled(lambda: sorted(set(leftovers.listening_sockets()) - listening), 5.0)
    out.leftovers += [f"socket {s}" for s in sockets]
    segments = sorted(leftovers.segments_and_doorbells(rank_pids(workdir)))
    out.leftovers += [f"shared memory {s}" for s in segments]
    shm_segment.cleanup_stale_segments()  # (so that one trial's leftovers do not fail the next)


# -- a campaign -------------------------------------------------------------------------------------------
@dataclass
class Summary:
    """Trials summed up: `as_dict()` for JSON, `text()` to print."""
    trials: int = 0
    steps: int = 0
    ops: int = 0
    seconds: float = 0.0
    faults: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    shrinks: int = 0
    retried_shrinks: int = 0
    cascades: int = 0
    gid_splits: int = 0
    phantoms: int = 0
    skipped: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)  # problems by kind
    seeds: dict[str, list[int]] = field(default_factory=dict)  # problem kind -> the seeds that had it
    failing: list[dict[str, Any]] = field(default_factory=list)  # per failing trial: seed and problems

    def add(self, o: TrialOutcome) -> None:
        self.trials += 1
        self.steps += o.steps
        self.ops += o.ops
        self.seconds += o.seconds
        self.faults.update(f.fault for f in o.injected)
        self.errors.update(o.errors)
        self.shrinks += o.shrinks
        self.retried_shrinks += o.retried_shrinks
        self.cascades += len(o.cascades)
        self.gid_splits += o.gid_splits
        self.phantoms += len(o.phantoms)
        self.skipped.update(o.skipped)
        for k in TrialOutcome.PROBLEMS:
            self.counts[k] += len(getattr(o, k))
            if getattr(o, k):
                self.seeds.setdefault(k, []).append(o.trial.seed)
        for k, n in (("gid_splits", o.gid_splits), ("phantoms", len(o.phantoms)), ("cascades", len(o.cascades))):
            if n:
                self.seeds.setdefault(k, []).append(o.trial.seed)
        if not o.ok:
            self.failing.append({"seed": o.trial.seed, "world": o.trial.world, "transport": o.trial.transport,
                                 "problems": o.problems()[:20], "notes": o.notes[:10]})

    @property
    def wrong_results(self) -> int:
        return self.counts["wrong"]

    @property
    def hangs(self) -> int:
        return self.counts["hangs"]

    @property
    def misblames(self) -> int:
        return self.counts["misblames"]

    @property
    def ok(self) -> bool:
        return not self.failing

    def as_dict(self) -> dict[str, Any]:
        return {"trials": self.trials, "steps": self.steps, "ops": self.ops, "seconds": round(self.seconds, 1),
                "faults": dict(self.faults), "errors": dict(self.errors), "shrinks": self.shrinks,
                "retried_shrinks": self.retried_shrinks, "wrong_results": self.wrong_results, "hangs": self.hangs,
                "misblames": self.misblames, **{k: self.counts[k] for k in TrialOutcome.PROBLEMS
                                                if k not in ("wrong", "hangs", "misblames")},
                "cascaded_blames": self.cascades, "gid_splits": self.gid_splits, "phantoms": self.phantoms,
                "skipped": dict(self.skipped),
                "seeds_by_problem": self.seeds, "failing_seeds": [f["seed"] for f in self.failing],
                "failing": self.failing}

    def text(self) -> str:
        d = self.as_dict()
        lines = [f"{d['trials']} trials, {d['steps']} steps, {d['ops']} checked ops, {d['seconds']}s",
                 "faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"),
                 f"shrink_group calls in recoveries: {self.shrinks} ({self.retried_shrinks} retried)",
                 "errors by class: " + (", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"),
                 f"wrong results: {self.wrong_results}, hangs: {self.hangs}, misblames: {self.misblames}",
                 "also: " + ", ".join(f"{k} {self.counts[k]}" for k in TrialOutcome.PROBLEMS
                                      if k not in ("wrong", "hangs", "misblames")),
                 f"diagnostics: blames of ranks held up by a faulted one {self.cascades}, groups made under "
                 f"different ids {self.gid_splits}, faulted ranks' groups the healthy did not make "
                 f"{self.phantoms}",
                 "steps left out for torch's limits: " + (", ".join(f"{v}x {k}" for k, v in self.skipped.items())
                                                          or "none"),
                 "seeds by problem: " + ("; ".join(f"{k} {v}" for k, v in self.seeds.items()) or "none"),
                 "failing seeds: " + (" ".join(str(f["seed"]) for f in self.failing) or "none")]
        for f in self.failing:
            lines.append(f"  seed {f['seed']} (world {f['world']}, {f['transport']}):")
            lines += [f"    {p[:400]}" for p in f["problems"][:8]]
        return "\n".join(lines)


def run_campaign(trials: int, seed: int, workdir: Path, *, timeout: float = TIMEOUT,
                 transports: Sequence[str] = TRANSPORTS, worlds: Sequence[int] = WORLDS, code: str | None = None,
                 keep: bool = False, progress: Any = None, records: list[dict[str, Any]] | None = None,
                 fork: bool = False) -> Summary:
    """Trials `seed` .. `seed + trials - 1`, each in `workdir/seed<s>` (removed when it passed, unless
    `keep`). `progress(outcome, summary)` is called after each (the summary so far); `records` collects
    each trial's record. `fork`: the ranks are forked from one process that imported torch (testing.zygote),
    which saves most of a short trial's time; what is tested after the import is the same."""
    with contextlib.ExitStack() as stack:
        zygote = (stack.enter_context(start_zygote(LOOPBACK.but(pythonpath=(code,) if code else ())))
                  if fork else None)
        return _campaign(trials, seed, workdir, timeout, transports, worlds, code, keep, progress, records, zygote)


def _campaign(trials: int, seed: int, workdir: Path, timeout: float, transports: Sequence[str],
              worlds: Sequence[int], code: str | None, keep: bool, progress: Any,
              records: list[dict[str, Any]] | None, zygote: Zygote | None) -> Summary:
    summary = Summary()
    for s in range(seed, seed + trials):
        trial = make_trial(s, timeout, transports, worlds)
        where = workdir / f"seed{s}"
        outcome = run_trial(trial, where, code=code, zygote=zygote)
        if outcome.setup and not any(getattr(outcome, k) for k in TrialOutcome.PROBLEMS if k != "setup"):
            # (ranks that could not even set up on a busy machine: once more, said in the notes)
            shutil.rmtree(where, ignore_errors=True)
            again = run_trial(trial, where, code=code, zygote=zygote)
            again.notes.insert(0, f"run again: the first run could not set up ({outcome.setup[0][:200]})")
            outcome = again
        summary.add(outcome)
        if records is not None:
            records.append(outcome.record())
        if progress is not None:
            progress(outcome, summary)
        if outcome.ok and not keep:
            shutil.rmtree(where, ignore_errors=True)
    return summary


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m torch_thunderbolt.testing.reliability.campaign",
                                 description="A randomized fault campaign against shrink, split and the agreement.")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="trial k runs seed SEED+k")
    ap.add_argument("--json", type=Path, help="write the summary and every trial's record here")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="the group's timeout, seconds")
    ap.add_argument("--transport", action="append", choices=TRANSPORTS, help="only these kinds of link")
    ap.add_argument("--world", action="append", type=int, choices=WORLDS, help="only these world sizes")
    ap.add_argument("--workdir", type=Path, help="where the ranks run (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's directory, not only failing ones")
    ap.add_argument("--code", help="run the ranks on the package in this directory (a patch side by side)")
    ap.add_argument("--fork", action="store_true",
                    help="fork the ranks from one process that imported torch (testing.zygote): trials take about "
                         "half the time; the ranks' code after the import is the same")
    args = ap.parse_args(list(argv) if argv is not None else None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tb-campaign-"))
    records: list[dict[str, Any]] = []

    def write(summary: Summary) -> None:
        if args.json:
            args.json.write_text(json.dumps({"summary": summary.as_dict(), "trials": records}, indent=1,
                                            default=str))

    def progress(o: TrialOutcome, summary: Summary) -> None:
        print(o.line(), flush=True)
        for p in o.problems()[:6]:
            print(f"    {p[:300]}", flush=True)
        for n in o.notes[:3]:
            print(f"    note: {n[:300]}", flush=True)
        write(summary)  # (after every trial: a long run stopped early keeps what it found)

    summary = run_campaign(args.trials, args.seed, workdir, timeout=args.timeout,
                           transports=args.transport or TRANSPORTS, worlds=args.world or WORLDS, code=args.code,
                           keep=args.keep, progress=progress, records=records, fork=args.fork)
    print(summary.text())
    print(f"trial directories: {workdir}")
    write(summary)
    sys.exit(0 if summary.ok else 1)


if __name__ == "__main__":
    main()
