"""HF Accelerate on the thunderbolt backend, as the README's recipe says: create the process group first,
then `Accelerator(cpu=True)` finds it and wraps the model in DDP. Run under `torch-thunderbolt launch`
(or torchrun); argv[1] is the backend (thunderbolt, or gloo to compare). Prints one RESULT line."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import torch_thunderbolt  # noqa: F401 - registers the backend (torch's autoload does too, once installed)


def main() -> None:
    dist.init_process_group(sys.argv[1])  # before Accelerator(): it uses the group that exists
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # cpu=True: on a Mac, Accelerate has no multi-process mode for mps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "backend": dist.get_backend(),
                                  "accelerate_backend": accelerator.state.backend,
                                  "distributed_type": str(accelerator.distributed_type),
                                  "processes": accelerator.num_processes, "wrapped": type(model).__name__,
                                  "params": params}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
