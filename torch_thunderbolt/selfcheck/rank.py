"""One rank of a selfcheck: every check in turn on every rank, each with a deadline; rank 0 prints the lines
and writes the report.

Bookkeeping runs on a gloo control group; the checked traffic runs on groups of the thunderbolt backend,
one per kind of link, whose collectives time out with the check. Each rank marks in the rendezvous store
when it starts and ends a check, so when a check does not end on every rank in time rank 0 names the ranks
that never finished it (the store answers even when a rank stops answering its peers) and stops there:
the group is no longer trustworthy. Rank 0 publishes each check's line (its verdict) in the store, so every
rank holds the same lines; when rank 0 itself does not publish one in time, the lowest rank that finished
the check names it, prints the line and writes the report instead.
"""
from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist

from ..bench.config import RankEnv
from ..config import Config
from ..errors import CollectiveTimeout, ConfigError, PeerLostError, ThunderboltError
from . import ops, report
from .model import (BENCH_SIZES, FAIL, FAMILIES, KINDS, LEAD_STUCK, NOT_RUN, OK, WARN, Line, Options, counts,
                    format_line, summary, worst)

GRACE = 5.0  # seconds the other ranks get to finish a check after its deadline on this one
FAULT_BOUND = 20.0  # seconds within which survivors must get a named error when a rank leaves
RENDEZVOUS_CHECKS = 2  # the ranks' meeting waits this many checks' deadlines

# A rank's part of a check: (status, detail, fix, errors); rank 0 combines every rank's part.
Part = tuple[str, str, str, list[str]]


class Stuck(ThunderboltError):
    """Ranks did not finish a check in time; the job cannot go on."""


def _error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


class Selfcheck:
    def __init__(self, opts: Options, env: RankEnv, out: TextIO = sys.stdout) -> None:
        self.opts, self.env, self.out = opts, env, out
        self.rank, self.world = env.rank, env.world_size
        self.lead = env.rank == 0
        self.lines: list[Line] = []
        self.index = 0
        self.groups: dict[str, Any] = {}  # kind -> thunderbolt group forced to that kind
        self.hosts: list[dict] = []
        self.figures: list[dict] = []
        self.started = time.monotonic()
        self.timeout = datetime.timedelta(seconds=opts.check_timeout)
        self.reporter = self.lead  # the rank that prints the lines and writes the report
        self.total = 0
        self.doctor: dict[str, dict] = {}  # "hostname (rank r)" -> that host's doctor record
        self.bench_meta: dict = {}
        self.bench_text = ""
        self.ddp_figures: dict[str, dict] = {}  # device -> scripts/ddp_overlap.py's phases and hidden share
        self.running = False  # a "running" note is on the terminal's last line

    # -- the frame of every check ------------------------------------------------------------------------

    def say(self, text: str) -> None:
        if self.reporter:
            self._clear_running()
            print(text, file=self.out, flush=True)

    def _show_running(self, name: str) -> None:
        """On a terminal, which check runs now (replaced by its line when it ends)."""
        if self.reporter and self.out.isatty():
            self.out.write(f"\r[{self.index:>2}/{self.total}] ...  {name}\033[K")
            self.out.flush()
            self.running = True

    def _clear_running(self) -> None:
        if self.running:
            self.out.write("\r\033[K")
            self.running = False

    def check(self, name: str, part: Callable[[], Part], collective: str = "") -> Line:
        """Run this rank's `part` of check `name`, then combine every rank's part on rank 0 (within the
        check's deadline). `collective`: the op family it exercises (where a test-only hang may be planted)."""
        self.index += 1
        key = f"selfcheck/{self.index}"
        store = self.store
        store.set(f"{key}/start/{self.rank}", name)
        begin = time.monotonic()
        self._show_running(name)
        if collective and self.opts.injected("hang", self.rank, collective):
            while True:  # test-only (--inject hang): this rank stops answering, as a wedged one would
                time.sleep(3600)
        try:
            mine = part()
        except Exception as exc:  # noqa: BLE001 - every failure is a line with its message in full
            mine = (FAIL, f"rank {self.rank}: {type(exc).__name__}: {exc}", self._fix_for(exc),
                    [f"rank {self.rank}: {_error_text(exc)}"])
        store.set(f"{key}/done/{self.rank}", json.dumps(mine))
        if not self.lead:
            return self._follow(name, key, begin, mine)
        parts = self._collect(key, begin)
        seconds = time.monotonic() - begin
        missing = [r for r in range(self.world) if parts[r] is None]
        if missing:
            line = self._stuck_line(name, key, missing, seconds, [p for p in parts if p])
        else:
            line = self._combine(name, parts, seconds)
        store.set(f"{key}/verdict", json.dumps({"line": line.to_json(), "stuck": bool(missing)}))
        self._emit(line)
        if missing:
            raise Stuck(line.detail)
        return line

    def _collect(self, key: str, begin: float) -> list[Part | None]:
        """Every rank's part, None where a rank did not end the check before its deadline (rank 0)."""
        deadline = begin + self.opts.check_timeout + GRACE
        parts: list[Part | None] = []
        for r in range(self.world):
            if self._wait_for(f"{key}/done/{r}", deadline):
                parts.append(tuple(json.loads(self.store.get(f"{key}/done/{r}"))))  # type: ignore[arg-type]
            else:
                parts.append(None)
        return parts

    def _follow(self, name: str, key: str, begin: float, mine: Part) -> Line:
        """The other ranks take rank 0's verdict (it waits for everyone), so every rank holds the same line
        and stops together. Rank 0 gives it within its deadline; past a longer one it is stuck itself."""
        deadline = time.monotonic() + self.opts.check_timeout + 2 * GRACE
        if self._wait_for(f"{key}/verdict", deadline):
            verdict = json.loads(self.store.get(f"{key}/verdict"))
            line = Line(**verdict["line"])
            self.lines.append(line)
            if verdict["stuck"]:
                raise Stuck(line.detail)
            return line
        finished = [r for r in range(1, self.world) if r == self.rank or self._has(f"{key}/done/{r}")]
        missing = [r for r in range(self.world) if r not in finished]
        # The lowest rank that finished the check reports it: one report, as rank 0 would have written.
        self.reporter = self.rank == finished[0]
        parts = [tuple(json.loads(self.store.get(f"{key}/done/{r}"))) if r != self.rank else mine
                 for r in finished if r == self.rank or self._has(f"{key}/done/{r}")]
        line = self._stuck_line(name, key, missing, time.monotonic() - begin, parts)  # type: ignore[arg-type]
        self._emit(line)
        raise Stuck(line.detail)

    def _has(self, key: str) -> bool:
        """Whether the store holds `key`; False when the store (rank 0's process serves it) does not answer."""
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - a store that does not answer holds nothing we can read
            return False

    def _wait_for(self, key: str, deadline: float) -> bool:
        while True:
            if self._has(key):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _stuck_line(self, name: str, key: str, missing: list[int], seconds: float, parts: list[Part]) -> Line:
        store_answers = self._has(f"{key}/start/{self.rank}")

        def state(r: int) -> str:
            if not store_answers:
                return "its process, which serves the rendezvous store, does not answer" if r == 0 else \
                    "unknown: the store does not answer"
            return "started it, never finished" if self._has(f"{key}/start/{r}") else "never started it"

        what = ", ".join(f"rank {r} ({state(r)})" for r in missing)
        errors = [e for p in parts for e in p[3]]
        return Line(FAIL, name, f"stuck: {what} within {self.opts.check_timeout:g} s", ranks=missing,
                    fix=f"rank(s) {', '.join(map(str, missing))} stopped answering: look at their host (a wedged "
                        "port or process, a sleeping Mac); the checks after this one did not run",
                    seconds=seconds, errors=errors)

    def _combine(self, name: str, parts: list[Part | None], seconds: float) -> Line:
        statuses = [p[0] for p in parts if p]
        status = worst(statuses)
        bad = [r for r, p in enumerate(parts) if p and p[0] != OK]
        errors = [e for p in parts if p for e in p[3]]
        if status in (OK, NOT_RUN):
            return Line(status, name, next(p[1] for p in parts if p and p[0] == status), seconds=seconds)
        first = parts[bad[0]]
        detail = "; ".join(dict.fromkeys(p[1] for p in parts if p and p[0] == status))
        return Line(status, name, detail, first[2], seconds, ranks=bad if status == FAIL else [], errors=errors)

    def _emit(self, line: Line) -> None:
        self.lines.append(line)
        self.say(format_line(line, self.index, self.total))

    @staticmethod
    def _fix_for(exc: BaseException) -> str:
        if isinstance(exc, CollectiveTimeout):
            return "a rank did not take part in time: see which (the message names it) and its own output"
        if isinstance(exc, PeerLostError):
            return "a peer's connection broke: is its process alive, the cable seated?"
        if isinstance(exc, ConfigError):
            return "fix the setting the message names"
        return "report this with the selfcheck files attached"

    # -- the run --------------------------------------------------------------------------------------------

    def run(self) -> int:
        from ..backend.registration import register

        register()
        os.environ.setdefault("MASTER_ADDR", self.env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.env.master_port))
        # Ranks started over ssh on several Macs arrive seconds apart (each loads torch first).
        init_deadline = datetime.timedelta(seconds=RENDEZVOUS_CHECKS * self.opts.check_timeout)
        begin = time.monotonic()
        try:
            dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world,
                                    timeout=init_deadline)
        except Exception as exc:  # noqa: BLE001 - the rendezvous is a check of its own
            line = Line(FAIL, "rendezvous", f"rank {self.rank} could not meet the other {self.world - 1} rank(s) "
                        f"at {self.env.master_addr}:{self.env.master_port}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}",
                        "is every host up and running the same job? Is MASTER_ADDR reachable from every host?",
                        seconds=time.monotonic() - begin, errors=[_error_text(exc)])
            if not self.lead:
                print(format_line(line), file=sys.stderr, flush=True)
                return 1
            # Rank 0 reports what it alone can see: its host, its doctor (the addresses a job would use,
            # whether the store's address answers), and the error in full.
            self.hosts = [self._facts()]
            self._emit(line)
            record, (status, detail, fix, errors) = self._doctor_here()
            self.doctor = {f"{self.hosts[0]['hostname']} (rank 0)": record}
            self._emit(Line(status, "doctor on this host", detail, fix, errors=errors))
            self._write_report(None)
            return 1
        self.store = dist.distributed_c10d._get_default_store()
        # A store that stops answering (rank 0's process frozen) must not hold a rank beyond a check's deadline.
        self.store.set_timeout(datetime.timedelta(seconds=self.opts.check_timeout + GRACE))
        code = 1
        try:
            code = self._checks()
        finally:
            dist.destroy_process_group()
        return code

    def _checks(self) -> int:
        from ..version import __version__

        self.hosts = self._gather_hosts()
        plan = self._plan()
        self.total = len(plan)
        self.say(f"# torch-thunderbolt {__version__} selfcheck: {self.world} ranks on {len({h['host'] for h in self.hosts})} "
                 f"host(s){', quick' if self.opts.quick else ''}; {self.total} checks, each within "
                 f"{self.opts.check_timeout:g} s")
        stuck = None
        try:
            for step in plan:
                step()
        except Stuck as exc:
            stuck = str(exc)
        self.say(f"# {summary(counts(self.lines))}" + (f" of {self.total} checks (stopped)" if stuck else ""))
        if self.reporter:
            self._write_report(stuck)
        if stuck is not None and self.reporter and not self.lead:
            return LEAD_STUCK
        failed = stuck is not None or any(line.status == FAIL for line in self.lines)
        return 1 if failed else 0

    def _write_report(self, stuck: str | None) -> None:
        doc = report.document(self, stuck)
        paths = report.write(self.opts.out_dir, doc, self.rank)
        self.say(f"# which parallelism over these cables: {doc['guidance']['row']} ({doc['guidance']['why']})")
        self.say(f"# wrote {paths[0]} and {paths[1]} (attach both to a report)")

    def _facts(self) -> dict:
        from ..rendezvous.hosts import host_identity

        mine = report.system_facts()
        mine.update(rank=self.rank, host=host_identity(), hostname=socket.gethostname(),
                    mps=bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()))
        return mine

    def _gather_hosts(self) -> list[dict]:
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, self._facts())
        return every

    def _plan(self) -> list[Callable[[], None]]:
        steps: list[Callable[[], None]] = [self._doctor, *[(lambda k=k: self._kind(k)) for k in KINDS]]
        devices = ["cpu"] + (["mps"] if all(h["mps"] for h in self.hosts) else [])
        for kind in KINDS:
            for device in devices:
                for family in FAMILIES:
                    steps.append(lambda k=kind, d=device, f=family: self._family(k, d, f))
        steps += [self._no_mps] if devices == ["cpu"] else []
        steps += [self._ddp, self._bench, self._fault]
        return steps

    # -- the checks ---------------------------------------------------------------------------------------

    def _doctor(self) -> None:
        first_of_host = next(h["rank"] for h in self.hosts if h["host"] == self.hosts[self.rank]["host"])

        def part() -> Part:
            if first_of_host != self.rank:
                return OK, "", "", []
            record, mine = self._doctor_here()
            self.store.set(f"selfcheck/doctor/{self.rank}", json.dumps(record))
            return mine

        line = self.check("doctor on every host", part)
        keys = {f"{h['hostname']} (rank {h['rank']})": f"selfcheck/doctor/{h['rank']}" for h in self.hosts}
        self.doctor = {name: json.loads(self.store.get(k)) for name, k in keys.items() if self._has(k)}
        if line.status == OK:
            line.detail = f"{sum(len(d['findings']) for d in self.doctor.values()) or 'all'} " \
                          f"findings ok on {len({h['host'] for h in self.hosts})} host(s)"

    def _doctor_here(self) -> tuple[dict, Part]:
        """The doctor on this host: its record for the report, and this rank's part of the check."""
        from ..doctor import gather_facts, run_checks

        facts = gather_facts()
        findings = run_checks(facts)
        status = worst([f.status for f in findings])
        bad = [f for f in findings if f.status != OK]
        name = socket.gethostname()
        if not bad:
            return report.doctor_record(facts, findings), (OK, f"{len(findings)} doctor checks ok on {name}", "", [])
        return report.doctor_record(facts, findings), (
            status, f"{name}: " + "; ".join(f"[{f.status}] {f.check}: {f.detail}" for f in bad),
            " | ".join(f.fix for f in bad if f.fix), [])

    def _kind(self, kind: str) -> None:
        single = len({h["host"] for h in self.hosts}) == 1

        def part() -> Part:
            if kind == "shm" and not single:
                return NOT_RUN, "the ranks run on several hosts (shared memory joins ranks of one host)", "", []
            cfg = dataclasses.replace(Config.from_env(os.environ), transport=kind)
            try:
                group = dist.new_group(backend="thunderbolt", timeout=self.timeout, pg_options=cfg)
            except ConfigError as exc:
                if kind == "rdma":
                    # Where RDMA is expected (a Mac), its absence is worth a look; elsewhere it is normal.
                    status = WARN if sys.platform == "darwin" else NOT_RUN
                    return status, f"not available: {exc}", \
                        "run `torch-thunderbolt doctor` for RDMA's set-up (rdma_ctl enable in Recovery)" \
                        if status == WARN else "", []
                raise
            self.groups[kind] = group
            return OK, f"a group over {self.world} ranks forced to {kind}", "", []

        self.check(f"links of kind {kind}", part)

    def _family(self, kind: str, device: str, family: str) -> None:
        if kind not in self.groups:
            return self._skip(f"{family} over {kind} on {device}", f"no {kind} group (see 'links of kind {kind}')")
        group = self.groups[kind]
        corrupt = self.opts.injected("wrong", self.rank, family)

        def part() -> Part:
            count, problems = ops.FAMILY_FUNCTIONS[family](group, dist.get_rank(group), self.world, device, corrupt)
            if problems:
                return FAIL, f"rank {self.rank}: {len(problems)} wrong: {'; '.join(problems[:3])}", \
                    "a wrong result is a bug: report it with the selfcheck files attached", \
                    [f"rank {self.rank}: {p}" for p in problems]
            return OK, f"{count} case(s) exact against the reference", "", []

        self.check(f"{family} over {kind} on {device}", part, collective=family)

    def _skip(self, name: str, why: str) -> None:
        self.index += 1
        self._emit(Line(NOT_RUN, name, why))

    def _no_mps(self) -> None:
        self._skip("ops on mps tensors", "no mps device on every rank (Apple-silicon Macs have one)")

    def _ddp(self) -> None:
        kind = next((k for k in KINDS if k in self.groups), None)
        devices = ["cpu"] + (["mps"] if all(h["mps"] for h in self.hosts) else [])

        def part() -> Part:
            if kind is None:
                return FAIL, "no group to run DDP on", "see the 'links of kind' lines", []
            from .ddp import ddp_step, overlap

            results = {d: ddp_step(self.groups[kind], self.rank, self.world, d) for d in devices}
            problems = [p for d in devices for p in results[d][1]]
            if "mps" in results:
                gap = max((a - b).abs().max().item() for a, b in zip(results["mps"][0], results["cpu"][0]))
                if gap > 1e-4:
                    problems.append(f"mps gradients differ from cpu by {gap:g}")
            if problems:
                return FAIL, f"rank {self.rank}: " + "; ".join(problems), "report it with the selfcheck files", \
                    [f"rank {self.rank}: {p}" for p in problems]
            iters, warmup = (3, 1) if self.opts.quick else (7, 2)
            # Every rank gets the same figures (each phase is the slowest rank's), so each can report them.
            self.ddp_figures = {d: {"transport": kind, **overlap(self.groups[kind], self.rank, d, iters, warmup)}
                                for d in devices}
            hidden = "; ".join(f"on {d} it hides {f['hidden']:.2f} of the exchange (backward alone "
                               f"{1e3 * f['compute_s']:.0f} ms, with the exchange {1e3 * f['step_s']:.0f} ms, "
                               f"exchange alone {1e3 * f['exchange_s']:.0f} ms)" for d, f in self.ddp_figures.items())
            return OK, f"one DDP step over {kind} on {'/'.join(devices)}: gradients equal the average of every " \
                       f"rank's; {hidden}", "", []

        self.check("DDP step", part)

    def _bench(self) -> None:
        from ..bench import app
        from ..bench.config import BackendSpec, BenchConfig

        sizes = BENCH_SIZES[:2] if self.opts.quick else BENCH_SIZES
        cfg = BenchConfig(backends=(BackendSpec("thunderbolt", "thunderbolt"), BackendSpec("gloo", "gloo")),
                          baseline="gloo", ops=("all_reduce",), sizes=sizes, iters=3 if self.opts.quick else 10,
                          warmup=1 if self.opts.quick else 3, memcpy=True, cable_rate=self._cable_rate(),
                          progress=False, timeout=self.opts.check_timeout)
        single = len({h["host"] for h in self.hosts}) == 1

        def part() -> Part:
            backend = Config.from_env(os.environ)
            groups = [dist.new_group(backend="thunderbolt", timeout=self.timeout, pg_options=backend),
                      dist.new_group(backend="gloo", timeout=self.timeout)]
            text = io.StringIO()
            code, doc = app.run_in_groups(cfg, self.env, backend, groups, out=text, err=text)
            if doc is not None:  # rank 0's: the records and what they were measured against
                self.figures, self.bench_meta, self.bench_text = doc["results"], doc["meta"], text.getvalue()
            if code:
                return FAIL, f"rank {self.rank}: the bench found wrong results", "report it", [text.getvalue()]
            return OK, report.bench_summary(self.figures, cfg.cable_rate, single) if doc is not None else "", "", []

        self.check("bench against gloo", part)

    def _cable_rate(self) -> str | None:
        if self.opts.cable_rate:
            return self.opts.cable_rate
        speeds = [s for d in self.doctor.values() for s in d["port_speeds"].values() if s]
        return f"{int(min(speeds))}gbit" if speeds else None

    def _fault(self) -> None:
        if self.world < 3:
            return self._skip("a rank leaving", f"needs 3 or more ranks, the job has {self.world}")
        leaver = self.world - 1
        tcp = self.groups.get("tcp")

        def part() -> Part:
            if tcp is None:
                return FAIL, "no tcp group to check on", "see 'links of kind tcp'", []
            # The group's last rank leaves the job at once (as a crash would), the others run an all_reduce:
            # each must get an error naming it, within FAULT_BOUND.
            dist.barrier(group=tcp)
            if self.rank == leaver:
                self.store.set(f"selfcheck/{self.index}/done/{self.rank}", json.dumps([OK, "left", "", []]))
                sys.stdout.flush()
                os._exit(0)
            t = torch.ones(1 << 16)
            start = time.monotonic()
            try:
                dist.all_reduce(t, group=tcp)
            except ThunderboltError as exc:
                took = time.monotonic() - start
                named = f"rank {leaver}" in str(exc) or getattr(exc, "peer", -1) == leaver or \
                    leaver in getattr(exc, "ranks", [])
                if not named:
                    return FAIL, f"rank {self.rank} got an error not naming rank {leaver}: {type(exc).__name__}: " \
                                 f"{exc}", "report it", [_error_text(exc)]
                if took > FAULT_BOUND:
                    return FAIL, f"rank {self.rank} took {took:.1f} s (> {FAULT_BOUND:g} s) to learn rank {leaver} " \
                                 "left", "report it", [_error_text(exc)]
                return OK, f"rank {leaver} left; every survivor got {type(exc).__name__} naming it within " \
                           f"{FAULT_BOUND:g} s", "", []
            return FAIL, f"rank {self.rank}: all_reduce finished although rank {leaver} had left", "report it", []

        self.check("a rank leaving", part)
