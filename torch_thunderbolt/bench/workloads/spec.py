"""What `bench --workload` runs and the arithmetic of its columns. Pure: no torch import.

Figures the projection uses are constants here, each with where it was measured or published:

- `RDMA_OP_CPU_US`: our rdma link's own CPU cost per small all_reduce (4 KB, 2 ranks), the median of the
  9 runs of BENCHMARKS §6 (docs/bench/rdma-cpu-cost-ab.txt: 40.2–43.2 µs, median 41.2), measured on the
  fake verbs fabric with the fabric's own time subtracted.
- `RDMA_WIRE_LATENCY_US`: `ib_send_lat` 64 B between two Macs over TB5, 4.15 µs (hellas-ai/thunderbolt-
  ibverbs PR #28, published, not measured here).
- `RDMA_QP_GBIT`: one queue pair's one-way rate for 1 MiB messages, ~15 Gbit/s (hellas-ai/thunderbolt-
  ibverbs #44, published).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

WORKLOADS = ("vit-ddp", "llama-pp", "llama-tp")
# "cpu": the host's CPU, arithmetic done. "fake": the untimed fake accelerator (device tensors, CPU speed,
# exact). The others: the timed emulated Apple-silicon GPU's presets (testing.apple_gpu), timing-only.
DEVICES = ("cpu", "fake", "m2-ultra", "m3-ultra", "m4-max", "m4-pro")
DEFAULT_DEVICE = "m2-ultra"
DDP_HOOKS = ("none", "int8", "bf16", "fp16")
# llama-tp's split: "dtensor", PyTorch's own tensor parallelism (parallelize_module over a DeviceMesh of the
# group); "manual", the decoder's hand-written Megatron shards with explicit all_reduces.
TP_IMPLS = ("dtensor", "manual")
DEFAULT_TP_IMPL = "dtensor"
DEFAULT_MODEL = {"vit-ddp": "base", "llama-pp": "llama8b", "llama-tp": "llama8b"}
DEFAULT_BATCHES = {"vit-ddp": (32,), "llama-pp": (1, 4), "llama-tp": (1, 4)}
DEFAULT_ITERS, DEFAULT_WARMUP = 5, 2
PROMPT_TOKENS = 32  # keys each decoded token attends to at the first step (the KV cache's start)

RDMA_OP_CPU_US = 41.2
RDMA_WIRE_LATENCY_US = 4.15
RDMA_QP_GBIT = 15.0
PROJECTION_LABEL = "rdma (projection)"


def exposed_share(step: float, compute: float) -> float:
    """The share of a step spent on communication that the compute did not cover: (step - compute) / step
    (clamped at 0: noise can make the step with communication the faster one)."""
    return max(0.0, (step - compute) / step) if step > 0 else 0.0


def median_of_max(per_rank: Sequence[Sequence[float]]) -> float:
    """Each iteration took as long as its slowest rank; the median over iterations."""
    return statistics.median(max(column) for column in zip(*per_rank))


def ring_all_reduce_steps(world: int) -> int:
    """Messages each rank sends, one after the other, in a ring all_reduce: reduce-scatter then all-gather."""
    return 2 * (world - 1)


def projected_rdma_op_us(nbytes: int, world: int, cpu_us: float = RDMA_OP_CPU_US,
                         latency_us: float = RDMA_WIRE_LATENCY_US, gbit: float = RDMA_QP_GBIT) -> float:
    """One all_reduce of `nbytes` over RDMA on TB5, projected: our link's CPU cost per op plus, per ring
    step, the wire's latency and the chunk's time at one queue pair's rate. A projection, not a measurement."""
    if world < 2:
        return 0.0
    steps = ring_all_reduce_steps(world)
    chunk = nbytes / world
    return cpu_us + steps * (latency_us + chunk * 8 / (gbit * 1e3))


@dataclass(frozen=True)
class TpTraffic:
    """The collectives one decoded token costs a tensor-parallel rank."""
    all_reduces: int       # two per layer (attention and feed-forward partial sums)
    all_reduce_bytes: int  # each: batch x hidden activations
    all_gathers: int       # one: each shard's best logit and its index
    all_gather_bytes: int


def tp_traffic(layers: int, hidden: int, batch: int, itemsize: int) -> TpTraffic:
    return TpTraffic(2 * layers, batch * hidden * itemsize, 1, batch * 2 * 4)


def projected_tp_comm_ms(traffic: TpTraffic, world: int, cpu_us: float = RDMA_OP_CPU_US) -> float:
    """Communication per token of tensor parallel over RDMA, projected (see projected_rdma_op_us); the small
    all_gather counts as one more all_reduce of its bytes."""
    per = traffic.all_reduces * projected_rdma_op_us(traffic.all_reduce_bytes, world, cpu_us)
    per += traffic.all_gathers * projected_rdma_op_us(traffic.all_gather_bytes, world, cpu_us)
    return per / 1e3
