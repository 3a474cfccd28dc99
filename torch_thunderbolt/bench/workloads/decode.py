"""`--workload llama-pp` / `llama-tp`: a Llama-shaped decoder generating tokens, pipeline or tensor parallel.

Pipeline (pp): rank s holds the s-th contiguous run of layers (the first also the embedding, the last the
norm and LM head); each decoded token's hidden state goes rank to rank, and the last rank's chosen token
goes back to the first. A batch cut into microbatches keeps several stages busy at once.
Tensor parallel (tp): every rank holds 1/world of every layer (Megatron-style: heads, key/value heads,
feed-forward width, vocabulary); two all_reduces of the batch's hidden states per layer complete the
partial sums, and one small all_gather picks the token from every shard's best logit.

Per iteration and backend (interleaved, order alternating), each timed from a common start with the device
synchronised at the end, `tokens` decoded tokens:
  decode     the parallel decode with its communication;
  compute    the same on every rank with no communication at all (pp: each stage alone, on dummy inputs;
             tp: the shards with no all_reduce);
  transfers  the communication alone: the same messages, in the same order, with no compute.
ms/token = decode / tokens. For pp, a whole model on one device would take the sum of the stages' compute
(the `1 device` column); for tp, compute is one shard's.

Device tensors and gloo: gloo has no kernels for a device, so on one the gloo rows copy each message to
host memory and back (as a Mac user of gloo must); thunderbolt takes device tensors itself.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...testing.models import llama
from .device import Device, place
from .spec import PROMPT_TOKENS

DTYPE = torch.float16


class Wire:
    """One backend's messages for the decoder, on device tensors or staged through the host for gloo."""

    def __init__(self, group: Any, kind: str, device: Device) -> None:
        self.group, self.device = group, device
        self.staged = kind == "gloo" and not device.is_cpu
        self.world = dist.get_world_size(group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        if self.staged:
            host = t.to("cpu")
            dist.all_reduce(host, group=self.group)
            return t.copy_(host)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t.unsqueeze(0)
        src = t.to("cpu") if self.staged else t
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=src.device)
        dist.all_gather_into_tensor(out, src.contiguous(), group=self.group)
        out = out.view(self.world, *t.shape)
        return out.to(self.device.torch_device) if self.staged else out

    def send(self, t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
        """Start sending `t`; (the work, the tensor that must stay alive until it is waited on)."""
        src = t.to("cpu") if self.staged else t.contiguous()
        return dist.isend(src, dst, group=self.group), src

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        where = "cpu" if self.staged else self.device.torch_device
        buf = torch.empty(shape, dtype=dtype, device=where)
        dist.recv(buf, src, group=self.group)
        return buf.to(self.device.torch_device) if self.staged else buf


@dataclass
class Phases:
    """One rank's times of one case and backend, seconds per iteration (of `tokens` tokens)."""
    decode: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    transfers: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # the device's modelled busy time in `compute`


@dataclass(frozen=True)
class Case:
    batch: int
    microbatches: int

    @property
    def key(self) -> str:
        return f"batch={self.batch} microbatches={self.microbatches}"


def _fuse(stage: llama.LlamaStage, device: Device, whole_layers: bool) -> None:
    """Block-level kernels on the timed device (device.fuse): a whole decoder layer each for pipeline
    parallel; for tensor parallel each layer's attention and feed-forward halves and their norms, so the
    all_reduces between them stay real."""
    for name in ("embed", "norm", "lm_head"):
        if getattr(stage, name) is not None:
            setattr(stage, name, device.fuse(getattr(stage, name)))
    for i, layer in enumerate(stage.layers):
        if whole_layers:
            stage.layers[i] = device.fuse(layer)
        else:
            for part in ("input_norm", "attn", "post_attn_norm", "mlp"):
                setattr(layer, part, device.fuse(getattr(layer, part)))


def _set_reduce(stage: llama.LlamaStage, reduce: llama.Reduce) -> None:
    for layer in stage.layers:
        layer.reduce = reduce


class _Pipeline:
    """This rank's stage and the schedule of a pipeline decode."""

    def __init__(self, cfg: llama.LlamaConfig, rank: int, world: int, device: Device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        ids = llama.split_layers(cfg.layers, world)[rank]
        first, last = rank == 0, rank == world - 1
        self.stage = place(lambda d: llama.build_stage(cfg, ids, first, last, dtype=DTYPE, device=d), device)
        _fuse(self.stage, device, whole_layers=True)

    def _input(self, b: int) -> torch.Tensor:
        dev = self.device.torch_device
        if self.stage.first:
            return torch.zeros((b, 1), dtype=torch.long, device=dev)
        return torch.zeros((b, 1, self.cfg.hidden), dtype=DTYPE, device=dev)

    def decode(self, wire: Wire, case: Case, tokens: int, caches: list[list[llama.KVCache]]) -> None:
        b, m_count, s, n = case.batch // case.microbatches, case.microbatches, self.rank, self.world
        tok = [self._input(b) if self.stage.first else None for _ in range(m_count)]
        pending = []
        for t in range(tokens):
            for m in range(m_count):
                if self.stage.first:
                    x = tok[m] if (t == 0 or n == 1) else wire.recv((b, 1), torch.long, n - 1)
                else:
                    x = wire.recv((b, 1, self.cfg.hidden), DTYPE, s - 1)
                out = self.stage(x, caches[m], PROMPT_TOKENS + t)
                if self.stage.last:
                    nxt = out[:, -1].argmax(-1, keepdim=True)
                    if n == 1:
                        tok[m] = nxt
                    elif t < tokens - 1:
                        pending.append(wire.send(nxt, 0))
                else:
                    pending.append(wire.send(out, s + 1))
        for work, _ in pending:
            work.wait()

    def compute(self, case: Case, tokens: int, caches: list[list[llama.KVCache]]) -> None:
        b = case.batch // case.microbatches
        x = self._input(b)
        for t in range(tokens):
            for m in range(case.microbatches):
                self.stage(x, caches[m], PROMPT_TOKENS + t)

    def transfers(self, wire: Wire, case: Case, tokens: int) -> None:
        """The decode's messages in the decode's order, with zeros for payloads and no compute."""
        b, m_count, s, n = case.batch // case.microbatches, case.microbatches, self.rank, self.world
        if n == 1:
            return
        hidden = torch.zeros((b, 1, self.cfg.hidden), dtype=DTYPE, device=self.device.torch_device)
        token = torch.zeros((b, 1), dtype=torch.long, device=self.device.torch_device)
        pending = []
        for t in range(tokens):
            for m in range(m_count):
                if self.stage.first:
                    if t > 0:
                        wire.recv((b, 1), torch.long, n - 1)
                else:
                    wire.recv((b, 1, self.cfg.hidden), DTYPE, s - 1)
                if self.stage.last:
                    if t < tokens - 1:
                        pending.append(wire.send(token, 0))
                else:
                    pending.append(wire.send(hidden, s + 1))
        for work, _ in pending:
            work.wait()

    def caches(self, case: Case) -> list[list[llama.KVCache]]:
        return [self.stage.new_caches(case.batch // case.microbatches) for _ in range(case.microbatches)]


class _TensorParallel:
    """This rank's shard of every layer and a tensor-parallel decode."""

    def __init__(self, cfg: llama.LlamaConfig, rank: int, world: int, device: Device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.stage = place(lambda d: llama.build_stage(cfg, range(cfg.layers), True, True, dtype=DTYPE, device=d,
                                                       shards=world), device)
        _fuse(self.stage, device, whole_layers=False)

    def _step(self, wire: Wire | None, x: torch.Tensor, caches: list[llama.KVCache], pos: int) -> torch.Tensor:
        logits = self.stage(x, caches, pos)[:, -1]
        best, index = logits.max(-1)
        if wire is None:
            return index[:, None]
        # Each shard's best logit and its index in the whole vocabulary; the best of those is the token.
        pair = torch.stack((best.float(), (index + self.rank * logits.shape[-1]).float()), dim=-1)
        every = wire.all_gather(pair)  # [world, batch, 2]
        choice = every[..., 0].argmax(0)  # [batch]
        return every[..., 1].gather(0, choice[None]).long().view(-1, 1)

    def decode(self, wire: Wire, case: Case, tokens: int, caches: list[llama.KVCache]) -> None:
        _set_reduce(self.stage, wire.all_reduce_)
        x = torch.zeros((case.batch, 1), dtype=torch.long, device=self.device.torch_device)
        for t in range(tokens):
            x = self._step(wire, x, caches, PROMPT_TOKENS + t)

    def compute(self, case: Case, tokens: int, caches: list[llama.KVCache]) -> None:
        _set_reduce(self.stage, llama.no_reduce)
        x = torch.zeros((case.batch, 1), dtype=torch.long, device=self.device.torch_device)
        for t in range(tokens):
            x = self._step(None, x, caches, PROMPT_TOKENS + t)

    def transfers(self, wire: Wire, case: Case, tokens: int) -> None:
        hidden = torch.zeros((case.batch, 1, self.cfg.hidden), dtype=DTYPE, device=self.device.torch_device)
        pair = torch.zeros((case.batch, 2), dtype=torch.float32, device=self.device.torch_device)
        for _ in range(tokens):
            for _ in range(2 * self.cfg.layers):
                wire.all_reduce_(hidden)
            wire.all_gather(pair)

    def caches(self, case: Case) -> list[llama.KVCache]:
        return self.stage.new_caches(case.batch)


def model_config(preset: str, tokens: int) -> llama.LlamaConfig:
    """The preset with a KV cache just long enough for the prompt and the decoded tokens."""
    return llama.make_config(preset, max_seq=PROMPT_TOKENS + tokens + 1)


def run(kind_of_parallel: str, preset: str, cases: list[Case], groups: list[Any], kinds: list[str], device: Device,
        rank: int, world: int, tokens: int, iters: int, warmup: int,
        control: Any = None) -> tuple[dict[str, list[Phases]], dict]:
    """This rank's phases per case key and backend (in the order of `groups`), and what the model is."""
    cfg = model_config(preset, tokens)
    if kind_of_parallel == "tp":
        llama.check_shards(cfg, world)
    runner: _Pipeline | _TensorParallel = (_TensorParallel if kind_of_parallel == "tp" else _Pipeline)(
        cfg, rank, world, device)
    wires = [Wire(g, k, device) for g, k in zip(groups, kinds)]
    out: dict[str, list[Phases]] = {}

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier(group=control)
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        for case in cases:
            caches: Any = runner.caches(case)
            phases = [Phases() for _ in wires]
            for it in range(warmup + iters):
                order = list(enumerate(wires)) if it % 2 == 0 else list(enumerate(wires))[::-1]
                for i, wire in order:
                    decode = timed(lambda: runner.decode(wire, case, tokens, caches))
                    busy0 = device.busy_seconds() if device.busy_seconds else 0.0
                    compute = timed(lambda: runner.compute(case, tokens, caches))
                    busy = (device.busy_seconds() - busy0) if device.busy_seconds else 0.0
                    transfers = timed(lambda: runner.transfers(wire, case, tokens))
                    if it >= warmup:
                        phases[i].decode.append(decode)
                        phases[i].compute.append(compute)
                        phases[i].transfers.append(transfers)
                        phases[i].busy.append(busy)
            out[case.key] = phases
            del caches
    how = ["host copy + gloo" if w.staged else ("device tensors" if not device.is_cpu else "cpu tensors") for w in wires]
    return out, {"config": cfg.__dict__, "params": cfg.param_count(), "weight_bytes": cfg.param_count() * 2,
                 "how": how}


def summarize(per_rank: list[Phases], parallel: str, case: Case, tokens: int) -> dict[str, float]:
    """One case and backend over all ranks: per-token medians (each iteration the slowest rank's; the `1
    device` figure of pp is the sum of the stages' compute)."""
    n = len(per_rank[0].decode)
    decode = statistics.median(max(r.decode[i] for r in per_rank) for i in range(n))
    transfers = statistics.median(max(r.transfers[i] for r in per_rank) for i in range(n))
    combine = sum if parallel == "pp" else max
    compute = statistics.median(combine(r.compute[i] for r in per_rank) for i in range(n))
    busy = statistics.median(combine(r.busy[i] for r in per_rank) for i in range(n))
    ms = 1e3 / tokens
    return {"ms_per_token": decode * ms, "compute_ms_per_token": compute * ms, "comm_ms_per_token": transfers * ms,
            "tokens_per_s": case.batch * tokens / decode if decode > 0 else 0.0,
            "device_busy_ms_per_token": busy * ms, "device_share": busy / compute if compute > 0 else 0.0,
            "iters": n}
