#!/usr/bin/env python3
"""Measure the thunderbolt backend against gloo on emulated Mac clusters (root; Linux network namespaces).

    sudo .venv/bin/python scripts/lab_bench.py                        # every scenario, writes docs/lab-results.md
    sudo .venv/bin/python scripts/lab_bench.py --scenarios chain3-1gbit,cables --iters 5
    sudo .venv/bin/python scripts/lab_bench.py --quick                # short version: 4K/1M only, 2 iterations
    sudo .venv/bin/python scripts/lab_bench.py --workload "vit-ddp --ddp-hook none,int8" --hosts 2 \
        --rate 10gbit --work docs/bench/vit-ddp-pair-10gbit     # a `bench --workload` run on one lab

Each scenario brings a lab up (`lab_session`), runs `torch-thunderbolt bench` (thunderbolt and gloo
interleaved in the same run) on every host through `torch-thunderbolt launch --hostfile` with the lab's
hostfile (THUNDERBOLT_IFNAME = all of a host's cables, GLOO_SOCKET_IFNAME = its first one), and takes the
lab down. `cables` compares one against two 1 Gbit/s cables on a pair (alternating runs); `compression`
times fp32 against THUNDERBOLT_COMPRESSION=int8 all_reduce on a 1 Gbit/s pair and counts the bytes each
puts on the wire (the group's `transport.bytes_sent`, and the lab's interface counters).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MASTER_PORT = 29621  # inside the lab's namespaces only
CC = "reno"  # every namespace, so gloo and thunderbolt run under the same congestion control
BENCH_OPS = "all_reduce,broadcast,all_gather,reduce_scatter"


@dataclass(frozen=True)
class Scenario:
    name: str
    hosts: int
    topology: str
    rate: str
    cables: int = 1
    ifnames: dict[int, str] = field(default_factory=dict)  # host -> THUNDERBOLT_IFNAME override
    nproc_per_host: int = 1  # >1: ranks on one emulated Mac share memory (the hybrid shm + TCP transport)


SCENARIOS = {f"{t}{n}-{r}": Scenario(f"{t}{n}-{r}", n, t, r)
             for t, n in (("chain", 3), ("ring", 3), ("mesh", 4)) for r in ("1gbit", "5gbit")}
ONE_CABLE = Scenario("pair-1cable-1gbit", 2, "pair", "1gbit", 2, {0: "tb1_0", 1: "tb0_0"})
TWO_CABLES = Scenario("pair-2cables-1gbit", 2, "pair", "1gbit", 2)
COMPRESSION = Scenario("pair-compression-1gbit", 2, "pair", "1gbit")
SCENARIOS["pair2x2-1gbit"] = Scenario("pair2x2-1gbit", 2, "pair", "1gbit", nproc_per_host=2)


# ---- pure helpers ----------------------------------------------------------------------------------------

def hostfile_for(lab_hosts: list[dict], scenario: Scenario) -> list[dict]:
    """The lab's hostfile with a scenario's per-host interface overrides applied."""
    return [dict(h, ifname=scenario.ifnames.get(i, h["ifname"])) for i, h in enumerate(lab_hosts)]


def fmt_size(n: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def fmt_time(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def bench_table(records: list[dict]) -> list[str]:
    """Markdown rows: per op and size, thunderbolt and gloo median [min–max] time, busbw, ratio."""
    rows = ["| op | size | thunderbolt median [min–max] | busbw GB/s | gloo median [min–max] | busbw GB/s "
            "| speed-up |", "|---|---|---|---|---|---|---|"]
    keyed = {(r["backend"], r["op"], r["bytes"]): r for r in records if "time_us" in r}
    for op, size in sorted({(o, b) for _, o, b in keyed}, key=lambda k: (BENCH_OPS.split(",").index(k[0])
                                                                         if k[0] in BENCH_OPS else 9, k[1])):
        tb, gl = keyed.get(("thunderbolt", op, size)), keyed.get(("gloo", op, size))
        if tb is None or gl is None:
            continue
        rows.append(f"| {op} | {fmt_size(size)} | {_cell(tb)} | {tb['busbw_gbps']:.3f} | {_cell(gl)} | "
                    f"{gl['busbw_gbps']:.3f} | **{gl['time_us'] / tb['time_us']:.2f}×** |")
    return rows


def _cell(rec: dict) -> str:
    return f"{fmt_time(rec['time_us'])} [{fmt_time(rec['time_us_min'])}–{fmt_time(rec['time_us_max'])}]"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


# ---- running things on a lab -----------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERBOLT_", "GLOO_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch(hostfile: Path, cmd: list[str], timeout: float, nproc_per_host: int = 1) -> tuple[list[str], str]:
    """Run `cmd` on every host through the launcher; returns (argv used, stdout)."""
    argv = [sys.executable, "-m", "torch_thunderbolt", "launch", "--hostfile", str(hostfile), "--master-port",
            str(MASTER_PORT), "--grace", "2", "--nproc-per-host", str(nproc_per_host), "--", *cmd]
    done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return argv, done.stdout


def with_lab(scenario: Scenario, work: Path, body):
    from torch_thunderbolt.testing.lab import lab_session

    with lab_session(scenario.hosts, scenario.topology, cables=scenario.cables, rate=scenario.rate, cc=CC) as lab:
        hostfile = work / f"{scenario.name}.hosts.json"
        hostfile.write_text(json.dumps(hostfile_for(lab.hostfile(), scenario)))
        return body(lab, hostfile)


def run_bench(scenario: Scenario, work: Path, ops: str, sizes: str, iters: int, warmup: int) -> dict:
    out_json = work / f"{scenario.name}.{int(time.time() * 1000)}.json"
    cmd = [sys.executable, "-m", "torch_thunderbolt", "bench", "--ops", ops, "--sizes", sizes, "-n", str(iters),
           "-w", str(warmup), "--json", str(out_json), "--no-progress", "--timeout", "900"]

    def body(lab, hostfile):
        argv, stdout = launch(hostfile, cmd, timeout=1200, nproc_per_host=scenario.nproc_per_host)
        return {"argv": argv, "stdout": stdout, "doc": json.loads(out_json.read_text())}

    return with_lab(scenario, work, body)


def lab_command(scenario: Scenario, cmd_tail: str) -> str:
    """The commands a reader types to repeat a scenario by hand."""
    extra = f" --cables {scenario.cables}" if scenario.cables > 1 else ""
    nproc = f" --nproc-per-host {scenario.nproc_per_host}" if scenario.nproc_per_host > 1 else ""
    return (f"sudo .venv/bin/torch-thunderbolt lab up --hosts {scenario.hosts} --topology {scenario.topology} "
            f"--rate {scenario.rate}{extra} --cc {CC}\n"
            f"torch-thunderbolt lab hostfile -o hosts.json"
            f"{'   # then set ifname to one cable per host' if scenario.ifnames else ''}\n"
            f"sudo .venv/bin/torch-thunderbolt launch --hostfile hosts.json{nproc} -- {cmd_tail}\n"
            f"sudo .venv/bin/torch-thunderbolt lab down")


# ---- compression: one rank of the fp32-vs-int8 job (run through the launcher) ------------------------------

def compression_rank(size: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401

    dist.init_process_group("gloo", init_method="env://")
    groups = {}
    for mode in ("none", "int8"):
        os.environ["THUNDERBOLT_COMPRESSION"] = mode  # read when the group is created
        groups[mode] = dist.new_group(backend="thunderbolt")
    groups["gloo"] = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), size // 4
    base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(dist.get_world_size()))
    times = {m: [] for m in groups}
    wire, err = {}, {}
    for it in range(iters + 1):
        for mode in (list(groups) if it % 2 == 0 else list(groups)[::-1]):
            t = base.clone()
            before = getattr(groups[mode], "transport", None)
            sent0 = before.bytes_sent if before is not None else 0
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t, group=groups[mode])
            elapsed = time.perf_counter() - start
            if it > 0:  # the first round is warm-up
                times[mode].append(elapsed)
            if before is not None:
                wire[mode] = before.bytes_sent - sent0
            err[mode] = float((t - exact).abs().max() / exact.abs().max())
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, times)
    worst = {m: [max(s[m][i] for s in slowest) for i in range(iters)] for m in groups}
    if rank == 0:
        print("COMPRESSION " + json.dumps({"times_s": worst, "bytes_sent_rank0": wire, "max_rel_error": err}),
              flush=True)
    dist.destroy_process_group()


def run_compression(work: Path, size: int, iters: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compression-rank", "--size", str(size),
           "--iters", str(iters)]

    def body(lab, hostfile):
        before = lab.counters("mac0")
        argv, stdout = launch(hostfile, cmd, timeout=900)
        after = lab.counters("mac0")
        line = next(ln for ln in stdout.splitlines() if "COMPRESSION " in ln)
        data = json.loads(line.split("COMPRESSION ", 1)[1])
        data["argv"] = argv
        data["mac0_tx_bytes_total"] = sum(after[d][1] - before[d][1] for d in after)
        return data

    return with_lab(COMPRESSION, work, body)


def run_workload(hosts: int, rate: str, workload: str, work: Path) -> dict:
    """`bench --workload ...` with one rank per emulated Mac of a chain of `hosts` joined by `rate` cables;
    its output and JSON are kept in `work`."""
    name = f"workload-{shlex.split(workload)[0]}-{hosts}macs-{rate}"
    scenario = Scenario(name, hosts, "chain" if hosts > 2 else "pair", rate)
    out_json = work / f"{name}.json"
    cmd = [sys.executable, "-m", "torch_thunderbolt", "bench", "--workload", *shlex.split(workload),
           "--json", str(out_json), "--no-progress", "--timeout", "3000"]

    def body(lab, hostfile):
        argv, stdout = launch(hostfile, cmd, timeout=3600)
        (work / f"{name}.txt").write_text(f"# {lab_command(scenario, shlex.join(['python', *cmd[1:]]))}\n{stdout}")
        return {"argv": argv, "stdout": stdout, "doc": json.loads(out_json.read_text())}

    return with_lab(scenario, work, body)


# ---- report ------------------------------------------------------------------------------------------------

def scenario_section(scenario: Scenario, run: dict, bench_tail: str) -> list[str]:
    meta = run["doc"].get("meta", {})
    per_host = f", {scenario.nproc_per_host} ranks per host" if scenario.nproc_per_host > 1 else ""
    lines = [f"### {scenario.name}: {scenario.hosts} hosts{per_host}, {scenario.topology}, {scenario.cables} "
             f"cable(s) per cabled pair at {scenario.rate}", "",
             "```", lab_command(scenario, bench_tail), "```", "",
             f"(ran: `python {shlex.join(run['argv'][1:])}`; congestion control {meta.get('congestion_control', CC)}; "
             f"{meta.get('iters', '?')} iterations after {meta.get('warmup', '?')} warm-up; time = median of the "
             "per-iteration maximum over ranks, [min–max] over iterations)", ""]
    return lines + bench_table(run["doc"]["results"]) + [""]


def cables_section(runs: dict[str, list[dict]], bench_tail: str) -> list[str]:
    def tb64(run: dict) -> dict:
        return next(r for r in run["doc"]["results"] if r.get("backend") == "thunderbolt"
                    and r.get("op") == "all_reduce" and r.get("bytes") == 64 << 20)

    one = [tb64(r)["busbw_gbps"] for r in runs["one"]]
    two = [tb64(r)["busbw_gbps"] for r in runs["two"]]
    ratio = statistics.median(two) / statistics.median(one)
    lines = ["### 1 vs 2 cables between a pair, 1 Gbit/s each (64 MB all_reduce, thunderbolt)", "",
             "```", lab_command(TWO_CABLES, bench_tail), "```", "",
             f"One cable: the same lab with `ifname` = `tb1_0` / `tb0_0` only. {len(one)} alternating runs "
             "each (one, two, one, two, ...); busbw GB/s median [min–max] over runs (each run's value is itself "
             "a median over iterations).", "",
             "| cables | busbw GB/s | time per 64 MB all_reduce |", "|---|---|---|",
             f"| 1 | {spread(one)} | {fmt_time(statistics.median(tb64(r)['time_us'] for r in runs['one']))} |",
             f"| 2 | {spread(two)} | {fmt_time(statistics.median(tb64(r)['time_us'] for r in runs['two']))} |",
             "", f"**2 cables / 1 cable = {ratio:.2f}×** (target ≥ 1.7×).", ""]
    return lines


def compression_section(data: dict, size: int) -> list[str]:
    med = {m: statistics.median(v) for m, v in data["times_s"].items()}
    rows = [f"### int8 compression vs fp32, {fmt_size(size)}B all_reduce on a 1 Gbit/s pair", "",
            "```", lab_command(COMPRESSION, shlex.join(["python", "scripts/lab_bench.py", "--compression-rank",
                                                        "--size", str(size)])), "```", "",
            f"{len(data['times_s']['none'])} interleaved iterations per mode (barrier before each); time = "
            "median [min–max] of the slowest rank; bytes = rank 0's `transport.bytes_sent` for one all_reduce.", "",
            "| mode | time | bytes sent by rank 0 | max error / max |value| |", "|---|---|---|---|"]
    labels = {"none": "thunderbolt fp32", "int8": "thunderbolt int8", "gloo": "gloo fp32"}
    for mode in ("none", "int8", "gloo"):
        v = data["times_s"][mode]
        sent = data["bytes_sent_rank0"].get(mode)
        rows.append(f"| {labels[mode]} | {med[mode] * 1e3:.0f} ms [{min(v) * 1e3:.0f}–{max(v) * 1e3:.0f}] | "
                    f"{'-' if sent is None else f'{sent:,}'} | {data['max_rel_error'][mode]:.2e} |")
    rows += ["", f"**speed of int8 relative to fp32: {med['none'] / med['int8']:.2f}×** (target ≥ 3×); bytes on the wire "
             f"{data['bytes_sent_rank0']['int8'] / data['bytes_sent_rank0']['none']:.3f} of fp32. mac0's interface "
             f"counters moved {data['mac0_tx_bytes_total']:,} tx bytes over the whole job (all three modes, "
             "warm-up and setup).", ""]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join([*SCENARIOS, "cables", "compression"]))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sizes", default="4K,1M,64M")
    p.add_argument("--cable-runs", type=int, default=2, help="alternating runs per cable count")
    p.add_argument("--quick", action="store_true", help="4K,1M only, 2 iterations, 1 cable run")
    p.add_argument("--out", default=str(REPO / "docs" / "lab-results.md"))
    p.add_argument("--work", default=None, help="directory for the bench JSON files (default: a temp dir)")
    p.add_argument("--compression-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=64 << 20, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, metavar="ARGS",
                   help="instead of the scenarios: `bench --workload ARGS` on one lab (--hosts, --rate); output "
                        "and JSON into --work")
    p.add_argument("--hosts", type=int, default=2, help="with --workload: emulated Macs (a pair, or a chain)")
    p.add_argument("--rate", default="10gbit", help="with --workload: the cables' rate")
    args = p.parse_args(argv)
    if args.compression_rank:
        compression_rank(args.size, args.iters)
        return 0
    if args.quick:
        args.sizes, args.iters, args.warmup, args.cable_runs, args.size = "4K,1M", 2, 1, 1, 1 << 20
    from torch_thunderbolt.testing.lab import lab_skip_reason

    reason = lab_skip_reason()
    if reason:
        print(f"lab_bench: cannot run: {reason}", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="lab-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.workload is not None:
        print(run_workload(args.hosts, args.rate, args.workload, work)["stdout"])
        print(f"lab_bench: wrote {work}", file=sys.stderr)
        return 0
    tail = (f"python -m torch_thunderbolt bench --ops {BENCH_OPS} --sizes {args.sizes} -n {args.iters} "
            f"-w {args.warmup}")
    # The command that wrote the page, not a date: the page is a current figure with the command behind it.
    command = shlex.join(["sudo", "python", "scripts/lab_bench.py", *(sys.argv[1:] if argv is None else argv)])
    out = ["<!-- written by scripts/lab_bench.py -->", "# Lab results: the full tables", "",
           f"Written by `{command}`; the summary and the bounds: "
           "[BENCHMARKS.md](../BENCHMARKS.md#3-emulated-macs-network-namespace-lab) §3.", ""]
    for name in args.scenarios.split(","):
        print(f"lab_bench: {name} ...", file=sys.stderr, flush=True)
        if name in SCENARIOS:
            run = run_bench(SCENARIOS[name], work, BENCH_OPS, args.sizes, args.iters, args.warmup)
            print(run["stdout"], file=sys.stderr)
            out += scenario_section(SCENARIOS[name], run, tail)
        elif name == "cables":
            sizes = "64M" if not args.quick else "1M"
            runs = {"one": [], "two": []}
            for _ in range(args.cable_runs):
                for key, sc in (("one", ONE_CABLE), ("two", TWO_CABLES)):
                    runs[key].append(run_bench(sc, work, "all_reduce", sizes, args.iters, args.warmup))
            if not args.quick:
                out += cables_section(runs, f"python -m torch_thunderbolt bench --ops all_reduce --sizes 64M "
                                            f"-n {args.iters} -w {args.warmup}")
        elif name == "compression":
            data = run_compression(work, args.size, args.iters)
            out += compression_section(data, args.size)
        else:
            raise SystemExit(f"unknown scenario {name!r}: expected {', '.join([*SCENARIOS, 'cables', 'compression'])}")
        Path(args.out).write_text("\n".join(out) + "\n")  # after every scenario: a crash keeps what was measured
    print(f"lab_bench: wrote {args.out} (bench JSON in {work})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
