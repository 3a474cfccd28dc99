"""Same-run A/B of this version against another one: registers the other version as backend "tbold".

    git -C . archive OLD_COMMIT torch_thunderbolt | tar x -C /tmp/ab --transform s/^torch_thunderbolt/torch_thunderbolt_old/
    TB_AB_OLD=1 PYTHONPATH=scripts/ab_previous:/tmp/ab torch-thunderbolt bench --backends new=thunderbolt,old=tbold,gloo \\
        --baseline old --ops all_reduce,broadcast,all_gather,sendrecv --sizes 4K,1M,64M -n 30 --transport shm

Python imports this module at start-up in the bench process and in every rank it starts (they inherit
PYTHONPATH), so both versions run interleaved in the same processes. Does nothing unless TB_AB_OLD is set.
"""
import os

if os.environ.get("TB_AB_OLD"):
    import torch.distributed as dist

    import torch_thunderbolt  # noqa: F401 - this version owns "thunderbolt"
    from torch_thunderbolt_old.backend import registration as old

    if "tbold" not in dist.Backend.backend_list:
        dist.Backend.register_backend("tbold", old.create_process_group, extended_api=True, devices=["cpu"])
