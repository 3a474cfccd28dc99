"""Ranks of test_old_torch.py: a torch without shrink_group (this torch with it taken away before the backend
registers: the rank runs with TORCH_DEVICE_BACKEND_AUTOLOAD=0). Registration leaves torch as it is; after a
loss the survivors call the group's `shrink` themselves and use what it returns through its own methods."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if TYPE_CHECKING:
    from torch_thunderbolt.testing.program import Exit

# Nothing of torch_thunderbolt at import (its package registers the backend): `direct` takes shrink_group
# away first, and a test may import this module without changing its own torch.


def _without_shrink_group() -> None:
    """torch as it was before shrink_group: no shrink_group, nor the steps registration wraps."""
    for module in (c10d, dist):
        for name in ("shrink_group", "_create_shrunk_process_group", "_finalize_shrunk_group"):
            if hasattr(module, name):
                delattr(module, name)


def direct() -> "Exit":
    """3 ranks: rank 2 exits hard after one all_reduce; ranks 0 and 1 shrink by hand and use the result."""
    assert os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0"
    _without_shrink_group()
    import torch_thunderbolt  # noqa: F401 - registers the backend, on this torch without shrink_group
    from torch_thunderbolt.backend import registration
    from torch_thunderbolt.testing.program import Exit, outcome, rank, register_pid, result

    register_pid()
    dist.init_process_group("thunderbolt", init_method="env://", timeout=timedelta(seconds=60))
    out = {"install_shrink": registration.install_shrink(registration.TorchPlaces.of_torch()),
           "patched": any(hasattr(c10d, name) for name in registration.SHRINK_STEPS) or hasattr(dist, "shrink_group")}
    x = torch.ones(10)
    dist.all_reduce(x)
    if rank() == 2:
        return Exit(0, hard=True)
    out["loss"] = outcome(lambda: [dist.all_reduce(torch.ones(1 << 18)) for _ in range(100)])
    old = c10d._get_default_group()
    new = old.shrink([2])
    r, w = new.rank(), new.size()
    a = torch.full((1 << 18,), float(r + 1))
    new.allreduce([a]).wait()
    b = torch.full((100,), float(r))
    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    new.broadcast([b], opts).wait()
    outs = [[torch.zeros(3) for _ in range(w)]]
    new.allgather(outs, [torch.full((3,), float(r))]).wait()
    c = torch.full((5,), float(r))
    if r == 0:
        new.send([c + 7], 1, 0).wait()
    else:
        new.recv([c], 0, 0).wait()
    new.barrier().wait()
    d = torch.full((7,), float(r + 1))
    dist.all_reduce(d, group=new)  # torch's functions that need no rank translation take it as it is
    out.update({"rank": r, "size": w, "sum": a.unique().tolist(), "bcast": b.unique().tolist(),
                "gathered": [t[0].item() for t in outs[0]], "recv": c.unique().tolist() if r == 1 else None,
                "dist_sum": d.unique().tolist(), "old_usable": old.usable,
                "same_engine": new.transport.engine is old.transport.engine})
    result(out)
    new.shutdown()
    dist.destroy_process_group()
    return Exit(0)


if __name__ == "__main__":
    _without_shrink_group()
    from torch_thunderbolt.testing.program import main

    main({"direct": direct})
