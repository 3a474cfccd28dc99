"""One rank of a selfcheck: every check in turn on every rank, each with a deadline; rank 0 prints the lines
and writes the report.

Bookkeeping runs on a gloo control group; the checked traffic runs on groups of the thunderbolt backend,
one per kind of link, whose collectives time out with the check. Each rank marks in the rendezvous store
when it starts and ends a check, so when a check does not end on every rank in time rank 0 names the ranks
that never finished it (the store answers even when a rank stops answering its peers) and stops there:
the group is no longer trustworthy.
"""
from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist

from ..bench.config import RankEnv
from ..config import Config
from ..errors import CollectiveTimeout, ConfigError, PeerLostError, ThunderboltError
from . import ops, report
from .model import BENCH_SIZES, FAIL, KINDS, OK, WARN, Line, Options, worst

GRACE = 5.0  # seconds the other ranks get to finish a check after its deadline on this one
FAULT_BOUND = 20.0  # seconds within which survivors must get a named error when a rank leaves

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

    # -- the frame of every check ------------------------------------------------------------------------

    def say(self, text: str) -> None:
        if self.lead:
            print(text, file=self.out, flush=True)

    def check(self, name: str, part: Callable[[], Part], collective: str = "") -> Line:
        """Run this rank's `part` of check `name`, then combine every rank's part on rank 0 (within the
        check's deadline). `collective`: the op family it exercises (where a test-only hang may be planted)."""
        self.index += 1
        key = f"selfcheck/{self.index}"
        store = self.store
        store.set(f"{key}/start/{self.rank}", name)
        begin = time.monotonic()
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
            self._ack(key)
            line = Line(mine[0], name, mine[1], mine[2], time.monotonic() - begin, errors=mine[3])
            self.lines.append(line)
            return line
        parts = self._collect(key, begin)
        seconds = time.monotonic() - begin
        if parts is None or any(p is None for p in parts):
            missing = [r for r in range(self.world) if parts is None or parts[r] is None]
            line = self._stuck_line(name, key, missing, seconds, [p for p in (parts or []) if p])
            self._emit(line)
            raise Stuck(line.detail)
        line = self._combine(name, parts, seconds)
        self._emit(line)
        return line

    def _collect(self, key: str, begin: float) -> list[Part | None] | None:
        """Every rank's part, None where a rank did not end the check before its deadline (rank 0)."""
        deadline = begin + self.opts.check_timeout + GRACE
        parts: list[Part | None] = []
        for r in range(self.world):
            if self._wait_for(f"{key}/done/{r}", begin, deadline):
                parts.append(tuple(json.loads(self.store.get(f"{key}/done/{r}"))))  # type: ignore[arg-type]
            else:
                parts.append(None)
        self.store.set(f"{key}/verdict", "stuck" if any(p is None for p in parts) else "on")
        return parts

    def _ack(self, key: str) -> None:
        """The other ranks follow rank 0's verdict (it waits for everyone), so every rank stops together."""
        self.store.wait([f"{key}/verdict"], datetime.timedelta(seconds=self.opts.check_timeout + 2 * GRACE))
        if self.store.get(f"{key}/verdict") == b"stuck":
            raise Stuck(f"rank 0 found ranks stuck in check {self.index}")

    def _wait_for(self, key: str, begin: float, deadline: float | None = None) -> bool:
        deadline = deadline or begin + self.opts.check_timeout + 2 * GRACE
        while True:
            if self.store.check([key]):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _stuck_line(self, name: str, key: str, missing: list[int], seconds: float, parts: list[Part]) -> Line:
        started = [r for r in missing if self.store.check([f"{key}/start/{r}"])]
        what = ", ".join(f"rank {r} ({'started it, never finished' if r in started else 'never started it'})"
                         for r in missing)
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
        if status == OK:
            return Line(OK, name, parts[0][1], seconds=seconds)
        first = parts[bad[0]]
        detail = "; ".join(dict.fromkeys(p[1] for p in parts if p and p[0] == status))
        return Line(status, name, detail, first[2], seconds, ranks=bad if status == FAIL else [], errors=errors)

    def _emit(self, line: Line) -> None:
        self.lines.append(line)
        if self.lead:
            from .model import format_line

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
        init_deadline = datetime.timedelta(seconds=max(60.0, self.opts.check_timeout))
        try:
            dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world,
                                    timeout=init_deadline)
        except Exception as exc:  # noqa: BLE001 - the rendezvous is a check of its own
            line = Line(FAIL, "rendezvous", f"rank {self.rank} could not meet the other {self.world - 1} rank(s) "
                        f"at {self.env.master_addr}:{self.env.master_port}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}",
                        "is every host up and running the same job? Is MASTER_ADDR reachable from every host?",
                        errors=[_error_text(exc)])
            print(f"FAIL {line.check}: {line.detail}\n     fix: {line.fix}", file=self.out if self.lead else sys.stderr)
            return 1
        self.store = dist.distributed_c10d._get_default_store()
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
        if self.lead:
            paths = report.write(self.opts.out_dir, report.document(self, stuck))
            self.say(f"# wrote {paths[0]} and {paths[1]} (attach both to a report)")
        failed = stuck is not None or any(line.status == FAIL for line in self.lines)
        return 1 if failed else 0

    def _gather_hosts(self) -> list[dict]:
        from ..rendezvous.hosts import host_identity

        mine = report.system_facts()
        mine.update(rank=self.rank, host=host_identity(), hostname=socket.gethostname(),
                    mps=bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()))
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        return every

    def _plan(self) -> list[Callable[[], None]]:
        steps: list[Callable[[], None]] = [self._doctor, *[(lambda k=k: self._kind(k)) for k in KINDS]]
        devices = ["cpu"] + (["mps"] if all(h["mps"] for h in self.hosts) else [])
        for kind in KINDS:
            for device in devices:
                for family in ops.FAMILIES:
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
            from ..doctor import gather_facts, run_checks

            facts = gather_facts()
            findings = run_checks(facts)
            self.doctor_findings = [dataclasses.asdict(f) for f in findings]
            self.store.set(f"selfcheck/doctor/{self.rank}", json.dumps(
                {"findings": self.doctor_findings, "interfaces": facts.interfaces,
                 "thunderbolt_ifnames": facts.thunderbolt_ifnames, "mtus": facts.mtus,
                 "port_speeds": (facts.rdma.port_speeds if facts.rdma else {})}))
            status = worst([f.status for f in findings])
            bad = [f for f in findings if f.status != OK]
            name = self.hosts[self.rank]["hostname"]
            if not bad:
                return OK, f"{len(findings)} doctor checks ok on {name}", "", []
            return (status, f"{name}: " + "; ".join(f"[{f.status}] {f.check}: {f.detail}" for f in bad),
                    " | ".join(f.fix for f in bad if f.fix), [])

        line = self.check("doctor on every host", part)
        if self.lead:
            keys = {f"{h['hostname']} (rank {h['rank']})": f"selfcheck/doctor/{h['rank']}" for h in self.hosts}
            self.doctor = {name: json.loads(self.store.get(k)) for name, k in keys.items() if self.store.check([k])}
        if line.status == OK:
            line.detail = f"{sum(len(d['findings']) for d in getattr(self, 'doctor', {}).values()) or 'all'} " \
                          f"findings ok on {len({h['host'] for h in self.hosts})} host(s)"

    def _kind(self, kind: str) -> None:
        single = len({h["host"] for h in self.hosts}) == 1

        def part() -> Part:
            if kind == "shm" and not single:
                return OK, "not checked: the ranks run on several hosts (shared memory joins ranks of one host)", \
                    "", []
            cfg = dataclasses.replace(Config.from_env(os.environ), transport=kind)
            try:
                group = dist.new_group(backend="thunderbolt", timeout=self.timeout, pg_options=cfg)
            except ConfigError as exc:
                if kind == "rdma":
                    # Where RDMA is expected (a Mac), its absence is worth a look; elsewhere it is normal.
                    status = WARN if sys.platform == "darwin" else OK
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
        self._emit(Line(OK, name, f"not checked: {why}"))

    def _no_mps(self) -> None:
        self._skip("ops on mps tensors", "no mps device on every rank (Apple-silicon Macs have one)")

    def _ddp(self) -> None:
        kind = next((k for k in KINDS if k in self.groups), None)
        devices = ["cpu"] + (["mps"] if all(h["mps"] for h in self.hosts) else [])

        def part() -> Part:
            if kind is None:
                return FAIL, "no group to run DDP on", "see the 'links of kind' lines", []
            from .ddp import ddp_step

            results = {d: ddp_step(self.groups[kind], self.rank, self.world, d) for d in devices}
            problems = [p for d in devices for p in results[d][1]]
            if "mps" in results:
                gap = max((a - b).abs().max().item() for a, b in zip(results["mps"][0], results["cpu"][0]))
                if gap > 1e-4:
                    problems.append(f"mps gradients differ from cpu by {gap:g}")
            if problems:
                return FAIL, f"rank {self.rank}: " + "; ".join(problems), "report it with the selfcheck files", \
                    [f"rank {self.rank}: {p}" for p in problems]
            return OK, f"one DDP step over {kind} on {'/'.join(devices)}: gradients equal the average of every " \
                       f"rank's", "", []

        self.check("DDP step", part)

    def _bench(self) -> None:
        from ..bench import app
        from ..bench.config import BackendSpec, BenchConfig

        sizes = BENCH_SIZES[:2] if self.opts.quick else BENCH_SIZES
        path = os.path.join(tempfile.gettempdir(), f"selfcheck-bench-{os.getpid()}.json")
        cfg = BenchConfig(backends=(BackendSpec("thunderbolt", "thunderbolt"), BackendSpec("gloo", "gloo")),
                          baseline="gloo", ops=("all_reduce",), sizes=sizes, iters=3 if self.opts.quick else 10,
                          warmup=1 if self.opts.quick else 3, memcpy=True, cable_rate=self._cable_rate(),
                          json_path=path if self.lead else None, progress=False, timeout=self.opts.check_timeout)

        def part() -> Part:
            backend = Config.from_env(os.environ)
            groups = [dist.new_group(backend="thunderbolt", timeout=self.timeout, pg_options=backend),
                      dist.new_group(backend="gloo", timeout=self.timeout)]
            text = io.StringIO()
            code = app.run_in_groups(cfg, self.env, backend, groups, out=text, err=text)
            if self.lead:
                self.bench_text = text.getvalue()
                with open(path) as f:
                    self.figures = json.load(f)["results"]
                os.unlink(path)
            if code:
                return FAIL, f"rank {self.rank}: the bench found wrong results", "report it", [text.getvalue()]
            return OK, report.bench_summary(self.figures, cfg.cable_rate) if self.lead else "", "", []

        self.check("bench against gloo", part)

    def _cable_rate(self) -> str | None:
        if self.opts.cable_rate:
            return self.opts.cable_rate
        speeds = [s for d in getattr(self, "doctor", {}).values() for s in d.get("port_speeds", {}).values() if s]
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
