"""The smallest model-parallel program, runnable as written: two ranks split a two-layer model.

Rank 0 runs layer1 and sends the activations; rank 1 receives them and runs layer2.

    torchrun --nproc-per-node 2 examples/seed_example.py            # thunderbolt if installed, else gloo
    torchrun --nproc-per-node 2 examples/seed_example.py --backend gloo
    python examples/seed_example.py                                  # starts its own 2 local ranks

What it needs to run: the rendezvous comes from torchrun (env://; a rendezvous URL needs an address the
ranks reach, not a MAC address), the model uses MPS when present and the CPU otherwise, and activations
travel as CPU tensors (torch.distributed CPU backends do not take MPS tensors). Rank 1 also recomputes
the whole model locally and checks the split result against it.
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn


def default_backend() -> str:
    try:
        import torch_thunderbolt  # noqa: F401  (importing it registers backend "thunderbolt")
    except ImportError:
        return "gloo"
    return "thunderbolt" if "thunderbolt" in dist.Backend.backend_list else "gloo"


# Create a simple model and split it over the devices
class SimpleModel(nn.Module):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.layer1 = nn.Linear(1024, 1024)
        self.layer2 = nn.Linear(1024, 512)

    def forward(self, x):
        # Each device computes its own part
        if dist.get_rank() == 0:
            x = self.layer1(x)
            # Send the activations to rank 1
            dist.send(x.cpu(), dst=1)
            return None
        x_recv = torch.zeros(32, 1024)
        dist.recv(x_recv, src=0)
        return self.layer2(x_recv.to(self.device))


def example_input() -> torch.Tensor:
    return torch.randn(32, 1024, generator=torch.Generator().manual_seed(1))


def run(backend: str) -> None:
    if backend == "thunderbolt":
        import torch_thunderbolt  # noqa: F401  (each rank process registers the backend)
    dist.init_process_group(backend=backend)  # rank, world size and address from torchrun's environment
    try:
        if dist.get_world_size() != 2:
            raise SystemExit(f"this example needs exactly 2 ranks, got {dist.get_world_size()}")
        device = torch.device("mps" if torch.backends.mps.is_available() else "cpu")
        torch.manual_seed(0)  # both ranks build identical weights
        model = SimpleModel(device).to(device)
        with torch.no_grad():
            if dist.get_rank() == 0:
                model(example_input().to(device))
            else:
                output = model(None)
                print(f"Output shape: {output.shape}")
                expected = model.layer2(model.layer1(example_input().to(device)))
                diff = (output - expected).abs().max().item()
                print(f"backend {backend}: max |split - whole model| = {diff:.3g}")
                if diff > 1e-4:
                    raise SystemExit("the split model disagrees with the whole model")
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, backend: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(backend)


def main() -> None:
    parser = argparse.ArgumentParser(description="the seed's two-rank send/recv example")
    parser.add_argument("--backend", default=None, help="default: thunderbolt if installed, else gloo")
    backend = parser.parse_args().backend or default_backend()
    if "RANK" in os.environ:  # under torchrun
        run(backend)
        return
    with socket.socket() as s:  # no torchrun: start 2 local ranks on a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(backend, port), nprocs=2)


if __name__ == "__main__":
    main()
