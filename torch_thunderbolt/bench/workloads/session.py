"""One rank's `bench --workload` run: the control group (gloo), one group per measured backend, the device,
the workload's cases interleaved over the backends; rank 0 prints the tables and writes the JSON."""
from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
from typing import Any, TextIO

from ...config import Config
from ..config import BenchConfig, RankEnv
from . import table
from .device import open_device
from .spec import PROJECTION_LABEL, projected_tp_comm_ms, tp_traffic


def run_rank(cfg: BenchConfig, env: RankEnv, backend: Config, out: TextIO = sys.stdout) -> int:
    import torch
    import torch.distributed as dist

    from .. import report

    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    torch.set_num_threads(1)
    # The device first: the fake accelerators must be installed before the first backward pass.
    device = open_device(cfg.device)
    timeout = datetime.timedelta(seconds=cfg.timeout)
    dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout)
    lead = env.rank == 0

    def say(text: str) -> None:
        if lead:
            print(text, file=out, flush=True)

    try:
        groups = [dist.new_group(backend=b.kind, timeout=timeout,
                                 pg_options=backend if b.kind == "thunderbolt" else None) for b in cfg.backends]
        hosts: list[Any] = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        kinds = [b.kind for b in cfg.backends]
        say(f"# torch-thunderbolt bench --workload {cfg.workload}: world_size {env.world_size} on "
            f"{', '.join(sorted(set(hosts)))}; model {cfg.model}; device {device.describe()}; backends "
            f"{', '.join(b.label for b in cfg.backends)} interleaved; {cfg.iters} iters after {cfg.warmup} warmup; "
            "each phase = median of per-iteration max over ranks")
        if cfg.workload == "vit-ddp":
            records, model = _vit(cfg, env, groups, kinds, device)
            say(_vit_header(model, env.world_size))
            say(table.vit_table(records))
            from . import ddp

            for key, traces in model.get("traces", {}).items():
                for b, trace in zip(cfg.backends, traces):
                    say(f"# timeline of one step, {b.label}, {key} (rank {env.rank}; each bucket by the "
                        "backend's own path, in a tracing hook):")
                    say("\n".join("#" + line for line in ddp.describe_trace(trace)))
        else:
            records, model = _llama(cfg, env, groups, kinds, device)
            say(_llama_header(cfg, model, env.world_size))
            say(table.llama_table(records))
            if any(r.get("projection") for r in records):
                say(f"# {PROJECTION_LABEL}: PROJECTED, NOT MEASURED: the compute column measured above plus, per "
                    "collective, our rdma link's CPU cost per op (BENCHMARKS §6, fake verbs fabric) and the published "
                    "TB5 wire latency and single-queue-pair rate (docs/bench/ and bench/workloads/spec.py cite them)")
        if lead and cfg.json_path:
            meta = report.build_meta(cfg, env.world_size, hosts, [{"label": b.label, "kind": b.kind}
                                                                  for b in cfg.backends],
                                     backend.transport, backend.streams, report.system_congestion_control())
            meta.update(workload=cfg.workload, device=cfg.device, device_description=device.describe(),
                        model=model)
            report.write_json(cfg.json_path, report.document(meta, records))
            say(f"# wrote {cfg.json_path}")
        return 0
    finally:
        dist.destroy_process_group()


def _gather(local: Any) -> list[Any]:
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return every


def _vit(cfg: BenchConfig, env: RankEnv, groups: list[Any], kinds: list[str], device: Any) -> tuple[list[dict], dict]:
    from . import ddp

    cases = [ddp.Case(h, c, b) for h in cfg.ddp_hooks for c in cfg.bucket_caps for b in cfg.batches]
    local, model = ddp.run(cfg.model or "base", cases, groups, kinds, device, env.rank, cfg.iters, cfg.warmup,
                           timeline=cfg.timeline)
    every = _gather(local)
    records = []
    for case in cases:
        for i, b in enumerate(cfg.backends):
            figures = ddp.summarize([r[case.key][i] for r in every], case.batch, env.world_size)
            records.append({"workload": "vit-ddp", "backend": b.label, "backend_kind": b.kind,
                            "how": model["how"][case.key][i], "hook": case.hook, "bucket_cap_mb": case.bucket_cap_mb,
                            "batch": case.batch, "world_size": env.world_size, "device": cfg.device, **figures})
    table.add_speed(records, cfg.baseline, "step_s", ("hook", "bucket_cap_mb", "batch"))
    return records, model


def _llama(cfg: BenchConfig, env: RankEnv, groups: list[Any], kinds: list[str],
           device: Any) -> tuple[list[dict], dict]:
    from . import decode

    parallel = "tp" if cfg.workload == "llama-tp" else "pp"
    micro = cfg.microbatches if parallel == "pp" else 1
    cases = [decode.Case(b, micro if b % micro == 0 else 1) for b in cfg.batches]
    local, model = decode.run(parallel, cfg.model or "llama8b", cases, groups, kinds, device, env.rank,
                              env.world_size, cfg.tokens, cfg.iters, cfg.warmup, tp_impl=cfg.tp_impl)
    every = _gather(local)
    records = []
    for case in cases:
        rows = []
        for i, b in enumerate(cfg.backends):
            figures = decode.summarize([r[case.key][i] for r in every], parallel, case, cfg.tokens)
            rows.append({"workload": cfg.workload, "backend": b.label, "backend_kind": b.kind,
                         "how": model["how"][i], "batch": case.batch, "microbatches": case.microbatches,
                         "world_size": env.world_size, "device": cfg.device, "tokens": cfg.tokens,
                         **({"tp_impl": cfg.tp_impl} if parallel == "tp" else {}), **figures})
        records += rows
        if parallel == "tp" and env.world_size > 1:
            records.append(_projection(rows, model, case.batch, env.world_size))
    table.add_speed(records, cfg.baseline, "ms_per_token", ("batch", "microbatches"))
    return records, model


def _projection(measured: list[dict], model: dict, batch: int, world: int) -> dict:
    """The tp row projected for RDMA over TB5: the compute measured beside the backends' rows (their median:
    it does not depend on the backend) plus the projected collectives."""
    conf = model["config"]
    comm = projected_tp_comm_ms(tp_traffic(conf["layers"], conf["hidden"], batch, 2), world)
    compute = statistics.median(r["compute_ms_per_token"] for r in measured)
    ms = compute + comm
    return {**measured[0], "backend": PROJECTION_LABEL, "compute_ms_per_token": compute, "backend_kind": "rdma", "how": "projection", "projection": True,
            "ms_per_token": ms, "comm_ms_per_token": comm, "tokens_per_s": batch * 1e3 / ms, "speed": None}


def _vit_header(model: dict, world: int) -> str:
    conf = model["config"]
    return (f"# ViT {conf['image_size']}px patch {conf['patch']}, dim {conf['dim']}, depth {conf['depth']}: "
            f"{model['params'] / 1e6:.1f} M params, {model['grad_bytes'] / 1e6:.0f} MB fp32 gradients; world {world}; "
            "batch per rank; exposed = (step - no-comm) / step; hidden = 1 - (step - no-comm) / exch")


def _llama_header(cfg: BenchConfig, model: dict, world: int) -> str:
    conf = model["config"]
    return (f"# Llama-shaped decoder: hidden {conf['hidden']}, {conf['layers']} layers, {conf['heads']}/"
            f"{conf['kv_heads']} heads, intermediate {conf['intermediate']}, vocab {conf['vocab_size']}: "
            f"{model['params'] / 1e9:.2f} G params, {model['weight_bytes'] / 1e9:.1f} GB fp16; "
            f"{'pipeline' if cfg.workload == 'llama-pp' else _TP_SPLIT[cfg.tp_impl] + ' tensor'} parallel over "
            f"{world}; {cfg.tokens} tokens per iteration; ms per token of each sequence")


_TP_SPLIT = {"dtensor": "DTensor (parallelize_module)", "manual": "hand-written Megatron"}
