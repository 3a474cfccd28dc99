"""Program of test_tp_dtensor.py: the Llama-style decoder split by DTensor (`llama.parallelize`) over the
ranks, on the timed Apple-silicon GPU in exact mode, against the whole model in this process.

Each rank builds the whole tiny model (every rank the same weights), a copy of it split over a 1-D
DeviceMesh of the group named by TP_BACKEND (thunderbolt; or gloo_staged, gloo through host copies), and
runs a prompt and a few decoded tokens through both; the split model's logits are this rank's vocabulary
slice, gathered over the default (gloo, host) group before comparing."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401  (registers the backend)
from torch_thunderbolt.bench import staged
from torch_thunderbolt.testing import apple_gpu
from torch_thunderbolt.testing.models import llama
from torch_thunderbolt.testing.program import main, result


def logits_match() -> None:
    gpu = apple_gpu.install("m2-ultra", exact=True)
    dev = gpu.device
    dist.init_process_group("gloo")
    kind = os.environ["TP_BACKEND"]
    group = staged.new_staged_group(dist.new_group(backend="gloo")) if kind == "gloo_staged" else \
        dist.new_group(backend=kind)
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, dev.type)
    cfg = llama.make_config("tiny")
    whole = llama.build_stage(cfg, range(cfg.layers), True, True, seed=3, dtype=torch.float32, device=dev)
    split = llama.parallelize(
        llama.build_stage(cfg, range(cfg.layers), True, True, seed=3, dtype=torch.float32, device=dev), mesh)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(11)).to(dev)
    caches_whole, caches_split = whole.new_caches(2), split.new_caches(2)
    steps = []
    x_whole = x_split = prompt
    pos = 0
    for _ in range(4):
        want = whole(x_whole, caches_whole, pos).cpu()
        local = split(x_split, caches_split, pos)
        parts = [torch.empty(local.shape) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.cpu())  # over the default group: what is compared, not what is tested
        got = torch.cat(parts, dim=-1)
        steps.append({"shape": list(got.shape), "want_shape": list(want.shape), "local_vocab": local.shape[-1],
                      "max_abs_diff": float((got - want).abs().max()), "max_abs": float(want.abs().max()),
                      "same_tokens": bool(torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1)))})
        pos += x_whole.shape[1]
        x_whole = want[:, -1:].argmax(-1).to(dev)
        x_split = x_whole
    result({"steps": steps, "weight_type": type(split.layers[0].attn.q_proj.weight).__name__,
            "cache_kv_heads": caches_split[0].k.shape[1]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main({"logits_match": logits_match})
