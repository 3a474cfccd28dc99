"""Repeat the kill -9 scenario: N seeded trials, report hangs, detection times and which rank each survivor blamed.

    python scripts/reliability/kill_trials.py --trials 100 --seed 1 --json kill.json
    python scripts/reliability/kill_trials.py --per-op 50 --world 3 --size 67108864   # every op, 3 ranks, 64 MB
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# Run from a checkout without installing (under `sudo`, `python` may be another interpreter): the package
# is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.reliability.kill import ALL_OPS, KillCase, run_kill_trial  # noqa: E402


def blame_table(records: list[dict]) -> dict:
    """Per op: trials, survivors' errors that named the killed rank (correct blames) out of all survivors, hangs."""
    table: dict = {}
    for r in records:
        row = table.setdefault(r["case"]["op"], {"trials": 0, "survivors": 0, "correct": 0, "wrong": 0,
                                                 "hangs": 0, "trials_all_correct": 0})
        row["trials"] += 1
        row["hangs"] += bool(r["hang"])
        victim = r["case"]["victim"]
        survivors = r["case"]["world"] - 1
        row["survivors"] += survivors
        good = sum(1 for p in r["blamed"].values() if p == victim)
        row["correct"] += good
        row["wrong"] += len(r["blamed"]) - good
        row["trials_all_correct"] += good == survivors
    return table


def summarize(records: list[dict]) -> dict:
    det = [t for r in records for t in r["detection"].values()]
    ex = [t for r in records for t in r["exit_after_error"].values()]
    q = statistics.quantiles(det, n=20) if len(det) >= 2 else det

    def stats(v: list[float]) -> dict:
        return {"n": len(v), "median": round(statistics.median(v), 3), "max": round(max(v), 3),
                "min": round(min(v), 3)} if v else {"n": 0}

    return {"trials": len(records), "ok": sum(1 for r in records if not r["problems"]),
            "hangs": sum(1 for r in records if r["hang"]),
            "blame_by_op": blame_table(records),
            "outcomes": dict(Counter(e["type"] for r in records for e in r["errors"].values())),
            "detection_s": dict(stats(det), p95=round(q[-1], 3) if q else None),
            "exit_after_error_s": stats(ex),
            "by_op": {op: stats([t for r in records if r["case"]["op"] == op for t in r["detection"].values()])
                      for op in sorted({r["case"]["op"] for r in records})},
            "by_world": {w: stats([t for r in records if r["case"]["world"] == w for t in r["detection"].values()])
                         for w in sorted({r["case"]["world"] for r in records})}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1, help="trial i uses seed SEED*100000+i")
    ap.add_argument("--json", help="write every trial record and the summary here")
    ap.add_argument("--per-op", type=int, default=0,
                    help="instead of --trials random cases: this many trials of every op (--ops) at --world/--size")
    ap.add_argument("--ops", default=",".join(ALL_OPS))
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--size", type=int, default=64 << 20)
    args = ap.parse_args()
    if args.per_op:  # interleaved, so a time-limited run still covers every op
        cases = [KillCase.fixed(args.seed * 100000 + i * 100 + j, args.world, op, args.size)
                 for i in range(args.per_op) for j, op in enumerate(args.ops.split(","))]
    else:
        cases = [KillCase.from_seed(args.seed * 100000 + i) for i in range(args.trials)]
    args.trials = len(cases)
    records = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-kill-") as tmp:
        for i, case in enumerate(cases):
            out = run_kill_trial(case, Path(tmp) / f"t{i}")
            records.append(out.record())
            det = ", ".join(f"r{k}:{v:.2f}s blamed {out.blamed.get(k)}" for k, v in out.detection.items())
            print(f"[{i + 1}/{args.trials}] seed={case.seed} world={case.world} {case.op} {case.size}B "
                  f"victim={case.victim} -> {'ok' if out.ok() else 'FAIL'} {det} {'; '.join(out.problems)[:300]}",
                  flush=True)
    summary = summarize(records)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "trials": records}, indent=1))
    return 0 if summary["ok"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
