"""Lightning's DDP on the thunderbolt backend, as the README's recipe says: `accelerator="cpu"` and
`DDPStrategy(process_group_backend="thunderbolt")`, under `torch-thunderbolt launch` (or torchrun), whose
environment Lightning reads (devices = LOCAL_WORLD_SIZE, num_nodes = GROUP_WORLD_SIZE). argv[1] is the
backend (thunderbolt, or gloo to compare). Prints one RESULT line per rank."""
from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import torch_thunderbolt  # noqa: F401 - registers the backend (torch's autoload does too, once installed)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
                        strategy=DDPStrategy(process_group_backend=sys.argv[1]), max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Regression()
    trainer.fit(model, loader)
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "backend": dist.get_backend(),
                                  "world": trainer.world_size, "params": params}), flush=True)


if __name__ == "__main__":
    main()
