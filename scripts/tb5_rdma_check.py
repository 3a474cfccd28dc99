#!/usr/bin/env python3
"""For owners of two Thunderbolt 5 Macs: run `bench` over RDMA and over TCP between them and print what this
run measured beside the figures others published for RDMA over Thunderbolt 5.

    python scripts/tb5_rdma_check.py --hostfile hosts.json      # run it on the first Mac of the hostfile
    python scripts/tb5_rdma_check.py --from-json rdma.json tcp.json   # only print, from earlier runs

The hostfile is `launch`'s (`torch-thunderbolt topo --ssh mac1,mac2 --hostfile hosts.json` writes one). Run
`torch-thunderbolt doctor` on both Macs first: RDMA needs macOS 26.2+, `rdma_ctl enable` in Recovery and a
Thunderbolt 5 cable. Each bench is one `launch` (one rank per Mac); its JSON is written by rank 0, on the
first Mac of the hostfile, so run this script there.

The published figures are OTHER PEOPLE'S MEASUREMENTS on their Macs, with other tools (perftest's ib_send_lat
and ib_send_bw, a C++ PyTorch prototype, MLX's JACCL): they show what the hardware can do, not what this
backend does. The "this run" columns are yours.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZES = "64,4K,64K,1M,16M"
# (what, op, bytes, how to read the row, published figure, its source)
PUBLISHED = [
    ("one-way latency, 64 B", "sendrecv", 64, "us", "4.15 us (ib_send_lat)", "hellas-ai/thunderbolt-ibverbs PR #28"),
    ("one-way latency, 4 KiB", "sendrecv", 4096, "us", "4.64 us (ib_send_lat, UC)",
     "hellas-ai/thunderbolt-ibverbs PR #27"),
    ("bandwidth, 64 KiB messages", "sendrecv", 65536, "gbit", "75 Gbit/s (ib_send_bw, UC, 1 QP)",
     "hellas-ai/thunderbolt-ibverbs PR #27"),
    ("all_reduce 1 MiB, algbw", "all_reduce", 1 << 20, "gbyte", "7.08 GB/s (PyTorch RDMA prototype)",
     "pytorch/pytorch PR #181087"),
    ("all_reduce 16 MiB, algbw", "all_reduce", 16 << 20, "gbyte", "9.07 GB/s (same); 6-9 GB/s MLX JACCL, TCCL",
     "pytorch/pytorch PRs #181087, #189856"),
]


def _row(doc: dict[str, Any], op: str, nbytes: int) -> dict[str, Any] | None:
    for r in doc.get("results", []):
        if r.get("op") == op and r.get("bytes") == nbytes and r.get("backend") != "floor":
            return r
    return None


def _value(row: dict[str, Any] | None, unit: str) -> str:
    if row is None:
        return "-"
    if row.get("wrong"):
        return "WRONG RESULT"
    if unit == "us":
        return f"{row['time_us']:.1f} us"
    if unit == "gbit":
        return f"{row['algbw_gbps'] * 8:.1f} Gbit/s"
    return f"{row['algbw_gbps']:.2f} GB/s"


def compare(rdma: dict[str, Any], tcp: dict[str, Any]) -> list[list[str]]:
    """The table: what, published (theirs), this run over RDMA, this run over TCP, source."""
    rows = [["", "published (their measurement)", "this run: rdma", "this run: tcp", "source"]]
    for what, op, nbytes, unit, figure, source in PUBLISHED:
        rows.append([what, figure, _value(_row(rdma, op, nbytes), unit), _value(_row(tcp, op, nbytes), unit), source])
    return rows


def render(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_bench(hostfile: str, transport: str, out: Path, iters: int) -> None:
    cmd = [sys.executable, "-m", "torch_thunderbolt", "launch", "--hostfile", hostfile, "--",
           "python", "-m", "torch_thunderbolt", "bench", "--transport", transport, "--backends", "thunderbolt",
           "--ops", "sendrecv,all_reduce", "--sizes", SIZES, "-n", str(iters), "-w", "20", "--json", str(out)]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hostfile", help="launch's hostfile naming the two Macs")
    src.add_argument("--from-json", nargs=2, metavar=("RDMA", "TCP"), help="bench JSON files of earlier runs")
    ap.add_argument("-n", "--iters", type=int, default=200)
    args = ap.parse_args()
    if args.hostfile:
        work = Path(tempfile.mkdtemp(prefix="tb5-rdma-check-"))
        paths = [work / "rdma.json", work / "tcp.json"]
        for transport, path in zip(("rdma", "tcp"), paths):
            run_bench(args.hostfile, transport, path, args.iters)
    else:
        paths = [Path(p) for p in args.from_json]
    rdma, tcp = (json.loads(p.read_text()) for p in paths)
    print()
    print("Published figures are other people's measurements with other tools; the 'this run' columns are this")
    print("backend on your Macs (bench: one-way = ping-pong / 2; algbw = bytes / time).")
    print(render(compare(rdma, tcp)))
    if args.hostfile:
        print(f"\nbench JSON: {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
