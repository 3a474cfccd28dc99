"""A Vision Transformer (ViT, "An Image is Worth 16x16 Words") in plain torch, no torchvision.

Presets follow the paper's sizes with patch 16: `small` (ViT-S/16, ~22 M parameters) and `base`
(ViT-B/16, ~86 M with a 1000-class head); `tiny` is a toy for tests.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch: int = 16
    channels: int = 3
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    classes: int = 1000

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    def validate(self) -> "ViTConfig":
        sizes = (self.image_size, self.patch, self.channels, self.dim, self.depth, self.heads, self.classes)
        if min(sizes) < 1:
            raise ValueError(f"ViT sizes must be positive, got {asdict(self)}")
        if self.image_size % self.patch:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch ({self.patch})")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        return self


PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(image_size=32, dim=64, depth=2, heads=4, classes=10),
    "small": ViTConfig(dim=384, depth=12, heads=6),
    "base": ViTConfig(dim=768, depth=12, heads=12),
}


def make_config(preset: str, **overrides: int | None) -> ViTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}).validate()


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        hidden = int(cfg.dim * cfg.mlp_ratio)
        self.norm1 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.attn = SelfAttention(cfg.dim, cfg.heads)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        # A stride-16 convolution is exactly "cut into 16x16 patches and project each one".
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.patches + 1, cfg.dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.depth)))
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def param_count(cfg: ViTConfig) -> int:
    """Parameters of a ViT built from `cfg`, counted on the meta device (no memory, no init time)."""
    with torch.device("meta"):
        return sum(p.numel() for p in ViT(cfg).parameters())


class SyntheticImages:
    """Learnable synthetic data: each class is a fixed random image; a sample is its class image plus noise.

    The class images come from `seed` (identical on every rank); the noise and labels come from
    (seed, rank, step), so ranks see different samples, like a sharded dataset.
    """

    def __init__(self, cfg: ViTConfig, seed: int, noise: float = 1.0, max_classes: int = 64) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seed, self.noise = seed, noise
        # At most `max_classes` distinct classes: 1000 class images at 224x224 would take 600 MB.
        self.used_classes = min(cfg.classes, max_classes)
        self.prototypes = torch.randn(self.used_classes, cfg.channels, cfg.image_size, cfg.image_size,
                                      generator=gen)

    def batch(self, size: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, rank, step)) & 0x7FFF_FFFF)
        labels = torch.randint(0, self.used_classes, (size,), generator=gen)
        noise = torch.randn(self.prototypes[labels].shape, generator=gen)
        return self.prototypes[labels] + self.noise * noise, labels
