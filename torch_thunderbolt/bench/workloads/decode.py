"""`--workload llama-pp` / `llama-tp`: a Llama-shaped decoder generating tokens, pipeline or tensor parallel.

Pipeline (pp): rank s holds the s-th contiguous run of layers (the first also the embedding, the last the
norm and LM head); each decoded token's hidden state goes rank to rank, and the last rank's chosen token
goes back to the first. A batch cut into microbatches keeps several stages busy at once.
Tensor parallel (tp): every rank holds 1/world of every layer (Megatron-style: heads, key/value heads,
feed-forward width, vocabulary); two all_reduces of the batch's hidden states per layer complete the
partial sums, and one small all_gather picks the token from every shard's best logit. Two ways to split
(`--tp-impl`): `dtensor`, PyTorch's own `parallelize_module` over a 1-D DeviceMesh of each measured group
(`llama.parallelize`: DTensor issues the all_reduces, as functional collectives on that group), one copy of
the model per group; `manual`, the decoder's hand-written shards with the all_reduces called directly.

Per iteration and backend (interleaved, order alternating), each timed from a common start with the device
synchronised at the end, `tokens` decoded tokens:
  decode     the parallel decode with its communication;
  compute    the same on every rank with no communication at all (pp: each stage alone, on dummy inputs;
             tp: the shards with no all_reduce);
  transfers  the communication alone: the same messages, in the same order, with no compute.
ms/token = decode / tokens. For pp, a whole model on one device would take the sum of the stages' compute
(the `1 device` column); for tp, compute is one shard's.

Device tensors and gloo: gloo has no kernels for a device, so on one the gloo rows copy each message to
host memory and back (as a Mac user of gloo must); thunderbolt takes device tensors itself. DTensor hands
its collectives to the mesh's group, so its gloo rows use a group that stages through the gloo group
(bench/staged.py).

Fusion on the timed device (`device.fuse`): pipeline stages fuse whole layers; manual shards fuse each
layer's norms and attention and feed-forward halves (their all_reduces are outside); DTensor's fuse each
half's part before its row-parallel projection, whose DTensor matmul and all_reduce run as themselves, so a
fused block never hides one of DTensor's collectives.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def _pick(wire: Wire | None, logits: torch.Tensor, rank: int) -> torch.Tensor:
    """The next token of each sequence from this shard's slice of the vocabulary's logits [batch, vocab/world]."""
    best, index = logits.max(-1)
    if wire is None:
        return index[:, None]
    # Each shard's best logit and its index in the whole vocabulary; the best of those is the token.
    pair = torch.stack((best.float(), (index + rank * logits.shape[-1]).float()), dim=-1)
    every = wire.all_gather(pair)  # [world, batch, 2]
    choice = every[..., 0].argmax(0)  # [batch]
    return every[..., 1].gather(0, choice[None]).long().view(-1, 1)


class _TensorParallel:
    """This rank's shard of every layer (hand-written) and a tensor-parallel decode."""

    def __init__(self, cfg: llama.LlamaConfig, rank: int, world: int, device: Device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.stage = place(lambda d: llama.build_stage(cfg, range(cfg.layers), True, True, dtype=DTYPE, device=d,
                                                       shards=world), device)
        _fuse(self.stage, device, whole_layers=False)

    def _step(self, wire: Wire | None, x: torch.Tensor, caches: list[llama.KVCache], pos: int) -> torch.Tensor:
        return _pick(wire, self.stage(x, caches, pos)[:, -1], self.rank)

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


class _Core(nn.Module):
    """The part of an attention or feed-forward module before its output projection (`module.core`)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> torch.Tensor:
        return self.module.core(*args)


class _Halves(nn.Module):
    """An attention or feed-forward module as its (fusable) core and its row-parallel output projection.
    With `communicate` off, the projection's DTensor matmul still runs and its partial sum is left as it is:
    the same work on this rank with no all_reduce."""

    def __init__(self, core: nn.Module, out: nn.Module) -> None:
        super().__init__()
        self.core, self.out = core, out
        self.communicate = True

    def forward(self, *args: Any) -> torch.Tensor:
        h = self.core(*args)
        if self.communicate:
            return self.out(h)
        from torch.distributed.tensor import DTensor, Shard

        weight = self.out.weight
        local = DTensor.from_local(h, weight.device_mesh, [Shard(-1)], run_check=False)
        return F.linear(local, weight).to_local()


def _split_halves(stage: llama.LlamaStage, device: Device) -> list[_Halves]:
    """Each layer's attention and feed-forward as `_Halves`, their cores, norms, embedding and head fused."""
    for name in ("embed", "norm", "lm_head"):
        if getattr(stage, name) is not None:
            setattr(stage, name, device.fuse(getattr(stage, name)))
    halves = []
    for layer in stage.layers:
        layer.input_norm, layer.post_attn_norm = device.fuse(layer.input_norm), device.fuse(layer.post_attn_norm)
        layer.attn = _Halves(device.fuse(_Core(layer.attn)), layer.attn.o_proj)
        layer.mlp = _Halves(device.fuse(_Core(layer.mlp)), layer.mlp.down_proj)
        halves += [layer.attn, layer.mlp]
    return halves


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (DTensor hands back one that waits when first used)."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


class _DTensorParallel:
    """One copy of the model per measured group, each split by DTensor over a DeviceMesh of that group
    (`llama.parallelize`), and a tensor-parallel decode through it."""

    def __init__(self, cfg: llama.LlamaConfig, rank: int, world: int, device: Device, wires: list[Wire]) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        from ..staged import new_staged_group

        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.meshes: dict[int, Any] = {}
        self.stages: dict[int, llama.LlamaStage] = {}
        self.halves: dict[int, list[_Halves]] = {}
        for wire in wires:
            group = new_staged_group(wire.group) if wire.staged else wire.group
            mesh = DeviceMesh.from_group(group, device.torch_device.type)
            stage = place(lambda d: llama.build_stage(cfg, range(cfg.layers), True, True, dtype=DTYPE, device=d),
                          device, prepare=lambda m, mesh=mesh: llama.parallelize(m, mesh))
            self.meshes[id(wire)], self.stages[id(wire)] = mesh, stage
            self.halves[id(wire)] = _split_halves(stage, device)
        self.first = id(wires[0])

    def _communicate(self, key: int, on: bool) -> None:
        for half in self.halves[key]:
            half.communicate = on

    def decode(self, wire: Wire, case: Case, tokens: int, caches: list[llama.KVCache]) -> None:
        key = id(wire)
        self._communicate(key, True)
        x = torch.zeros((case.batch, 1), dtype=torch.long, device=self.device.torch_device)
        for t in range(tokens):
            x = _pick(wire, self.stages[key](x, caches, PROMPT_TOKENS + t)[:, -1], self.rank)

    def compute(self, case: Case, tokens: int, caches: list[llama.KVCache]) -> None:
        self._communicate(self.first, False)
        x = torch.zeros((case.batch, 1), dtype=torch.long, device=self.device.torch_device)
        for t in range(tokens):
            x = _pick(None, self.stages[self.first](x, caches, PROMPT_TOKENS + t)[:, -1], self.rank)

    def transfers(self, wire: Wire, case: Case, tokens: int) -> None:
        """The decode's collectives as DTensor issues them (a partial sum made whole), and the token's gather."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self.meshes[id(wire)]
        hidden = torch.zeros((case.batch, 1, self.cfg.hidden), dtype=DTYPE, device=self.device.torch_device)
        pair = torch.zeros((case.batch, 2), dtype=torch.float32, device=self.device.torch_device)
        for _ in range(tokens):
            for _ in range(2 * self.cfg.layers):
                partial = DTensor.from_local(hidden, mesh, [Partial()], run_check=False)
                hidden = _waited(partial.redistribute(mesh, [Replicate()]).to_local())
            wire.all_gather(pair)

    def caches(self, case: Case) -> list[llama.KVCache]:
        return self.stages[self.first].new_caches(case.batch)


def model_config(preset: str, tokens: int) -> llama.LlamaConfig:
    """The preset with a KV cache just long enough for the prompt and the decoded tokens."""
    return llama.make_config(preset, max_seq=PROMPT_TOKENS + tokens + 1)


def run(kind_of_parallel: str, preset: str, cases: list[Case], groups: list[Any], kinds: list[str], device: Device,
        rank: int, world: int, tokens: int, iters: int, warmup: int,
        control: Any = None, tp_impl: str = "manual") -> tuple[dict[str, list[Phases]], dict]:
    """This rank's phases per case key and backend (in the order of `groups`), and what the model is."""
    cfg = model_config(preset, tokens)
    wires = [Wire(g, k, device) for g, k in zip(groups, kinds)]
    runner: _Pipeline | _TensorParallel | _DTensorParallel
    if kind_of_parallel == "tp":
        llama.check_shards(cfg, world)
        runner = (_DTensorParallel(cfg, rank, world, device, wires) if tp_impl == "dtensor"
                  else _TensorParallel(cfg, rank, world, device))
    else:
        runner = _Pipeline(cfg, rank, world, device)
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
                 "how": how, "tp_impl": tp_impl if kind_of_parallel == "tp" else None}


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
