#!/usr/bin/env bash
# Re-measure what BENCHMARKS.md reports (this VM: ~16 min). Results land in docs/bench/.
# Run on a quiet machine: every figure is thunderbolt vs gloo, interleaved in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=docs/bench
mkdir -p "$OUT"
B="$PY -m torch_thunderbolt bench --no-progress"
ALL=all_reduce,broadcast,all_gather,reduce_scatter,all_to_all,sendrecv
# 1. TCP path, 2 local ranks (issue 3 targets), with the raw link for the efficiency column
$B --nproc 2 --transport tcp --ops $ALL --sizes 4K,64K,1M --iters 200 --warmup 20 \
   --json $OUT/tcp2-small.json | tee $OUT/tcp2-small.txt
$B --nproc 2 --transport tcp --ops $ALL --sizes 16M,64M,256M --iters 10 --warmup 2 --link \
   --json $OUT/tcp2-large.json --plot $OUT/tcp2-large.png | tee $OUT/tcp2-large.txt
# 2. all_reduce across sizes (efficiency dip check), 1M..256M
$B --nproc 2 --transport tcp --ops all_reduce -b 1M -e 256M -f 4 --iters 10 --warmup 2 \
   --json $OUT/tcp2-sweep.json --plot $OUT/tcp2-sweep.png | tee $OUT/tcp2-sweep.txt
# 3. default transport (shared memory within a host when available)
$B --nproc 2 --transport auto --ops $ALL --sizes 4K,64K,1M,16M,64M --iters 20 --warmup 3 \
   --json $OUT/auto2.json --plot $OUT/auto2.png | tee $OUT/auto2.txt
# 4. 4 ranks on 2 cores (oversubscribed) and 3 ranks
$B --nproc 4 --transport auto --ops all_reduce,broadcast,all_gather --sizes 4K,1M,64M --iters 10 --warmup 2 \
   --json $OUT/auto4.json | tee $OUT/auto4.txt
$B --nproc 3 --transport tcp --ops all_reduce,all_gather --sizes 4K,1M,64M --iters 10 --warmup 2 \
   --json $OUT/tcp3.json | tee $OUT/tcp3.txt
# 5. point-to-point latency per round trip (TCP, then the default transport), gloo in the same processes
THUNDERBOLT_TRANSPORT=tcp $PY -m torch.distributed.run --nproc-per-node 2 scripts/p2p_latency.py --interleave \
   | tee $OUT/p2p-latency-tcp.txt
$PY -m torch.distributed.run --nproc-per-node 2 scripts/p2p_latency.py --interleave | tee $OUT/p2p-latency-auto.txt
# 6. the CPU floor of the 2-rank shared-memory all_reduce (is 5x gloo reachable?), next to one memcpy
$PY scripts/shm_allreduce_floor.py | tee $OUT/shm-allreduce-floor.txt
