#!/usr/bin/env bash
# Re-measure BENCHMARKS.md sections 1 and 3 (every figure against its bound), results in docs/bench/:
#   bash scripts/bench_bounds.sh            # one host: 2 ranks over shared memory and over TCP (~1 min)
#   sudo bash scripts/bench_bounds.sh lab   # the emulated Macs at 1 and 10 Gbit/s (~6 min, needs root)
# RUN=2 ... names the files *-run2 (BENCHMARKS reports several runs of each).
# Run on a quiet machine: thunderbolt, gloo and the floor are interleaved in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=docs/bench
mkdir -p "$OUT"
TB="$PY -m torch_thunderbolt"
SUFFIX=${RUN:+-run$RUN}

if [ "${1:-host}" = host ]; then
  for transport in shm tcp; do
    $TB bench --no-progress --nproc 2 --floor --link --memcpy --ops all_reduce,broadcast,all_gather,sendrecv \
        --sizes 4K,1M,64M -n 20 --transport "$transport" --json "$OUT/bound-${transport}2$SUFFIX.json" \
        | tee "$OUT/bound-${transport}2$SUFFIX.txt"
  done
  exit 0
fi

OPS=all_reduce,all_gather,reduce_scatter,broadcast
for rate in 1gbit 10gbit; do
  for shape in ring3 chain3 mesh4 pair2; do
    name="bb${shape}"
    case $shape in
      ring3) up=(--hosts 3 --topology ring) ;;
      chain3) up=(--hosts 3 --topology chain) ;;
      mesh4) up=(--hosts 4 --topology mesh) ;;
      pair2) up=(--hosts 2 --topology pair --cables 2) ;;
    esac
    $TB lab down --name "$name" >/dev/null 2>&1 || true
    $TB lab up --name "$name" "${up[@]}" --rate "$rate" --cc reno
    base="$OUT/lab-$shape-$rate"
    $TB launch --lab "$name" -- $TB bench --no-progress --backends thunderbolt,gloo --ops $OPS --sizes 64M \
        -n 5 -w 1 --cable-rate "$rate" --json "$base-bound$SUFFIX.json" 2>&1 | grep -v SECRET | tee "$base-bound$SUFFIX.txt"
    if [ "$shape" != pair2 ]; then  # one stream per peer: a single cable each (the pair's 2 cables need 2)
      $TB launch --lab "$name" --env THUNDERBOLT_STREAMS=1 -- $TB bench --no-progress --backends thunderbolt \
          --ops $OPS --sizes 64M -n 5 -w 1 --cable-rate "$rate" --json "$base-streams1$SUFFIX.json" 2>&1 \
          | grep -v SECRET | tee "$base-streams1$SUFFIX.txt"
    fi
    $PY scripts/lab_raw_cables.py --name "$name" --runs 2 --bytes "$([ "$rate" = 1gbit ] && echo 64M || echo 256M)" \
        | tee "$base-raw$SUFFIX.txt"
    $TB lab down --name "$name"
  done
done
