"""A tiny job for launcher tests: every rank all_reduces (rank + 1) and prints what it got."""
import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()
if args.backend == "thunderbolt":
    import torch_thunderbolt  # noqa: F401  (registers the backend)
dist.init_process_group(backend=args.backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"allreduce rank={rank} world={world} ifname={os.environ.get('GLOO_SOCKET_IFNAME')} "
      f"master={os.environ['MASTER_ADDR']} result={t.item():g}", flush=True)
dist.destroy_process_group()
