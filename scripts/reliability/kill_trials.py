"""Repeat the kill -9 scenario: N seeded trials, report hangs and the distribution of detection times.

    python scripts/reliability/kill_trials.py --trials 100 --seed 1 --json kill.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.reliability.kill import KillCase, run_kill_trial  # noqa: E402


def summarize(records: list[dict]) -> dict:
    det = [t for r in records for t in r["detection"].values()]
    ex = [t for r in records for t in r["exit_after_error"].values()]
    q = statistics.quantiles(det, n=20) if len(det) >= 2 else det

    def stats(v: list[float]) -> dict:
        return {"n": len(v), "median": round(statistics.median(v), 3), "max": round(max(v), 3),
                "min": round(min(v), 3)} if v else {"n": 0}

    return {"trials": len(records), "ok": sum(1 for r in records if not r["problems"]),
            "hangs": sum(1 for r in records if r["hang"]),
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
    args = ap.parse_args()
    records = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-kill-") as tmp:
        for i in range(args.trials):
            case = KillCase.from_seed(args.seed * 100000 + i)
            out = run_kill_trial(case, Path(tmp) / f"t{i}")
            records.append(out.record())
            det = ", ".join(f"r{k}:{v:.2f}s" for k, v in out.detection.items())
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
