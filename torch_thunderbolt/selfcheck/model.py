"""What a selfcheck finds, without torch: one `Line` per check, and the options of a run."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ..config import Injection

OK, WARN, FAIL = "ok", "warn", "FAIL"
# A check that did not run (no group of that kind here, no mps device, ...): its detail says why. Counted
# apart, so a report's "ok" count holds only checks that ran and passed.
NOT_RUN = "not run"
STATUSES = (OK, WARN, FAIL, NOT_RUN)
REPORT_VERSION = 2
# The exit code of a rank that found rank 0 stuck and wrote the report in its place (the run is over).
LEAD_STUCK = 3

FAMILIES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
            "send_recv", "barrier", "objects")
KINDS = ("shm", "rdma", "tcp")
BENCH_SIZES = (4 << 10, 1 << 20, 64 << 20)


@dataclass
class Line:
    """One check's outcome as the report shows it. `errors`: every error message in full (with its rank)."""

    status: str
    check: str
    detail: str
    fix: str = ""
    seconds: float = 0.0
    ranks: list[int] = field(default_factory=list)  # the ranks at fault (wrong, failing or stuck), if any
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def worst(statuses: "list[str]") -> str:
    """The line's status from every rank's: the worst that ran; "not run" only when no rank ran it."""
    for status in (FAIL, WARN, OK):
        if status in statuses:
            return status
    return NOT_RUN if statuses else OK


def counts(lines: "list[Line]") -> dict[str, int]:
    return {s: sum(1 for line in lines if line.status == s) for s in STATUSES}


def summary(tally: dict[str, int]) -> str:
    """"ok 20, warn 1, FAIL 0, not run 17": every status, those that did not run apart."""
    return ", ".join(f"{s} {tally.get(s, 0)}" for s in STATUSES)


@dataclass(frozen=True)
class Options:
    quick: bool = False
    out_dir: str = "."
    check_timeout: float = 30.0  # seconds for one check (its collectives' timeout too)
    cable_rate: str | None = None
    injections: tuple[Injection, ...] = ()
    nproc: int = 2

    def injected(self, fault: str, rank: int, family: str) -> bool:
        return any(i.fault == fault and i.rank == rank and i.op in ("", family) for i in self.injections)

    def to_argv(self) -> list[str]:
        """Flags that parse back into these options (for the ranks this process starts)."""
        argv = ["--out-dir", self.out_dir, "--check-timeout", repr(self.check_timeout)]
        argv += ["--quick"] if self.quick else []
        argv += ["--cable-rate", self.cable_rate] if self.cable_rate else []
        for i in self.injections:
            argv += ["--inject", f"{i.fault}:{i.rank}" + (f":{i.op}" if i.op else "")]
        return argv


def format_line(line: Line, index: int | None = None, total: int | None = None) -> str:
    where = f"[{index:>2}/{total}] " if index is not None and total else ""
    text = f"{where}{line.status:<4} {line.check}: {line.detail} ({line.seconds:.1f} s)"
    if line.fix:
        text += f"\n{' ' * len(where)}     fix: {line.fix}"
    return text


class Findings(Protocol):
    """What a report is written from: a run's lines, figures and facts (`rank.Selfcheck` has them)."""

    lines: list[Line]
    opts: Any  # the run's Options (`quick`)
    world: int
    started: float
    rank: int
    hosts: list[dict[str, Any]]
    doctor: Any
    ddp_figures: Any
    figures: Any
    bench_meta: Any
    bench_text: str
