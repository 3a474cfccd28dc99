"""Soak run: N random collectives on W ranks, every result checked; prints mismatches and RSS start/end.

    python scripts/reliability/soak.py --ops 100000 --world 3 --seed 1 --json soak.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.reliability.procs import start_ranks  # noqa: E402
from tests.reliability.soak import SCRIPT  # noqa: E402


def run_soak(ops: int, world: int, seed: int, workdir: Path, limit: float) -> list[dict]:
    ranks = start_ranks(SCRIPT, world, workdir, {"TB_OPS": str(ops), "TB_SEED": str(seed)})
    try:
        finished = ranks.wait(time.time() + limit, step=0.5)
    finally:
        ranks.kill_all()
    if not finished:
        raise SystemExit(f"soak hung or ran over {limit}s; see {workdir}")
    out = []
    for rk in ranks.ranks:
        res = rk.tagged("RESULT")
        if rk.returncode != 0 or not res:
            raise SystemExit(f"rank {rk.rank} failed (rc {rk.returncode}):\n{rk.stderr()[-3000:]}")
        out.append(res[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100000)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=4 * 3600, help="seconds before the run counts as hung")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tb-soak-") as tmp:
        results = run_soak(args.ops, args.world, args.seed, Path(tmp), args.limit)
    summary = {"ops": args.ops, "world": args.world, "seed": args.seed,
               "mismatches": sum(r["mismatches"] for r in results), "per_rank": results}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
