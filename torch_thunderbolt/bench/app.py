"""One benchmark run: spawn local ranks, or act as one rank of a launched job.

A rank initialises the default group with gloo (the control group: rendezvous, gathering times, the
raw-link handshake) and one `new_group` per measured backend over all ranks, so the measured traffic
never shares a group with the bookkeeping.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

from ..errors import ConfigError, ThunderboltError
from . import bounds, link, memcpy, metrics, report, spawn, spec, table
from ..config import Config
from .config import (BackendSpec, BenchConfig, RankEnv, backend_config, measured_backends, rank_env, to_argv,
                     validate_for_world)
from .sizes import format_size
from .spec import FLOOR_LABEL, NULL_BACKEND

LINK_SOCKBUF = 4 << 20
LINK_PINGS = 2000


def main(cfg: BenchConfig, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    env = rank_env(environ)
    if cfg.plot_path:
        report.require_matplotlib()
    if env is None:
        validate_for_world(cfg, cfg.nproc)
        _check_backends(measured_backends(cfg))  # one clear error here rather than one per spawned rank
        backend_config(cfg, environ)  # a bad THUNDERBOLT_* is one clear error here, not one per rank
        return spawn.run_local(cfg.nproc, to_argv(cfg), cfg.timeout)
    return run_rank(cfg, env)


class Progress:
    """A progress bar on rank 0's terminal; silent when stderr is not a terminal."""

    def __init__(self, stream: TextIO, total: int, enabled: bool) -> None:
        self.stream, self.total, self.done, self.label = stream, total, 0, ""
        self.enabled = enabled and stream.isatty()
        self._last = 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            self.stream.write(table.format_progress(self.done, self.total, self.label))
            self.stream.flush()

    def clear(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def _check_backends(backends: Sequence[BackendSpec]) -> None:
    import torch.distributed as dist

    if any(b.kind == "thunderbolt" for b in backends):
        # Explicitly: under `python -m torch_thunderbolt bench` (how ranks are started) the package's own import
        # does not register, to keep the command line free of torch until a command needs it.
        from ..backend.registration import register

        register()
    if any(b.kind == NULL_BACKEND for b in backends):
        from . import null

        null.register()
    for b in backends:
        if b.kind not in dist.Backend.backend_list:
            hint = " (import torch_thunderbolt did not register it: is the core installed?)" \
                if b.kind == "thunderbolt" else ""
            raise ConfigError(f"backend {b.kind!r} is not registered with torch.distributed{hint}; "
                              f"measure others with e.g. --backends gloo")


def _transport_of(kind: str, group: Any, backend: Config) -> str:
    """What carries a group's bytes; for our backend, what "auto" actually chose when it says so."""
    if kind == "gloo":
        return "tcp"
    if kind == NULL_BACKEND:
        return "none"
    described = getattr(group, "transport", None)
    if isinstance(described, str):
        return described
    if described is not None:  # a transport object: what its engine holds ("tcp", "shm", "shm+tcp")
        return str(getattr(described, "kind", "?"))
    return backend.transport if kind == "thunderbolt" else "?"


def unlike_paths_note(transports: Mapping[str, str], baseline: str | None) -> str | None:
    """The warning printed above the tables when a backend's bytes take another path than the baseline's."""
    base = transports.get(baseline) if baseline else None
    if base is None or base == "none":
        return None
    others = {label: t for label, t in transports.items() if label != baseline and t not in (base, "none")}
    if not others:
        return None
    paths = ", ".join(f"{label} over {t}" for label, t in sorted(others.items()))
    hint = " (--transport tcp compares the same path)" if "shm" in " ".join(others.values()) else ""
    return (f"# NOTE: {paths}, {baseline} over {base}: the ratio column compares these paths as much as the "
            f"backends, not a cable{hint}")


def _link_streams_of(kind: str, streams: int) -> int | None:
    """The stream count whose raw throughput a backend's busbw is compared to (gloo: one socket per peer)."""
    return {"thunderbolt": streams, "gloo": 1}.get(kind)


def local_networks(master_addr: str, ifnames: tuple[str, ...] = ()) -> tuple[list[str], str | None]:
    """This rank's networks as the backend would choose its addresses (`ifnames`: THUNDERBOLT_IFNAME, else
    the interface towards the store host), and why they are unknown when they are ([] then)."""
    try:
        from ..transport.netif import choose_addresses, network_of

        return [network_of(a) for a in choose_addresses(ifnames, master_addr)], None
    except (ThunderboltError, ImportError, OSError, ValueError) as exc:
        return [], str(exc)


def run_rank(cfg: BenchConfig, env: RankEnv, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
             op_table: Mapping[str, Any] | None = None) -> int:
    """Everything one rank does; rank 0 prints and writes files. Returns the exit code."""
    validate_for_world(cfg, env.world_size)
    backend = backend_config(cfg, os.environ)
    if cfg.workload is not None:
        from .workloads.session import run_rank as run_workload

        _check_backends(cfg.backends)
        return run_workload(cfg, env, backend, out)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)  # for torch's env:// rendezvous of the control group
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    import torch.distributed as dist

    backends = measured_backends(cfg)
    _check_backends(backends)
    timeout = datetime.timedelta(seconds=cfg.timeout)
    dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    try:
        groups = [dist.new_group(backend=b.kind, timeout=timeout,
                                 pg_options=backend if b.kind == "thunderbolt" else None) for b in backends]
        return _Session(cfg, env, backend, groups, out, err, op_table).run()
    finally:
        dist.destroy_process_group()


def run_in_groups(cfg: BenchConfig, env: RankEnv, backend: Config, groups: list[Any], out: TextIO = sys.stdout,
                  err: TextIO = sys.stderr) -> tuple[int, dict | None]:
    """The benchmark inside a job a tool already set up (the default group initialised, one group per
    `measured_backends(cfg)` made by the caller): how `selfcheck` runs it among its other checks. Returns
    the exit code and, on rank 0, the document `--json` would write (in memory: no file is written)."""
    validate_for_world(cfg, env.world_size)
    session = _Session(cfg, env, backend, groups, out, err, None)
    code = session.run()
    return code, session.document if env.rank == 0 else None


class _Session:
    def __init__(self, cfg: BenchConfig, env: RankEnv, backend: Config, groups: list[Any], out: TextIO,
                 err: TextIO, op_table: Mapping[str, Any] | None) -> None:
        self.cfg, self.env, self.backend, self.groups = cfg, env, backend, groups
        self.streams = backend.streams  # TCP streams per peer of the thunderbolt backend
        self.out, self.err, self.op_table = out, err, op_table
        self.lead = env.rank == 0
        self.backends = measured_backends(cfg)  # the --backends, and the floor last
        self.transports = {b.label: _transport_of(b.kind, g, backend) for b, g in zip(self.backends, groups)}
        self.records: list[dict] = []
        self.document: dict | None = None  # rank 0: meta and records, once run() has ended
        self.nets: list[list[str]] = []  # every rank's networks and host identity (_discover_cabling)
        self.host_ids: list[str] = []
        self.memcpy_bound: bounds.Bound | None = None
        self.deferred: list[list[metrics.Result]] = []  # results waiting for the memcpy bound
        self.wrong_results = 0
        self.progress = Progress(err, 0, enabled=False)  # replaced once the number of steps is known

    def say(self, text: str) -> None:
        if self.lead:
            print(text, file=self.out, flush=True)

    def run(self) -> int:
        import torch.distributed as dist

        hosts: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        congestion = report.system_congestion_control()
        transport = self.backend.transport
        backends = [{"label": b.label, "kind": b.kind, "transport": self.transports[b.label],
                     "link_streams": _link_streams_of(b.kind, self.streams)} for b in self.backends]
        meta = report.build_meta(self.cfg, self.env.world_size, hosts, backends, transport, self.streams, congestion)
        meta["thunderbolt_cc"] = self.backend.congestion_control or None
        meta["cabling"] = self._discover_cabling()
        self._warn_unfair_cc(meta["thunderbolt_cc"], congestion)
        measured = [b.label for b in self.cfg.backends]
        self.say(f"# torch-thunderbolt bench: world_size {self.env.world_size} on {', '.join(sorted(set(hosts)))}; "
                 f"dtype {self.cfg.dtype}; backends {', '.join(measured)}"
                 f"{' interleaved' if len(self.backends) > 1 else ''}"
                 f"{f' with the dispatch floor ({FLOOR_LABEL})' if self.cfg.floor else ''}; "
                 f"{self.cfg.iters} iters after {self.cfg.warmup} warmup; time = median of per-iteration max over "
                 f"ranks; tcp congestion control {congestion or '?'}")
        self._warn_unlike_paths()
        self._say_cabling()
        link_gbps = self._link() if self.cfg.link else {}
        before = self._memcpy() if self.cfg.memcpy else None
        plan = {op: self._layouts(op) for op in self.cfg.ops}
        steps = sum(len(lays) for lays in plan.values()) * (self.cfg.warmup + self.cfg.iters)
        self.progress = Progress(self.err, steps, self.cfg.progress and self.lead)
        for op, layouts in plan.items():
            self._op(op, layouts, link_gbps)
        if self.cfg.memcpy:  # every rank takes part in the barrier; only rank 0 has figures
            after = self._memcpy()
            if before is not None and after is not None:
                meta["memcpy"] = {"before": before, "after": after}
                self.say(memcpy.describe(before, after))
                self.memcpy_bound = bounds.memcpy_bound(before, after)
        for results in self.deferred:
            self._finish(results, link_gbps)
        if self.lead:
            self.document = report.document(meta, self.records)
            self._write(meta)
        if self.wrong_results:
            if self.lead:
                print(f"torch-thunderbolt bench: error: {self.wrong_results} result(s) had wrong values "
                      "(see the #wrong column)", file=self.err)
            return 1
        return 0

    @property
    def single_host(self) -> bool:
        return len(set(self.host_ids)) <= 1

    def _discover_cabling(self) -> dict:
        """Every rank's networks and host identity, as the backend discovers the cabling (for the cable
        bound); the JSON gets the networks and a host index per rank, not the identities themselves."""
        import torch.distributed as dist

        from ..rendezvous import hosts

        nets, problem = local_networks(self.env.master_addr, self.backend.ifnames)
        mine = {"nets": nets, "host": hosts.host_identity(), "problem": problem}
        every: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, mine)
        self.nets = [e["nets"] for e in every]
        self.host_ids = [e["host"] for e in every]
        index = {h: i for i, h in enumerate(dict.fromkeys(self.host_ids))}
        cabling = {"networks": self.nets, "host_index": [index[h] for h in self.host_ids],
                   "cable_rate": self.cfg.cable_rate}
        problems = [f"rank {r}: {e['problem']}" for r, e in enumerate(every) if e["problem"]]
        if problems:
            cabling["problems"] = problems
        if not self.single_host:
            cabling["cables_per_host"] = [g.cables for g in bounds.host_cabling(self.nets, self.host_ids)]
        return cabling

    def _say_cabling(self) -> None:
        if self.cfg.cable_rate is None:
            return
        why = bounds.missing_cables(self.nets, self.host_ids)
        if why is not None:
            self.say(f"# --cable-rate {self.cfg.cable_rate}: no cable bound, {why}")
            return
        per_host = bounds.host_cabling(self.nets, self.host_ids)
        self.say(f"# cabling: {bounds.cabling_kind(self.nets, self.host_ids)} of {len(per_host)} hosts, cables per "
                 f"host {[g.cables for g in per_host]} at {bounds.format_rate(bounds.rate_bits(self.cfg.cable_rate))}"
                 " per direction")

    def _bound_of(self, op: str, link_gbps: dict[int, dict]) -> dict[str, bounds.Bound | None]:
        """Each backend's bound at `op` (none for the floor)."""
        cable = None
        if self.cfg.cable_rate is not None and not self.single_host:
            cable = bounds.cable_bound(op, self.nets, self.host_ids, bounds.rate_bits(self.cfg.cable_rate))
        out: dict[str, bounds.Bound | None] = {}
        for b in self.backends:
            if b.kind == NULL_BACKEND:
                continue
            streams = _link_streams_of(b.kind, self.streams)
            tcp = bounds.link_bound(op, link_gbps.get(streams) if streams else None, streams)
            out[b.label] = bounds.choose_bound(self.transports[b.label], self.single_host, cable, tcp,
                                               self.memcpy_bound)
        return out

    def _memcpy(self) -> dict | None:
        """Rank 0 copies a buffer of the largest size while the others wait at a barrier."""
        import torch.distributed as dist

        result = memcpy.measure(max(self.cfg.sizes)) if self.lead else None
        dist.barrier()
        return result

    def _warn_unfair_cc(self, ours: str | None, system: str | None) -> None:
        """Congestion control alone moves TCP throughput 2-3x; gloo always uses the system's."""
        kinds = {b.kind for b in self.cfg.backends}
        if ours and ours != system and {"thunderbolt", "gloo"} <= kinds:
            self.say(f"# warning: THUNDERBOLT_CC={ours} but gloo uses the system's {system or '?'}: "
                     "the ratio column compares congestion controls as much as backends")

    def _warn_unlike_paths(self) -> None:
        """A ratio between backends whose bytes take different paths measures the paths, not the backends:
        on one host "auto" picks shared memory while gloo always goes through loopback TCP."""
        text = unlike_paths_note(self.transports, self.cfg.baseline)
        if text:
            self.say(text)

    def _link(self) -> dict[int, dict]:
        import torch.distributed as dist

        needed = {s for b in self.cfg.backends if (s := _link_streams_of(b.kind, self.streams))}
        plan = link.LinkPlan(tuple(sorted(set(self.cfg.link_streams) | needed)), self.cfg.link_bytes,
                             self.cfg.link_repeats, LINK_PINGS,
                             link.socket_buffer(LINK_SOCKBUF, link.read_rmem_max()), self.cfg.timeout)

        def share(obj: object) -> object:
            box = [obj]
            dist.broadcast_object_list(box, src=1)
            return box[0]

        outcome = link.run(self.env.rank, plan, (self.env.master_addr, self.env.master_port), share)
        if outcome is None:
            return {}
        throughput, latency, address = outcome
        self.say(table.format_link(throughput, latency, address, plan.nbytes, plan.repeats))
        self.records += report.link_records(throughput, latency, address, self.env.world_size)
        return {rec["streams"]: rec for rec in throughput}

    def _layouts(self, op: str) -> list[spec.Layout]:
        """One layout per distinct rounded size (small sizes may round to the same one)."""
        itemsize = spec.dtype(self.cfg.dtype).itemsize
        layouts = (spec.layout(op, s, itemsize, self.env.world_size) for s in self.cfg.sizes)
        return list({lay.nbytes: lay for lay in layouts}.values())

    def _op(self, op: str, layouts: list[spec.Layout], link_gbps: dict[int, dict]) -> None:
        from . import runner

        cfg, n, progress = self.cfg, self.env.world_size, self.progress
        dt = spec.dtype(cfg.dtype)
        fn = runner.op_function(op, self.op_table)
        checked = [b.kind != NULL_BACKEND for b in self.backends]  # the floor computes nothing to check
        results: list[metrics.Result] = []
        for lay in layouts:
            progress.label = f"{op} {format_size(lay.nbytes)}B"
            try:
                local = runner.time_size(op, lay, self.groups, self.env.rank, n, runner.torch_dtype(dt.name),
                                         cfg.warmup, cfg.iters, fn, progress.step, checked=checked)
            except runner.OpFailedError as exc:
                progress.clear()
                label = self.backends[exc.group_index].label
                raise runner.OpFailedError(f"rank {self.env.rank}, backend {label}: {exc}", exc.group_index) from exc
            total = runner.reduce_over_ranks(local, None)
            for b, times, wrong in zip(self.backends, total.times_us, total.wrong):
                results.append(metrics.make_result(b.label, b.kind, op, lay, n, dt.name, self.transports[b.label],
                                                   times, wrong))
        progress.clear()
        if self._memcpy_bound_pending():
            self.deferred.append(results)  # printed once the second memcpy figure is in
        else:
            self._finish(results, link_gbps)

    def _memcpy_bound_pending(self) -> bool:
        """A shared-memory row on one host is measured against memcpy, the mean of the figures taken before
        and after the collectives: its tables wait for the second one."""
        return (self.cfg.memcpy and self.single_host and self.memcpy_bound is None
                and any(t == "shm" for t in self.transports.values()))

    def _finish(self, results: list[metrics.Result], link_gbps: dict[int, dict]) -> None:
        """The derived columns of one op's results, its tables, its records."""
        cfg = self.cfg
        metrics.add_ratios(results, cfg.baseline)
        streams_of = {b.label: s for b in self.backends if (s := _link_streams_of(b.kind, self.streams))}
        metrics.add_efficiency(results, link_gbps, streams_of)
        if cfg.floor:
            metrics.add_floor(results, FLOOR_LABEL)
        metrics.add_bounds(results, self._bound_of(results[0].op, link_gbps))
        self.wrong_results += sum(1 for r in results if r.wrong)
        for b in self.backends:
            rows = [r for r in results if r.backend == b.label]
            self.say(table.format_table(rows, cfg.baseline, self.transports[b.label]))
        self.records += [r.record() for r in results]

    def _write(self, meta: dict) -> None:
        if self.cfg.json_path:
            report.write_json(self.cfg.json_path, self.document or report.document(meta, self.records))
            self.say(f"# wrote {self.cfg.json_path}")
        if self.cfg.plot_path:
            report.write_plot(self.cfg.plot_path, self.records)
            self.say(f"# wrote {self.cfg.plot_path}")
