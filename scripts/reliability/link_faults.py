"""Link faults, repeated: frozen peer (SIGSTOP), cable cut mid-collective with 1 cable (every rank must error)
and with 2 cables (the job must carry on: checked all_reduces for 12 s, longest pause reported), cable cut while
idle. Lab scenarios need root. Prints per-scenario outcome counts and detection times.

    sudo .venv/bin/python scripts/reliability/link_faults.py --trials 5 --json links.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

# Run from a checkout without installing (under `sudo`, `python` may be another interpreter): the package
# is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.lab import lab_session, lab_skip_reason  # noqa: E402
from torch_thunderbolt.testing.reliability.links import cable_cut, sigstop_peer  # noqa: E402

SCENARIOS = {
    "sigstop": dict(lab=None),
    "cut-1-cable": dict(lab=1, group_timeout=20.0),
    "cut-2-cables": dict(lab=2, group_timeout=30.0, size=4 << 20, run_for=12.0),  # must carry on
    "cut-idle": dict(lab=1, group_timeout=60.0, idle=20.0),
}


def one(name: str, workdir: Path) -> dict:
    spec = SCENARIOS[name]
    if spec["lab"] is None:
        return sigstop_peer(workdir, group_timeout=3.0).record()
    with lab_session(2, "pair", cables=spec["lab"], rate="10gbit") as lab:
        kw = {k: v for k, v in spec.items() if k != "lab"}
        return cable_cut(lab, workdir, **kw).record()


def summarize(records: list[dict]) -> dict:
    det = [t for r in records for t in r["detection"].values()]
    return {"trials": len(records), "outcomes": dict(Counter(e["type"] for r in records for e in r["errors"].values())),
            "ranks_without_error": sum(1 for r in records for n in r["notes"] if "no result" in n or "completed" in n),
            "detection_s": {"median": round(statistics.median(det), 3), "max": round(max(det), 3)} if det else None,
            "runs_completed": sum(1 for r in records for d in r.get("done", {}).values() if d["wrong"] == 0),
            "wrong_results": sum(d["wrong"] for r in records for d in r.get("done", {}).values()),
            "longest_pause_s": max((g for r in records for g in r.get("max_gap_s", {}).values()), default=None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.scenarios.split(",")
    if any(SCENARIOS[n]["lab"] for n in names) and lab_skip_reason():
        print(f"lab scenarios skipped: {lab_skip_reason()}")
        names = [n for n in names if not SCENARIOS[n]["lab"]]
    report = {}
    with tempfile.TemporaryDirectory(prefix="tb-links-") as tmp:
        for name in names:
            recs = [one(name, Path(tmp) / f"{name}-{i}") for i in range(args.trials)]
            report[name] = {"summary": summarize(recs), "trials": recs}
            print(name, json.dumps(report[name]["summary"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
