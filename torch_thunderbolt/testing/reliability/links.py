"""Link faults: a cable cut mid-collective (lab, root), a frozen peer (SIGSTOP: half-open, no FIN), and a link
dropped while the job is idle (keepalive). Shared by tests/reliability/test_link_faults.py and
scripts/reliability/link_faults.py; the ranks run programs/links.py."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch_thunderbolt.lab.view import Lab
from torch_thunderbolt.testing.lab import lab_setup
from torch_thunderbolt.testing.ranks import Ranks, reliability_setup, start_ranks

from .programs import links as links_program


@dataclass
class LinkOutcome:
    fault_at: float | None = None
    errors: dict = field(default_factory=dict)  # rank -> ERROR record
    done: dict = field(default_factory=dict)  # rank -> DONE record (runs that must survive the fault)
    last_op: dict = field(default_factory=dict)  # rank -> time its last collective finished
    max_gap: dict = field(default_factory=dict)  # rank -> longest time between two finished collectives
    finished: bool = False
    notes: list = field(default_factory=list)

    def detection(self) -> dict:
        return {r: round(e["t"] - self.fault_at, 3) for r, e in self.errors.items()} if self.fault_at else {}

    def record(self) -> dict:
        return {"detection": self.detection(), "errors": self.errors, "finished": self.finished,
                "done": self.done, "max_gap_s": self.max_gap, "last_op_after_fault": {r: round(t - (self.fault_at or 0), 3)
                                                          for r, t in self.last_op.items()},
                "notes": self.notes}


def _wait_ready(ranks: Ranks, limit: float = 90.0) -> bool:
    end = time.time() + limit
    while time.time() < end:
        if all(r.tagged("READY") for r in ranks.ranks):
            return True
        if any(r.proc.poll() is not None for r in ranks.ranks):
            return False
        time.sleep(0.05)
    return False


def _collect(ranks: Ranks, out: LinkOutcome, limit: float) -> LinkOutcome:
    out.finished = ranks.wait(time.time() + limit)
    for rk in ranks.ranks:
        errs = rk.tagged("ERROR")
        if rk.tagged("DONE"):
            out.done[rk.rank] = rk.tagged("DONE")[0]
        if rk.tagged("OP"):
            times = rk.tagged("OP")
            out.last_op[rk.rank] = times[-1]
            out.max_gap[rk.rank] = round(max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0, 3)
        if errs:
            out.errors[rk.rank] = errs[0]
        elif rk.tagged("PASSED"):
            out.notes.append(f"rank {rk.rank} completed its collective")
        else:
            out.notes.append(f"rank {rk.rank}: no result (rc {rk.returncode}) {rk.stderr()[-300:]}")
    return out


def sigstop_peer(workdir: Path, group_timeout: float = 3.0, size: int = 1 << 20) -> LinkOutcome:
    """2 ranks on loopback; rank 1 is frozen mid-loop (its kernel keeps ACKing: no FIN, no RST)."""
    ranks = start_ranks(links_program, 2, workdir, args=["until_error"], setup=reliability_setup(),
                        env={"TB_TIMEOUT": str(group_timeout), "TB_SIZE": str(size)})
    out = LinkOutcome()
    try:
        if not _wait_ready(ranks):
            out.notes.append("setup failed: " + ranks.ranks[0].stderr()[-500:])
            return out
        time.sleep(0.3)
        out.fault_at = time.time()
        os.kill(ranks.ranks[1].proc.pid, signal.SIGSTOP)
        end = time.time() + group_timeout + 20
        while time.time() < end and ranks.ranks[0].proc.poll() is None:
            time.sleep(0.05)
        ranks.poll()
        errs = ranks.ranks[0].tagged("ERROR")
        if errs:
            out.errors[0] = errs[0]
        out.finished = ranks.ranks[0].proc.poll() is not None
    finally:
        ranks.kill_all()  # SIGCONT + SIGKILL for the frozen one
    return out


def cable_cut(lab: Lab, workdir: Path, cut_host: int = 0, cut_cable: int = 0, group_timeout: float = 10.0,
              size: int = 1 << 20, idle: float = 0.0, run_for: float = 0.0) -> LinkOutcome:
    """Ranks 0..n-1 on the lab's hosts; `ip link set DEV down` on one cable end while they work (or idle).
    With `run_for`, the ranks run checked all_reduces for that many seconds and report DONE (the job is
    expected to survive the cut)."""
    hosts = lab.hosts()
    env = {"TB_TIMEOUT": str(group_timeout), "TB_SIZE": str(size), "TB_IDLE": str(idle), "TB_RUN": str(run_for)}
    # One rank per emulated host, on its cables; the reliability runs' transport and code.
    reliability = reliability_setup()
    setup = lab_setup(lab).with_env(reliability.env).but(pythonpath=reliability.pythonpath)
    ranks = start_ranks(links_program, len(hosts), workdir, args=["checked_run" if run_for else "until_error"],
                        env=env, setup=setup)
    out = LinkOutcome()
    try:
        if not _wait_ready(ranks):
            out.notes.append("setup failed: " + ranks.ranks[0].stderr()[-800:])
            return out
        time.sleep(0.5 if not idle else 1.0)
        dev = lab.ifnames(hosts[cut_host])[cut_cable]
        out.fault_at = time.time()
        subprocess.run(lab.exec_argv(hosts[cut_host], ["ip", "link", "set", dev, "down"]), check=True)
        out.notes.append(f"cut {hosts[cut_host]}:{dev}")
        return _collect(ranks, out, group_timeout + idle + run_for + 30)
    finally:
        ranks.kill_all()
