"""SIGSTOP of one rank in the middle of a large collective: a pause is never a loss, and the blame is right.

A frozen rank's kernel keeps ACKing and closes its receive window once its socket buffer is full; a peer
sending to it must not take that for a lost link (PeerLostError after THUNDERBOLT_LINK_TIMEOUT_MS) but time
out at the group timeout, naming the frozen rank. A trial is fully described by its case (op, size, world,
victim, root, when the victim freezes); its ranks run programs/pause.py. Either the runner freezes the victim
while every rank loops over the op (at a moment after the ranks are ready), or the victim freezes itself
right after the barrier (`first`) and the others run the op once: then what a survivor sends it, up to what
the socket buffers hold, is left in the kernel by a send that is over for the program. The runner waits for
the others' errors, then wakes and kills the victim. Shared by tests/reliability/test_pause.py (a few trials,
and the 20-trial run marked slow).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch_thunderbolt.config import Config
from torch_thunderbolt.rendezvous.tcp import effective_socket_buffer
from torch_thunderbolt.testing.ranks import Ranks, reliability_setup, start_ranks

from .programs import pause as pause_program

OPS = ("all_reduce", "broadcast", "send_recv")
LATE_LIMIT = 1.5  # seconds past the group timeout a survivor's error may come on a busy machine
START_LIMIT = 90.0  # process start and init on a busy 2-core box


@dataclass(frozen=True)
class PauseCase:
    index: int
    op: str
    size: int = 64 << 20
    world: int = 2
    victim: int = 1
    delay: float = 0.2  # seconds after every rank is ready
    first: bool = False  # the victim freezes itself before the op (the others run it once)

    @property
    def root(self) -> int:
        """The broadcast's root: a survivor, so that it sends to the frozen rank."""
        return (self.victim + 1) % self.world

    @classmethod
    def nth(cls, index: int, size: int = 64 << 20, world: int = 2) -> "PauseCase":
        """Trial `index`: the ops in turn, the victim and the moment of the freeze (0.1 to 0.6 s after the
        ranks are ready, the 64 MB ops then running) spread over the trials."""
        return cls(index, OPS[index % len(OPS)], size, world, victim=(index // len(OPS)) % world,
                   delay=round(0.1 + 0.5 * ((index * 7) % 11) / 10, 3))


def held_size(op: str) -> int:
    """Bytes of `op` on 2 ranks whose share for the frozen rank is twice the socket buffer per stream: more
    than its receive window takes, less than that and the sender's socket buffer hold together. The kernels
    then take all of it, and the sender's kernel keeps what the window has no room for."""
    cfg = Config()
    share = 2 * effective_socket_buffer(cfg) * cfg.streams
    return 2 * share if op == "all_reduce" else share  # (an all_reduce sends the peer half of its tensor)


@dataclass
class PauseOutcome:
    case: PauseCase
    frozen_at: float | None = None
    errors: dict = field(default_factory=dict)  # survivor rank -> ERROR record
    returncodes: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def lost(self) -> bool:
        """Some survivor took the frozen rank for a lost one (the error this scenario must never give)."""
        return any(e["type"] == "PeerLostError" for e in self.errors.values())

    def ok(self) -> bool:
        return not self.problems

    def record(self) -> dict:
        after = ({r: round(e["t"] - self.frozen_at, 3) for r, e in self.errors.items()}
                 if self.frozen_at is not None else {})
        return {"case": asdict(self.case), "after_freeze": after, "errors": self.errors,
                "returncodes": self.returncodes, "problems": self.problems}


def run_pause_trial(case: PauseCase, workdir: Path, group_timeout: float = 10.0,
                    link_timeout_ms: int | None = None) -> PauseOutcome:
    """Run one trial; `link_timeout_ms`: THUNDERBOLT_LINK_TIMEOUT_MS for the ranks (None: the default)."""
    env = {"TB_TIMEOUT": str(group_timeout), "TB_OP": case.op, "TB_SIZE": str(case.size), "TB_ROOT": str(case.root)}
    if link_timeout_ms is not None:
        env["THUNDERBOLT_LINK_TIMEOUT_MS"] = str(link_timeout_ms)
    out = PauseOutcome(case)
    env["TB_VICTIM"] = str(case.victim)
    ranks = start_ranks(pause_program, case.world, workdir, args=["frozen_first" if case.first else "until_error"],
                        env=env, setup=reliability_setup())
    try:
        if not _wait_ready(ranks):
            out.problems.append("set-up failed: " + " | ".join(rk.stderr()[-600:] for rk in ranks))
            return out
        if case.first:
            while not ranks[case.victim].tagged("STOPPED") and ranks[case.victim].proc.poll() is None:
                time.sleep(0.02)
            stopped = ranks[case.victim].tagged("STOPPED")
            out.frozen_at = stopped[0] if stopped else None
        else:
            time.sleep(case.delay)
            out.frozen_at = time.time()
            os.kill(ranks[case.victim].proc.pid, signal.SIGSTOP)
        survivors = [rk for rk in ranks if rk.rank != case.victim]
        end = time.time() + group_timeout + 20
        while time.time() < end and any(rk.proc.poll() is None for rk in survivors):
            time.sleep(0.05)
    finally:
        ranks.kill_all()  # SIGCONT, then SIGKILL: the frozen rank never outlives the trial
    _judge(out, ranks, group_timeout)
    return out


def _wait_ready(ranks: Ranks) -> bool:
    end = time.time() + START_LIMIT
    while time.time() < end:
        if all(rk.tagged("READY") for rk in ranks):
            return True
        if any(rk.proc.poll() is not None for rk in ranks):
            return False
        time.sleep(0.05)
    return False


def _judge(out: PauseOutcome, ranks: Ranks, group_timeout: float) -> None:
    case = out.case
    for rk in ranks:
        out.returncodes[rk.rank] = rk.returncode
        if rk.rank == case.victim:
            continue
        errs = rk.tagged("ERROR")
        if not errs:
            out.problems.append(f"rank {rk.rank} reported no error (rc {rk.returncode}): {rk.stderr()[-600:]}")
            continue
        e = out.errors[rk.rank] = errs[0]
        if e["type"] != "CollectiveTimeout" or e["ranks"] != [case.victim]:
            out.problems.append(f"rank {rk.rank}: expected CollectiveTimeout naming rank {case.victim}, got {e}")
        elif not group_timeout <= e["seconds"] < group_timeout + LATE_LIMIT:
            out.problems.append(f"rank {rk.rank}: timed out after {e['seconds']}s, not at the group timeout "
                                f"({group_timeout}s)")
        if rk.returncode != 3:
            out.problems.append(f"rank {rk.rank}: exit code {rk.returncode} (expected 3 after its error)")
