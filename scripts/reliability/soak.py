"""Soak run: N random collectives on W ranks, every result checked; prints mismatches and RSS start/end.

    python scripts/reliability/soak.py --ops 100000 --world 3 --seed 1 --json soak.json
    python scripts/reliability/soak.py --ops 10000 --world 2 --transport auto --mixed-runs 20

The op stream and what it checks: torch_thunderbolt/testing/reliability/programs/soak.py. --mixed ends the long run with ranks that
disagree on the reduce op ("random" or e.g. "sum,max"); --mixed-runs K adds K short runs (--mixed-ops ops
each, seeds seed*1000+1 ... seed*1000+K) that each end so. Every rank of every such run must raise
MismatchError.
--transport: tcp (default, or TB_RELIABILITY_TRANSPORT), shm, or auto (shared memory on one host).
Exit status 1 on any mismatch, error, unsupported (op, dtype) pair not refused cleanly, or mixed op that was
not a MismatchError on every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Run from a checkout without installing (under `sudo`, `python` may be another interpreter): the package
# is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.ranks import reliability_setup, start_ranks  # noqa: E402
from torch_thunderbolt.testing.reliability.programs import soak  # noqa: E402


def run_soak(ops: int, world: int, seed: int, workdir: Path, limit: float, transport: str | None = None,
             mixed: str = "", timeout: float = 120.0, extra_env: dict | None = None) -> list[dict]:
    env = {"TB_OPS": str(ops), "TB_SEED": str(seed), "TB_MIXED": mixed, "TB_TIMEOUT": str(timeout),
           **(extra_env or {})}
    if transport:
        env["THUNDERBOLT_TRANSPORT"] = transport
    with start_ranks(soak, world, workdir, env=env, setup=reliability_setup()) as ranks:
        finished = ranks.wait(time.time() + limit, step=0.5)
    if not finished:
        raise SystemExit(f"soak hung or ran over {limit}s (seed {seed}, {world} ranks); see {workdir}")
    out = []
    for rk in ranks.ranks:
        res = rk.tagged("RESULT")
        if rk.returncode != 0 or not res:
            raise SystemExit(f"rank {rk.rank} failed (rc {rk.returncode}, seed {seed}):\n{rk.stderr()[-3000:]}")
        out.append(res[-1])
    return out


def mixed_failures(results: list[dict]) -> list[dict]:
    """The ranks whose mixed-op call did not raise MismatchError (success, timeout, another error)."""
    got = [r.get("mixed", {"ok": None, "type": "not run (the op stream failed first)"}) for r in results]
    return [dict(g, rank=i) for i, g in enumerate(got) if g["ok"] is not False or g["type"] != "MismatchError"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100000)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transport", choices=("tcp", "shm", "auto"),
                    default=os.environ.get("TB_RELIABILITY_TRANSPORT", "tcp"))
    ap.add_argument("--mixed", default="", help='end the run with mixed reduce ops: "random" or e.g. "sum,max"')
    ap.add_argument("--mixed-runs", type=int, default=0, help="short runs that each end with mixed reduce ops")
    ap.add_argument("--mixed-ops", type=int, default=50, help="ops of each short mixed run")
    ap.add_argument("--timeout", type=float, default=120.0, help="the process group's timeout (s)")
    ap.add_argument("--limit", type=float, default=4 * 3600, help="seconds before the run counts as hung")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for every rank, e.g. THUNDERBOLT_ALGO=ring (the ranks do not inherit ours)")
    ap.add_argument("--json")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-soak-") as tmp:
        results = run_soak(args.ops, args.world, args.seed, Path(tmp) / "main", args.limit, args.transport,
                           args.mixed, args.timeout, extra)
        long_wall = round(time.monotonic() - t0, 1)
        mixed_runs = []
        for k in range(1, args.mixed_runs + 1):
            seed = args.seed * 1000 + k  # runs with neighbouring --seed values draw different cases
            res = run_soak(args.mixed_ops, args.world, seed, Path(tmp) / f"mixed{k}", 600,
                           args.transport, "random", min(args.timeout, 30.0), extra)
            mixed_runs.append({"seed": seed, "case": res[0].get("mixed", {}).get("case"),
                               "mismatches": sum(r["mismatches"] for r in res),
                               "errors": [e for r in res for e in r["errors"]],
                               "failures": mixed_failures(res),
                               "seconds": [round(r.get("mixed", {}).get("seconds", -1), 3) for r in res]})
    failed_mixed = ([] if not args.mixed else mixed_failures(results)) + [
        f for m in mixed_runs for f in m["failures"]]
    summary = {"ops": args.ops, "world": args.world, "seed": args.seed, "transport": args.transport, "env": extra,
               "mismatches": sum(r["mismatches"] for r in results) + sum(m["mismatches"] for m in mixed_runs),
               "errors": [e for r in results for e in r["errors"]] + [e for m in mixed_runs for e in m["errors"]],
               "refusal_problems": [p for r in results for p in r.get("refusals", [])],
               "mixed_runs": len(mixed_runs) + bool(args.mixed), "mixed_not_mismatch_error": failed_mixed,
               "wall_seconds": long_wall, "total_seconds": round(time.monotonic() - t0, 1),
               "per_rank": results, "mixed": mixed_runs}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    ok = not (summary["mismatches"] or summary["errors"] or summary["refusal_problems"] or failed_mixed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
