"""Machine-readable output: the JSON document (meta + one record per result) and the optional plot."""
from __future__ import annotations

import datetime
import json
import platform
import socket
import subprocess
import sys
from typing import Callable, Sequence

from ..errors import ConfigError
from .config import BenchConfig
from .spec import NULL_BACKEND

SCHEMA_VERSION = 1
UNITS = {"time_us": "microseconds (median over iters; sendrecv: one-way = round trip / 2)",
         "*_gbps": "GB/s = 1e9 bytes per second", "latency_us": "microseconds one-way (RTT/2)",
         "bytes": "the nccl-tests size column (largest buffer per rank)",
         "floor_us": "microseconds: the null backend's time at the same op and size (--floor; torch's dispatch "
                     "into a Python process group)",
         "x_floor": "time_us / floor_us",
         "bound_fraction": "busbw_gbps / bound_gbps; bound_kind: cables (--cable-rate, between hosts), tcp_link "
                           "(--link, one host, TCP) or memcpy (--memcpy, one host, shared memory)"}

# record keys every collective result carries (the documented minimum of the format)
REQUIRED_KEYS = ("backend", "op", "bytes", "world_size", "dtype", "transport", "time_us", "time_us_min",
                 "time_us_max", "algbw_gbps", "busbw_gbps", "wrong")
LINK_KEYS = ("backend", "op", "bytes", "streams", "gbps", "latency_us", "transport")

RunCommand = Callable[[Sequence[str]], str]


def _run_command(argv: Sequence[str]) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=5, check=True).stdout


def system_congestion_control(read_file: Callable[[str], str] | None = None,
                              run_command: RunCommand = _run_command) -> str | None:
    """net.ipv4.tcp_congestion_control on Linux; net.inet.tcp.cc.algorithm on macOS; None if unknown."""
    def default_read(path: str) -> str:
        with open(path) as f:
            return f.read()

    try:
        return (read_file or default_read)("/proc/sys/net/ipv4/tcp_congestion_control").strip() or None
    except OSError:
        pass
    try:
        return run_command(["sysctl", "-n", "net.inet.tcp.cc.algorithm"]).strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def build_meta(cfg: BenchConfig, world_size: int, hosts: Sequence[str], backends: Sequence[dict],
               transport: str, streams: int, congestion: str | None, now: datetime.datetime | None = None) -> dict:
    import torch

    now = now or datetime.datetime.now(datetime.timezone.utc)
    return {
        "tool": "torch-thunderbolt bench", "schema_version": SCHEMA_VERSION,
        "timestamp": now.isoformat(timespec="seconds"), "host": socket.gethostname(), "hosts": list(hosts),
        "torch_version": torch.__version__, "python_version": platform.python_version(),
        "platform": platform.platform(), "argv": sys.argv[1:], "world_size": world_size, "dtype": cfg.dtype,
        "iters": cfg.iters, "warmup": cfg.warmup, "ops": list(cfg.ops), "sizes": list(cfg.sizes),
        "backends": list(backends), "baseline": cfg.baseline, "transport": transport,
        "thunderbolt_streams": streams, "tcp_congestion_control": congestion, "units": UNITS,
    }


def link_records(throughput: Sequence[dict], latency: dict, address: str, world_size: int) -> list[dict]:
    """One record per stream count, in the same list as the collective results (op "link_tcp")."""
    return [{"backend": "raw_tcp", "backend_kind": "tcp", "op": "link_tcp", "world_size": world_size,
             "dtype": None, "transport": "tcp", "address": address, **rec,
             "latency_us": latency["latency_us"], "latency_us_p10": latency["latency_us_p10"],
             "latency_us_p90": latency["latency_us_p90"], "wrong": 0} for rec in throughput]


def document(meta: dict, records: Sequence[dict]) -> dict:
    return {"meta": meta, "results": list(records)}


def validate_document(doc: dict) -> list[str]:
    """Problems with a bench JSON document (empty when it follows the format); used by the tests."""
    problems = [f"missing top-level {k!r}" for k in ("meta", "results") if k not in doc]
    for i, rec in enumerate(doc.get("results", [])):
        keys = LINK_KEYS if rec.get("op") == "link_tcp" else REQUIRED_KEYS
        problems += [f"results[{i}] lacks {k!r}" for k in keys if k not in rec]
    for k in ("timestamp", "host", "torch_version", "iters", "tcp_congestion_control"):
        if k not in doc.get("meta", {}):
            problems.append(f"meta lacks {k!r}")
    return problems


def write_json(path: str, doc: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    except OSError as exc:
        raise ConfigError(f"cannot write --json {path!r}: {exc}") from exc


def require_matplotlib() -> None:
    """Fail before the benchmark runs, not after, when --plot cannot be honoured."""
    from ..extras import require_matplotlib as require

    require("--plot")


def write_plot(path: str, records: Sequence[dict]) -> None:
    """busbw and latency against size, one row of two panels per op, one line per backend."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    collective = [r for r in records if r["op"] != "link_tcp"]
    links = [r for r in records if r["op"] == "link_tcp"]
    ops = list(dict.fromkeys(r["op"] for r in collective))
    if not ops:
        raise ConfigError("--plot: no collective results to plot")
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
    for row, op in enumerate(ops):
        bw_ax, lat_ax = axes[row]
        for backend in dict.fromkeys(r["backend"] for r in collective if r["op"] == op):
            rows = sorted((r for r in collective if r["op"] == op and r["backend"] == backend), key=lambda r: r["bytes"])
            sizes = [r["bytes"] for r in rows]
            if rows[0].get("backend_kind") != NULL_BACKEND:  # the floor moves nothing: no bandwidth to draw
                bw_ax.plot(sizes, [r["busbw_gbps"] for r in rows], marker="o", label=backend)
            lat_ax.plot(sizes, [r["time_us"] for r in rows], marker="o", label=backend)
        for link in links:
            bw_ax.axhline(link["gbps"], linestyle="--", linewidth=0.8, color="grey")
            bw_ax.annotate(f"raw TCP x{link['streams']}", (1, link["gbps"]), xycoords=("axes fraction", "data"),
                           ha="right", va="bottom", fontsize=7, color="grey")
        bw_ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title=f"{op}: bus bandwidth")
        lat_ax.set(xscale="log", yscale="log", xlabel="size (bytes)", ylabel="time (us)", title=f"{op}: latency")
        bw_ax.legend(fontsize=8)
        lat_ax.legend(fontsize=8)
        bw_ax.grid(True, which="both", alpha=0.3)
        lat_ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write --plot {path!r}: {exc}") from exc
    finally:
        plt.close(fig)
