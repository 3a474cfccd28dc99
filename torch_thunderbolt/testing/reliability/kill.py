"""kill -9 of one rank at a random moment during a collective: the scenario shared by the CI test
(tests/reliability/test_kill.py) and the ≥100-trial script (scripts/reliability/kill_trials.py). A trial is
fully described by its seed (world size, op, size, victim, moment, root); its ranks run programs/kill.py."""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from torch_thunderbolt.testing.ranks import Ranks, reliability_setup, start_ranks

from .programs import kill as kill_program

OPS = ("all_reduce", "broadcast", "all_gather", "send_recv")  # what from_seed draws from (CI seeds rely on it)
ALL_OPS = ("all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "all_to_all", "send_recv")
SIZES = (4, 1 << 10, 64 << 10, 1 << 20, 4 << 20)
DETECT_LIMIT = 5.0  # seconds from the kill to the error on every survivor
HANG_LIMIT = 30.0  # a survivor still running this long after the kill counts as a hang


@dataclass(frozen=True)
class KillCase:
    seed: int
    world: int
    op: str
    size: int
    victim: int
    root: int
    delay: float

    @classmethod
    def fixed(cls, seed: int, world: int, op: str, size: int) -> "KillCase":
        """Given world, op and size; victim, root and moment drawn from the seed."""
        rng = random.Random(seed)
        return cls(seed, world, op, size, rng.randrange(world), rng.randrange(world), round(rng.uniform(0.0, 0.5), 3))

    @classmethod
    def from_seed(cls, seed: int, worlds: tuple[int, ...] = (2, 3, 4)) -> "KillCase":
        rng = random.Random(seed)
        world = rng.choice(worlds)
        return cls(seed, world, rng.choice(OPS), rng.choice(SIZES), rng.randrange(world), rng.randrange(world),
                   round(rng.uniform(0.0, 0.5), 3))


@dataclass
class KillOutcome:
    case: KillCase
    hang: bool
    killed_at: float | None
    errors: dict  # survivor rank -> ERROR record
    returncodes: dict
    exit_after_error: dict  # survivor rank -> seconds from its error to its process exit
    problems: list

    @property
    def blamed(self) -> dict:
        """survivor rank -> the rank its error named as the cause (its `peer`), None if it named none."""
        return {r: e.get("peer") for r, e in self.errors.items()}

    @property
    def detection(self) -> dict:
        if self.killed_at is None:
            return {}
        return {r: e["t"] - self.killed_at for r, e in self.errors.items()}

    def ok(self) -> bool:
        return not self.problems

    def record(self) -> dict:
        return {"case": asdict(self.case), "hang": self.hang, "detection": self.detection, "blamed": self.blamed,
                "exit_after_error": self.exit_after_error, "returncodes": self.returncodes,
                "errors": self.errors, "problems": self.problems}


def run_kill_trial(case: KillCase, workdir: Path, group_timeout: float = 60.0) -> KillOutcome:
    env = {"TB_TIMEOUT": str(group_timeout), "TB_OP": case.op, "TB_SIZE": str(case.size),
           "TB_VICTIM": str(case.victim), "TB_ROOT": str(case.root), "TB_DELAY": str(case.delay)}
    ranks = start_ranks(kill_program, case.world, workdir, args=["kill_trial"], env=env, setup=reliability_setup())
    try:
        start_limit = time.time() + 90  # process start + init on a busy 2-core box
        killed_at = None
        finished = False
        while time.time() < start_limit and killed_at is None:
            kill = ranks.ranks[case.victim].tagged("KILLAT")
            killed_at = kill[0] if kill else None
            if ranks.ranks[case.victim].proc.poll() is not None and killed_at is None:
                break
            time.sleep(0.02)
        if killed_at is not None:
            finished = ranks.wait(killed_at + HANG_LIMIT)
    finally:
        ranks.kill_all()
    return _judge(case, ranks, killed_at, finished)


def _judge(case: KillCase, ranks: Ranks, killed_at: float | None, finished: bool) -> KillOutcome:
    problems: list[str] = []
    errors, rcs, exit_after = {}, {}, {}
    if killed_at is None:
        problems.append("the victim never reached its kill (setup failed): "
                        + ranks.ranks[case.victim].stderr()[-800:])
    for rk in ranks.ranks:
        rcs[rk.rank] = rk.returncode
        if rk.rank == case.victim:
            continue
        errs = rk.tagged("ERROR")
        if not errs:
            problems.append(f"rank {rk.rank} reported no error (rc {rk.returncode}): {rk.stderr()[-800:]}")
            continue
        e = errs[0]
        errors[rk.rank] = e
        if rk.exited_at is not None:
            exit_after[rk.rank] = round(rk.exited_at - e["t"], 3)
        if e["type"] != "PeerLostError" or e["peer"] != case.victim or f"rank {case.victim}" not in e["msg"]:
            problems.append(f"rank {rk.rank}: expected PeerLostError naming rank {case.victim}, got {e}")
        if killed_at is not None and e["t"] - killed_at > DETECT_LIMIT:
            problems.append(f"rank {rk.rank}: detected after {e['t'] - killed_at:.2f}s (> {DETECT_LIMIT}s)")
        if rk.returncode != 1:  # an uncaught Python exception, nothing worse (no signal, no hang)
            problems.append(f"rank {rk.rank}: exit code {rk.returncode} (expected 1 from the uncaught error)")
    if killed_at is not None and not finished:
        problems.append("hang: some survivor was still running %.0fs after the kill" % HANG_LIMIT)
    return KillOutcome(case, killed_at is not None and not finished, killed_at, errors, rcs, exit_after, problems)
