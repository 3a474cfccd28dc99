"""Abort and re-init, many times: N cycles of init_process_group -> ops checked exact -> destroy or abort in
each rank process, every K-th cycle with a rank killed and replaced; what each process holds after each
cycle (file descriptors, threads, shared memory, the package's objects, fake-fabric queue pairs, memory
regions, PDs ...) must not grow after a warm-up of two cycles.

    python scripts/reliability/reinit_cycles.py --cycles 100 --kill-every 10 --kinds tcp,shm,hierarchical,rdma \\
        --json reinit.json

The scenario and its checks: torch_thunderbolt/testing/reliability/reinit.py. Prints one summary per kind
(counts after the warm-up and at the end, min-max over the processes that lived through the whole run;
fake-fabric objects held at most; cycle seconds) and every problem; exit status 1 if there is any.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# Run from a checkout without installing: the package is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.reliability.reinit import KINDS, LAB_KINDS, run_cycles  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--kill-every", type=int, default=10, help="every K-th cycle kills a rank (0: never)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS + LAB_KINDS)} (lab: root)")
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds before a kind's run counts as hung")
    ap.add_argument("--json", help="write every kind's summary and problems here")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS + LAB_KINDS)
    if unknown or args.cycles < 3:
        ap.error(f"unknown kinds {sorted(unknown)}" if unknown else "--cycles must be at least 3")
    report = []
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix=f"tb-reinit-{kind}-") as tmp:
            run = run_cycles(kind, args.cycles, Path(tmp), kill_every=args.kill_every, timeout=args.limit)
        entry = {**run.summary(), "problems": run.problems(), "growth": run.growth()}
        print(json.dumps(entry, indent=1), flush=True)
        report.append(entry)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(e["problems"] or e["growth"] for e in report) else 0


if __name__ == "__main__":
    sys.exit(main())
