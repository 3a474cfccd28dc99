"""A small Llama-style decoder in plain torch: RMSNorm, rotary embeddings, grouped-query attention with a
KV cache, SwiGLU feed-forward.

The model is built as *stages*: a contiguous run of decoder layers, plus the token embedding on the first
stage and the final norm + LM head on the last. The whole model is simply the one stage holding every
layer. Every part is initialised from its own seed (derived from the model seed and the layer index), so a
pipeline rank can build only its layers and still get exactly the weights a single process would build.

A stage can also be one *shard* of a tensor-parallel split (Megatron-style, `shards` > 1): each rank holds
1/shards of the attention heads, of the key/value heads, of the feed-forward width and of the LM head's
vocabulary; the attention output and the feed-forward output are partial sums that the stage's `reduce`
(an all_reduce) completes, and the logits are this shard's slice of the vocabulary. A shard's weights are
drawn from its own seed, not sliced from the whole model's: shards serve timing, not equal outputs.

`parallelize` splits a whole stage the same way through PyTorch's own tensor parallelism instead
(`torch.distributed.tensor.parallel`): column-parallel query, key, value, gate, up projections and LM head,
row-parallel output and down projections, over a 1-D DeviceMesh. Each rank keeps its slice of the whole
model's weights, DTensor's redistribution does the two all_reduces per layer, and the logits are this rank's
slice of the whole model's vocabulary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 4
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336
    max_seq: int = 512
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> "LlamaConfig":
        if min(self.vocab_size, self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) < 1:
            raise ValueError(f"model sizes must be positive, got {asdict(self)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head size hidden/heads = {self.head_dim} must be even for rotary embeddings")
        return self

    def param_count(self) -> int:
        """Parameters of the whole model (embedding and LM head untied)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return 2 * self.vocab_size * h + self.layers * per_layer + h


# `h4096` keeps Llama-3-8B's layer shape (hidden 4096, GQA 32/8 heads, SwiGLU 14336) at 4 layers instead
# of 32, and a 32k vocabulary: ~1.1 G parameters, 4.5 GB in fp32, so 1 process + 2 stages fit in 24 GB.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, hidden=64, layers=4, heads=4, kv_heads=2, intermediate=172,
                        max_seq=128, rope_theta=10000.0),
    "small": LlamaConfig(vocab_size=8192, hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816),
    "h4096": LlamaConfig(),
    # Llama-3-8B's whole shape (32 layers, 128256-token vocabulary): 8.03 G parameters, 16 GB in fp16. What
    # `bench --workload llama-*` times on the timed device, which never allocates or touches the weights.
    "llama8b": LlamaConfig(vocab_size=128256, layers=32),
}


def make_config(preset: str, **overrides: int | None) -> LlamaConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset], **given).validate()


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges per stage; earlier stages take the remainder (the last holds the LM head)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"cannot split {n_layers} layers over {n_stages} stages "
                         "(need layers >= stages >= 1)")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 weights do not lose the mean-square.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_seq, head_dim/2] for rotary position embeddings."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim/2]. Rotate-half convention."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def check_shards(cfg: LlamaConfig, shards: int) -> None:
    """A tensor-parallel split needs every split dimension to be a multiple of the shard count."""
    sizes = {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "intermediate": cfg.intermediate,
             "vocab_size": cfg.vocab_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % shards]
    if shards < 1 or bad:
        raise ValueError(f"cannot split the model over {shards} tensor-parallel shards: "
                         f"{', '.join(bad) or 'shards must be >= 1'} (must be multiples of the shard count)")


def tp_plan(stage: "LlamaStage") -> dict[str, Any]:
    """The Megatron split as a `parallelize_module` plan: column-parallel projections into the heads and the
    feed-forward width (and the LM head, whose logits stay this rank's vocabulary slice), row-parallel
    projections out of them (their partial sums all_reduced by DTensor)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(stage.layers)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    if stage.lm_head is not None:
        plan["lm_head"] = ColwiseParallel()
    return plan


def parallelize(stage: "LlamaStage", mesh: Any) -> "LlamaStage":
    """Split a whole stage (built with shards=1) over the 1-D DeviceMesh `mesh` with `parallelize_module`
    (`tp_plan`); in place. Every rank holds the same whole weights, so each takes its own slice with no
    communication (`src_data_rank=None`); a stage on the meta device stays unallocated until `to_empty`."""
    from torch.distributed.tensor.parallel import parallelize_module

    if stage.shards != 1:
        raise ValueError(f"parallelize splits a whole stage; this one is already 1/{stage.shards} of one")
    check_shards(stage.cfg, mesh.size())
    parallelize_module(stage, mesh, tp_plan(stage), src_data_rank=None)
    stage.shards = mesh.size()  # this rank's KV caches hold its share of the key/value heads
    return stage


class KVCache:
    """Preallocated keys/values of one layer for one (micro-)batch (this shard's key/value heads)."""

    def __init__(self, batch: int, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 shards: int = 1) -> None:
        shape = (batch, cfg.kv_heads // shards, cfg.max_seq, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = pos + k.shape[2]
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, shards: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads, self.kv_heads = cfg.heads // shards, cfg.kv_heads // shards
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.core(x, cache, pos, cos, sin))

    def core(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Everything before the output projection: the attention of the heads this module's projections
        yield. Head counts are read off the projections' outputs, so the same code runs a whole layer, a
        Megatron shard, or a layer whose projections DTensor split (`parallelize`)."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.update(k, v, pos)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Query i sits at position pos+i and may see keys 0..pos+i.
        mask = None
        if t > 1:
            keys = torch.arange(pos + t, device=x.device)
            mask = keys[None, :] <= (pos + torch.arange(t, device=x.device))[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, -1)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig, shards: int = 1) -> None:
        super().__init__()
        width = cfg.intermediate // shards
        self.gate_proj = nn.Linear(cfg.hidden, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.core(x))

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before the down projection."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class DecoderLayer(nn.Module):
    """One layer; with `shards` > 1 one tensor-parallel shard of it, whose two partial sums `reduce`
    completes (Megatron's two all_reduces per layer)."""

    def __init__(self, cfg: LlamaConfig, shards: int = 1, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, shards)
        self.post_attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, shards)
        self.reduce = reduce

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.reduce(self.attn(self.input_norm(x), cache, pos, cos, sin))
        return x + self.reduce(self.mlp(self.post_attn_norm(x)))


def _seeded(seed: int, build):
    # Each part gets its own RNG stream, so which rank builds it does not change its weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class LlamaStage(nn.Module):
    """Layers `layer_ids` of the model; token ids in if it has the embedding, logits out if it has the LM
    head, hidden states otherwise. Build one with `build_stage`, or carve one out of a whole model with
    `share_stage` (no copy)."""

    def __init__(self, cfg: LlamaConfig, layer_ids: Sequence[int], layers: Sequence[DecoderLayer],
                 embed: nn.Embedding | None, norm: RMSNorm | None, lm_head: nn.Linear | None,
                 shards: int = 1) -> None:
        super().__init__()
        if len(layer_ids) != len(layers):
            raise ValueError("one layer id per layer expected")
        self.cfg, self.layer_ids, self.shards = cfg, list(layer_ids), shards
        self.embed, self.layers, self.norm, self.lm_head = embed, nn.ModuleList(layers), norm, lm_head
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def first(self) -> bool:
        return self.embed is not None

    @property
    def last(self) -> bool:
        return self.lm_head is not None

    def new_caches(self, batch: int) -> list[KVCache]:
        p = next(self.parameters())
        return [KVCache(batch, self.cfg, p.dtype, p.device, self.shards) for _ in self.layers]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, caches: list[KVCache], pos: int) -> torch.Tensor:
        t = x.shape[1]
        if pos + t > self.cfg.max_seq:
            raise ValueError(f"sequence of {pos + t} tokens exceeds max_seq={self.cfg.max_seq}")
        if self.embed is not None:
            x = self.embed(x)
        cos, sin = self.rope_cos[pos:pos + t], self.rope_sin[pos:pos + t]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, pos, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x)).float()
        return x


def build_stage(cfg: LlamaConfig, layer_ids: Sequence[int], first: bool, last: bool, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                checkpoint: dict[str, torch.Tensor] | None = None, shards: int = 1,
                reduce: Reduce = no_reduce) -> LlamaStage:
    """Build one stage; with `checkpoint` (a whole-model state dict), load this stage's share of it. With
    `shards` > 1, one tensor-parallel shard whose partial sums `reduce` completes (see the module's
    docstring); under `torch.device("meta")` nothing is allocated (`to_empty` then places it)."""
    check_shards(cfg, shards)
    if checkpoint is not None and shards > 1:
        raise ValueError("a checkpoint loads into whole stages only (shards=1)")
    base = seed * 1_000_003 + (shards - 1) * 7_919
    stage = LlamaStage(
        cfg, layer_ids,
        layers=[_seeded(base + 100 + i, lambda: DecoderLayer(cfg, shards, reduce)) for i in layer_ids],
        embed=_seeded(base + 1, lambda: nn.Embedding(cfg.vocab_size, cfg.hidden)) if first else None,
        norm=RMSNorm(cfg.hidden, cfg.norm_eps) if last else None,
        lm_head=(_seeded(base + 2, lambda: nn.Linear(cfg.hidden, cfg.vocab_size // shards, bias=False))
                 if last else None),
        shards=shards)
    if checkpoint is not None:
        stage.load_state_dict(stage_state_dict(checkpoint, stage.layer_ids, first, last))
    return _keep_rope_fp32(stage.to(dtype=dtype, device=device)).eval()


def share_stage(full: LlamaStage, layer_ids: Sequence[int], first: bool, last: bool) -> LlamaStage:
    """A stage that reuses `full`'s modules (same tensors, no copy) for layers `layer_ids`."""
    pick = [full.layers[full.layer_ids.index(i)] for i in layer_ids]
    stage = LlamaStage(full.cfg, layer_ids, pick, full.embed if first else None,
                       full.norm if last else None, full.lm_head if last else None, full.shards)
    return _keep_rope_fp32(stage.to(device=full.rope_cos.device)).eval()


def _keep_rope_fp32(stage: LlamaStage) -> LlamaStage:
    # `.to(dtype)` also casts buffers; rotary angles stay fp32 so every stage rotates identically.
    stage.rope_cos, stage.rope_sin = stage.rope_cos.float(), stage.rope_sin.float()
    return stage


def stage_state_dict(full: dict[str, torch.Tensor], layer_ids: Sequence[int], first: bool,
                     last: bool) -> dict[str, torch.Tensor]:
    """Select a stage's keys from a whole-model state dict (global layer numbers → local ones)."""
    out = {}
    local = {g: i for i, g in enumerate(layer_ids)}
    for key, value in full.items():
        head, _, rest = key.partition(".")
        if head == "layers":
            idx, _, tail = rest.partition(".")
            if int(idx) in local:
                out[f"layers.{local[int(idx)]}.{tail}"] = value
        elif (head == "embed" and first) or (head in ("norm", "lm_head") and last):
            out[key] = value
    return out


def greedy_generate(model: LlamaStage, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Single-process greedy decoding with the KV cache: returns [B, new_tokens] token ids."""
    caches = model.new_caches(prompt.shape[0])
    logits = model(prompt, caches, 0)
    tokens = [logits[:, -1].argmax(-1)]
    pos = prompt.shape[1]
    for _ in range(new_tokens - 1):
        logits = model(tokens[-1][:, None], caches, pos)
        tokens.append(logits[:, -1].argmax(-1))
        pos += 1
    return torch.stack(tokens, dim=1)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def human_params(n: int) -> str:
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"


__all__ = ["LlamaConfig", "PRESETS", "make_config", "split_layers", "LlamaStage", "build_stage",
           "share_stage", "stage_state_dict", "greedy_generate", "KVCache", "param_bytes", "human_params",
           "check_shards", "no_reduce", "tp_plan", "parallelize"]
