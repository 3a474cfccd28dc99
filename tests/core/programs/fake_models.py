"""The program of test_fake_device.py: models trained side by side on the CPU and on the fake accelerator
(testing.fake_device), in one process of its own (the fake device is installed once per process, and
before the first backward pass: torch's autograd engine counts devices then)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_thunderbolt.testing.fake_device import host_view, install, values
from torch_thunderbolt.testing.models import vit as vit_models
from torch_thunderbolt.testing.program import main, result

D = "tbfake"


class Attention(nn.Module):
    """nn.MultiheadAttention, through its explicit path (need_weights) or F.scaled_dot_product_attention."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


def tiny_vit() -> nn.Module:
    return vit_models.ViT(vit_models.make_config("tiny"))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], type]] = {
    "linear_tanh": (lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                    lambda: torch.randn(5, 8), torch.optim.AdamW),
    "conv": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
                                   nn.Flatten(), nn.Linear(4 * 7 * 7, 3)),
             lambda: torch.randn(2, 3, 16, 16), torch.optim.SGD),
    "layer_norm_dropout": (lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.3)),
                           lambda: torch.randn(4, 3, 8), torch.optim.AdamW),
    "attention": (lambda: Attention(need_weights=True), lambda: torch.randn(2, 5, 16), torch.optim.AdamW),
    "attention_sdpa_math": (lambda: Attention(need_weights=False), lambda: torch.randn(2, 5, 16),
                            torch.optim.AdamW),
    "vit_sdpa_math": (tiny_vit, lambda: torch.randn(2, 3, 32, 32), torch.optim.AdamW),
}


def side_by_side(make: Callable[[], nn.Module], data: Callable[[], torch.Tensor], opt: type,
                 steps: int = 2) -> dict[str, Any]:
    """Train a model and its copy on the device for `steps` optimizer steps from the same seeds: are the
    losses, gradients and weights of every step identical?"""
    torch.manual_seed(0)
    cpu = make()
    dev = copy.deepcopy(cpu).to(D)
    opt_cpu = opt(cpu.parameters(), lr=1e-2, **({"momentum": 0.9} if opt is torch.optim.SGD else {}))
    opt_dev = opt(dev.parameters(), lr=1e-2, **({"momentum": 0.9} if opt is torch.optim.SGD else {}))
    x = data()
    same, worst = True, 0.0
    for step in range(steps):
        torch.manual_seed(step)  # dropout draws the same numbers on both
        loss_cpu = cpu(x).square().mean()
        loss_cpu.backward()
        torch.manual_seed(step)
        loss_dev = dev(x.to(D)).square().mean()
        loss_dev.backward()
        pairs = [(loss_cpu.detach(), values(loss_dev))]
        pairs += [(p.grad, values(q.grad)) for p, q in zip(cpu.parameters(), dev.parameters())]
        opt_cpu.step()
        opt_dev.step()
        opt_cpu.zero_grad()
        opt_dev.zero_grad()
        pairs += [(p.detach(), values(q)) for p, q in zip(cpu.parameters(), dev.parameters())]
        same = same and all(torch.equal(a, b) for a, b in pairs)
        worst = max(worst, max(float((a - b).abs().max()) for a, b in pairs))
    return {"identical": same, "max_diff": worst}


def models() -> None:
    log = install()
    out: dict[str, Any] = {}
    for name, (make, data, opt) in MODELS.items():
        log.clear()
        if name.endswith("_sdpa_math"):
            with sdpa_kernel(SDPBackend.MATH):  # the CPU's math path: what any other device runs
                out[name] = side_by_side(make, data, opt)
        else:
            out[name] = side_by_side(make, data, opt)
        # Like mps, backward runs on autograd's device thread, not the thread that called backward().
        out[name]["threads"] = sorted(log.threads())
    result(out)


def semantics() -> None:
    """Views, strides and in-place ops: each check is True when the device did what the CPU does."""
    install()
    checks: dict[str, bool] = {}
    base = torch.arange(24.0).view(4, 6)
    d = base.to(D)

    def same(name: str, dev: torch.Tensor, cpu: torch.Tensor) -> None:
        checks[name] = (dev.device.type == D and dev.shape == cpu.shape and dev.stride() == cpu.stride()
                        and dev.storage_offset() == cpu.storage_offset() and torch.equal(values(dev), cpu))

    same("transpose", d.t(), base.t())
    same("transpose_of_transpose", d.t()[1:].t(), base.t()[1:].t())
    same("strided_slice", d[::2, 1::3], base[::2, 1::3])
    same("transposed_matmul", d.t() @ d, base.t() @ base)
    same("expand", d[:1].expand(3, 6), base[:1].expand(3, 6))
    same("permute_contiguous", d.view(2, 2, 6).permute(2, 0, 1).contiguous(),
         base.view(2, 2, 6).permute(2, 0, 1).contiguous())
    same("unbind", d.t().unbind(0)[2], base.t().unbind(0)[2])
    c, dv = base.clone(), d.clone()
    c.t()[2].add_(100)
    dv.t()[2].add_(100)
    same("in_place_through_view_writes_base", dv, c)
    checks["views_share_storage"] = dv.t().untyped_storage()._cdata == dv.untyped_storage()._cdata
    c, dv = base.clone(), d.clone()
    c.t_()
    dv.t_()
    same("metadata_in_place", dv, c)
    out_c, out_d = torch.empty(0), torch.empty(0, device=D)
    torch.mul(base, 2, out=out_c)
    torch.mul(d, 2, out=out_d)
    same("out_resized", out_d, out_c)
    g = d.clone()
    g.resize_(6, 6)
    checks["resize_keeps_values"] = g.shape == (6, 6) and torch.equal(values(g).view(-1)[:24], base.view(-1))
    x = d.clone()
    x.detach().zero_()
    checks["detach_shares_memory"] = torch.equal(values(x), torch.zeros(4, 6))
    checks["host_view_is_a_view"] = host_view(d[1]).data_ptr() == d[1].data_ptr()
    checks["item"] = d[1, 2].item() == 8.0
    checks["to_cpu"] = torch.equal(d.t().cpu(), base.t()) and d.t().cpu().device.type == "cpu"
    torch.manual_seed(5)
    r_c = torch.randn(3, 4)
    torch.manual_seed(5)
    r_d = torch.randn(3, 4, device=D)
    same("random_stream", r_d, r_c)
    result(checks)


def sdpa_default() -> None:
    """F.scaled_dot_product_attention without a forced kernel: the CPU takes its fused kernel, other
    devices the math path (fake_device.SDPA_NOTE). Close, not identical."""
    install()
    q = torch.randn(2, 4, 5, 8)
    on_cpu = F.scaled_dot_product_attention(q, q, q)
    on_dev = values(F.scaled_dot_product_attention(q.to(D), q.to(D), q.to(D)))
    with sdpa_kernel(SDPBackend.MATH):
        math = F.scaled_dot_product_attention(q, q, q)
    result({"close": bool(torch.allclose(on_cpu, on_dev, atol=1e-6)), "equal_to_math": torch.equal(math, on_dev)})


if __name__ == "__main__":
    main({"models": models, "semantics": semantics, "sdpa_default": sdpa_default})
