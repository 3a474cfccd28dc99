#!/usr/bin/env bash
# Re-measure the one-host figures of BENCHMARKS.md (no root needed; ~10 min here). Results land in docs/bench/.
# Run on a quiet machine: every figure is interleaved in the same run with its yardstick (gloo, the floor).
#   section 1: the bounds, three runs          section 6: the rdma path's fake-fabric CPU cost
#   section 7: per-frame integrity, alternated section 8: async all_reduce on the fake device
# Not here: section 2 (an A/B against the previous release: its commands are in BENCHMARKS.md), and what
# needs root: `sudo bash scripts/bench_bounds.sh lab` (section 3) and
# `sudo .venv/bin/python scripts/ddp_overlap.py --lab 1gbit --iters 7 --warmup 2` (section 8).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=docs/bench
mkdir -p "$OUT"
for run in 1 2 3; do
  RUN=$run PY=$PY bash scripts/bench_bounds.sh
done
$PY scripts/rdma_cpu_cost.py --ops 3000 --runs 3 | tee "$OUT/rdma-cpu-cost.txt"
secret=$($PY -c 'import secrets; print(secrets.token_hex(32))')
for run in 1 2; do
  for mode in none mac; do
    THUNDERBOLT_SECRET=$secret THUNDERBOLT_INTEGRITY=$mode THUNDERBOLT_TRANSPORT=tcp $PY -m torch_thunderbolt bench \
        --no-progress --nproc 2 --transport tcp --ops all_reduce --sizes 4K,1M,64M -n 50 -w 5 \
        --json "$OUT/integrity-$mode-run$run.json" | tee "$OUT/integrity-$mode-run$run.txt"
  done
done
$PY scripts/ddp_overlap.py --async-calls 10 | tee "$OUT/ddp-async-calls.txt"
