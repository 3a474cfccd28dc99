"""Jobs whose ranks start the group and exit at once, on a busy host: does any rank fail inside our set-up?

    python scripts/reliability/early_exit.py --trials 50 --world 3 --json early_exit.json
    python scripts/reliability/early_exit.py --trials 10 --backend gloo          # the same jobs on gloo

Each trial runs `world` ranks on this host (testing.ranks, THUNDERBOLT_TRANSPORT as given: auto = shared
memory) that call init_process_group and exit (testing/reliability/programs/early_exit.py; --exit now, the
default: with os._exit, so rank 0's store goes the moment its set-up returns), with one busy loop per core
beside them. A failed rank is counted as failing "in torch_thunderbolt" when a frame of its traceback is in
this package (its set-up reading the store, say), else as failing in torch's own steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

# Run from a checkout without installing: the package is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch_thunderbolt.testing.ranks import run_ranks  # noqa: E402
from torch_thunderbolt.testing.reliability.programs import early_exit  # noqa: E402

_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\w+)')


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """`n` processes spinning in a Python loop (one per core), killed when the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def where_it_failed(stderr: str) -> dict:
    """The failing rank's last error line and the innermost frame of ours and of torch's in its traceback."""
    frames = _FRAME.findall(stderr)
    ours = [f"{Path(f).name}:{fn}" for f, fn in frames if "torch_thunderbolt" in f]
    torch_frames = [f"{Path(f).name}:{fn}" for f, fn in frames if "/torch/" in f]
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith((" ", "[W", "[E"))]
    return {"in": "torch_thunderbolt" if ours else "torch", "ours": ours[-1] if ours else None,
            "torch": torch_frames[-1] if torch_frames else None, "error": lines[-1][:300] if lines else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy loops beside the ranks (one per core)")
    ap.add_argument("--backend", default="thunderbolt", choices=["thunderbolt", "gloo"])
    ap.add_argument("--transport", default="auto", help="THUNDERBOLT_TRANSPORT of the ranks")
    ap.add_argument("--exit", default="now", choices=["normal", "now"],
                    help="how a rank exits after set-up: the interpreter's exit, or os._exit at once")
    ap.add_argument("--json", help="write every trial and the summary here")
    args = ap.parse_args()
    env = {"TB_BACKEND": args.backend, "THUNDERBOLT_TRANSPORT": args.transport, "TB_TIMEOUT": "60",
           "TB_EXIT": args.exit}
    trials = []
    t0 = time.monotonic()
    with busy_cores(args.busy), tempfile.TemporaryDirectory(prefix="tb-early-exit-") as tmp:
        for i in range(args.trials):
            start = time.monotonic()
            try:
                results = run_ranks(early_exit, args.world, Path(tmp) / f"t{i}", args=["init_and_exit"], env=env,
                                    timeout=150, expect_ok=False)
                failed = {res.rank: where_it_failed(res.stderr) for res in results if res.returncode != 0}
                hung = False
            except AssertionError as exc:  # ranks hung: killed at the timeout
                failed, hung = {-1: {"in": "hang", "ours": None, "torch": None, "error": str(exc)[:300]}}, True
            trials.append({"trial": i, "seconds": round(time.monotonic() - start, 2), "hung": hung,
                           "failed": failed})
            what = "ok" if not failed else "; ".join(f"rank {r} in {f['in']} ({f['ours'] or f['torch']}): "
                                                     f"{f['error'][:120]}" for r, f in failed.items())
            print(f"[{i + 1}/{args.trials}] {trials[-1]['seconds']:.1f}s {what}", flush=True)
    inside = Counter(f["in"] for t in trials for f in t["failed"].values())
    summary = {"backend": args.backend, "transport": args.transport, "world": args.world, "busy_loops": args.busy,
               "exit": args.exit,
               "trials": len(trials), "trials_failed": sum(1 for t in trials if t["failed"]),
               "trials_failed_in_torch_thunderbolt": sum(
                   1 for t in trials if any(f["in"] == "torch_thunderbolt" for f in t["failed"].values())),
               "trials_hung": sum(1 for t in trials if t["hung"]), "failed_ranks_by_place": dict(inside),
               "where": dict(Counter(f["ours"] or f["torch"] for t in trials for f in t["failed"].values())),
               "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "trials": trials}, indent=1))
    return 0 if summary["trials_failed_in_torch_thunderbolt"] == 0 and not summary["trials_hung"] else 1


if __name__ == "__main__":
    sys.exit(main())
